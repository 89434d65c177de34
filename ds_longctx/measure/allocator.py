"""A model of PyTorch's CUDA caching allocator, to predict ``max_memory_reserved`` from a trace of allocations.

The planner counts live bytes (what ``max_memory_allocated`` reports). What an out-of-memory error is about
is what the caching allocator has *reserved* from the driver: live bytes plus blocks it keeps cached but
cannot use for the next request (fragmentation). On one H100 run (bench/results/gpu_train_1b_h100.json)
that slack was 2.95 GiB over a 26.9 GiB allocated peak. This module replays a sequence of allocations and
frees through the allocator's placement rules and reports the reserved bytes they lead to.

Rules reproduced (c10/cuda/CUDACachingAllocator.cpp, c10/core/AllocatorConfig.h):
- request sizes round up to 512 B; requests <= 1 MiB go to the small pool, larger ones to the large pool;
- a request takes the best-fitting cached free block of its pool (smallest size, then lowest address);
  a block is split when the rest is >= 512 B (small pool, or any pool with expandable segments) or
  > 1 MiB (large pool, classic segments); a freed block merges with free neighbours;
- classic segments (the default): with no fitting cached block a new segment is cudaMalloc'ed: 2 MiB for
  a small request, 20 MiB for a request under 10 MiB, else the request rounded up to 2 MiB;
- expandable segments (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, what train.py's runs use):
  one virtual range per pool; with no fitting cached block the free block at the range's mapped end is
  grown by mapping the shortfall in pages (20 MiB large, 2 MiB small); among fitting blocks one that
  could grow no further is preferred to the end block;
- nothing is returned to the driver unless a request fails (then cached blocks are released and the
  request retried) or ``empty_cache`` is called: so the reserved peak is reached at the end of a trace
  that never comes near the device's capacity, which is what this model assumes (``capacity`` is None).

Streams: each stream has its own pools (and, with expandable segments, its own ranges): a block freed by
the offload prefetch's copy stream is never reused by the compute stream. Events may name their stream.

Not modelled (say so where it matters): CUDA graph pools, ``max_split_size_mb`` and
``roundup_power2_divisions``, and allocations made outside the caching allocator (CUDA context, NCCL,
cuBLAS/cuDNN handles): those are the planner's fixed ``--reserve``.

What strands memory (``CachingAllocatorModel.growth``, ``ReplayResult.stranded_by_label``): every time the model
maps new memory (a classic segment, or pages at an expandable range's end) while its pool holds free cached bytes,
the new bytes that lie above the trace's allocated peak, up to the free bytes, are "stranded": the request was
refused by free blocks that were each too small, and the step never grew into them. Charged to the request's label
(its op and category; in a recorded CUDA trace, its innermost frame outside torch) and summed over the trace (at most
the reserved slack), that names the allocations whose sizes strand the reserved bytes.

Pure Python, no torch: events are ``("+", key, nbytes)``, ``("+", key, nbytes, stream)`` or
``("+", key, nbytes, stream, label)``, and ``("-", key)``.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

MIN_BLOCK = 512                 # kMinBlockSize
SMALL_SIZE = 1 << 20            # kSmallSize: requests up to this go to the small pool
SMALL_BUFFER = 2 << 20          # kSmallBuffer: a small-pool segment / page
MIN_LARGE_ALLOC = 10 << 20      # kMinLargeAlloc
ROUND_LARGE = 2 << 20           # kRoundLarge
LARGE_PAGE = 20 << 20           # kLargeBuffer: a 1-10 MiB request's segment; the expandable large page


def round_size(nbytes: int) -> int:
    if nbytes < MIN_BLOCK:
        return MIN_BLOCK
    return -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def segment_size(size: int) -> int:
    """cudaMalloc size of a new classic segment for a rounded request of ``size``."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_PAGE
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class _Block:
    __slots__ = ("addr", "size", "allocated", "mapped", "prev", "next", "pool", "seg")

    def __init__(self, addr: int, size: int, pool: "_Pool", mapped: bool = True, seg: int = 0):
        self.addr, self.size, self.pool, self.mapped, self.seg = addr, size, pool, mapped, seg
        self.allocated = False
        self.prev: Optional[_Block] = None
        self.next: Optional[_Block] = None


class _Pool:
    """Free mapped blocks ordered by (size, address): the allocator's best-fit set."""

    def __init__(self, small: bool):
        self.small = small
        self.free: List[Tuple[int, int, int]] = []   # (size, addr, id) sorted
        self.by_id: Dict[int, _Block] = {}
        self.unmapped: Optional[_Block] = None       # expandable: the range's unmapped tail
        self.base = 0                                # expandable: the range's first address

    def add(self, b: _Block) -> None:
        bisect.insort(self.free, (b.size, b.addr, id(b)))
        self.by_id[id(b)] = b

    def remove(self, b: _Block) -> None:
        i = bisect.bisect_left(self.free, (b.size, b.addr, id(b)))
        assert self.free[i][2] == id(b)
        del self.free[i]
        del self.by_id[id(b)]


@dataclass
class Growth:
    """One mapping of new memory: ``request`` (rounded) bytes for ``label`` on ``stream`` mapped ``mapped`` new
    bytes while its pool held ``free`` cached bytes (its largest free block ``largest``, the range's free end
    block excluded when it was grown); ``reserved``: the bytes mapped in all after it. :meth:`stranded`: of the new
    bytes, those the free ones could not serve (min(mapped, free)) that lie above the trace's live peak (reserved
    after the mapping less ``peak_allocated``): a mapping the step grows into later strands nothing, and over a trace
    the stranded bytes add up to at most its reserved slack."""
    label: object
    stream: object
    request: int
    mapped: int
    free: int
    largest: int
    allocated: int          # bytes held just before the request
    reserved: int = 0       # bytes mapped in all, this mapping included

    def stranded(self, peak_allocated: int) -> int:
        return max(0, min(self.mapped, self.free, self.reserved - peak_allocated))


@dataclass
class ReplayResult:
    peak_allocated: int     # max over the trace of the rounded bytes held (max_memory_allocated)
    peak_reserved: int      # max over the trace of the bytes taken from the driver (max_memory_reserved)
    reserved: int           # at the end
    events: int
    reserved_by_stream: Dict[object, int] = field(default_factory=dict)   # bytes mapped per stream at the end
    growth: List[Growth] = field(default_factory=list)
    floor: int = 0          # at the allocated peak, what no out-of-memory retry could release (CachingAllocatorModel.floor)

    @property
    def slack(self) -> int:
        return self.peak_reserved - self.peak_allocated

    @property
    def ratio(self) -> float:
        return self.peak_reserved / self.peak_allocated if self.peak_allocated else 1.0

    def stranded_by_label(self) -> Dict[object, int]:
        """Stranded bytes (:meth:`Growth.stranded` above this trace's allocated peak) summed per label, largest first."""
        out: Dict[object, int] = {}
        for g in self.growth:
            n = g.stranded(self.peak_allocated)
            if n:
                out[g.label] = out.get(g.label, 0) + n
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def summary(self, top: int = 8) -> dict:
        """JSON-able figures: peaks, ratio, reserved per stream, the labels that stranded the most."""
        return {"peak_allocated": self.peak_allocated, "peak_reserved": self.peak_reserved,
                "ratio": round(self.ratio, 4), "floor": self.floor, "events": self.events,
                "reserved_by_stream": {str(k): v for k, v in self.reserved_by_stream.items()},
                "stranded": sum(g.stranded(self.peak_allocated) for g in self.growth),
                "stranded_by_label": [[str(k), v] for k, v in list(self.stranded_by_label().items())[:top]]}


class CachingAllocatorModel:
    """One device. ``alloc``/``free`` by caller-chosen key; ``reserved``/``allocated`` in bytes."""

    def __init__(self, expandable_segments: bool = True):
        self.expandable = expandable_segments
        self.pools: Dict[tuple, _Pool] = {}   # (stream, small) -> pool
        self.live: Dict[object, _Block] = {}
        self.allocated = 0
        self.reserved = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        self._next_addr = 0
        self._segments = 0
        self.reserved_by_stream: Dict[object, int] = {}
        self.growth: List[Growth] = []
        self._seg_size: Dict[int, int] = {}
        self.floor_at_peak = 0      # bytes the allocator could not give back at the allocated peak (:meth:`floor`)
        self._pending: Optional[tuple] = None   # (label, stream, request, free, largest, allocated) of the request

    # --- driver side ----------------------------------------------------------------------------
    def _new_range(self, size: int) -> int:
        addr = self._next_addr
        self._next_addr += size + (1 << 30)   # distinct, never adjacent
        self._segments += 1
        return addr

    def _grow(self, pool: _Pool, size: int) -> _Block:
        """Expandable: map pages at the end of the pool's range until its last free block holds ``size``."""
        page = SMALL_BUFFER if pool.small else LARGE_PAGE
        tail = pool.unmapped
        if tail is None:  # the range is created on first use, as large as anything could need
            tail = _Block(self._new_range(1 << 50), 1 << 50, pool, mapped=False)
            pool.unmapped, pool.base = tail, tail.addr
        last = tail.prev if tail.prev is not None and not tail.prev.allocated else None
        have = last.size if last is not None else 0
        need = -(-(size - have) // page) * page
        new = _Block(tail.addr, need, pool)
        tail.addr += need
        tail.size -= need
        new.prev, new.next = tail.prev, tail
        if tail.prev is not None:
            tail.prev.next = new
        tail.prev = new
        self._mapped(need)
        if last is not None:
            pool.remove(last)
            self._merge(new, last)
        return new

    def _new_segment(self, pool: _Pool, size: int) -> _Block:
        seg = segment_size(size)
        b = _Block(self._new_range(seg), seg, pool)
        b.seg = b.addr
        self._seg_size[b.addr] = seg
        self._mapped(seg)
        return b

    def _mapped(self, nbytes: int) -> None:
        """``nbytes`` newly taken from the driver for the pending request."""
        self.reserved += nbytes
        label, stream, request, free, largest, allocated = self._pending
        self.reserved_by_stream[stream] = self.reserved_by_stream.get(stream, 0) + nbytes
        self.growth.append(Growth(label, stream, request, nbytes, free, largest, allocated, self.reserved))

    # --- blocks -----------------------------------------------------------------------------------
    @staticmethod
    def _merge(dst: _Block, src: _Block) -> None:
        """Absorb the free neighbour ``src`` into ``dst``."""
        if src is dst.prev:
            dst.addr = src.addr
            dst.prev = src.prev
            if src.prev is not None:
                src.prev.next = dst
        else:
            dst.next = src.next
            if src.next is not None:
                src.next.prev = dst
        dst.size += src.size

    def _best_fit(self, pool: _Pool, size: int) -> Optional[_Block]:
        i = bisect.bisect_left(pool.free, (size, -1, -1))
        if i == len(pool.free):
            return None
        b = pool.by_id[pool.free[i][2]]
        if self.expandable:
            # prefer a block that cannot grow to the end block of the range (get_free_block's expandable walk)
            def grows(x):
                return x.size + (x.next.size if x.next is not None and not x.next.mapped else 0)

            while i + 1 < len(pool.free):
                nxt = pool.by_id[pool.free[i + 1][2]]
                if grows(nxt) >= grows(b):
                    break
                i, b = i + 1, nxt
        return b

    def alloc(self, key, nbytes: int, stream=0, label=None) -> None:
        if key in self.live:
            raise ValueError(f"allocator model: key {key!r} is already live")
        size = round_size(int(nbytes))
        small = size <= SMALL_SIZE
        pool = self.pools.get((stream, small))
        if pool is None:
            pool = self.pools[(stream, small)] = _Pool(small)
        b = self._best_fit(pool, size)
        if b is not None:
            pool.remove(b)
        else:
            # what the pool held free when it had to map more (the range's free end block, which growing
            # absorbs, excluded): the figures of the Growth this request records
            end = pool.unmapped.prev if self.expandable and pool.unmapped is not None else None
            sizes = [sz for sz, _, i in pool.free if end is None or pool.by_id[i] is not end]
            self._pending = (label, stream, size, sum(sizes), max(sizes, default=0), self.allocated)
            if self.expandable:
                b = self._grow(pool, size)
            else:
                b = self._new_segment(pool, size)
        rest = b.size - size
        split = rest >= MIN_BLOCK if (small or self.expandable) else rest > SMALL_SIZE
        if split:
            r = _Block(b.addr + size, rest, b.pool, seg=b.seg)
            r.prev, r.next = b, b.next
            if b.next is not None:
                b.next.prev = r
            b.next = r
            b.size = size
            pool.add(r)
        b.allocated = True
        self.live[key] = b
        self.allocated += b.size
        if self.allocated >= self.peak_allocated:
            self.peak_allocated = self.allocated
            self.floor_at_peak = self.floor()
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def floor(self) -> int:
        """Device bytes the allocator cannot return now, however short the device: on an out-of-memory retry it
        releases every cached block it can (release_cached_blocks), which with expandable segments unmaps every
        page no live block touches (2 MiB pages small, 20 MiB large), with classic segments frees every segment
        holding no live block. So a step whose reserved peak (no pressure) exceeds the device still runs (slower:
        each retry synchronizes and remaps) while this floor, at the allocated peak, fits."""
        if not self.expandable:
            return sum(self._seg_size[s] for s in {b.seg for b in self.live.values()})
        total = 0
        by_pool: Dict[int, List[_Block]] = {}
        for b in self.live.values():
            by_pool.setdefault(id(b.pool), []).append(b)
        for blocks in by_pool.values():
            pool = blocks[0].pool
            page = SMALL_BUFFER if pool.small else LARGE_PAGE
            last = -1
            for b in sorted(blocks, key=lambda x: x.addr):
                lo, hi = (b.addr - pool.base) // page, (b.addr + b.size - 1 - pool.base) // page
                lo = max(lo, last + 1)
                if hi >= lo:
                    total += (hi - lo + 1) * page
                    last = hi
        return total

    def free(self, key) -> None:
        b = self.live.pop(key)
        b.allocated = False
        self.allocated -= b.size
        pool = b.pool
        for n in (b.prev, b.next):
            if n is not None and n.mapped and not n.allocated:
                pool.remove(n)
                self._merge(b, n)
        pool.add(b)

    def replay(self, events: Iterable[tuple]) -> ReplayResult:
        n = 0
        for ev in events:
            n += 1
            if ev[0] == "+":
                self.alloc(ev[1], ev[2], ev[3] if len(ev) > 3 else 0, ev[4] if len(ev) > 4 else None)
            else:
                self.free(ev[1])
        return ReplayResult(self.peak_allocated, self.peak_reserved, self.reserved, n, dict(self.reserved_by_stream),
                            list(self.growth), self.floor_at_peak)


def replay(events: Iterable[tuple], expandable_segments: bool = True) -> ReplayResult:
    """Replay ``("+", key, nbytes)`` / ``("-", key)`` events through a fresh allocator model."""
    return CachingAllocatorModel(expandable_segments).replay(events)


def frame_label(frames) -> Optional[str]:
    """``file:line function`` of the innermost frame of a snapshot trace entry outside torch itself (the
    caller that asked for the memory: ds_longctx, DeepSpeed, transformers, a script), or None without frames."""
    for f in frames or ():
        name = str(f.get("filename", ""))
        if not name or name.startswith("??") or "/torch/" in name or name.startswith("<"):
            continue
        short = "/".join(name.replace("\\", "/").split("/")[-2:])
        return f"{short}:{f.get('line', 0)} {f.get('name', '')}"
    return None


def events_from_snapshot(snapshot: dict, device: int = 0) -> List[tuple]:
    """The alloc/free events of ``torch.cuda.memory._snapshot()``'s trace (recorded with
    ``torch.cuda.memory._record_memory_history``) as replay events keyed by address, each with its stream and,
    when the history recorded stacks (``context="alloc"``), its :func:`frame_label`."""
    out = []
    live = {}
    for i, e in enumerate(snapshot.get("device_traces", [[]])[device]):
        act = e.get("action")
        if act == "alloc":
            key = (e["addr"], i)
            live[e["addr"]] = key
            out.append(("+", key, int(e["size"]), e.get("stream", 0), frame_label(e.get("frames"))))
        elif act == "free_completed" and e["addr"] in live:
            out.append(("-", live.pop(e["addr"])))
    return out


def seed_events(snapshot: dict, device: int = 0) -> List[tuple]:
    """Events that rebuild the allocator state a ``torch.cuda.memory._snapshot()`` shows: every block of every
    segment allocated in address order, then the inactive (cached) ones freed. Keyed ``("seed", i)``."""
    out, frees = [], []
    segs = [s for s in snapshot.get("segments", []) if s.get("device", device) == device]
    for seg in sorted(segs, key=lambda s: s.get("address", 0)):
        for b in seg.get("blocks", []):
            key = ("seed", len(out))
            out.append(("+", key, int(b["size"]), seg.get("stream", 0)))
            if b.get("state") != "active_allocated":
                frees.append(("-", key))
    return out + frees


def save_events(events: List[tuple], path: str, meta: Optional[dict] = None) -> None:
    """Write replay events to ``path`` (gzip JSON: keys renumbered, labels in one table), small enough to bring back
    from a device call: a 75,000-event step is about a megabyte. :func:`load_events` reads it."""
    import gzip
    import json

    keys: Dict[object, int] = {}
    labels: Dict[object, int] = {}
    rows = []
    for ev in events:
        if ev[0] == "+":
            k = keys.setdefault(ev[1], len(keys))
            lab = ev[4] if len(ev) > 4 else None
            rows.append([k, int(ev[2]), str(ev[3] if len(ev) > 3 else 0), labels.setdefault(lab, len(labels))])
        else:
            rows.append([keys[ev[1]]])
    with gzip.open(path, "wt") as f:
        json.dump({"meta": meta or {}, "labels": [k for k, _ in sorted(labels.items(), key=lambda kv: kv[1])],
                   "events": rows}, f, separators=(",", ":"))


def load_events(path: str) -> tuple:
    """(events, meta) from :func:`save_events`' file."""
    import gzip
    import json

    with gzip.open(path, "rt") as f:
        d = json.load(f)
    labels = d["labels"]
    out = [("+", r[0], r[1], r[2], labels[r[3]]) if len(r) > 1 else ("-", r[0]) for r in d["events"]]
    return out, d.get("meta", {})


def check_step(start: dict, end: dict, expandable_segments: bool = True, device: int = 0,
               save_to: Optional[str] = None) -> dict:
    """The model against the real allocator over one recorded step.

    ``start``: ``torch.cuda.memory._snapshot()`` taken before the step (and before
    ``_record_memory_history`` starts); ``end``: the snapshot after it, whose trace holds the step's
    allocations and frees. Returns the model's reserved/allocated bytes right after rebuilding the start
    state (``seed_*``: to compare with the real start, which says how well the layout was rebuilt) and at
    the step's peak (``peak_*``: to compare with max_memory_reserved/allocated over the step). ``save_to``: also
    write the seed and step events there (:func:`save_events`; ``meta["seed_events"]`` says where the step starts)."""
    m = CachingAllocatorModel(expandable_segments)
    seed = seed_events(start, device)
    m.replay(seed)
    seed_reserved, seed_allocated = m.reserved, m.allocated
    m.peak_reserved, m.peak_allocated = m.reserved, m.allocated   # the step's peaks start here
    m.growth = []                                                  # what the step itself mapped
    step = events_from_snapshot(end, device)
    res = m.replay(step)
    if save_to:
        save_events(seed + step, save_to, {"seed_events": len(seed), "expandable_segments": expandable_segments})

    def by_stream(snap):
        out: Dict[str, int] = {}
        for seg in snap.get("segments", []):
            if seg.get("device", device) == device:
                k = str(seg.get("stream", 0))
                out[k] = out.get(k, 0) + int(seg.get("total_size", 0))
        return out

    real_start = by_stream(start)
    return {"seed_reserved": seed_reserved, "seed_allocated": seed_allocated,
            "real_start_reserved": sum(real_start.values()), "peak_reserved": m.peak_reserved,
            "peak_allocated": m.peak_allocated, "seed_events": len(seed), "step_events": len(step),
            "expandable_segments": expandable_segments,
            # where the reserved bytes are (the real allocator's segments per stream, before and after the step;
            # the model's), and which requests mapped memory while the pool held free blocks too small for them
            "real_reserved_by_stream_start": real_start, "real_reserved_by_stream_end": by_stream(end),
            "explain": res.summary(top=12)}


__all__ = ["CachingAllocatorModel", "Growth", "ReplayResult", "replay", "events_from_snapshot", "frame_label",
           "seed_events", "check_step", "save_events", "load_events", "round_size", "segment_size"]
