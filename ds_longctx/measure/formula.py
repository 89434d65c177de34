"""The project's one FLOPs formula (model FLOPs, without checkpoint recomputation: the MFU convention), for one
sample of S tokens, N = parameters without the input embedding, L attention layers, attention width w = query
heads x head_dim (not the hidden size: they differ, e.g. Qwen3, Gemma):

    dense     = 6 * N * S                  (forward 2NS + backward 4NS)
    attention = 6 * L * w * S^2            (QK^T and PV: 4*S^2*w forward per layer, x3 with backward,
                                            halved by the causal mask)

The planner's step time and the runtime profiler's TFLOPs both use it; analytic, no torch."""
from __future__ import annotations

from typing import Dict

from ..models import attention_dims


def config_value(cfg, key, default):
    if cfg is None:
        return default
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def count_params(model) -> Dict[str, int]:
    """Total parameters and those of the input embedding (ZeRO-3 partitioned params report ds_numel)."""
    total = emb = 0
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    embed_ids = {id(p) for p in embed.parameters()} if embed is not None else set()
    for p in model.parameters():
        n = getattr(p, "ds_numel", None) or p.numel()
        total += n
        if id(p) in embed_ids:
            emb += n
    return {"total": total, "embedding": emb}


def attention_width(tc) -> float:
    """Query heads x head_dim: the width of QK^T and PV (equals hidden_size only when head_dim does), per layer from
    its own heads and head dims (models.attention_dims) and averaged over the quadratic-attention layers (so
    :func:`attention_layers` x this is their sum: Gemma 4's global layers have their own head_dim); with latent
    attention's query/key and value head dims, heads x their mean (QK^T is heads x qk wide, PV heads x v)."""
    dims = attention_dims(tc)
    types = getattr(tc, "layer_types", None)
    if isinstance(types, (list, tuple)) and len(types) == len(dims):
        dims = [d for d, t in zip(dims, types) if str(t) not in _NO_QUADRATIC] or dims
    widths = [d.heads * (d.qk_dim + d.v_dim) / 2 for d in dims]
    w = sum(widths) / len(widths)
    return int(w) if w == int(w) else w


# layer kinds without softmax attention over the sequence (transformers' layer_types): no S^2 term in the MFU formula
_NO_QUADRATIC = ("linear_attention", "conv", "mamba", "mlp", "moe")


def attention_layers(tc) -> int:
    """The layers whose softmax attention is quadratic in the sequence: every layer, unless ``layer_types`` says
    some are linear attention / state-space / conv mixers (Qwen3.5's 24 of 32 Gated DeltaNet layers add no S^2)."""
    types = getattr(tc, "layer_types", None)
    if not isinstance(types, (list, tuple)) or not types:
        return getattr(tc, "num_hidden_layers", 0)
    return sum(1 for t in types if str(t) not in _NO_QUADRATIC)


def flops_per_sample(seq_len: int, n_params_no_embed: int, num_layers: int, attn_width: int) -> Dict[str, float]:
    """MFU's numerator: 6 x non-embedding params per token plus 6 x width x S^2 per quadratic-attention layer
    (``num_layers``: :func:`attention_layers`)."""
    dense = 6.0 * n_params_no_embed * seq_len
    attn = 6.0 * num_layers * attn_width * float(seq_len) ** 2
    return {"dense": dense, "attention": attn, "total": dense + attn}
