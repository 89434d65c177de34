"""What an RL step (``ds-longctx plan --objective grpo``) holds beyond an SFT step of the same length, by arithmetic.

A GRPO step through TRL + ``enable()`` (hf/rl.py) is, on each rank: the rollout generation (transformers' generate
on whole sequences, the weights gathered under ZeRO-3), then the reference and old-policy forwards (no gradient: their
activations are freed layer by layer, below the training step's peak), then the policy's forward and backward on the
sequence shard, which is the SFT step the planner simulates (the per-token log-probabilities through the same tiled
lm_head step as the tiled loss). On top of that step: the reference model's weights (a second model, partitioned
like the policy's under ZeRO-3, whole otherwise; none with ``lora``: the adapters disabled) and the per-token values
every rank of the group holds for the whole sequence (policy, old-policy and reference log-probabilities, entropy,
the mask and the advantages: fp32, O(tokens)). The generation is a separate peak: the gathered weights plus the KV
cache of the rollout rows (K and V per full-attention layer and token; a sliding layer keeps its window; a recurrent
layer a fixed state, not counted)."""
from __future__ import annotations

from typing import Optional

from ..models import attention_shape, text_config

OBJECTIVES = ("sft", "grpo")
TOKEN_FIELDS = 8  # fp32 per token, whole sequence, every rank: lp, old lp, ref lp, entropy, kl, mask, advantage, loss


def kv_cache_bytes(model_config, tokens: int, rows: int, dtype_bytes: int) -> int:
    """K and V of ``rows`` sequences of ``tokens`` over the model's attention layers."""
    tc = text_config(model_config)
    shape = attention_shape(model_config)
    types = list(getattr(tc, "layer_types", None) or ["full_attention"] * int(tc.num_hidden_layers))
    window = getattr(tc, "sliding_window", None)
    total = 0
    for t in types:
        if "linear" in t or t in ("mamba", "conv", "mlp"):
            continue  # a recurrent / conv layer's state does not grow with the tokens
        kept = min(tokens, int(window)) if (t == "sliding_attention" and window) else tokens
        total += 2 * shape.kv_heads * shape.head_dim * kept
    return total * rows * dtype_bytes


def grpo_extras(model_config, params_total: int, dtype_bytes: int, zero_stage: int, world: int, seq_len: int,
                micro_batch: int, lora: bool = False, rollout_rows: Optional[int] = None) -> dict:
    """{"breakdown": bytes added to the training step's peak per rank, "generation": the generation peak per rank
    (bytes, and its parts)}."""
    ref = 0 if lora else (params_total * dtype_bytes // world if zero_stage == 3 else params_total * dtype_bytes)
    fields = TOKEN_FIELDS * 4 * seq_len * micro_batch
    rows = rollout_rows or micro_batch
    weights = params_total * dtype_bytes  # gathered for generation (TRL's ds3_gather_for_generation) or whole
    kv = kv_cache_bytes(model_config, seq_len, rows, dtype_bytes)
    return {"breakdown": {"rl_reference_model": int(ref), "rl_token_fields": int(fields)},
            "generation": {"bytes": int(weights + kv), "weights": int(weights), "kv_cache": int(kv), "rows": rows}}


__all__ = ["OBJECTIVES", "grpo_extras", "kv_cache_bytes"]
