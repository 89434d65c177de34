"""Pieces shared by the Llama-family architectures (rotate-half RoPE, RMS q/k-norm)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rope_bshd(t, cos, sin):
    """HF's apply_rotary_pos_emb for one tensor [b, s, <head dims>..., d] with cos/sin [b, s, d]."""
    shape = (cos.shape[0], cos.shape[1]) + (1,) * (t.dim() - 3) + (cos.shape[-1],)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    return (t * cos) + (rotate_half(t) * sin)


def rope_bshd_backward(g, cos, sin):
    """Gradient of :func:`rope_bshd` w.r.t. its input: the rotation is linear, so it is its transpose,
    ``g * cos + rotate_half^T(g * sin)`` with ``rotate_half^T(w) = cat(w2, -w1)``; it needs nothing from
    the forward."""
    shape = (cos.shape[0], cos.shape[1]) + (1,) * (g.dim() - 3) + (cos.shape[-1],)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    w = g * sin
    half = w.shape[-1] // 2
    return (g * cos) + torch.cat((w[..., half:], -w[..., :half]), dim=-1)


def rms_norm(t, weight, eps: float):
    """Same op order as LlamaRMSNorm/Qwen3RMSNorm (fp32 statistics, cast back, then scale)."""
    dtype = t.dtype
    h = t.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + eps)
    return weight * h.to(dtype)


@dataclass(frozen=True)
class AttentionFacts:
    """Where a model's attention keeps its pieces; attribute names on the attention module."""
    model_types: Tuple[str, ...]
    attention_class: str          # class name in transformers.models.<model_type>.modeling_<model_type>
    q: str = "q_proj"
    k: str = "k_proj"
    v: str = "v_proj"
    o: str = "o_proj"
    q_norm: Optional[str] = None
    k_norm: Optional[str] = None
    # where a sliding window would come from (module attr first, then config attr); None = no window
    sliding_window_attr: Optional[str] = None
