"""Ring (context-parallel) attention: sequence parallelism past the head count (issue 47).

SP = Ulysses degree U x ring degree R. The Ulysses all-to-all (untied stages or DeepSpeed's wrapper) runs inside
groups of U consecutive SP ranks and leaves each rank its heads over its ring rank's "ring-local" sequence (S/R
tokens: with R > 1 the zigzag chunks r and 2R-1-r of dist.layout.ring_segments, the causal load balance). The
attention over the whole sequence is then this module's :class:`RingBackend`, a ``kernels.Backend`` like any other
(so the untied stage loop, sinks and the DeepSpeed core call it unchanged): the key/value blocks of the R ring ranks
go round the ring group, the next block in flight (async P2P) while the current one computes, and each block's
partial (out, lse) merges into fp32 accumulators by its log-sum-exp. Backward: the kernel's own backward per block
given the FINAL out and lse (then P = exp(s - lse) and rowsum(dout * out) are the global softmax's: exact per block);
dq accumulates here, the k/v blocks go round again and their fp32 dk|dv accumulator travels one hop behind them
(home after R hops).

A ring step is a list of rectangles (query rows x key columns, both ring-local): zigzag chunks are equal or
disjoint, so a rectangle is ``diag`` (the same chunk: causal, the layer's window applied by the kernel as on one
process), ``full`` (every key before every query) or ``band`` (a sliding window cuts a disjoint pair: the banded kernel
with the pair's offset). Packed documents cut every rectangle per document, and a pair no document (or window)
reaches is skipped. Nothing here knows heads, models or config keys.

Ours, not a maintained ring: torch 2.13's ``context_parallel`` dispatches only CUDA SDPA ops (on CPU + gloo it raises
"aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy registered"), rotates
k/v by all-gather / all-to-all rather than async P2P and has neither packed documents nor windows on its SDPA path;
ring-flash-attn is CUDA/flash-attn only with no kernel interface. This one rings any of our LSE kernels (the CPU
flash op on gloo, the banded kernel for windows / soft-caps, flash / cuDNN on CUDA), per document, inside each
untied stage.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist

from ..dist.layout import ring_segments
from .kernels import Backend, Windowed, banded_attention_backward, banded_attention_forward


@dataclass(frozen=True)
class Rect:
    """One kernel call of a ring step: query rows [q0, q1) of this rank against key columns [k0, k1) of the block
    (both ring-local). ``kind``: 'diag' (a causal square over the same global positions), 'full' (every key before
    every query, inside any window) or 'band' (a window cuts the pair: allowed iff 0 <= qpos - kpos < window, query
    row i at key position i + ``offset``)."""
    q0: int
    q1: int
    k0: int
    k1: int
    kind: str
    offset: int = 0

    @property
    def work(self) -> float:
        """Query-key pairs computed (a causal square counts half)."""
        n = (self.q1 - self.q0) * (self.k1 - self.k0)
        return n / 2 if self.kind == "diag" else float(n)


def rectangles(q_segs: Sequence[Tuple[int, int, int]], k_segs: Sequence[Tuple[int, int, int]],
               spans: Sequence[Tuple[int, int]], window: int = 0) -> List[Rect]:
    """The kernel calls of one ring step for one sample: ``q_segs`` / ``k_segs`` (local start, global start, length)
    of the queries' and the keys' ring ranks (dist.layout.ring_segments), ``spans`` the sample's documents (global
    [a, e)), ``window`` the layer's sliding window (0: none). Pairs nothing reaches are left out; every row of a
    rectangle sees at least one key (its LSE is finite)."""
    out = []
    for ql, qg, n in q_segs:
        for kl, kg, m in k_segs:
            diag = kg == qg
            if not diag and kg < qg + n and kg + m > qg:
                raise ValueError(f"ring segments overlap without being equal: queries [{qg}, {qg + n}), keys "
                                 f"[{kg}, {kg + m})")
            if not diag and kg >= qg + n:
                continue  # every key after every query
            for da, de in spans:
                qa, qb = max(qg, da), min(qg + n, de)
                ka, kb = max(kg, da), min(kg + m, de)
                if qa >= qb or ka >= kb:
                    continue
                if diag:
                    out.append(Rect(ql + qa - qg, ql + qb - qg, kl + ka - kg, kl + kb - kg, "diag"))
                elif not window:
                    out.append(Rect(ql + qa - qg, ql + qb - qg, kl + ka - kg, kl + kb - kg, "full"))
                elif qa - (kb - 1) < window:  # else the whole pair is out of the window
                    qb2 = min(qb, kb - 1 + window)  # rows that see a key
                    ka2 = max(ka, qa - window + 1)  # keys some row sees
                    kind = "full" if (qb2 - 1) - ka2 < window else "band"
                    out.append(Rect(ql + qa - qg, ql + qb2 - qg, kl + ka2 - kg, kl + kb - kg, kind, qa - ka2))
    return out


def ring_work(seq: int, ring: int, ring_rank: int, spans=None, window: int = 0) -> float:
    """Query-key pairs ring rank ``ring_rank`` computes over the R steps (the balance the zigzag order buys; a
    count, no tensors)."""
    spans = spans if spans is not None else [(0, seq)]
    q = ring_segments(seq, ring, ring_rank)
    return sum(rc.work for step in range(ring)
               for rc in rectangles(q, ring_segments(seq, ring, (ring_rank - step) % ring), spans, window))


class RingComm:
    """Async P2P round the ring group: send to the next ring rank, receive from the previous one. ``waited``: the
    seconds spent waiting (the exposed communication; what the overlap measurement reads)."""

    def __init__(self, group):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)
        self.waited = 0.0

    def shift(self, send: torch.Tensor, tag: int):
        """Post the send of ``send`` and the receive of the previous rank's tensor of the same shape: (receive
        buffer, requests)."""
        recv = torch.empty_like(send)
        if send.device.type == "meta":  # the planner's stand-in device on its fake group (no backend for meta)
            return recv, [dist.isend(send, self.next, self.group, tag), dist.irecv(recv, self.prev, self.group, tag)]
        # one batch: NCCL runs a ring of separate sends and receives in issue order (each send waiting on the next
        # rank's receive, issued after that rank's own send): batched, they start together
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, self.next, self.group, tag),
                                       dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)])
        return recv, reqs

    def wait(self, reqs) -> None:
        t = time.perf_counter()
        for r in reqs:
            r.wait()
        self.waited += time.perf_counter() - t


_KV, _DKV = 0, 1  # P2P tags: the k|v blocks, the travelling dk|dv accumulators


class RingBackend(Backend):
    """Attention of ring-local q [b, S/R, h, d] over the whole sequence of ``seq`` tokens (module doc); k/v
    [b, S/R, hk, d] ring-local too. ``inner``: the layer's kernel (a kernels.Windowed for a window / soft-cap);
    ``group``: the ring group (its rank r holds dist.layout.ring_segments(seq, R, r)); ``docs``: the batch's
    attention.documents.Documents over the global sequence (None: one causal sequence per sample); ``overlap``
    False only for the measurement (each block waited for before its compute)."""

    native_gqa = True

    def __init__(self, inner: Backend, group, seq: int, docs=None, overlap: bool = True):
        self.inner, self.group, self.seq = inner, group, seq
        self.ring = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        if isinstance(inner, Windowed):
            self.base, (self.window, self.softcap) = inner.inner, inner.pattern
        else:
            self.base, self.window, self.softcap = inner, 0, 0.0
        if docs is not None and docs.seq_len != seq:
            raise ValueError(f"ring attention: {docs} for a sequence of {seq} tokens")
        self.docs = docs
        self.overlap = overlap
        self.name = f"ring{self.ring}+{inner.name}"
        self.device_type = inner.device_type
        self.comm = RingComm(group) if self.ring > 1 else None

    # the rectangles of a step ----------------------------------------------------------------
    def _steps(self, b: int):
        """Per ring step: (source ring rank, [(sample slice, rectangles)])."""
        mine = ring_segments(self.seq, self.ring, self.rank)
        out = []
        for step in range(self.ring):
            src = (self.rank - step) % self.ring
            theirs = ring_segments(self.seq, self.ring, src)
            if self.docs is None or self.docs.dense:
                rows = [(slice(0, b), rectangles(mine, theirs, [(0, self.seq)], self.window))]
            else:
                rows = [(slice(i, i + 1), rectangles(mine, theirs, spans, self.window))
                        for i, spans in enumerate(self.docs.bounds)]
            out.append((src, rows))
        return out

    def _agree_kernels(self, q, k, v, scale):
        """A measured 'auto' (kernels.MeasuredChoice) chooses at a signature's first call with a collective over the
        job; rectangles (and with documents, which of them exist) differ by rank, so every rank chooses both
        signatures here, at the same point, before the ring starts."""
        choose = getattr(self.base, "choose", None)
        if choose is not None:
            choose(q, k, v, True, scale, self.window, self.softcap)  # the diagonal blocks
            if not self.window:  # the full blocks (a windowed layer's run the banded kernel)
                choose(q, k, v, False, scale, 0, self.softcap)

    def _fwd(self, q, k, v, rc: Rect, scale):
        if rc.kind == "diag":
            return self.inner.forward(q, k, v, True, scale)
        if not self.window:
            kernel = Windowed(self.base, 0, self.softcap) if self.softcap else self.base
            return kernel.forward(q, k, v, False, scale)
        return banded_attention_forward(q, k, v, True, scale, self.window, self.softcap, rc.offset)

    def _bwd(self, do, q, k, v, o, lse, rc: Rect, scale):
        if rc.kind == "diag":
            return self.inner.backward(do, q, k, v, o, lse, True, scale)
        if not self.window:
            kernel = Windowed(self.base, 0, self.softcap) if self.softcap else self.base
            return kernel.backward(do, q, k, v, o, lse, False, scale)
        return banded_attention_backward(do, q, k, v, o, lse, True, scale, self.window, self.softcap, rc.offset)

    def _blocks(self, k, v):
        """The first block (this rank's k|v) as one flat buffer to send, and how to view a received one."""
        nk = k.numel()
        flat = torch.cat([k.reshape(-1), v.reshape(-1)]) if self.comm is not None else None
        return flat, lambda f: (f[:nk].view(k.shape), f[nk:].view(v.shape))

    # forward ----------------------------------------------------------------------------------
    def forward(self, q, k, v, causal: bool, scale: float, window=None, softcap=None):
        if not causal:
            raise ValueError("ring attention is causal (the ring's rectangles are causal blocks)")
        b, S, h, _ = q.shape
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        out = torch.zeros(b, S, h, v.shape[-1], dtype=acc, device=q.device)
        lse = torch.full((b, h, S), float("-inf"), dtype=acc, device=q.device)
        self._agree_kernels(q, k, v, scale)
        flat, view = self._blocks(k, v)
        kk, vv = k, v
        for step, (src, rows) in enumerate(self._steps(b)):
            reqs = None
            if self.comm is not None and step < self.ring - 1:
                nxt, reqs = self.comm.shift(flat, _KV)  # the next block in flight during this one
                if not self.overlap:
                    self.comm.wait(reqs)
                    reqs = []
            for sl, rects in rows:
                for rc in rects:
                    o, l = self._fwd(q[sl, rc.q0:rc.q1], kk[sl, rc.k0:rc.k1], vv[sl, rc.k0:rc.k1], rc, scale)
                    _merge(out[sl, rc.q0:rc.q1], lse[sl, :, rc.q0:rc.q1], o, l)
            if reqs is not None:
                self.comm.wait(reqs)
                flat = nxt
                kk, vv = view(flat)
        return out.to(q.dtype), lse

    # backward ---------------------------------------------------------------------------------
    def backward(self, dout, q, k, v, out, lse, causal: bool, scale: float, window=None, softcap=None):
        b = q.shape[0]
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        lse = lse.to(acc)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        flat, view = self._blocks(k, v)
        kk, vv = k, v
        nk = k.numel()
        dkv, dkv_reqs = None, None  # the dk|dv accumulator of the block in hand (fp32), and its arrival
        for step, (src, rows) in enumerate(self._steps(b)):
            reqs = None
            if self.comm is not None and step < self.ring - 1:
                nxt, reqs = self.comm.shift(flat, _KV)
                if not self.overlap:
                    self.comm.wait(reqs)
                    reqs = []
            block = []  # this step's (k/v columns, dk, dv) per rectangle, in k's dtype (the kernel's)
            for sl, rects in rows:
                for rc in rects:
                    qs, ks = (sl, slice(rc.q0, rc.q1)), (sl, slice(rc.k0, rc.k1))
                    gq, gk, gv = self._bwd(dout[qs], q[qs], kk[ks], vv[ks], out[qs],
                                           lse[sl, :, rc.q0:rc.q1].contiguous(), rc, scale)
                    dq[qs] += gq
                    block.append((ks, gk, gv))
            # the block's fp32 dk|dv accumulator: as it arrived from the previous ring rank (which sent it one step
            # ago, so it came during this step's kernels), or new at step 0; this step's parts are added into it
            if dkv_reqs is not None:
                self.comm.wait(dkv_reqs)
            else:
                dkv = torch.zeros(nk + v.numel(), dtype=acc, device=q.device)
            ak, av = dkv[:nk].view(k.shape), dkv[nk:].view(v.shape)
            for ks, gk, gv in block:
                ak[ks] += gk
                av[ks] += gv
            del block, ak, av
            if self.comm is not None:
                dkv, dkv_reqs = self.comm.shift(dkv, _DKV)  # on to the next rank; home after R hops
                if not self.overlap:
                    self.comm.wait(dkv_reqs)
                    dkv_reqs = []
            if reqs is not None:
                self.comm.wait(reqs)
                flat = nxt
                kk, vv = view(flat)
        if dkv_reqs:
            self.comm.wait(dkv_reqs)
        dk, dv = dkv[:nk].view(k.shape), dkv[nk:].view(v.shape)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _merge(out, lse, o, l):
    """out / lse (views of the fp32 accumulators) <- their LSE-weighted merge with a block's (o, l): lse' =
    logaddexp(lse, l), out' = out e^(lse - lse') + o e^(l - lse'). Every row of a block saw a key (l finite)."""
    l = l.to(lse.dtype)
    new = torch.logaddexp(lse, l)
    out.mul_(torch.exp(lse - new).transpose(1, 2).unsqueeze(-1))
    out.add_(o.to(out.dtype) * torch.exp(l - new).transpose(1, 2).unsqueeze(-1))
    lse.copy_(new)


def ring_backend(inner: Backend, group, seq: int, docs=None) -> Backend:
    """``inner`` rung over ``group`` for a sequence of ``seq`` tokens (``group`` None: ``inner`` itself)."""
    if group is None:
        return inner
    return RingBackend(inner, group, seq, docs)


__all__ = ["Rect", "RingBackend", "RingComm", "rectangles", "ring_backend", "ring_work"]
