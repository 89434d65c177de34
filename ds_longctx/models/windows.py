"""Which decoder layers do NOT attend plain causal over the whole sequence: sliding windows, chunked
attention, other layer types; bidirectional attention. Read from the config the way transformers' own
modeling code reads it, so the SP attention paths (full causal over the gathered sequence) can refuse
what they would silently compute differently.

* ``layer_types`` (Gemma2/3, Qwen2 with ``use_sliding_window``, GPT-OSS, Llama4, Cohere2, ...): a
  'sliding_attention' layer uses ``config.sliding_window``, a 'chunked_attention' layer
  ``config.attention_chunk_size``; any type other than 'full_attention' (and the MLP kinds) is not
  plain causal attention.
* no ``layer_types`` (Mistral, Mixtral, Phi3, Starcoder2, Qwen3-MoE): a set ``sliding_window`` applies to
  every layer. Qwen-family configs already turn it to None/0 when ``use_sliding_window`` is false.

HF's window: query q sees keys k with q - window < k <= q, so a window (or chunk) of at least the
sequence length is exactly full causal attention.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from ._common import text_config

_FULL = ("full_attention",)
_MLP_KINDS = ("dense", "sparse", "moe")  # MLP layer kinds that may share the list (transformers' BC)


@dataclass(frozen=True)
class RestrictedLayers:
    """Layers of one kind that are not full causal attention: their indices, the kind and its span
    (the window or chunk in tokens; None when the kind has none)."""
    kind: str
    layers: Tuple[int, ...]
    span: Optional[int]

    def exact_for(self, seq_len: Optional[int]) -> bool:
        """Full causal over ``seq_len`` tokens: only a window or chunk that covers the whole sequence."""
        return self.span is not None and seq_len is not None and self.span >= seq_len

    def describe(self) -> str:
        layers = list(self.layers)
        shown = f"{layers[:8]}{'...' if len(layers) > 8 else ''}"
        if self.kind == "sliding_attention":
            return f"a sliding window of {self.span} tokens on layers {shown}"
        if self.kind == "chunked_attention":
            return f"chunked attention of {self.span}-token chunks on layers {shown}"
        return f"'{self.kind}' layers {shown}"


def restricted_layers(model_config) -> List[RestrictedLayers]:
    """Every group of layers whose attention is not full causal attention (empty list: all are)."""
    tc = text_config(model_config)
    window = getattr(tc, "sliding_window", None) or None  # Qwen2-MoE writes 0 for "off"
    types = getattr(tc, "layer_types", None)
    n = getattr(tc, "num_hidden_layers", None)
    if types is None:
        if window is None:
            return []
        return [RestrictedLayers("sliding_attention", tuple(range(n or 0)), int(window))]
    groups = {}
    for i, t in enumerate(types):
        if t in _FULL or t in _MLP_KINDS:
            continue
        groups.setdefault(t, []).append(i)
    out = []
    for kind, layers in groups.items():
        span = None
        if kind == "sliding_attention":
            span = window
        elif kind == "chunked_attention":
            span = getattr(tc, "attention_chunk_size", None)
        out.append(RestrictedLayers(kind, tuple(layers), int(span) if span else None))
    return out


def is_bidirectional(model_config) -> bool:
    """Gemma3-style embedding configs attend both ways (``use_bidirectional_attention``)."""
    tc = text_config(model_config)
    return bool(getattr(tc, "use_bidirectional_attention", False)) or getattr(tc, "is_causal", True) is False


__all__ = ["RestrictedLayers", "restricted_layers", "is_bidirectional"]
