"""The kernels as custom ops (flash-attn's style): one op per direction with a fake (shapes and dtypes only, what
every backend returns) and a FLOP formula (the causal mask halves the square). The real kernel is the named
backend's ``_fwd``/``_bwd``. out/dq/dk/dv come back as [b, s, h, d] views of kernel buffers; the fakes allocate
them contiguous in that shape (same bytes)."""
from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula
from typing import Tuple

from ...measure.flops import attention_flops, register_attention
from .base import BACKENDS, _instance


@torch.library.custom_op("ds_longctx::attention_forward", mutates_args=())
def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                      backend: str, window: int = 0, softcap: float = 0.0) -> Tuple[torch.Tensor, torch.Tensor]:
    out, lse = _instance(BACKENDS[backend])._fwd_pattern(q, k, v, causal, scale, window, softcap)
    # a custom op may not return an input or a view of one: never the case for a kernel's fresh buffers
    return out, lse


@attention_forward.register_fake
def _(q, k, v, causal, scale, backend, window=0, softcap=0.0):
    b, s, h, _ = q.shape
    return (torch.empty(b, s, h, v.shape[-1], dtype=q.dtype, device=q.device),
            torch.empty(b, h, s, dtype=torch.float32, device=q.device))


@torch.library.custom_op("ds_longctx::attention_backward", mutates_args=())
def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, causal: bool, scale: float, backend: str, window: int = 0,
                       softcap: float = 0.0) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = _instance(BACKENDS[backend])._bwd_pattern(dout, q, k, v, out, lse, causal, scale, window, softcap)
    return dq, dk, dv


@attention_backward.register_fake
def _(dout, q, k, v, out, lse, causal, scale, backend, window=0, softcap=0.0):
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device),
            torch.empty(v.shape, dtype=v.dtype, device=v.device))


def backward_workspace_bytes(q_shape, k_shape, itemsize: int) -> int:
    """Device memory a flash-attention-2 backward holds during the call besides its results (flash_api.cpp
    mha_bwd): an fp32 dq accumulator, the fp32 softmax_d row sums, and head-expanded dk/dv under GQA. What
    the planner charges a GPU attention backward (the CPU kernel's is not modelled). Layout [b, s, h, d]."""
    b, s, h, d = q_shape
    work = 4 * b * s * h * d + 4 * b * h * s
    if k_shape[2] != h:
        work += 2 * b * k_shape[1] * h * k_shape[3] * itemsize
    return work


def _register_flop_formulas():
    fwd, bwd = torch.ops.ds_longctx.attention_forward, torch.ops.ds_longctx.attention_backward

    @register_flop_formula(fwd)
    def _fwd_flops(q, k, v, causal, scale, backend, window=0, softcap=0.0, *args, out_shape=None, **kwargs) -> int:
        b, s, h, d = q
        return attention_flops(b, h, s, k[1], d, causal, backward=False, window=window or None)

    @register_flop_formula(bwd)
    def _bwd_flops(dout, q, k, v, out, lse, causal, scale, backend, window=0, softcap=0.0, *args, out_shape=None,
                   **kwargs) -> int:
        b, s, h, d = q
        return attention_flops(b, h, s, k[1], d, causal, backward=True, window=window or None)

    register_attention(fwd, backward=False)
    register_attention(bwd, backward=True)


_register_flop_formulas()
