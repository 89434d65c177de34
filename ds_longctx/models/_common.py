"""Pieces shared by the Llama-family architectures (rotate-half RoPE, RMS q/k-norm)."""
from __future__ import annotations

import inspect
import textwrap
from dataclasses import dataclass
from typing import Optional, Tuple

import torch


def text_config(model_config):
    """The decoder's config (multimodal configs nest it; plain causal-LM configs are it)."""
    return model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config


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


@dataclass(frozen=True)
class Architecture:
    """Everything ds_longctx knows about one HF architecture. Adding one: a file here defining its
    ``Architecture``, one line in ``models/__init__.py``'s registry, a tiny config in tests/tiny_models.py."""
    attention: AttentionFacts     # fused untied attention: where q/k/v/o, q/k-norm, sliding window live
    mlp_class: str                # decoder MLP class, pointwise over tokens (sequence tiling is exact)

    @property
    def model_types(self) -> Tuple[str, ...]:
        return self.attention.model_types


def layer_role(child_name: str) -> Optional[str]:
    """'attention' / 'mlp' / None for a decoder layer's child by its attribute name (HF's naming across
    architectures: self_attn, attention, mlp, feed_forward, block_sparse_moe, ...)."""
    low = child_name.lower()
    if "norm" in low:  # post_attention_layernorm is a norm, not attention
        return None
    if low.endswith("attn") or low.endswith("attention"):
        return "attention"
    if low in ("mlp", "feed_forward", "ffn", "block_sparse_moe") or low.endswith("mlp"):
        return "mlp"
    return None


def _src(fn) -> str:
    try:
        return textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return ""


def _reference_rmsnorm_source() -> str:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return _src(LlamaRMSNorm.forward)


def is_llama_style_rmsnorm(module) -> bool:
    """Class name ends in RMSNorm, has weight/variance_epsilon, and its forward is Llama's source.

    The source check matters: several HF norms share the name and attributes but not the formula
    (``1 + weight``, gated, weight applied in fp32), and swapping those would silently change the model.
    """
    cls = type(module)
    if not cls.__name__.endswith("RMSNorm"):
        return False
    if not isinstance(getattr(module, "weight", None), torch.Tensor) or not hasattr(module, "variance_epsilon"):
        return False
    if module.weight.dim() != 1:
        return False
    ref = _reference_rmsnorm_source()
    return bool(ref) and _src(cls.forward) == ref
