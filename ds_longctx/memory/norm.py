"""Memory-efficient RMSNorm for HF's Llama-style norms (Llama, Mistral, Qwen2, Qwen3).

HF's ``LlamaRMSNorm`` upcasts to fp32 and autograd keeps the fp32 copy of the input (for ``pow`` and
``* rsqrt``) plus the rounded normalized value (for ``weight *``) until backward: at long context
that is several fp32 ``[seq_shard, hidden]`` tensors per norm inside a recomputed layer. Here only
the input (its own dtype) and the fp32 ``1/rms`` (``[..., 1]``) are kept; backward recomputes the
normalized value tile by tile, so its fp32 temporaries are bounded by the tile, not the sequence.

The forward runs the same ops in the same order as HF (the output is bit-equal), tile by tile over
rows, so its fp32 upcast and square are also bounded by the tile; only which tensors stay alive
differs. The weight is an input of the Function and the norm is still called through its module, so ZeRO-3's module hooks gather the weight and see its gradient as usual.
"""
from __future__ import annotations

from typing import List

import torch

from .tiles import row_starts
from ..models import is_llama_style_rmsnorm  # noqa: F401  (re-exported: which norms have Llama's formula)

# fp32 elements per forward/backward tile: 128 MiB per fp32 temporary, small next to a layer at 1M+ tokens
# yet large enough that the per-tile kernel launches are negligible.
_TILE_ELEMS = 32 * 2**20


def _rows_per_tile(hidden: int) -> int:
    return max(1, _TILE_ELEMS // max(1, hidden))


def tile_starts(rows: int, step: int):
    """First rows of the row tiles (memory/tiles.py: all of them; the planner's step runs the first)."""
    return row_starts(rows, step)


def rms_norm_rows(x, weight, eps: float):
    """``weight * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(x.dtype)`` over row tiles -> (out, rstd).

    Row tiles: every op is per row (the mean is over the last dim), so each tile computes exactly what
    the whole-tensor forward computes (bit-equal to HF), while the fp32 upcast and its square exist for
    one tile at a time instead of two fp32 [s, hidden] tensors (20 GiB at 5M tokens on 8 ranks).
    """
    input_dtype = x.dtype
    hidden = x.shape[-1]
    out_dtype = torch.promote_types(weight.dtype, input_dtype)
    x2 = x.reshape(-1, hidden)
    # allocated in their final shapes: a Function returning a view of its own buffer makes autograd
    # keep a second copy
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    rstd = torch.empty(x.shape[:-1] + (1,), dtype=torch.float32, device=x.device)
    out2, rstd2 = out.view(-1, hidden), rstd.view(-1, 1)
    step = _rows_per_tile(hidden)
    for lo in tile_starts(x2.shape[0], step):
        hi = min(lo + step, x2.shape[0])
        xf = x2[lo:hi].to(torch.float32)
        variance = xf.pow(2).mean(-1, keepdim=True)
        r = torch.rsqrt(variance + eps)
        del variance
        rstd2[lo:hi] = r
        # in place when x was already fp32 would clobber the saved input, so only mutate our own copy
        normed = xf * r if input_dtype == torch.float32 else xf.mul_(r)
        del xf
        out2[lo:hi] = weight * normed.to(input_dtype)
        del normed, r
    return out, rstd


def rms_norm_tile(x2, r2, weight, lo: int, hi: int):
    """Rows [lo, hi) of the norm's output, re-derived from the 2-D input and its saved 1/rms (bit-equal
    to the forward's rows)."""
    # x * r with x in bf16/fp16 and r fp32 computes in fp32 on x's exact upcast: the forward's
    # x.float() * r without the fp32 copy of x (16 instead of 24 bytes moved per element)
    return weight * (x2[lo:hi] * r2[lo:hi]).to(x2.dtype)


def rms_norm_rows_backward(x, rstd, weight, grad_out, need_x: bool = True, need_w: bool = True, out=None):
    """Tiled backward of :func:`rms_norm_rows` -> (grad_x, grad_w). ``out``: where grad_x goes (may be
    ``grad_out`` itself: each tile is read before it is written)."""
    input_dtype = x.dtype
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    r2 = rstd.reshape(-1, 1)
    g2 = grad_out.reshape(-1, hidden)
    grad_x = (out.view(-1, hidden) if out is not None else torch.empty_like(x2)) if need_x else None
    # fp32 accumulator across tiles; autograd would sum in the output dtype over the whole batch
    grad_w = torch.zeros(hidden, dtype=torch.float32, device=x.device) if need_w else None
    step = _rows_per_tile(hidden)
    for lo in tile_starts(x2.shape[0], step):
        hi = min(lo + step, x2.shape[0])
        xf = x2[lo:hi].to(torch.float32)
        r = r2[lo:hi]
        g = g2[lo:hi]
        if need_w:
            normed = (xf * r).to(input_dtype)  # bit-equal to the forward's value
            grad_w += (g * normed).to(torch.float32).sum(0)
            del normed
        if need_x:
            # autograd's chain: mul by weight in the output dtype, cast back to the input dtype
            # (the .to(input_dtype) node), then to fp32 (the .to(float32) node)
            gn = (g * weight).to(input_dtype).to(torch.float32)
            dot = (gn * xf).sum(-1, keepdim=True)
            # d/dx [x * (mean(x^2)+eps)^-1/2] = r*g - x * r^3 * sum(g*x) / H
            gx = gn.mul_(r)
            gx.sub_(xf * (r.pow(3) * dot / hidden))
            grad_x[lo:hi] = gx.to(input_dtype)
            del gn, gx, dot
        del xf, g
    if need_x:
        grad_x = grad_x.reshape(x.shape)
    if need_w:
        grad_w = grad_w.to(weight.dtype).reshape(weight.shape)
    return grad_x, grad_w


class MemoryEfficientRMSNorm(torch.autograd.Function):
    """``weight * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(x.dtype)``, saving x and rstd."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        out, rstd = rms_norm_rows(x, weight, eps)
        ctx.save_for_backward(x, rstd, weight)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, rstd, weight = ctx.saved_tensors
        grad_x, grad_w = rms_norm_rows_backward(x, rstd, weight, grad_out, ctx.needs_input_grad[0],
                                                ctx.needs_input_grad[1])
        return grad_x, grad_w, None


def _norm_forward(module):
    def forward(hidden_states):
        return MemoryEfficientRMSNorm.apply(hidden_states, module.weight, module.variance_epsilon)

    return forward


def install_memory_efficient_rmsnorm(model) -> List[torch.nn.Module]:
    """Patch the forward of every Llama-style RMSNorm *instance* in ``model`` (decoder layers, q/k
    norms, the final norm); the class stays untouched. Returns the patched modules."""
    patched = []
    for m in model.modules():
        if "forward" in m.__dict__ or not is_llama_style_rmsnorm(m):
            continue
        m.forward = _norm_forward(m)
        patched.append(m)
    return patched


def uninstall_memory_efficient_rmsnorm(modules) -> None:
    for m in modules:
        m.__dict__.pop("forward", None)
