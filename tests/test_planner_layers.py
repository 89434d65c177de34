"""The planner per layer (issue 37 item 2): head counts and head dims resolved per layer (Gemma 4's sliding vs global
layers, multi-head latent attention's query/key vs value head dims) in the planner's arithmetic (kept attention
outputs, the MFU width, heads_per_chunk candidates) and in its simulated steps (extrapolated per layer kind with
each kind's own shape). Fast: no spawn, one tiny simulation."""
import pytest

from arch_cases import BASE, VOCAB


def _gemma4(layers=4, **kw):
    import transformers as tf

    types = kw.pop("layer_types", ["sliding_attention", "full_attention"] * (layers // 2))
    cfg = tf.Gemma4TextConfig(**dict(BASE, num_hidden_layers=layers), num_key_value_heads=2, head_dim=8,
                              global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
                              sliding_window=64, layer_types=types, vocab_size_per_layer_input=VOCAB,
                              hidden_size_per_layer_input=8, attention_dropout=0.0, **kw)
    cfg._attn_implementation = "sdpa"
    return cfg


def _deepseek_v3():
    import transformers as tf

    cfg = tf.DeepseekV3Config(**dict(BASE, num_hidden_layers=2), num_key_value_heads=4, qk_rope_head_dim=8,
                              qk_nope_head_dim=16, v_head_dim=16, kv_lora_rank=16, q_lora_rank=None,
                              n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                              first_k_dense_replace=1, n_group=1, topk_group=1)
    cfg._attn_implementation = "sdpa"
    return cfg


def _lc(sp=2, n_keep=None):
    from ds_longctx.config import parse

    return parse({"sequence_parallel_size": sp, "long_context": {"attention": {"implementation": "untied_ulysses"}}})


def test_gemma4_dims_per_layer_and_the_arithmetic_sums_them():
    """Gemma 4: sliding layers 4 heads x 8 (2 kv heads), global layers 4 heads x 32 (1 kv head); the kept attention
    bytes of the first n layers and the MFU width equal the direct per-layer sums from the config, and differ from
    the largest shape's (what the planner sized before)."""
    from ds_longctx.measure.formula import attention_width
    from ds_longctx.models import LayerDims, attention_dims, attention_shape
    from ds_longctx.planner.host import kept_attention_bytes

    cfg = _gemma4()
    dims = attention_dims(cfg)
    assert dims == (LayerDims(4, 2, 8, 8), LayerDims(4, 1, 32, 32)) * 2
    S, sp, mb, dt = 1024, 2, 1, 2
    direct = [mb * (S // sp) * 4 * d * dt + mb * (4 // sp) * S * 4 for d in (8, 32, 8, 32)]
    for n in range(1, 5):
        assert kept_attention_bytes(cfg, _lc(sp), S, mb, dt, first=n) == sum(direct[:n])
    assert kept_attention_bytes(cfg, _lc(sp), S, mb, dt) == max(direct)  # one slot any layer's fits
    largest = attention_shape(cfg)
    assert (largest.heads, largest.head_dim) == (4, 32)
    assert sum(direct) < 4 * max(direct)  # the largest shape on every layer: 1.6x too much
    assert attention_width(cfg) == (4 * 8 + 4 * 32) / 2 != largest.heads * largest.head_dim


def test_latent_attention_dims_in_the_arithmetic():
    """DeepSeek-V3 (MLA): the attention function gets query/key heads of nope + rope = 24 and values of 16, while the
    config's head_dim is the rope part alone (8): the kept output is the values padded to 24 (untied's stage buffers),
    the MFU width heads x (24 + 16) / 2."""
    from ds_longctx.measure.formula import attention_width
    from ds_longctx.models import LayerDims, attention_dims, attention_shape
    from ds_longctx.planner.host import kept_attention_bytes

    cfg = _deepseek_v3()
    assert attention_shape(cfg).head_dim == 8
    assert attention_dims(cfg) == (LayerDims(4, 4, 24, 16),) * 2
    S = 512
    assert kept_attention_bytes(cfg, _lc(2), S, 1, 2, first=2) == 2 * ((S // 2) * 4 * 24 * 2 + 2 * S * 4)
    assert attention_width(cfg) == 4 * 20


def test_heads_per_chunk_candidates_divide_every_layer():
    """heads_per_chunk 'auto' candidates divide every layer shape's local heads (the gcd): a per-layer config whose
    global layers have 4 query heads and sliding layers 6 gives divisors of 2 at SP 1, not of 6."""
    from ds_longctx.planner.search import _local_heads

    cfg = _gemma4()
    assert _local_heads(cfg, 2) == 2
    import transformers as tf

    mixed = tf.Gemma4TextConfig(**dict(BASE, num_hidden_layers=2, num_attention_heads=6, hidden_size=48),
                                num_key_value_heads=2, head_dim=8, layer_types=["sliding_attention", "full_attention"],
                                vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8,
                                per_layer_config={1: {"num_attention_heads": 4, "head_dim": 16}})
    assert _local_heads(mixed, 1) == 2


def test_gemma4_plan_extrapolates_each_kind_with_its_own_shape():
    """A 6-layer Gemma 4 (sliding, sliding, global) x 2 planned at SP 2 from 2 and 3 layers per kind: the extrapolated
    step's work equals the full-depth simulation's (the global kind grows with head_dim 32; its stand-in config used
    to keep the per-layer overrides of the original positions and transformers refused it: 'not homogeneous'), and
    the attention bytes at the peak are the full-depth ones."""
    from sp_cases import ds_config

    from ds_longctx.planner import Planner

    types = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    cfg = ds_config(3, 2, {"attention": {"implementation": "untied_ulysses", "heads_per_chunk": 1}},
                    bf16={"enabled": True})
    planner = Planner(cfg, _gemma4(6, layer_types=types), 2, "h100")
    ext, full = planner.run(256), planner.run(256, full_depth=True)
    assert ext.extrapolated and not full.extrapolated
    fe, ff = ext.time["flops"], full.time["flops"]
    assert ff.get("attention_forward", 0) > 0 and set(fe) == set(ff)
    for k in ff:
        assert fe[k] == pytest.approx(ff[k], rel=1e-6), k
    assert ext.breakdown["attention"] == full.breakdown["attention"]


def test_deepseek_dense_then_moe_layers_counted_per_kind():
    """DeepSeek-V3's first ``first_k_dense_replace`` layers have a dense MLP, the rest MoE: the planner's parameter
    count (from 1- and 2-layer builds, all dense before: the experts were missing) equals a full-depth fake build's,
    and its simulated steps extrapolate per kind (planner.core._layer_kinds)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ds_longctx.planner.core import _layer_kinds, param_info
    from ds_longctx.planner.simulate import build_model

    cfg = _deepseek_v3()
    cfg.num_hidden_layers, cfg.first_k_dense_replace = 8, 3
    assert _layer_kinds(cfg) == ["layer/dense"] * 3 + ["layer/moe"] * 5
    model = build_model(cfg, torch.bfloat16, "meta", FakeTensorMode(allow_non_fake_inputs=True))
    info = param_info(cfg)
    assert info.total == sum(p.numel() for p in model.parameters())
    assert info.largest_module == max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
