"""Pieces shared by the Llama-family architectures (rotate-half RoPE, RMS q/k-norm)."""
from __future__ import annotations

import functools
import inspect
import textwrap
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ..errors import ConfigError
from .adapters import is_linear_forward


def text_config(model_config):
    """The decoder's config (multimodal configs nest it; plain causal-LM configs are it)."""
    return model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config


@dataclass(frozen=True)
class AttentionShape:
    """Query heads, key/value heads and head size of a decoder's attention, read once from its config.

    ``layers``: where the config gives them per layer (transformers' heterogeneous configs: Gemma 4's global layers
    have their own ``head_dim`` and key/value heads), each layer's shape in layer order, and then ``heads``,
    ``kv_heads`` and ``head_dim`` are the largest over the layers (upper bounds, for sizing); () where every layer
    has the one shape. Whatever splits heads reads :meth:`of_layer` / :meth:`distinct`."""
    heads: int
    kv_heads: int
    head_dim: int
    layers: Tuple["AttentionShape", ...] = ()

    def of_layer(self, idx) -> "AttentionShape":
        """Layer ``idx``'s shape (this one where the config has one shape, or the index is unknown)."""
        if self.layers and isinstance(idx, int) and 0 <= idx < len(self.layers):
            return self.layers[idx]
        return self if not self.layers else AttentionShape(self.heads, self.kv_heads, self.head_dim)

    def distinct(self) -> Tuple["AttentionShape", ...]:
        """Every shape some layer has, once each, in first-layer order."""
        if not self.layers:
            return (self,)
        return tuple(dict.fromkeys(self.layers))


# the config spellings transformers ships, in the order they are tried
_KV_SPELLINGS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num")
_HEAD_DIM_SPELLINGS = ("head_dim", "attention_head_size", "head_size")


def attention_shape(model_config) -> AttentionShape:
    """Heads, KV heads and head_dim through every spelling transformers uses: the one reader of them in
    ds_longctx. ``num_key_value_heads`` missing (GPT-NeoX, Phi, OLMo, ...) means multi-head attention
    (``multi_query=True``: one KV head); ``head_dim`` missing or None (Mixtral's default, GPT-NeoX) means
    hidden_size / heads, which is what those models' attention modules compute."""
    tc = text_config(model_config)
    name = getattr(tc, "model_type", None) or type(tc).__name__
    per_layer = set(getattr(tc, "per_layer_attributes", None) or ()) if getattr(tc, "is_heterogeneous", False) else set()
    if not per_layer & {"num_attention_heads", *_KV_SPELLINGS, *_HEAD_DIM_SPELLINGS, "hidden_size"}:
        return _attention_shape(tc, name)
    # transformers' per-layer (heterogeneous) config: its global head_dim (etc.) raises; each layer's view has its own
    views = tc.per_layer_config
    layers = tuple(_attention_shape(views[i], f"{name} layer {i}") for i in range(len(views)))
    if len(set(layers)) == 1:
        return layers[0]
    return AttentionShape(heads=max(s.heads for s in layers), kv_heads=max(s.kv_heads for s in layers),
                          head_dim=max(s.head_dim for s in layers), layers=layers)


def latent_dims(tc, head_dim: int) -> Tuple[int, int]:
    """(query/key head dim, value head dim) of the heads the attention function gets: multi-head latent attention
    (DeepSeek-V2/V3, GLM-4-MoE-Lite, ...) has qk_nope_head_dim + qk_rope_head_dim and v_head_dim after its
    up-projections (its config's ``head_dim`` is the rope part alone); every other model one ``head_dim`` for both."""
    v = getattr(tc, "v_head_dim", None)
    if not (getattr(tc, "kv_lora_rank", None) or (isinstance(v, int) and v != head_dim)):
        return head_dim, head_dim
    qk = getattr(tc, "qk_head_dim", None)
    if not isinstance(qk, int):
        qk = int(getattr(tc, "qk_nope_head_dim", 0) or 0) + int(getattr(tc, "qk_rope_head_dim", 0) or 0)
    return int(qk), int(v if isinstance(v, int) else head_dim)


@dataclass(frozen=True)
class LayerDims:
    """One decoder layer's attention as its attention function gets it: query heads, key/value heads, query/key head
    dim and value head dim (they differ under multi-head latent attention)."""
    heads: int
    kv_heads: int
    qk_dim: int
    v_dim: int


def attention_dims(model_config) -> Tuple[LayerDims, ...]:
    """:class:`LayerDims` of every decoder layer, in layer order: per layer where the config gives shapes per layer
    (Gemma 4's sliding vs global layers), with latent attention's separate q/k and v head dims (:func:`latent_dims`).
    What the planner's arithmetic sizes per layer instead of by the largest shape."""
    tc = text_config(model_config)
    shape = attention_shape(model_config)
    n = int(getattr(tc, "num_hidden_layers", 0) or 0) or max(1, len(shape.layers))
    out = []
    for i in range(n):
        s = shape.of_layer(i)
        qk, v = latent_dims(tc, s.head_dim)
        out.append(LayerDims(s.heads, s.kv_heads, qk, v))
    return tuple(out)


def _attention_shape(tc, name: str) -> AttentionShape:
    heads = getattr(tc, "num_attention_heads", None)
    if not isinstance(heads, int) or heads < 1:
        raise ConfigError("model.config.num_attention_heads", f"the {name} config has no attention head count "
                          f"(got {heads!r})", "sequence parallelism and the planner need attention heads to "
                          "split; a model without them (state-space, recurrent) cannot be split along the sequence: "
                          "train it at sequence_parallel_size 1 with long_context.attention.implementation 'none'")
    if getattr(tc, "multi_query", False) is True and not getattr(tc, "new_decoder_architecture", False):
        kv = 1  # Falcon's multi-query layout (its num_kv_heads is used only by the new decoder architecture)
    else:
        kv = next((getattr(tc, k) for k in _KV_SPELLINGS if getattr(tc, k, None) is not None), heads)
    d = next((getattr(tc, k) for k in _HEAD_DIM_SPELLINGS if getattr(tc, k, None) is not None), None)
    if d is None:
        hidden = getattr(tc, "hidden_size", None)
        if not isinstance(hidden, int) or hidden % heads:
            raise ConfigError("model.config.head_dim", f"the {name} config gives no head_dim and hidden_size "
                              f"{hidden!r} is not a multiple of its {heads} heads", "set head_dim in the model config")
        d = hidden // heads
    if not (isinstance(kv, int) and kv >= 1 and heads % kv == 0):
        raise ConfigError("model.config.num_key_value_heads", f"the {name} config has {kv!r} key/value heads for "
                          f"{heads} query heads", "key/value heads must divide the query heads")
    return AttentionShape(heads=heads, kv_heads=int(kv), head_dim=int(d))


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
    # where the module itself keeps its sliding window (a dotted attribute path); the fused forward checks it
    # against models.windows.layer_attention (the window it applies); None = the module keeps none
    sliding_window_attr: Optional[str] = None


@dataclass(frozen=True)
class Architecture:
    """Everything ds_longctx knows about one HF architecture. Adding one: a file here defining its
    ``Architecture``, one line in ``models/__init__.py``'s registry, a tiny config in tests/tiny_models.py
    (fused attention) or tests/arch_cases.py (MLP only)."""
    attention: Optional[AttentionFacts]  # fused untied attention: where q/k/v/o, q/k-norm, sliding window live;
    #                                      None: no fused path (untied runs at the attention-function level)
    mlp_class: str                # decoder MLP class, pointwise over tokens (sequence tiling is exact)
    types: Tuple[str, ...] = ()   # model_type(s) when there are no attention facts to carry them
    # the MLP's forward unpacks [batch, seq, hidden] (MoE blocks): tiles are given as [1, rows, hidden]
    mlp_batched: bool = False
    # a module attribute adding random noise to the MLP's input in training (Mixtral's router jitter): a tile
    # recomputed in backward would draw other noise than its forward, so tiling is refused while it is on
    mlp_noise_attr: Optional[str] = None

    @property
    def model_types(self) -> Tuple[str, ...]:
        return self.attention.model_types if self.attention is not None else self.types


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


@dataclass(frozen=True)
class MlpForm:
    """An MLP forward that is pointwise over tokens, as transformers writes it in ``reference`` (a class of
    ``transformers.models.<model_type>``); modular transformers copies these forwards verbatim into many
    architectures (Gemma, Granite, Cohere, OLMo, GLM-4, Arcee, ...)."""
    model_type: str
    reference: str                 # the class whose forward is the reference source
    linears: Tuple[str, ...]       # its nn.Linear attributes
    activation: Optional[str]      # its activation attribute (one of transformers' table: elementwise); None: the
    # forward calls a fixed torch function (F.silu), which the source check pins
    dropout: Optional[str] = None  # the attribute of a dropout probability it applies in training


_MLP_FORMS = (
    MlpForm("llama", "LlamaMLP", ("gate_proj", "up_proj", "down_proj"), "act_fn"),   # down(act(gate(x)) * up(x))
    MlpForm("phi3", "Phi3MLP", ("gate_up_proj", "down_proj"), "activation_fn"),       # fused gate/up, chunked
    MlpForm("nemotron", "NemotronMLP", ("up_proj", "down_proj"), "act_fn"),           # down(act(up(x)))
    MlpForm("phi", "PhiMLP", ("fc1", "fc2"), "activation_fn"),                        # fc2(act(fc1(x)))
    MlpForm("seed_oss", "SeedOssMLP", ("gate_proj", "up_proj", "down_proj"), "act_fn", "residual_dropout"),
    MlpForm("starcoder2", "Starcoder2MLP", ("c_fc", "c_proj"), "act", "residual_dropout"),
    # out(act(x1) * x2), x1|x2 = in(x): Granite-4's shared MLP beside its MoE block (granitemoehybrid's too)
    MlpForm("granitemoeshared", "GraniteMoeSharedMLP", ("input_linear", "output_linear"), "activation"),
    # down(act(gate(x) * m_g) * up(x)) * m_d, scalar multipliers from the config: Falcon-H1
    MlpForm("falcon_h1", "FalconH1MLP", ("gate_proj", "up_proj", "down_proj"), "act_fn"),
    MlpForm("llama4", "Llama4TextMLP", ("gate_proj", "up_proj", "down_proj"), "activation_fn"),  # Llama 4's dense MLP
    MlpForm("lfm2", "Lfm2MLP", ("w1", "w2", "w3"), None),  # w2(silu(w1(x)) * w3(x)): LFM2's and LFM3's
)


def mlp_form_names() -> Tuple[str, ...]:
    """The reference classes of the recognised MLP forms (for messages)."""
    return tuple(f.reference for f in _MLP_FORMS)


@functools.lru_cache(maxsize=None)
def _mlp_form_sources():
    import importlib

    out = []
    for form in _MLP_FORMS:
        mod = importlib.import_module(f"transformers.models.{form.model_type}.modeling_{form.model_type}")
        out.append((form, _src(getattr(mod, form.reference).forward)))
    return out


@functools.lru_cache(maxsize=None)
def _activation_classes() -> tuple:
    from transformers.activations import ACT2CLS

    return tuple({v[0] if isinstance(v, tuple) else v for v in ACT2CLS.values()})


def _elementwise_activation(act) -> bool:
    return isinstance(act, _activation_classes())


def pointwise_mlp_form(module) -> Optional[MlpForm]:
    """The form whose reference forward ``module`` runs verbatim, with its Linear attributes nn.Linear and its
    activation one of transformers' table (elementwise); None otherwise. Such an MLP is pointwise over tokens
    whatever the architecture calls it, so tiling the sequence is exact (a form's dropout aside: see
    ``MlpForm.dropout``). The source check matters as for the norms: an MLP with the same attributes but another
    forward (a token shift, a capacity-limited router) would be tiled wrongly."""
    src = None
    for form, ref in _mlp_form_sources():
        if not all(is_linear_forward(getattr(module, n, None)) for n in form.linears):  # (LoRA on them: too)
            continue
        if form.activation is not None and not _elementwise_activation(getattr(module, form.activation, None)):
            continue
        src = _src(type(module).forward) if src is None else src
        if ref and src == ref:
            return form
    return None


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
