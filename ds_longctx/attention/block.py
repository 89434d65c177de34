"""The attention block as one autograd Function: input RMSNorm + untied attention + o_proj.

Why one Function: at the attention backward (a layer's memory peak at long context) autograd would
otherwise hold, besides what the kernels need, the input norm's output (attention's saved input, one
[s, hidden]) and o_proj's full input-gradient (all heads, another [s, hidden]). Here

* the normed input is not saved: backward re-derives it per row tile from the layer input (saved
  anyway, it is the checkpoint input) and the fp32 1/rms ([s, 1]) for each projection and weight-grad
  GEMM;
* no full attention-output gradient exists: each stage forms its own head columns,
  ``grad_out @ W_o[:, stage columns]``, straight into its all-to-all send buffer;
* the gradient w.r.t. the normed input accumulates in one [s, hidden] buffer that the norm's tiled
  backward then turns into the layer-input gradient in place.

The forward computes exactly what the separate modules compute (same ops on the same values: the loss
is bit-equal); backward differs only in summation order (per-tile GEMMs, per-stage dout/dk/dv).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..memory.keep import kept_or_computed
from ..memory.norm import _rows_per_tile, rms_norm_rows, rms_norm_rows_backward, rms_norm_tile, tile_starts
from .documents import with_documents
from .kernels import get_backend
from .untied import (ProjectionSpec, Schedule, StageSpec, _add_gt_x, _check_weights, _ProjSource, _staged_backward,
                     _staged_forward)


class _NormedProjSource(_ProjSource):
    """_ProjSource whose x is the normed layer input, re-derived per row tile (never whole).

    At one head per stage a re-derivation takes ~6x the time of the GEMM it feeds (H100 rates, Llama-3.2-1B:
    16 bytes per element at 2.9 TB/s against 128 FLOP per element of a [rows, 2048] x [2048, 64] GEMM at
    the 151 TFLOP/s measured for that shape), so each pass over the tiles serves every GEMM that can wait:
    a stage's weight-gradient GEMMs (``g^T @ xn``, nothing reads them before the end) are queued and run in
    the next pass, the next projection's (k and v together). Per layer backward: chunks + stages + 1 passes
    instead of 2 x chunks + 4 x stages. Each weight-gradient row block still sums the same tiles of the same
    stages in the same order (bit-equal).
    """

    def __init__(self, x_in, rstd, norm_w, *args):
        super().__init__(x_in, *args)
        self.r2 = rstd.reshape(-1, 1)
        self.norm_w = norm_w
        self.step = _rows_per_tile(x_in.shape[-1])
        self._waiting = []  # (g, gw_rows): weight-gradient GEMMs for the next pass

    def _pass(self, mms):
        waiting, self._waiting = self._waiting, []
        n = self.x2.shape[0]
        for lo in tile_starts(n, self.step):
            hi = min(lo + self.step, n)
            xn = rms_norm_tile(self.x2, self.r2, self.norm_w, lo, hi)
            for g, gw_rows in waiting:
                _add_gt_x(gw_rows, g[lo:hi], xn)
            for w_rows, out in mms:
                torch.mm(xn, w_rows.t(), out=out[lo:hi])

    def _x_mm(self, pairs):
        self._pass(pairs)

    def _x_grad_w(self, pairs):
        self._waiting.extend(pairs)

    def grads(self):
        if self._waiting:
            self._pass([])
        return super().grads()


def _dout_blocks(grad2, wo, sched: Schedule, off: int, b: int, s: int, d: int):
    """One stage's attention-output gradient, heads [r*H/C + off, +u) of every rank block r, as
    [b, s, C, u, d] laid out physically as [C, b, s, u, d] (the all-to-all send buffer)."""
    u, C = sched.heads_per_chunk, sched.sp
    buf = torch.empty(C, b * s, u * d, dtype=grad2.dtype, device=grad2.device)
    for r in range(C):
        h0 = r * sched.q_local + off
        torch.mm(grad2, wo[:, h0 * d:(h0 + u) * d], out=buf[r])
    return buf.view(C, b, s, u, d).permute(1, 2, 0, 3, 4)


class UntiedAttentionBlock(torch.autograd.Function):
    """x [b, s, D] (layer input, sequence-sharded) -> o_proj(attention(norm(x))) [b, s, D].

    ``norm_w`` None: x is attention's input as is (no norm fused)."""

    @staticmethod
    def forward(ctx, x, norm_w, cos, sin, wq, bq, wk, bk, wv, bv, qn, kn, wo, bo, stage: StageSpec, eps: float):
        spec, sched = stage.projection, stage.schedule
        d = spec.head_dim
        _check_weights(x, wq, wk, wv, sched.heads, sched.kv_heads, d)
        b, s = x.shape[0], x.shape[1]
        if norm_w is not None:
            xn, rstd = rms_norm_rows(x, norm_w, eps)
        else:
            xn, rstd = x, None

        def attend():
            src = _ProjSource(xn, cos, sin, wq, bq, wk, bk, wv, bv, qn, kn, spec, sched)
            return _staged_forward(src, sched, stage.group, stage.backend, stage.causal, stage.scale, b, s, d,
                                   xn.dtype, x.device)

        # keep_attention_output (memory/keep.py): in a checkpointed layer's recompute, out and lse come from
        # its first forward and the q/k/v projections and the attention forward are skipped
        out, lse_all = kept_or_computed(attend)
        del attend, xn  # the normed input is transient: backward re-derives it per row tile
        y = torch.nn.functional.linear(out.reshape(b, s, -1), wo, bo)  # what o_proj's module computes
        ctx.save_for_backward(x, norm_w, rstd, cos, sin, wq, bq, wk, bk, wv, bv, qn, kn, wo, bo, out, lse_all)
        ctx.stage = stage
        ctx.set_materialize_grads(False)
        return y

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return (None,) * 16
        x, norm_w, rstd, cos, sin, wq, bq, wk, bk, wv, bv, qn, kn, wo, bo, out, lse_all = ctx.saved_tensors
        st = ctx.stage
        sched, spec = st.schedule, st.projection
        b, s, D = x.shape
        d = spec.head_dim
        grad2 = grad.reshape(-1, grad.shape[-1])
        if grad2.stride(-1) != 1:
            grad2 = grad2.contiguous()
        out2 = out.view(-1, out.shape[2] * out.shape[3])
        # o_proj's weight/bias grads, as its Linear would form them
        gwo = grad2.t().mm(out2) if ctx.needs_input_grad[12] else None
        gbo = grad2.sum(0) if bo is not None and ctx.needs_input_grad[13] else None
        if norm_w is not None:
            src = _NormedProjSource(x, rstd, norm_w, cos, sin, wq, bq, wk, bk, wv, bv, qn, kn, spec, sched)
        else:
            src = _ProjSource(x, cos, sin, wq, bq, wk, bk, wv, bv, qn, kn, spec, sched)
        dxn, gwq, gbq, gwk, gbk, gwv, gbv, gqn, gkn = _staged_backward(
            src, sched, st.group, st.backend, st.causal, st.scale, out, None, lse_all,
            dout_for_stage=lambda off: _dout_blocks(grad2, wo, sched, off, b, s, d))
        del src
        gnw = None
        if norm_w is not None:
            # the normed-input gradient becomes the layer-input gradient in place, tile by tile
            dx, gnw = rms_norm_rows_backward(x, rstd, norm_w, dxn, True, ctx.needs_input_grad[1], out=dxn)
        else:
            dx = dxn
        return dx, gnw, None, None, gwq, gbq, gwk, gbk, gwv, gbv, gqn, gkn, gwo, gbo, None, None


def untied_attention_block(x, cos, sin, wq, wk, wv, wo, *, schedule: Schedule, spec: ProjectionSpec,
                           norm_weight=None, norm_eps: float = 1e-6, bq=None, bk=None, bv=None, bo=None,
                           q_norm=None, k_norm=None, group=None, backend=None, causal: bool = True,
                           scale: Optional[float] = None, docs=None) -> torch.Tensor:
    """``o_proj(attention(rms_norm(x)))`` for the sequence-sharded layer input x [b, s, D] (``norm_weight``
    None: no norm). Returns [b, s, D]; the residual add is the caller's. ``schedule``: the Schedule of the layer's
    heads over ``group``'s SP degree, built (and validated) once by the caller (the install builds it at install,
    not per forward). ``docs``: packed-document structure of the gathered sequence (attention/documents.py), None
    for one causal sequence."""
    backend = with_documents(backend if backend is not None else get_backend("auto", x.device), docs)
    scale = spec.head_dim ** -0.5 if scale is None else scale
    heads = schedule.heads
    if tuple(wo.shape) != (x.shape[-1], heads * spec.head_dim):
        raise ValueError(f"untied attention block: o_proj weight is {tuple(wo.shape)}, expected "
                         f"{(x.shape[-1], heads * spec.head_dim)}; under ZeRO-3 the weights must be gathered")
    if norm_weight is not None and tuple(norm_weight.shape) != (x.shape[-1],):
        raise ValueError(f"untied attention block: input norm weight is {tuple(norm_weight.shape)}, expected "
                         f"({x.shape[-1]},)")
    stage = StageSpec(schedule, group, backend, causal, scale, spec)
    return UntiedAttentionBlock.apply(x, norm_weight, cos, sin, wq, bq, wk, bk, wv, bv, q_norm, k_norm, wo, bo, stage,
                                      norm_eps)


__all__ = ["UntiedAttentionBlock", "untied_attention_block"]
