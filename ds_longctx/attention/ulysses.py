"""DeepSpeed's own Ulysses attention (``UlyssesSPAttentionHF``) installed on one model.

Built for our SP group instead of through DeepSpeed's ``register_with_transformers``, which also
creates the groups (we need them earlier, and the planner needs no collectives here) and writes
transformers' attention table process-wide; we route only this model's modules through the
attention registry, so other models keep the original function and the install can be undone.
"""
from __future__ import annotations

import torch

from . import registry
from .documents import document_core


def install_ulysses(model, group) -> registry.Installation:
    """Route ``model``'s attention through DeepSpeed's Ulysses for ``group`` (SP > 1). No collectives."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    from ..config import check_sp_attention_pattern
    from ..models import attention_shape, text_config
    from .hf import check_window

    impl = model.config._attn_implementation
    tc = text_config(model.config)
    if impl == "flex_attention":  # refused by initialize already; here too for direct callers of patch_model
        check_sp_attention_pattern("ulysses", model.config, None)
    # the core runs per document when the batch carries packed documents (documents.DOCS_KWARG)
    shape = attention_shape(tc)
    uattn = UlyssesSPAttentionHF(
        attn=document_core(registry.original(impl), impl), batch_size=1, attn_head_count=shape.heads,
        attn_head_size=shape.head_dim, kv_head_count=shape.kv_heads, num_hidden_layers=tc.num_hidden_layers,
        process_group=group,
        seq_length_is_variable=True)
    uattn.core_attn_implementation = impl

    def ulysses_attention(module, query, key, value, attention_mask, *args, **kwargs):
        # HF passes the layer's window (None on full-attention layers): refused unless it covers the sequence
        check_window(kwargs.get("sliding_window"), query.shape[2] * uattn.world_size,
                      getattr(module, "layer_idx", None), "ulysses")
        bs = query.shape[0]
        if uattn.batch_size != bs:  # DeepSpeed fixes the batch size at construction
            uattn.batch_size = bs
            for name in ("required_query_shape", "required_key_value_shape", "required_context_shape"):
                shape = list(getattr(uattn, name))
                shape[1] = bs
                setattr(uattn, name, torch.Size(shape))
        # HF built the mask for the local shard; attention runs causal over the gathered sequence (flex_attention,
        # whose BlockMask would carry causality, and windowed layers are refused above).
        return uattn(module, query, key, value, None, *args, **kwargs)

    # Same interception as DeepSpeed's register_with_transformers (the core key is overridden, which
    # keeps every HF branch that tests `_attn_implementation == "flash_attention_2"` etc.), per module.
    return registry.install(model, impl, ulysses_attention, "DeepSpeed Ulysses")


__all__ = ["install_ulysses"]
