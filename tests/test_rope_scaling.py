"""RoPE as keys (ds_longctx/config/rope_scaling.py): every rope type transformers has parses, applies to a config, builds a
model whose forward differs from the unscaled one, and survives save_pretrained / from_pretrained; bad values are
one ConfigError naming the flag."""
import json

import pytest
import torch
from transformers import AutoConfig

from ds_longctx.errors import ConfigError
from ds_longctx.config.rope_scaling import apply_rope, parse_rope_scaling, rope_types
from tiny_models import build, tiny_config

MPE = 16  # the tiny config's trained length; the forward runs at 2x it (dynamic and longrope scale past it)
SEQ = 2 * MPE


@pytest.fixture
def factors_file(tmp_path):
    p = tmp_path / "longrope.json"
    p.write_text(json.dumps({"short_factor": [1.0] * 4, "long_factor": [1.0, 2.0, 4.0, 8.0]}))  # head_dim 8
    return str(p)


def _specs(factors_file):
    return {
        "linear": "linear:4",
        "dynamic": "dynamic:2",
        "yarn": "yarn:factor=4,beta_fast=32",
        "longrope": f"longrope:4,factors={factors_file}",
        "llama3": "llama3:8,low_freq_factor=1,high_freq_factor=4",
        "proportional": "proportional:partial_rotary_factor=0.5",
    }


def _logits(cfg, ids):
    torch.manual_seed(0)
    model = build(cfg)
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def test_every_rope_type_parses_applies_and_changes_the_forward(factors_file, tmp_path):
    specs = _specs(factors_file)
    assert set(rope_types()) <= set(specs), f"a rope type without a test case: {set(rope_types()) - set(specs)}"
    ids = torch.randint(0, 64, (1, SEQ), generator=torch.Generator().manual_seed(1))
    plain = _logits(tiny_config(max_position_embeddings=MPE), ids)
    for rtype, spec in specs.items():
        cfg = tiny_config(max_position_embeddings=MPE)
        apply_rope(cfg, rope_scaling=spec)
        rp = cfg.rope_parameters
        assert rp["rope_type"] == rtype and rp["rope_theta"] == 10000.0, rp
        if rtype in ("yarn", "longrope", "llama3"):
            assert rp["original_max_position_embeddings"] == MPE
        if rtype in ("linear", "yarn", "longrope", "llama3"):
            assert cfg.max_position_embeddings == int(rp["factor"]) * MPE
        else:
            assert cfg.max_position_embeddings == MPE
        scaled = _logits(cfg, ids)
        assert not torch.allclose(scaled, plain), f"{rtype}: the scaling changed nothing"
        cfg.save_pretrained(tmp_path / rtype)
        back = AutoConfig.from_pretrained(tmp_path / rtype)
        assert back.rope_parameters == cfg.rope_parameters and back.max_position_embeddings == cfg.max_position_embeddings
        back._attn_implementation = "sdpa"
        torch.testing.assert_close(_logits(back, ids), scaled, rtol=0, atol=0)


def test_theta_and_explicit_keys():
    cfg = tiny_config(max_position_embeddings=MPE)
    apply_rope(cfg, rope_theta=500000.0)
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": 500000.0}
    apply_rope(cfg, rope_scaling="yarn:factor=4,original_max_position_embeddings=8,beta_fast=16")
    assert cfg.rope_parameters["rope_theta"] == 500000.0  # kept
    assert cfg.rope_parameters["original_max_position_embeddings"] == 8 and cfg.rope_parameters["beta_fast"] == 16
    assert cfg.max_position_embeddings == 32  # 4 x 8
    apply_rope(cfg, rope_scaling="linear:1.5")
    assert cfg.max_position_embeddings == 48  # 1.5 x 32 raises it
    apply_rope(cfg, rope_scaling="linear:1")
    assert cfg.max_position_embeddings == 48  # never lowered
    assert parse_rope_scaling("llama3:8,original_max_position_embeddings=8192") == {
        "rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0}
    assert parse_rope_scaling({"rope_type": "linear", "factor": 2}) == {"rope_type": "linear", "factor": 2}
    assert parse_rope_scaling("none") == {"rope_type": "default"}


@pytest.mark.parametrize("spec,says", [
    ("yarn", "needs a factor"),
    ("yarn:0.5", "below 1"),
    ("yarn:abc", "not a number"),
    ("foo:2", "unknown rope type"),
    ("linear:4,beta_fast=3", "linear takes no beta_fast"),
    ("linear:4,5", "is not key=value"),
    ("yarn:4,rope_theta=5", "--rope-theta"),
    ("longrope:4", "needs short_factor and long_factor"),
    ("longrope:4,factors=/no/such.json", "neither a number list nor a JSON file"),
    ("longrope:4,short_factor=[1,1,1],long_factor=[1,1,1,1]", "short_factor has 3 numbers"),
    ("llama3:8,low_freq_factor=4,high_freq_factor=1", "high_freq_factor"),
    ("llama3:1,original_max_position_embeddings=64", "original_max_position_embeddings"),
    ("yarn:4,beta_fast=1,beta_slow=32", "beta_fast"),
    ("none,x=1", "unknown rope type"),
])
def test_bad_values_name_the_flag(spec, says):
    cfg = tiny_config(max_position_embeddings=MPE)
    before = (dict(cfg.rope_parameters), cfg.max_position_embeddings)
    with pytest.raises(ConfigError) as e:
        apply_rope(cfg, rope_scaling=spec)
    assert e.value.key == "--rope-scaling" and says in str(e.value), str(e.value)
    assert (cfg.rope_parameters, cfg.max_position_embeddings) == before  # the config as it was


def test_bad_theta_and_nested_rope():
    with pytest.raises(ConfigError, match="--rope-theta"):
        apply_rope(tiny_config(), rope_theta=-1.0)
    from transformers import Gemma3TextConfig

    g = Gemma3TextConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_hidden_layers=2,
                         intermediate_size=48, vocab_size=64)
    with pytest.raises(ConfigError, match="per layer type"):
        apply_rope(g, rope_scaling="linear:2")
