"""Gemma 4 (text) tiny random-init models with per-layer attention shapes (sliding layers head_dim 8, global layers
their own global_head_dim 16, and with attention_k_eq_v their own key/value heads), per-layer inputs (PLE) and a
sliding window shorter than the sample: the spawned SP cases of tests/test_gemma4_sp.py (importable by spawned
workers)."""
from __future__ import annotations

import torch

from arch_cases import BASE, VOCAB

SEQ = 16
DOC_LENS = (5, 7, 4)


def gemma4_config(window: int = 4, global_head_dim: int = 16, k_eq_v: bool = False, kv_shared: int = 0):
    """Sliding and global layers alternating (the last global, as Gemma 4 requires); ``k_eq_v``: the global layers
    reuse their keys as values (no v_proj) and have 1 key/value head (num_global_key_value_heads) against the
    sliding layers' 2."""
    import transformers as tf

    kw = dict(num_global_key_value_heads=1, attention_k_eq_v=True) if k_eq_v else {}
    return tf.Gemma4TextConfig(**dict(BASE, num_hidden_layers=4), num_key_value_heads=2, head_dim=8,
                               global_head_dim=global_head_dim, sliding_window=window,
                               layer_types=["sliding_attention", "full_attention"] * 2, vocab_size_per_layer_input=VOCAB,
                               hidden_size_per_layer_input=8, num_kv_shared_layers=kv_shared, attention_dropout=0.0,
                               final_logit_softcapping=30.0, **kw)


def multimodal_config(**cfg):
    """``gemma4``: the text config above inside Gemma4Config, a one-layer vision tower, no audio (text-only batches
    never reach the towers)."""
    import transformers as tf

    return tf.Gemma4Config(text_config=gemma4_config(**cfg).to_dict(), audio_config=None,
                           vision_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                              num_attention_heads=2, num_key_value_heads=2, head_dim=8))


def build_gemma4(seed: int = 0, dtype=torch.float32, multimodal: bool = False, **cfg):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = multimodal_config(**cfg) if multimodal else gemma4_config(**cfg)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    with torch.no_grad():  # norms' weights off their init (ones), so that every layer's q/k-norm matters
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.linspace(-0.3, 0.3, p.numel()).view_as(p))
    return model


def batch(kind: str, seed: int = 0):
    from sp_cases import token_batch

    return token_batch(kind, VOCAB, SEQ, DOC_LENS, seed)


def reference(b: dict, attn: str = "sdpa", dtype=torch.float32, **cfg):
    """One process: (loss, SGD deltas, parameters); ``dtype``: the float32 model cast (float64: the same weights)."""
    model = build_gemma4(**cfg).to(dtype)
    if attn != "sdpa":
        model.set_attn_implementation(attn)
    loss = model(**b, use_cache=False).loss  # HF masks packed documents only without a cache
    loss.backward()
    return loss.item(), {n: (-p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
                         for n, p in model.named_parameters()}, {n: p.detach().clone() for n, p in model.named_parameters()}


def sp_step(lc: dict, b: dict, sp: int, **cfg):
    from sp_cases import one_sgd_step

    return one_sgd_step(build_gemma4(**cfg), b, sp, lc)


def tensor_errors(ref: dict, got: dict, params: dict) -> dict:
    """Per tensor, arch_cases.max_delta_error's measure (relative Frobenius error of the SGD delta beyond one ulp
    of the parameter per element)."""
    out = {}
    for n in ref:
        ulp = torch.finfo(torch.float32).eps * (params[n] + ref[n]).abs()
        beyond = ((got[n] - ref[n]).abs() - ulp).clamp(min=0)
        out[n] = float(beyond.norm() / ref[n].norm().clamp(min=1e-30))
    return out
