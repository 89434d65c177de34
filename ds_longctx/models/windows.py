"""Which decoder layers do NOT attend plain causal over the whole sequence: sliding windows, chunked
attention, other layer types; bidirectional attention; attention soft-capping. Read from the config the way
transformers' own modeling code reads it, so the SP attention paths apply what they can (windows and
soft-caps, on the gathered sequence; chunks as documents cut at every chunk: attention.documents.chunk_documents)
and refuse what they would silently compute differently (other layer types, bidirectional attention).

* ``layer_types`` (Gemma2/3, Qwen2 with ``use_sliding_window``, GPT-OSS, Llama4, Cohere2, ...): a
  'sliding_attention' layer uses ``config.sliding_window``, a 'chunked_attention' layer
  ``config.attention_chunk_size``; any type other than 'full_attention' (and the MLP kinds) is not
  plain causal attention.
* MiniMax (``layer_types`` of 'linear_attention' and 'full_attention'): its 'full_attention' layers apply a set
  ``config.sliding_window`` (transformers 5.24's MiniMaxAttention passes ``sliding_window=config.sliding_window``
  and MiniMaxModel builds their mask with create_sliding_window_causal_mask); its lightning layers ignore it.
* no ``layer_types`` (Mistral, Mixtral, Phi3, Starcoder2, Qwen3-MoE): a set ``sliding_window`` applies to
  every layer. Qwen-family configs already turn it to None/0 when ``use_sliding_window`` is false.

HF's window (transformers' masking_utils.sliding_window_overlay, and flash's window_size = (window - 1, ...)):
query q sees keys k with q - window < k <= q, so a window (or chunk) of at least the sequence length is
exactly full causal attention. :func:`layer_attention` gives each layer's window and attention soft-cap,
which the SP paths apply (attention/ulysses.py, attention/hf.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from ..errors import ConfigError
from ._common import text_config
from .hybrid import attends_fully

_FULL = ("full_attention",)
_MLP_KINDS = ("dense", "sparse", "moe", "mlp")  # MLP layer kinds that may share the list (transformers' BC;
# nemotron_h: its 'mlp' and 'moe' blocks are layers of their own, with no attention)
# model types whose 'full_attention' layers apply a set config.sliding_window (their modeling code passes it to the
# attention function on every attention layer and builds the sliding-window causal mask for them)
_WINDOWED_FULL = ("minimax",)
# model types (no layer_types) that apply a set config.sliding_window through the mask they build and pass no
# sliding_window to the attention function (transformers 5.24's PhimoeModel / PhimoeAttention)
_WINDOW_BY_MASK = ("phimoe",)


def _full_window(tc):
    """The window a 'full_attention' layer of this config applies (None: full causal)."""
    window = getattr(tc, "sliding_window", None) or None
    return int(window) if window and getattr(tc, "model_type", None) in _WINDOWED_FULL else None


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
    full_window = _full_window(tc)
    for i, t in enumerate(types):
        if t in _FULL and full_window is not None:  # MiniMax: its attention layers are windowed
            t = "sliding_attention"
        elif t in _FULL or t in _MLP_KINDS:
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


@dataclass(frozen=True)
class LayerAttention:
    """What one decoder layer's attention applies besides full causal attention, as transformers' modeling
    code reads it: its sliding window (tokens; None: full causal) and attention logit soft-cap (Gemma2's
    ``attn_logit_softcapping``; None: none). ``kind`` is the layer type (chunked and other types are not
    runnable by the SP paths: ``runnable`` is False for them)."""
    window: Optional[int] = None
    softcap: Optional[float] = None
    kind: str = "full_attention"
    chunk: Optional[int] = None  # a 'chunked_attention' layer's chunk (tokens)
    # the model applies the window through its attention mask only and passes no sliding_window to the attention
    # function (PhiMoE: create_sliding_window_causal_mask when config.sliding_window is set)
    window_by_mask: bool = False

    @property
    def passed_window(self) -> Optional[int]:
        """The sliding_window transformers passes to the attention function for this layer."""
        return None if self.window_by_mask else self.window

    def runnable(self, seq_len: int) -> bool:
        """Causal attention (with this window) over ``seq_len`` tokens is what the layer computes: any layer
        but other types, and a chunked layer only when its chunk covers the sequence."""
        if self.kind == "chunked_attention":
            return self.chunk is not None and self.chunk >= seq_len
        return self.kind in ("full_attention", "sliding_attention")

    def window_for(self, seq_len: int) -> Optional[int]:
        """The window that matters for a ``seq_len``-token sequence: None when it covers the whole sequence
        (then it is exactly full causal attention)."""
        return self.window if self.window is not None and self.window < seq_len else None

    def describe(self, layer: Optional[int]) -> str:
        where = f"layer {layer}" if layer is not None else "this layer"
        parts = ([f"a sliding window of {self.window} tokens"] if self.window else []) + \
            ([f"attention soft-capping {self.softcap:g}"] if self.softcap else [])
        return f"{where} ({' and '.join(parts) or self.kind})"


def layer_attention(model_config) -> List[LayerAttention]:
    """Per decoder layer (index = ``layer_idx``), its window, soft-cap and type: the facts the SP attention
    paths apply (Gemma2/3, Qwen2 and GPT-OSS-style ``layer_types``; Mistral's ``sliding_window`` on every
    layer; Gemma2's ``attn_logit_softcapping`` on every layer)."""
    tc = text_config(model_config)
    n = int(getattr(tc, "num_hidden_layers", 0) or 0)
    window = getattr(tc, "sliding_window", None) or None  # Qwen2-MoE writes 0 for "off"
    cap = getattr(tc, "attn_logit_softcapping", None) or None
    cap = float(cap) if cap is not None else None
    types = getattr(tc, "layer_types", None)
    if types is None:
        by_mask = bool(window) and getattr(tc, "model_type", None) in _WINDOW_BY_MASK
        return [LayerAttention(int(window) if window else None, cap,
                               "sliding_attention" if window else "full_attention", window_by_mask=by_mask)
                for _ in range(n)]
    chunk = getattr(tc, "attention_chunk_size", None) or None
    full_window = _full_window(tc)
    out = []
    for t in types:
        if t in _FULL and full_window is not None:  # MiniMax: a set sliding_window applies to its attention layers
            out.append(LayerAttention(full_window, cap, "sliding_attention"))
        elif t == "sliding_attention":
            out.append(LayerAttention(int(window) if window else None, cap, t))
        else:  # falcon_h1's 'hybrid' layers: full causal attention beside a Mamba2 mixer (models.hybrid)
            full = t in _MLP_KINDS or attends_fully(model_config, t)
            out.append(LayerAttention(None, cap, "full_attention" if full else t,
                                      int(chunk) if chunk and t == "chunked_attention" else None))
    return out


def not_runnable(idx, facts, global_len: int, impl: str) -> ConfigError:
    """The refusal of a layer the SP attention does not compute (chunked shorter than the sequence, other
    layer types), for direct callers of patch_model (initialize refuses them first, config.py)."""
    if facts.kind == "chunked_attention":  # 'ulysses' and the function-level untied path run chunks as documents
        return ConfigError("long_context.attention.fuse_projections",
                           f"layer {idx} has chunked attention of {facts.chunk}-token chunks, shorter than the gathered "
                           f"{global_len}-token sequence, which the fused untied path does not cut",
                           "set long_context.attention.fuse_projections to false (the attention-function level "
                           "untied path runs the chunks as documents), or use implementation 'ulysses'")
    return ConfigError("long_context.attention.implementation",
                       f"layer {idx} has a '{facts.kind}' layer; {impl!r} computes causal attention (with sliding "
                       f"windows) over the gathered {global_len}-token sequence, so it would be silently changed",
                       "this layer type is not supported under sequence parallelism yet; train with "
                       "long_context.attention.implementation 'none' at sequence_parallel_size 1, where "
                       "transformers' own attention runs it exactly")


def has_sdpa_path(model_config) -> bool:
    """Whether transformers has an SDPA attention path for the model: its causal LM class (transformers' auto
    mapping for the config's model_type) does not set ``_supports_sdpa = False``. Without one (GPT-OSS: attention
    sinks; Gemma 2: soft-capping) 'flex_attention' is what the model is loaded with. True when the class is not
    found (the question is then not ours to answer)."""
    import importlib

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    mt = getattr(model_config, "model_type", None)
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(mt) if isinstance(mt, str) else None
    try:
        cls = getattr(importlib.import_module(f"transformers.models.{mt}.modeling_{mt}"), name) if name else None
    except (ImportError, AttributeError):
        cls = None
    return cls is None or getattr(cls, "_supports_sdpa", True) is not False


def is_bidirectional(model_config) -> bool:
    """Gemma3-style embedding configs attend both ways (``use_bidirectional_attention``)."""
    tc = text_config(model_config)
    return bool(getattr(tc, "use_bidirectional_attention", False)) or getattr(tc, "is_causal", True) is False


__all__ = ["LayerAttention", "RestrictedLayers", "layer_attention", "restricted_layers", "is_bidirectional",
           "not_runnable", "has_sdpa_path"]
