"""``ds-longctx plan --objective grpo`` (planner/objectives.py): what a GRPO step through TRL + enable() holds beyond the
SFT step the planner simulates, by arithmetic: the reference model's weights (partitioned under ZeRO-3, none with LoRA),
the per-token values every rank holds, and the rollout's generation on one rank (gathered weights + KV cache)."""
import pytest


def _qwen3_8b():
    import os

    from ds_longctx.models.loading import load_model_config

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return load_model_config(os.path.join(root, "ds_configs", "models", "qwen3-8b.json"), None)


def test_kv_cache_and_grpo_extras_by_arithmetic():
    from ds_longctx.planner.objectives import TOKEN_FIELDS, grpo_extras, kv_cache_bytes

    cfg = _qwen3_8b()
    per_token = 36 * 2 * 8 * 128 * 2  # layers x (K, V) x kv heads x head_dim x bf16
    assert kv_cache_bytes(cfg, 1000, 2, 2) == per_token * 1000 * 2
    P = 8_190_735_360
    x = grpo_extras(cfg, P, 2, 3, 8, 131072, 1)
    assert x["breakdown"] == {"rl_reference_model": P * 2 // 8, "rl_token_fields": TOKEN_FIELDS * 4 * 131072}
    assert x["generation"] == {"bytes": P * 2 + per_token * 131072, "weights": P * 2, "kv_cache": per_token * 131072,
                               "rows": 1}
    assert grpo_extras(cfg, P, 2, 2, 8, 1024, 1)["breakdown"]["rl_reference_model"] == P * 2  # whole under ZeRO-1/2
    assert grpo_extras(cfg, P, 2, 3, 8, 1024, 1, lora=True)["breakdown"]["rl_reference_model"] == 0


def test_a_sliding_or_recurrent_layer_keeps_its_window_or_state():
    from ds_longctx.planner.objectives import kv_cache_bytes

    cfg = _qwen3_8b()
    cfg.layer_types = ["sliding_attention", "full_attention", "linear_attention"] * 12
    cfg.sliding_window = 100
    per_layer = 2 * 8 * 128 * 2
    assert kv_cache_bytes(cfg, 1000, 1, 2) == 12 * per_layer * (100 + 1000)


def test_objective_flag():
    from ds_longctx.planner.cli import _parser

    args = ["plan", "--deepspeed_config", "x.json", "--model-config", "m.json"]
    assert _parser().parse_args(args).objective == "sft"
    assert _parser().parse_args(args + ["--objective", "grpo"]).objective == "grpo"
    with pytest.raises(SystemExit):
        _parser().parse_args(args + ["--objective", "ppo"])
