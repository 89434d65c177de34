"""Tiny random-init MoE models of transformers 5's token-choice families (their own config classes) and the spawned
SP cases of tests/test_moe_tiled.py (importable by spawned workers)."""
from __future__ import annotations

import torch

from arch_cases import BASE, VOCAB

# expert count 4, top-2; a shared expert where the family has one; every layer an MoE layer unless the family keeps
# a first dense layer (then layer 0 is a dense MLP and layer 1 the MoE block)
_TOP2 = dict(num_experts_per_tok=2)


def moe_config(name: str):
    import transformers as tf

    b = dict(BASE)
    if name == "glm4_moe":
        return tf.Glm4MoeConfig(**b, num_key_value_heads=2, head_dim=8, n_routed_experts=4, moe_intermediate_size=24,
                                n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, **_TOP2)
    if name == "deepseek_v3":  # MLA: the shape issue 37 names (HF's own tiny default breaks its forward)
        return tf.DeepseekV3Config(**b, num_key_value_heads=4, n_routed_experts=4, moe_intermediate_size=24,
                                   n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                                   qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, kv_lora_rank=16,
                                   q_lora_rank=None, **_TOP2)
    if name == "minimax_m2":
        return tf.MiniMaxM2Config(**b, num_key_value_heads=2, head_dim=8, num_local_experts=4, bos_token_id=None,
                                  eos_token_id=None, **_TOP2)
    if name == "hunyuan_v1_moe":
        return tf.HunYuanMoEV1Config(**b, num_key_value_heads=2, head_dim=8, num_experts=4, moe_topk=2)
    if name == "ernie4_5_moe":
        return tf.Ernie4_5_MoeConfig(**b, num_key_value_heads=2, moe_num_experts=4, moe_k=2, moe_intermediate_size=24,
                                     moe_num_shared_experts=1, moe_layer_start_index=0)
    if name == "exaone_moe":
        return tf.ExaoneMoeConfig(**b, num_key_value_heads=2, head_dim=8, num_experts=4, moe_intermediate_size=24,
                                  num_shared_experts=1, n_group=1, topk_group=1, **_TOP2)
    if name == "phimoe":
        return tf.PhimoeConfig(**b, num_key_value_heads=2, num_local_experts=4, **_TOP2)
    if name == "granitemoe":
        return tf.GraniteMoeConfig(**b, num_key_value_heads=2, num_local_experts=4, **_TOP2)
    if name == "qwen3_5_moe":  # its full-attention layers only (the linear-attention layers are the hybrid issue)
        return tf.Qwen3_5MoeTextConfig(**b, num_key_value_heads=2, head_dim=8, num_experts=4, moe_intermediate_size=24,
                                       shared_expert_intermediate_size=24, layer_types=["full_attention"] * 2, **_TOP2)
    if name == "llama4_text":  # layer 0 dense, layer 1 Llama4TextMoe (every token through every expert, scaled by a
        # sigmoid of its top-k scores; stacked experts; returns (out, router_logits)); chunks cover the samples
        return tf.Llama4TextConfig(**b, num_key_value_heads=2, head_dim=8, num_local_experts=4, intermediate_size_mlp=48,
                                   moe_layers=[1], attn_temperature_tuning=False, **_TOP2)
    if name == "mixtral":
        return tf.MixtralConfig(**b, num_key_value_heads=2, num_local_experts=4, **_TOP2)
    if name == "qwen3_moe":
        return tf.Qwen3MoeConfig(**b, num_key_value_heads=2, head_dim=8, num_experts=4, moe_intermediate_size=24,
                                 **_TOP2)
    raise KeyError(name)


def build_moe(name: str, seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    cfg = moe_config(name)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    return model.train()


SEQ = 16
DOC_LENS = (5, 7, 4)  # packed: three documents, boundaries off the shard edges


def batch(kind: str, seed: int = 0):
    from sp_cases import token_batch

    return token_batch(kind, VOCAB, SEQ, DOC_LENS, seed)


# the router auxiliary (load-balancing) loss on, with a weight that moves the loss (tests show it does)
AUX = {"output_router_logits": True, "router_aux_loss_coef": 0.5}


def reference(name: str, b: dict, **overrides):
    """One process, no DeepSpeed: the loss and SGD(lr=1) deltas (= -grad), and the parameters."""
    model = build_moe(name, **overrides)
    loss = model(**b, use_cache=False).loss  # HF masks packed documents only without a cache
    loss.backward()
    # a parameter HF never differentiates (ERNIE-4.5's expert-score correction bias) does not move
    return loss.item(), {n: (-p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
                         for n, p in model.named_parameters()}, \
        {n: p.detach().clone() for n, p in model.named_parameters()}


def sp_step(name: str, lc: dict, b: dict, sp: int, **overrides):
    """One SGD(lr=1) step at SP=``sp`` through ds_longctx.initialize (ZeRO-3): (loss, deltas, tiled block classes)."""
    from ds_longctx.memory import get_memory_handle
    from sp_cases import one_sgd_step

    return one_sgd_step(build_moe(name, **overrides), b, sp, lc, inspect=lambda engine: sorted(
        {type(m).__name__ for m in get_memory_handle(engine).tiled_mlps}))
