"""Tiny HF model configs built locally (no hub): Llama, Mistral, Qwen2, Qwen3."""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

ARCHS = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}


def tiny_config(arch: str = "llama", heads: int = 4, kv_heads: int = 2, head_dim: int = 8, layers: int = 2,
                vocab: int = 64, intermediate: int = 48, attn: str = "sdpa", **overrides):
    cls = ARCHS[arch]
    kw = dict(hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
              head_dim=head_dim, num_hidden_layers=layers, vocab_size=vocab, intermediate_size=intermediate,
              max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False)
    if arch == "mistral":
        kw["sliding_window"] = None
    if arch in ("qwen2", "qwen3"):
        kw["use_sliding_window"] = False
    kw.update(overrides)
    cfg = cls(**kw)
    cfg._attn_implementation = attn
    return cfg


def build(cfg, seed: int = 0, dtype=torch.float32):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=cfg._attn_implementation)
    return model
