"""Offload of checkpointed decoder-layer inputs to host memory, with prefetch in backward.

Why not DeepSpeed's ``offload_activations.get_checkpoint_hidden_states_offloading_ctx_manager``:
its context must stay open across forward *and* backward (``__exit__`` clears the tracker, so a
``loss = engine(**batch)`` / ``engine.backward(loss)`` split raises "no longer tracked"), it never
offloads on a CPU accelerator (so nothing of it can be exercised in a CPU test), its restore makes
the compute stream wait at issue time (a restore issued early stalls the current layer's recompute,
so it cannot prefetch), and it patches ``GradientCheckpointingLayer.__call__`` process-wide. Here the
pack/unpack hooks are bound per checkpoint call (they outlive no context), the copy target is
injectable, and backward prefetches the previous layer's input while the current one recomputes.
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import threading
import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch.autograd.graph import saved_tensors_hooks

from .arena import HostArena, HostSlot


# ---------------------------------------------------------------------------------------------
# targets: where a checkpoint input goes and how it comes back
# ---------------------------------------------------------------------------------------------


class OffloadTarget:
    """Copies a device tensor to host memory and back. ``to_host``/``to_device`` may return before the
    copy ends; they return ``(tensor, event)`` and ``wait(event)`` orders the caller's stream after it."""

    def to_host(self, t: torch.Tensor):
        raise NotImplementedError

    def to_device(self, host: torch.Tensor, device: torch.device):
        raise NotImplementedError

    def wait(self, event) -> None:
        pass

    def sync(self, event) -> None:
        """Block the host until ``event``'s copy is done."""

    def release(self, host) -> None:
        """``host`` (what ``to_host`` returned) is no longer needed: its memory may be reused."""

    def memory_stats(self) -> dict:
        """Host/pinned/NVMe bytes this target holds (reported per step by the memory handle)."""
        return {}

    def close(self) -> None:
        """Free what the target holds (buffers, files). Called by the memory handle's remove()."""


class HostCopyTarget(OffloadTarget):
    """Host "memory" for tensors that already live on the CPU: a separate copy, made outside any
    active TorchDispatchMode so live-bytes trackers account it as host memory, the way the CUDA
    allocator never sees pinned host buffers. Copies are synchronous and bit-exact."""

    def to_host(self, t):
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            host.copy_(t.detach())
        return host, None

    def to_device(self, host, device):
        out = torch.empty(host.shape, dtype=host.dtype, device=device)
        out.copy_(host)
        return out, None


def _dispatch_free():
    """Allocations made here are host memory: keep them out of any live-bytes TorchDispatchMode, the
    way the CUDA allocator never sees pinned host buffers."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


class PinnedHostTarget(OffloadTarget):
    """Host copies in blocks of a :class:`~ds_longctx.memory.arena.HostArena` (exact-size, pinned on
    CUDA, reused step to step: torch's CachingHostAllocator would round each block up to a power of
    two and cache it, 8 GiB for a 5 GiB layer input). On CUDA the copies run on one side stream per
    device, so the D2H of layer i overlaps layer i+1's forward and the H2D of layer i-1 overlaps
    layer i's recompute; on CPU (tests, CI) they are synchronous into plain host blocks with the same
    accounting. ``to_host`` returns a :class:`HostSlot`; ``release`` gives its block back."""

    def __init__(self, pin_memory: bool = True, arena: Optional[HostArena] = None):
        self.pin_memory = pin_memory
        self.arena = arena if arena is not None else HostArena(pin=pin_memory and torch.cuda.is_available())
        self._streams = {}

    def _stream(self, device):
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device=device)
        return s

    def to_host(self, t):
        nbytes = t.numel() * t.element_size()
        with _dispatch_free():
            block = self.arena.take(nbytes)
            view = block.view(t.dtype, t.shape)
            if t.device.type != "cuda":
                view.copy_(t.detach())
                return HostSlot(block, view), None
        side = self._stream(t.device)
        side.wait_stream(torch.cuda.current_stream(t.device))  # t is produced on the compute stream
        if block.event is not None:
            side.wait_event(block.event)  # the block's last H2D (previous step) must have read it
        non_blocking = self.pin_memory and block.pinned
        with torch.cuda.stream(side):
            view.copy_(t.detach(), non_blocking=non_blocking)
        # the allocator must not hand t's block to the compute stream before the copy has read it
        t.record_stream(side)
        block.event = ev = side.record_event()
        return HostSlot(block, view), ev

    def to_device(self, host, device):
        device = torch.device(device)
        src = host.view
        if device.type != "cuda":
            out = torch.empty(src.shape, dtype=src.dtype, device=device)
            out.copy_(src)
            return out, None
        compute = torch.cuda.current_stream(device)
        side = self._stream(device)
        out = torch.empty(src.shape, dtype=src.dtype, device=device)  # owned by the compute stream
        # the block may have been freed by kernels still queued on the compute stream
        side.wait_stream(compute)
        with torch.cuda.stream(side):
            out.copy_(src, non_blocking=self.pin_memory and host.block.pinned)
        out.record_stream(side)  # a prefetch dropped unconsumed must not be reused mid-copy
        host.block.event = ev = side.record_event()  # reuse of the host block waits for this read
        return out, ev

    def release(self, host):
        self.arena.give(host.block)

    def wait(self, event):
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def sync(self, event):
        if event is not None:
            event.synchronize()

    def memory_stats(self) -> dict:
        return self.arena.stats()

    def close(self) -> None:
        self.arena.close()


class AutoTarget(PinnedHostTarget):
    """The default host target: one exact-size arena per rank, pinned when CUDA is present (CUDA
    tensors copy on side streams, CPU tensors synchronously; see :class:`PinnedHostTarget`)."""


# ---------------------------------------------------------------------------------------------
# the offloader
# ---------------------------------------------------------------------------------------------


@dataclass
class OffloadStats:
    offloaded_tensors: int = 0
    offloaded_bytes: int = 0
    restored_tensors: int = 0
    restored_bytes: int = 0
    prefetched_tensors: int = 0  # restores whose H2D was issued before they were needed
    host_bytes: int = 0  # host copies alive now
    host_bytes_peak: int = 0
    events: list = field(default_factory=list)  # ("offload"|"prefetch"|"restore", seq) when recording


class _Offloaded:
    """What autograd holds instead of a checkpoint input: the host copy (and, once prefetched, the
    device copy on its way back). Dies with the graph node that saved it, freeing the host copy."""

    __slots__ = ("seq", "host", "host_event", "device", "shape", "dtype", "requires_grad", "dev", "dev_event",
                 "companions", "__weakref__")

    def __init__(self, seq, t, host, host_event):
        self.seq, self.host, self.host_event = seq, host, host_event
        self.device, self.shape, self.dtype = t.device, t.shape, t.dtype
        self.requires_grad = t.requires_grad
        self.dev = None
        self.dev_event = None
        # the layer's kept attention output and LSE (memory/keep.py): weak, they live in the layer's frame;
        # restored together with this input
        self.companions = []


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CheckpointInputOffloader:
    """Moves each checkpointed layer's input to host memory at checkpoint time and brings it back in
    backward, one layer ahead of need.

    Use :meth:`capture` around one checkpoint call with that call's hidden-states tensor: the saved
    copy of that tensor (and only it) is replaced by a host copy. The hooks are bound at pack time,
    so backward may run any time later, outside any context.

    ``refusals``: a context manager factory around each copy out (the install's translation of the target's
    refusals, e.g. a full NVMe drive, into the config's error).
    """

    def __init__(self, target: Optional[OffloadTarget] = None, pin_memory: bool = True, prefetch: bool = True,
                 min_bytes: int = 0, record_events: bool = False, max_inflight: int = 1,
                 refusals=contextlib.nullcontext):
        self.target = target if target is not None else AutoTarget(pin_memory=pin_memory)
        self.refusals = refusals
        self.prefetch = prefetch
        self.min_bytes = min_bytes
        self.record_events = record_events
        self.stats = OffloadStats()
        self._seq = itertools.count(1)
        self._live: "weakref.WeakValueDictionary[int, _Offloaded]" = weakref.WeakValueDictionary()
        self._newest: Optional[weakref.ref] = None
        # A D2H copy frees its source only once the side stream has run it (record_stream), and the
        # host runs layers ahead of the GPU: unthrottled, every offloaded input stays allocated until
        # the next sync (measured on an H200: +1 GiB over plain checkpointing for 8 x 128 MiB inputs).
        # Waiting for the copy issued max_inflight layers ago keeps the host at most that far ahead.
        self.max_inflight = max_inflight
        self._inflight: collections.deque = collections.deque()
        self._lock = threading.Lock()
        # set by install_checkpointing when every layer has a trigger after its attention backward: the
        # previous layer's input is then brought back there instead of at this layer's unpack, where it
        # would sit on the device through this layer's whole backward peak
        self.defer_prefetch = False
        self._pending: Optional[int] = None
        self._anchor: Optional[weakref.ref] = None  # the input packed last: kept tensors travel with it

    # -- accounting ---------------------------------------------------------------------------
    def host_bytes(self) -> int:
        return self.stats.host_bytes

    def _event(self, kind, seq):
        if self.record_events:
            self.stats.events.append((kind, seq))

    def _host_alloc(self, n):
        with self._lock:
            self.stats.host_bytes += n
            self.stats.host_bytes_peak = max(self.stats.host_bytes_peak, self.stats.host_bytes)

    def _host_free(self, n):
        with self._lock:
            self.stats.host_bytes -= n

    def _release(self, target, host, n):
        release = getattr(target, "release", None)  # duck-typed targets (the planner's) may have none
        if release is not None:
            release(host)
        self._host_free(n)

    def reset_stats(self):
        live = self.stats.host_bytes
        self.stats = OffloadStats(host_bytes=live, host_bytes_peak=live)

    # -- hooks --------------------------------------------------------------------------------
    def capture(self, hidden_states: torch.Tensor):
        """saved_tensors_hooks for one checkpoint call that offload ``hidden_states`` when saved."""
        # weak: autograd keeps the pack hook alive with every tensor it saved, and a strong reference
        # here would pin the very device tensor we are offloading
        target = weakref.ref(hidden_states)
        return saved_tensors_hooks(lambda t: self._pack(t, target()), self._unpack)

    @staticmethod
    def _same(t, target):
        if t is target:
            return True
        # autograd may hand the hook an alias of the input rather than the input object itself
        return (t.shape == target.shape and t.dtype == target.dtype and t.device == target.device
                and t.numel() > 0 and t.data_ptr() == target.data_ptr() and t.stride() == target.stride())

    def _pack(self, t, hidden_states):
        if not isinstance(hidden_states, torch.Tensor) or not self._same(t, hidden_states):
            return t
        if _nbytes(t) < self.min_bytes or isinstance(t, torch.nn.Parameter):
            return t
        ref = self._copy_out(t, next(self._seq))
        self._live[ref.seq] = ref
        self._newest = self._anchor = weakref.ref(ref)
        self._event("offload", ref.seq)
        return ref

    def _copy_out(self, t, seq) -> _Offloaded:
        with self.refusals():
            host, ev = self.target.to_host(t)
        if ev is not None:
            self._inflight.append(ev)
            while len(self._inflight) > self.max_inflight:
                self.target.sync(self._inflight.popleft())
        ref = _Offloaded(seq, t, host, ev)
        n = _nbytes(t)
        self._host_alloc(n)
        # the target that made the copy gets it back (set_offload_target may swap targets later)
        weakref.finalize(ref, self._release, self.target, host, n)
        self.stats.offloaded_tensors += 1
        self.stats.offloaded_bytes += n
        return ref

    # -- kept attention outputs (memory/keep.py) ----------------------------------------------
    def keep(self, t: torch.Tensor) -> _Offloaded:
        """Offload ``t`` (a layer's attention output or LSE, made in its first forward) to the target of the
        layer's input, which was packed last; it is restored whenever that input is (prefetch included).
        The caller holds the returned handle; the host copy is freed when the handle dies."""
        anchor = self._anchor() if self._anchor is not None else None
        ref = self._copy_out(t, anchor.seq if anchor is not None else 0)
        if anchor is not None:
            anchor.companions.append(weakref.ref(ref))
        self._event("keep", ref.seq)
        return ref

    def restore_kept(self, ref: _Offloaded) -> torch.Tensor:
        """The device copy of a kept tensor (already on its way if its layer input was prefetched); the host
        copy stays, so a retained graph can restore it again."""
        if ref.dev is None:
            ref.dev, ref.dev_event = self.target.to_device(ref.host, ref.device)
        out, ev = ref.dev, ref.dev_event
        ref.dev, ref.dev_event = None, None
        self.target.wait(ev)
        self.stats.restored_tensors += 1
        self.stats.restored_bytes += _nbytes(out)
        return out

    def _start_restore(self, ref: _Offloaded):
        if ref.dev is None:
            # no wait on host_event: the H2D is queued on the same side stream as the D2H
            ref.dev, ref.dev_event = self.target.to_device(ref.host, ref.device)
        for c in ref.companions:  # the layer's kept attention output and LSE come back with its input
            c = c()
            if c is not None and c.dev is None:
                c.dev, c.dev_event = self.target.to_device(c.host, c.device)

    def prefetch_seq(self, seq: int) -> bool:
        ref = self._live.get(seq)
        if ref is None or ref.dev is not None:
            return False
        self._start_restore(ref)
        self.stats.prefetched_tensors += 1
        self._event("prefetch", seq)
        return True

    def prefetch_newest(self) -> bool:
        """Start bringing back the most recent input (called when the last checkpointed layer's forward
        ends: the backward needs it first, and its H2D overlaps the norm, lm_head and loss)."""
        ref = self._newest() if self._newest is not None else None
        self._newest = None
        return False if ref is None else self.prefetch_seq(ref.seq)

    def _unpack(self, ref):
        if not isinstance(ref, _Offloaded):
            return ref
        self._start_restore(ref)
        out, ev = ref.dev, ref.dev_event
        ref.dev, ref.dev_event = None, None  # hand over; a retained graph restores again from host
        self.target.wait(ev)
        self.stats.restored_tensors += 1
        self.stats.restored_bytes += _nbytes(out)
        self._event("restore", ref.seq)
        if self.prefetch:
            # backward walks the layers in reverse, so the previous layer's input is needed next
            if self.defer_prefetch:
                self._pending = ref.seq - 1
            else:
                self.prefetch_seq(ref.seq - 1)
        return out

    def prefetch_pending(self) -> bool:
        """Issue the prefetch deferred at the last unpack (called once the layer's attention backward is done)."""
        seq, self._pending = self._pending, None
        return False if seq is None else self.prefetch_seq(seq)
