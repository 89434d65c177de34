"""Llama 4 (text) with chunked attention shorter than the sample: tiny random-init models and the spawned SP cases of
tests/test_chunked_sp.py (importable by spawned workers)."""
from __future__ import annotations

import torch

from arch_cases import BASE, VOCAB

SEQ = 16
DOC_LENS = (5, 7, 4)  # packed: boundaries at 5 and 12, chunk boundaries at 4, 8, 12 (shards of 8 at SP=2, 4 at SP=4)


def llama4_config(chunk: int = 4):
    """Every layer type of Llama 4: chunked RoPE layers and a NoPE full-attention layer (no_rope_layers), dense MLPs
    (moe_layers empty: the MoE block is item 5's), attention-temperature tuning off (its positions under
    SP are another fix)."""
    import transformers as tf

    b = dict(BASE, num_hidden_layers=4)
    cfg = tf.Llama4TextConfig(**b, num_key_value_heads=2, head_dim=8, intermediate_size_mlp=48,
                              attention_chunk_size=chunk, moe_layers=[], attn_temperature_tuning=False,
                              no_rope_layers=[1, 1, 1, 0], use_qk_norm=True)
    return cfg


def build_llama4(seed: int = 0, chunk: int = 4):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(llama4_config(chunk), dtype=torch.float32, attn_implementation="sdpa")


def batch(kind: str, seed: int = 0):
    from sp_cases import token_batch

    return token_batch(kind, VOCAB, SEQ, DOC_LENS, seed)


def reference(b: dict, chunk: int = 4):
    model = build_llama4(chunk=chunk)
    loss = model(**b, use_cache=False).loss  # HF masks packed documents only without a cache
    loss.backward()
    return loss.item(), {n: (-p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
                         for n, p in model.named_parameters()}, {n: p.detach().clone() for n, p in model.named_parameters()}


def sp_step(lc: dict, b: dict, sp: int):
    from sp_cases import one_sgd_step

    return one_sgd_step(build_llama4(), b, sp, lc)
