"""Untied Ulysses (UPipe): DeepSpeed-Ulysses attention run as a loop over head chunks.

Tensors on a rank are sequence-sharded: x [b, s, D], q [b, s, H, d], k/v [b, s, G, d], out [b, s, H, d]
(s = S/C local tokens, C = SP degree). Each stage moves U = heads_per_chunk * C query heads to the
head-sharded layout [b, S, heads_per_chunk, d], runs the kernel keeping the LSE and writes the stage's
output heads back into a preallocated [b, s, H, d] buffer, so intermediates scale with U, not H.

Head schedule (standard pretrained pairing: query head h uses kv head h // (H/G)). Over the whole
layer rank r computes exactly the heads tied Ulysses gives it (query heads [r*H/C, (r+1)*H/C), kv
heads [r*G/C, (r+1)*G/C) or, when C > G, the one kv head r // (C/G)), so per-head results match tied
Ulysses. KV is sent in chunks of m kv heads per rank (m = u / gcd(u, group size), the fewest that
make every stage's u query heads fall inside the chunk) and reused by that chunk's stages.

Backward is a staged loop that re-projects (fused path) or re-slices (q/k/v path) and re-sends the
stage's inputs and calls the kernel's backward with the saved LSE: there is no attention forward
recompute. On the fused path each stage's dk/dv go back and are folded into dx/dW at once (no
accumulator over a chunk's stages) and RoPE's backward is the inverse rotation (nothing of a stage's
projection is kept); on the q/k/v path dk/dv accumulate in fp32 over a chunk's stages. dx in x's dtype
(an fp32 dx would cost 2x the layer input, more than the saving at long context).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..memory.keep import kept_or_computed
from ..models._common import rope_bshd, rope_bshd_backward
from .documents import with_documents
from .kernels import Backend, get_backend


# ---------------------------------------------------------------------------------------------
# schedule
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Schedule:
    heads: int            # H query heads
    kv_heads: int         # G key/value heads
    sp: int               # C
    heads_per_chunk: int  # u query heads per rank per stage

    def __post_init__(self):
        H, G, C, u = self.heads, self.kv_heads, self.sp, self.heads_per_chunk
        if min(H, G, C, u) < 1:
            raise ValueError(f"untied attention: heads={H}, kv_heads={G}, sp={C}, heads_per_chunk={u} must be >= 1")
        if H % G:
            raise ValueError(f"untied attention: {H} query heads are not a multiple of {G} kv heads")
        if H % C:
            raise ValueError(f"untied attention: SP degree {C} does not divide the {H} query heads")
        if G % C and C % G:
            raise ValueError(f"untied attention: SP degree {C} neither divides nor is a multiple of the {G} kv heads")
        if (H // C) % u:
            valid = [v for v in range(1, H // C + 1) if (H // C) % v == 0]
            raise ValueError(f"untied attention: heads_per_chunk={u} does not divide the {H // C} query heads per "
                             f"rank ({H} heads / SP {C}); use one of {valid}")

    # per-rank quantities -------------------------------------------------------------------
    @property
    def replicated(self) -> bool:
        return self.sp > self.kv_heads

    @property
    def rep(self) -> int:  # copies of each kv head across ranks
        return self.sp // self.kv_heads if self.replicated else 1

    @property
    def q_local(self) -> int:
        return self.heads // self.sp

    @property
    def kv_local(self) -> int:
        return 1 if self.replicated else self.kv_heads // self.sp

    @property
    def q_per_kv(self) -> int:  # local query heads per local kv head (not a process group)
        return self.q_local // self.kv_local

    @property
    def m(self) -> int:  # kv heads per rank per chunk
        u, g = self.heads_per_chunk, self.q_per_kv
        return u // math.gcd(u, g)

    @property
    def chunks(self) -> int:
        return self.kv_local // self.m

    @property
    def stages_per_chunk(self) -> int:
        return self.m * self.q_per_kv // self.heads_per_chunk

    @property
    def stages(self) -> int:
        return self.chunks * self.stages_per_chunk

    def q_offset(self, j: int, t: int) -> int:
        """First query head of stage (j, t) inside each rank's block of H/C heads."""
        return j * self.m * self.q_per_kv + t * self.heads_per_chunk

    def kv_offset(self, j: int) -> int:
        """First kv head of chunk j inside each rank's block of G/C kv heads (0 when replicated)."""
        return j * self.m

    # head lists (sent order: rank-major, so rank r receives entries [r*n, (r+1)*n)) ----------
    def kv_heads_of_chunk(self, j: int) -> List[int]:
        return [(r * self.kv_local + j * self.m + i) // self.rep for r in range(self.sp) for i in range(self.m)]

    def q_heads_of_stage(self, j: int, t: int) -> List[int]:
        u = self.heads_per_chunk
        return [r * self.q_local + j * self.m * self.q_per_kv + t * u + i for r in range(self.sp) for i in range(u)]

    def stage_kv(self, t: int):
        """How stage t's u local query heads use the chunk's m local kv heads.

        Returns ("slice", lo, hi): query heads map onto kv heads [lo, hi) with a uniform group (the
        kernel does GQA itself); or ("index", idx): kv head per query head (expanded, then summed back).
        """
        u, g = self.heads_per_chunk, self.q_per_kv
        if u % g == 0:
            return ("slice", t * u // g, (t + 1) * u // g)
        if g % u == 0:
            return ("slice", t * u // g, t * u // g + 1)
        return ("index", [(t * u + i) // g for i in range(u)])

    def lse_heads(self, rank: int) -> List[List[int]]:
        """Global query head of each LSE row on ``rank``: [stage][i] for the lse buffer [stages, b, u, S]."""
        u = self.heads_per_chunk
        out = []
        for j in range(self.chunks):
            for t in range(self.stages_per_chunk):
                heads = self.q_heads_of_stage(j, t)
                out.append(heads[rank * u:(rank + 1) * u])
        return out

    @cached_property
    def _index_cache(self):
        return {}

    def index(self, key, values, device) -> torch.Tensor:
        k = (key, device)
        if k not in self._index_cache:
            self._index_cache[k] = torch.tensor(values, dtype=torch.long, device=device)
        return self._index_cache[k]


# ---------------------------------------------------------------------------------------------
# all-to-all on 5-D views. A stage's heads on a rank are [b, s, C, n, d]: C rank blocks of n heads.
# Sources build them physically as [C, b, s, n, d], so the send buffer is the tensor itself.
# ---------------------------------------------------------------------------------------------


def _seq_to_head(t5, group):
    """[b, s, C, n, d] (sequence-sharded, block r for rank r) -> [b, C*s, n, d] head-sharded."""
    b, s, C, n, d = t5.shape
    if group is None:
        return t5.reshape(b, s, n, d)
    send = t5.permute(2, 0, 1, 3, 4).contiguous()  # a no-op when built in this layout
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 0, 2, 3, 4).reshape(b, C * s, n, d)  # a view when b == 1


def _head_to_seq(t, group, C):
    """[b, C*s, n, d] head-sharded -> [b, s, C, n, d] sequence-sharded (a strided view)."""
    b, S, n, d = t.shape
    s = S // C
    if group is None:
        return t.view(b, s, 1, n, d)
    send = t.reshape(b, C, s, n, d).permute(1, 0, 2, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 0, 3, 4)


def _blocks(t, C, per, off, n):
    """Heads [r*per + off, r*per + off + n) of every rank block r of t [b, s, C*per, d] -> [b, s, C, n, d]."""
    b, s, _, d = t.shape
    return t.view(b, s, C, per, d)[:, :, :, off:off + n]


# ---------------------------------------------------------------------------------------------
# sources: where a stage's q and a chunk's k/v come from, and where their gradients go
# ---------------------------------------------------------------------------------------------


class _QKVSource:
    """Attention-function level: HF already computed q/k/v (post RoPE) for all heads."""

    def __init__(self, q, k, v, sched: Schedule):
        self.q_, self.k_, self.v_ = q, k, v
        self.sc = sched

    def q(self, off, grad=False):
        sc = self.sc
        return _blocks(self.q_, sc.sp, sc.q_local, off, sc.heads_per_chunk), None

    def _kv(self, t, off):
        sc = self.sc
        if sc.replicated:  # every rank gets the one kv head its query heads need
            b, s, G, d = t.shape
            return t.repeat_interleave(sc.rep, dim=2).view(b, s, sc.sp, 1, d)
        return _blocks(t, sc.sp, sc.kv_local, off, sc.m)

    def kv(self, off, grad=False):
        return self._kv(self.k_, off), self._kv(self.v_, off), None

    def begin_backward(self):
        self.dq = torch.empty_like(self.q_)
        self.dk = torch.empty_like(self.k_)
        self.dv = torch.empty_like(self.v_)

    def q_grad(self, off, handle, dq5):
        sc = self.sc
        _blocks(self.dq, sc.sp, sc.q_local, off, sc.heads_per_chunk).copy_(dq5)

    def _kv_grad(self, dst, off, d5):
        sc = self.sc
        if sc.replicated:  # sum the replicas (fp32, like the fused path)
            b, s, C, _, d = d5.shape
            dst.copy_(d5.float().reshape(b, s, sc.kv_heads, sc.rep, d).sum(3))
        else:
            _blocks(dst, sc.sp, sc.kv_local, off, sc.m).copy_(d5)

    def kv_grad(self, off, handle, dk5, dv5):
        self._kv_grad(self.dk, off, dk5)
        self._kv_grad(self.dv, off, dv5)

    def grads(self):
        return self.dq, self.dk, self.dv


@dataclass
class ProjectionSpec:
    """Per-architecture pieces the fused path needs (see ds_longctx/models)."""
    head_dim: int
    rope: Callable            # rope(t [b, s, ..., d], cos [b, s, d], sin [b, s, d]) -> t
    norm: Optional[Callable] = None  # norm(t [b, s, ..., d], weight [d]) -> t (q/k-norm, e.g. Qwen3)
    # rope_grad(g, cos, sin) -> dL/dt: RoPE's backward without anything stored (a rotation by the negative
    # angle). None: known for models.rope_bshd, else the stage keeps its pre-RoPE projection and
    # differentiates rope by autograd
    rope_grad: Optional[Callable] = None


def _add_gt_x(gw_rows, g, x2):
    """gw_rows += g^T @ x2 (the product rounded once in g's dtype when the buffer is wider)."""
    if gw_rows.dtype == g.dtype:
        gw_rows.addmm_(g.t(), x2)
    else:
        gw_rows += (g.t() @ x2).to(gw_rows.dtype)


def _rope_grad_of(spec: ProjectionSpec):
    if spec.rope_grad is not None:
        return spec.rope_grad
    return rope_bshd_backward if spec.rope is rope_bshd else None


class _ProjSource:
    """Fused path: q/k/v are projected per stage from x, normed and rotated on local positions.

    Each rank block of a stage is one GEMM against a row slice (a view) of the weight, written into
    its slot of the [C, b*s, n*d] send buffer: no weight copy, no reordering copy before the send.

    Backward keeps nothing of a stage's projection for RoPE: its gradient is the inverse rotation of the
    incoming one (``rope_grad``). Only with a q/k-norm (or a RoPE without a known inverse) the stage
    keeps its pre-norm projection and re-runs norm (+ RoPE) under autograd at its gradient.
    Each stage's k/v gradient is folded into dx/dW as soon as it comes back (``per_stage_kv``), so no
    accumulator over a chunk's stages exists.
    """

    per_stage_kv = True

    def __init__(self, x, cos, sin, wq, bq, wk, bk, wv, bv, qn, kn, spec: ProjectionSpec, sched: Schedule):
        self.x, self.cos, self.sin = x, cos, sin
        self.w = {"q": (wq, bq, qn), "k": (wk, bk, kn), "v": (wv, bv, None)}
        self.spec, self.sc = spec, sched
        self.d = spec.head_dim
        self.x2 = x.reshape(-1, x.shape[-1])
        self.rope_grad = _rope_grad_of(spec)

    def _rows(self, which, off, n):
        """Row ranges (in heads) of the weight for each rank block, and heads per block."""
        sc = self.sc
        if which == "q":
            return [r * sc.q_local + off for r in range(sc.sp)], n
        if sc.replicated:  # project the G distinct kv heads once; replicas are made before the send
            return [0], sc.kv_heads
        return [r * sc.kv_local + off for r in range(sc.sp)], n

    def _gemms(self, which, off, n):
        """A projection's output buffer [blocks, b*s, n*d] and its (weight rows, out) GEMMs, for :meth:`_x_mm`."""
        w, d = self.w[which][0], self.d
        starts, n = self._rows(which, off, n)
        y = torch.empty(len(starts), self.x2.shape[0], n * d, dtype=self.x.dtype, device=self.x.device)
        return (starts, n, y), [(w[h0 * d:(h0 + n) * d], y[i]) for i, h0 in enumerate(starts)]

    def _proj(self, which, off, n, grad):
        part, pairs = self._gemms(which, off, n)
        self._x_mm(pairs)
        return self._projected(which, *part, grad)

    def _projected(self, which, starts, n, y, grad):
        """The projection y [blocks, b*s, n*d] -> (post-processed [b, s, blocks, n, d], its gradient handle)."""
        _, bias, nw = self.w[which]
        d = self.d
        if bias is not None:
            for i, h0 in enumerate(starts):
                y[i] += bias[h0 * d:(h0 + n) * d]
        b, s = self.x.shape[0], self.x.shape[1]
        y = y.view(len(starts), b, s, n, d).permute(1, 2, 0, 3, 4)  # [b, s, blocks, n, d]
        norm = self.spec.norm if (nw is not None and self.spec.norm is not None) else None
        with torch.no_grad():
            z = self._finish(which, self._post(which, y, nw if norm else None))
        if not grad:
            return z, None
        # what the gradient needs besides dz: the pre-norm projection only when autograd must re-run a
        # q/k-norm or an unknown RoPE; v (no post-ops) and RoPE alone keep nothing
        keep = which != "v" and (norm is not None or self.rope_grad is None)
        return z, [starts, n, y if keep else None, nw if norm else None]

    # the two GEMMs that read x (overridden where x is re-derived per row tile, attention/block.py)
    def _x_mm(self, pairs):
        """out [b*s, rows] = x @ w_rows^T for each (w_rows, out)"""
        for w_rows, out in pairs:
            torch.mm(self.x2, w_rows.t(), out=out)

    def _x_grad_w(self, pairs):
        """gw_rows += g^T @ x for each (g, gw_rows)"""
        for g, gw_rows in pairs:
            _add_gt_x(gw_rows, g, self.x2)

    def _post(self, which, y, nw):
        if which == "v":
            return y
        if nw is not None:
            y = self.spec.norm(y, nw)
        return self.spec.rope(y, self.cos, self.sin)

    def _post_grad(self, which, handle, dz):
        """dL/d(projection) (and dL/d(q/k-norm weight)) from dL/d(post-processed projection)."""
        _, _, y, nw = handle
        if which == "v":
            return dz, None
        if y is None:  # RoPE alone, analytic
            return self.rope_grad(dz, self.cos, self.sin), None
        y = y.detach().requires_grad_(True)
        nw_leaf = nw.detach().requires_grad_(True) if nw is not None else None
        with torch.enable_grad():
            if self.rope_grad is not None:  # re-run the norm only; RoPE's part is the inverse rotation
                dz = self.rope_grad(dz, self.cos, self.sin)
                z = self.spec.norm(y, nw_leaf)
            else:
                z = self._post(which, y, nw_leaf)
        grads = torch.autograd.grad(z, [y] + ([nw_leaf] if nw_leaf is not None else []), dz)
        return grads[0], (grads[1] if nw_leaf is not None else None)

    def _finish(self, which, z):
        if which != "q" and self.sc.replicated:  # [b, s, 1, G, d] -> [b, s, C, 1, d]
            b, s, _, G, d = z.shape
            return z.reshape(b, s, G, d).repeat_interleave(self.sc.rep, dim=2).view(b, s, self.sc.sp, 1, d)
        return z

    def q(self, off, grad=False):
        return self._proj("q", off, self.sc.heads_per_chunk, grad)

    def kv(self, off, grad=False):
        # k's and v's GEMMs in one _x_mm: where x is re-derived per row tile, one pass serves both
        (pk, gk), (pv, gv) = self._gemms("k", off, self.sc.m), self._gemms("v", off, self.sc.m)
        self._x_mm(gk + gv)
        del gk, gv
        k, hk = self._projected("k", *pk, grad)
        del pk
        v, hv = self._projected("v", *pv, grad)
        return k, v, (hk, hv)

    def begin_backward(self):
        self.dx = torch.zeros_like(self.x)
        self.g = {}

    def _grad_buffers(self, which):
        # allocated at first use: k/v grads only exist from the end of the first kv chunk on
        if which not in self.g:
            w, b, nw = self.w[which]
            # fp32: a kv weight gets one contribution per stage of its chunk (tiny next to activations)
            acc = torch.float32 if w.dtype in (torch.float16, torch.bfloat16) else w.dtype
            self.g[which] = [torch.zeros(w.shape, dtype=acc, device=w.device),
                             torch.zeros(b.shape, dtype=acc, device=b.device) if b is not None else None,
                             torch.zeros(nw.shape, dtype=torch.float32, device=nw.device)
                             if nw is not None and self.spec.norm is not None else None]
        return self.g[which]

    def _back(self, which, handle, dz):
        starts, n = handle[0], handle[1]
        gy, gnw = self._post_grad(which, handle, dz)
        if gnw is not None:
            self._grad_buffers(which)[2].add_(gnw.float())
        del dz, gnw
        d = self.d
        w = self.w[which][0]
        gw, gb, _ = self._grad_buffers(which)
        gy = gy.permute(2, 0, 1, 3, 4).reshape(len(starts), -1, n * d)  # [blocks, b*s, n*d]
        dx2 = self.dx.view(-1, self.dx.shape[-1])
        pairs = []
        for i, h0 in enumerate(starts):
            rows = slice(h0 * d, (h0 + n) * d)
            g_i = gy[i].to(dx2.dtype)
            dx2.addmm_(g_i, w[rows])
            # replicas were summed before; a kv row block gets one contribution per stage of its chunk
            pairs.append((g_i, gw[rows]))
            if gb is not None:
                gb[rows] += g_i.sum(0).to(gb.dtype)
        self._x_grad_w(pairs)

    def q_grad(self, off, handle, dq5):
        self._back("q", handle, dq5)
        handle.clear()  # the caller's reference must not keep the stage's projection alive

    def _unreplicate(self, d5):
        if not self.sc.replicated:
            return d5
        b, s, C, _, d = d5.shape  # sum replicas in fp32 -> [b, s, 1, G, d] like the projection
        G = self.sc.kv_heads
        return d5.float().reshape(b, s, G, self.sc.rep, d).sum(3).to(self.x.dtype).view(b, s, 1, G, d)

    def kv_grad(self, off, handle, dk5, dv5):
        """One stage's (or a whole chunk's) k/v gradient, folded into dx and dW now; the handle stays
        usable for the chunk's next stages (the caller drops it after the chunk)."""
        hk, hv = handle
        self._back("k", hk, self._unreplicate(dk5).to(self.x.dtype))
        self._back("v", hv, self._unreplicate(dv5).to(self.x.dtype))

    def grads(self):
        out = [self.dx]
        for which in ("q", "k", "v"):
            gw, gb, _ = self._grad_buffers(which)
            w, b, _ = self.w[which]
            out += [gw.to(w.dtype), gb.to(b.dtype) if gb is not None else None]
        for which in ("q", "k"):
            nw = self.w[which][2]
            gn = self._grad_buffers(which)[2]
            out.append(gn.to(nw.dtype) if gn is not None else None)
        return out


# ---------------------------------------------------------------------------------------------
# the staged loops
# ---------------------------------------------------------------------------------------------


def _kv_for_stage(sched, t, k, v):
    kind = sched.stage_kv(t)
    if kind[0] == "slice":
        return k[:, :, kind[1]:kind[2]], v[:, :, kind[1]:kind[2]], kind
    idx = sched.index(("kvmap", t), kind[1], k.device)
    return k.index_select(2, idx), v.index_select(2, idx), kind


def _out_blocks(out, sched, off):
    return _blocks(out, sched.sp, sched.q_local, off, sched.heads_per_chunk)


def _sink_corrected(o_h, lse, sinks):
    """A stage's kernel output o_h [b, S, u, d] and LSE [b, u, S] with a per-head sink logit (``sinks`` [u], this
    rank's heads of the stage) added to the softmax denominator: lse' = logaddexp(lse, sink), out' = out *
    exp(lse - lse') = out * sigmoid(lse - sink). The kernel's own backward given (out', lse') is then the gradient
    of the softmax with the sink (attention/ulysses._SinkAttention, the same formula on the tied path)."""
    lse_sink = torch.logaddexp(lse, sinks.to(lse.dtype).view(1, -1, 1))
    o_h = (o_h.to(lse.dtype) * torch.exp(lse - lse_sink).transpose(1, 2).unsqueeze(-1)).to(o_h.dtype)
    return o_h, lse_sink


def _sink_grad(do_h, o_h, lse_sink, sinks):
    """d loss / d sinks [u] of one stage: -sum over rows of P_sink * rowsum(dout * out'), P_sink = exp(sink - lse')."""
    delta = (do_h.to(lse_sink.dtype) * o_h.to(lse_sink.dtype)).sum(-1).transpose(1, 2)  # [b, u, S]
    p_sink = torch.exp(sinks.to(lse_sink.dtype).view(1, -1, 1) - lse_sink)
    return -(p_sink * delta).sum(dim=(0, 2))


def _staged_forward(src, sched: Schedule, group, backend: Backend, causal, scale, b, s, d, dtype, device,
                    sinks=None):
    """``sinks``: None, or [stages, u] this rank's heads' sink logits per stage (:func:`stage_sinks`)."""
    u, C = sched.heads_per_chunk, sched.sp
    out = torch.empty(b, s, sched.heads, d, dtype=dtype, device=device)
    lse_all = torch.empty(sched.stages, b, u, s * C, dtype=torch.float32, device=device)
    stage = 0
    for j in range(sched.chunks):
        k, v, _ = src.kv(sched.kv_offset(j))
        k_h, v_h = _seq_to_head(k, group), _seq_to_head(v, group)
        del k, v
        for t in range(sched.stages_per_chunk):
            off = sched.q_offset(j, t)
            q, _ = src.q(off)
            q_h = _seq_to_head(q, group)
            del q
            ks, vs, _ = _kv_for_stage(sched, t, k_h, v_h)
            o_h, lse = backend.forward(q_h, ks, vs, causal, scale)
            del q_h, ks, vs
            if sinks is not None:
                o_h, lse = _sink_corrected(o_h, lse, sinks[stage])
            lse_all[stage].copy_(lse)
            del lse
            o5 = _head_to_seq(o_h, group, C)
            del o_h
            _out_blocks(out, sched, off).copy_(o5)
            del o5
            stage += 1
        del k_h, v_h
    return out, lse_all


def _stage_kv_grad(sched, t, kind, dks, k_h, dtype):
    """A stage's k (or v) gradient in the chunk's head-sharded shape [b, S, m, d] and the model dtype."""
    if kind[0] == "slice" and kind[2] - kind[1] == k_h.shape[2]:
        return dks.to(dtype)
    full = torch.zeros(k_h.shape, dtype=torch.float32, device=dks.device)
    if kind[0] == "slice":
        full[:, :, kind[1]:kind[2]] += dks
    else:
        full.index_add_(2, sched.index(("kvmap", t), kind[1], dks.device), dks.float())
    return full.to(dtype)


def _stage_grads(src, sched, group, backend, causal, scale, out, lse_all, j, t, stage, k_h, v_h, kv_handle,
                 do_h, dk_acc, dv_acc, sinks=None, dsinks=None):
    """Kernel backward of stage (j, t) given its head-sharded dout; q's gradient goes to the source now,
    k/v's either now (per_stage_kv) or into the chunk's fp32 accumulators; with ``sinks`` the stage's sink
    gradient into ``dsinks`` [stages, u]."""
    device, C = out.device, sched.sp
    off = sched.q_offset(j, t)
    q, q_handle = src.q(off, grad=True)
    q_h = _seq_to_head(q, group)
    del q
    o_h = _seq_to_head(_out_blocks(out, sched, off), group)
    ks, vs, kind = _kv_for_stage(sched, t, k_h, v_h)
    if sinks is not None:  # out and the saved LSE are the sink-corrected ones (_sink_corrected)
        dsinks[stage] = _sink_grad(do_h, o_h, lse_all[stage], sinks[stage]).to(dsinks.dtype)
    dq_h, dks, dvs = backend.backward(do_h, q_h, ks, vs, o_h, lse_all[stage], causal, scale)
    del q_h, o_h, do_h, ks, vs
    if dk_acc is None:
        dt = out.dtype
        dk = _head_to_seq(_stage_kv_grad(sched, t, kind, dks, k_h, dt), group, C)
        del dks
        dv = _head_to_seq(_stage_kv_grad(sched, t, kind, dvs, v_h, dt), group, C)
        del dvs
        src.kv_grad(sched.kv_offset(j), kv_handle, dk, dv)
        del dk, dv
    elif kind[0] == "slice":
        dk_acc[:, :, kind[1]:kind[2]] += dks
        dv_acc[:, :, kind[1]:kind[2]] += dvs
    else:
        idx = sched.index(("kvmap", t), kind[1], device)
        dk_acc.index_add_(2, idx, dks.float())
        dv_acc.index_add_(2, idx, dvs.float())
    if dk_acc is not None:
        del dks, dvs
    dq5 = _head_to_seq(dq_h, group, C)
    del dq_h
    src.q_grad(off, q_handle, dq5)


def _staged_backward(src, sched: Schedule, group, backend: Backend, causal, scale, out, dout, lse_all,
                     dout_for_stage=None, sinks=None, dsinks=None):
    """dout: [b, s, H, d] output gradient, or None with ``dout_for_stage(off)`` giving each stage's head
    blocks [b, s, C, u, d] (formed per stage, so the whole dout never exists). ``sinks`` [stages, u]: the
    forward's (:func:`_staged_forward`); their gradient is written into ``dsinks`` of that shape."""
    device, C = out.device, sched.sp
    if dout is not None:
        dout = dout.contiguous()
    per_stage = getattr(src, "per_stage_kv", False)
    src.begin_backward()
    stage = 0
    for j in range(sched.chunks):
        k, v, kv_handle = src.kv(sched.kv_offset(j), grad=True)
        k_h, v_h = _seq_to_head(k, group), _seq_to_head(v, group)
        del k, v
        dk_acc = dv_acc = None
        if not per_stage:  # the q/k/v path: one copy of the chunk's grads into the full dk/dv
            dk_acc = torch.zeros(k_h.shape, dtype=torch.float32, device=device)
            dv_acc = torch.zeros(v_h.shape, dtype=torch.float32, device=device)
        for t in range(sched.stages_per_chunk):
            off = sched.q_offset(j, t)
            blocks = _out_blocks(dout, sched, off) if dout is not None else dout_for_stage(off)
            do_h = _seq_to_head(blocks, group)
            del blocks
            _stage_grads(src, sched, group, backend, causal, scale, out, lse_all, j, t, stage, k_h, v_h, kv_handle,
                         do_h, dk_acc, dv_acc, sinks, dsinks)
            del do_h
            stage += 1
        del k_h, v_h
        if not per_stage:
            dt = out.dtype
            dk = _head_to_seq(dk_acc.to(dt), group, C)
            dv = _head_to_seq(dv_acc.to(dt), group, C)
            del dk_acc, dv_acc
            src.kv_grad(sched.kv_offset(j), kv_handle, dk, dv)
            del dk, dv
        del kv_handle
    return src.grads()


@dataclass(frozen=True)
class StageSpec:
    """Everything about a call of the staged Functions that is not a tensor (one typed argument instead
    of a positional tuple). ``projection`` is set on the fused path only."""
    schedule: Schedule
    group: Any                  # the SP process group (None: SP=1)
    backend: Backend
    causal: bool
    scale: float
    projection: Optional[ProjectionSpec] = None


class UntiedQKVAttention(torch.autograd.Function):
    """q [b, s, H, d], k/v [b, s, G, d] sequence-sharded -> out [b, s, H, d] (+ lse, non-differentiable).
    ``sinks``: None, or [stages, u] this rank's per-stage sink logits (:func:`stage_sinks`; the LSE returned is then
    the sink-corrected one)."""

    @staticmethod
    def forward(ctx, q, k, v, spec: StageSpec, sinks=None):
        b, s, H, d = q.shape
        sched = spec.schedule
        _check_shapes(q, k, v)
        sk = sinks.detach() if sinks is not None else None
        ctx.spec = spec
        return _forward(ctx, _QKVSource(q, k, v, sched), spec, b, s, d, q, ((q, k, v), (sinks,)), sk)

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:
            return (None,) * 5
        q, k, v, out, lse_all, sinks = ctx.saved_tensors
        sp = ctx.spec
        dsinks = None
        if sinks is not None:
            sinks = sinks.detach()
            dsinks = torch.zeros(sinks.shape, dtype=lse_all.dtype, device=sinks.device)
        dq, dk, dv = _staged_backward(_QKVSource(q, k, v, sp.schedule), sp.schedule, sp.group, sp.backend, sp.causal,
                                      sp.scale, out, dout, lse_all, sinks=sinks, dsinks=dsinks)
        return dq, dk, dv, None, (dsinks.to(sinks.dtype) if dsinks is not None else None)


class UntiedFusedAttention(torch.autograd.Function):
    """x [b, s, D] sequence-sharded + projection weights -> out [b, s, H, d] (+ lse, non-differentiable)."""

    @staticmethod
    def forward(ctx, x, cos, sin, wq, bq, wk, bk, wv, bv, qn, kn, stage: StageSpec):
        spec, sched = stage.projection, stage.schedule
        d = spec.head_dim
        _check_weights(x, wq, wk, wv, sched.heads, sched.kv_heads, d)
        b, s = x.shape[0], x.shape[1]
        ctx.stage = stage
        return _forward(ctx, _ProjSource(x, cos, sin, wq, bq, wk, bk, wv, bv, qn, kn, spec, sched), stage, b, s, d, x,
                        ((x, cos, sin, wq, bq, wk, bk, wv, bv, qn, kn), ()))

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:
            return (None,) * 12
        x, cos, sin, wq, bq, wk, bk, wv, bv, qn, kn, out, lse_all = ctx.saved_tensors
        st = ctx.stage
        src = _ProjSource(x, cos, sin, wq, bq, wk, bk, wv, bv, qn, kn, st.projection, st.schedule)
        dx, gwq, gbq, gwk, gbk, gwv, gbv, gqn, gkn = _staged_backward(src, st.schedule, st.group, st.backend,
                                                                      st.causal, st.scale, out, dout, lse_all)
        return dx, None, None, gwq, gbq, gwk, gbk, gwv, gbv, gqn, gkn, None


def _forward(ctx, source, stage: StageSpec, b, s, d, like, saved, sinks=None):
    """Both Functions' forward: the staged loop over ``source``'s heads (``keep_attention_output``: the recompute of a
    checkpointed layer takes out/LSE from its first forward), out and LSE saved between ``saved``'s inputs (before,
    after) for backward, the LSE non-differentiable and no zero dLSE ([stages, b, u, S] fp32) materialised there."""
    out, lse_all = kept_or_computed(lambda: _staged_forward(
        source, stage.schedule, stage.group, stage.backend, stage.causal, stage.scale, b, s, d, like.dtype,
        like.device, sinks))
    ctx.save_for_backward(*saved[0], out, lse_all, *saved[1])
    ctx.mark_non_differentiable(lse_all)
    ctx.set_materialize_grads(False)
    return out, lse_all


def _check_shapes(q, k, v):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"untied attention: q/k/v must be [b, s_local, heads, head_dim], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"untied attention: q {tuple(q.shape)} and k/v {tuple(k.shape)}/{tuple(v.shape)} disagree")


def _check_weights(x, wq, wk, wv, heads, kv_heads, d):
    D = x.shape[-1]
    if x.dim() != 3:
        raise ValueError(f"untied attention: x must be [b, s_local, hidden], got {tuple(x.shape)}")
    for name, w, n in (("q", wq, heads), ("k", wk, kv_heads), ("v", wv, kv_heads)):
        if tuple(w.shape) != (n * d, D):
            raise ValueError(f"untied attention: {name}_proj weight is {tuple(w.shape)}, expected {(n * d, D)} "
                             f"(heads={n}, head_dim={d}, hidden={D}); under ZeRO-3 the weights must be gathered")


def stage_sinks(sinks: torch.Tensor, schedule: Schedule, group=None) -> torch.Tensor:
    """[stages, u]: the sink logits (``sinks`` [H], one per query head, GPT-OSS's ``sinks``) of the query heads this
    rank computes at each stage (:meth:`Schedule.lse_heads`); an index of ``sinks``, so autograd sums each
    stage's gradient back into its head (other ranks' heads get theirs on their rank, summed by the data-parallel
    gradient reduction as under 'ulysses')."""
    rank = dist.get_rank(group) if group is not None else 0
    idx = schedule.index(("sinks", rank), schedule.lse_heads(rank), sinks.device)
    return sinks[idx]


def untied_attention_qkv(q, k, v, schedule: Schedule, group=None, backend: Backend = None, causal: bool = True,
                         scale: Optional[float] = None, docs=None,
                         sinks: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention on sequence-sharded q [b, s, H, d], k/v [b, s, G, d] over the SP ``group``.

    ``schedule``: the :class:`Schedule` of these head counts (H, G) over ``group``'s SP degree with its heads per
    chunk, built (and so validated) once by the caller (the install builds it at install). Returns (out
    [b, s, H, d], lse [stages, b, heads_per_chunk, S]); ``Schedule.lse_heads(rank)`` names the query head of each
    LSE row. ``docs`` (``documents.Documents`` of the gathered sequence): attention is causal within each
    document. ``backend``: a kernels.Backend (default: 'auto' for the tensors' device). ``sinks`` [H]: a per-head
    sink logit in every softmax denominator (GPT-OSS's attention sinks, transformers' ``s_aux``), applied per stage
    from the kernel's LSE; it gets its gradient (the returned LSE is then the corrected one).
    """
    backend = with_documents(backend if backend is not None else get_backend("auto", q.device), docs)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if sinks is not None:
        if tuple(sinks.shape) != (schedule.heads,):
            raise ValueError(f"untied attention: sinks {tuple(sinks.shape)}, expected one per query head "
                             f"({schedule.heads},)")
        sinks = stage_sinks(sinks, schedule, group)
    return UntiedQKVAttention.apply(q, k, v, StageSpec(schedule, group, backend, causal, scale), sinks)


def untied_attention_fused(x, cos, sin, wq, wk, wv, *, schedule: Schedule, spec: ProjectionSpec, bq=None, bk=None,
                           bv=None, q_norm=None, k_norm=None, group=None, backend: Backend = None, causal: bool = True,
                           scale: Optional[float] = None, docs=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Project, rotate and attend per head chunk from the sequence-sharded layer input x [b, s, D].

    Returns (out [b, s, H, d], lse) like :func:`untied_attention_qkv` (the heads are the schedule's); o_proj is the
    caller's.
    """
    backend = with_documents(backend if backend is not None else get_backend("auto", x.device), docs)
    scale = spec.head_dim ** -0.5 if scale is None else scale
    stage = StageSpec(schedule, group, backend, causal, scale, spec)
    return UntiedFusedAttention.apply(x, cos, sin, wq, bq, wk, bk, wv, bv, q_norm, k_norm, stage)
