"""Every bad config or shape gets one clear error naming the key path and the fix."""
import pytest

from ds_longctx.patching.checks import check_against
from ds_longctx.config import ConfigError, parse
from tiny_models import tiny_config


def _err(ds_config, model_config=None, world=2, seq=None):
    with pytest.raises(ConfigError) as e:
        check_against(parse(ds_config), model_config, world, seq)
    return str(e.value)


def test_defaults_parse():
    lc = parse({"sequence_parallel_size": 2})
    assert lc.attention.implementation == "ulysses" and lc.sequence_parallel_size == 2
    assert not lc.tiled_mlp.enabled and not lc.activation_checkpointing.enabled


@pytest.mark.parametrize("section, key", [
    ({"attention": {"implemntation": "ulysses"}}, "long_context.attention.implemntation"),
    ({"tiled_mlp": {"enabled": True, "chunks": 4}}, "long_context.tiled_mlp.chunks"),
    ({"bogus": 1}, "long_context.bogus"),
])
def test_unknown_keys(section, key):
    msg = _err({"long_context": section})
    assert msg.startswith(key + ": unknown key") and "Fix: remove it" in msg


def test_unknown_implementation():
    msg = _err({"long_context": {"attention": {"implementation": "ring"}}})
    assert msg.startswith("long_context.attention.implementation: 'ring' is not allowed")
    assert "'untied_ulysses'" in msg


def test_unknown_kernel():
    msg = _err({"long_context": {"attention": {"kernel": "flash_attention_9"}}})
    assert msg.startswith("long_context.attention.kernel:") and "'sdpa'" in msg


def test_section_not_object():
    assert _err({"long_context": [1]}).startswith("long_context: expected an object")


def test_sp_not_positive():
    assert _err({"sequence_parallel_size": 0}).startswith("sequence_parallel_size: must be a positive integer")


def test_sp_does_not_divide_world():
    msg = _err({"sequence_parallel_size": 4}, world=6)
    assert msg.startswith("sequence_parallel_size: 4 does not divide the world size 6")


def test_heads_not_divisible():
    """SP past what the heads split: 'auto' rings the rest (issue 47); ring 1 named is refused with the degrees that
    work."""
    from ds_longctx.patching.checks import ring_degree_for

    cfg = parse({"sequence_parallel_size": 4})
    assert ring_degree_for(cfg, tiny_config(heads=6, kv_heads=6)) == 2  # Ulysses 2 x ring 2
    msg = _err({"sequence_parallel_size": 4, "long_context": {"attention": {"ring_degree": 1}}},
               tiny_config(heads=6, kv_heads=6), world=4)
    assert msg.startswith("long_context.attention.ring_degree: 1 leaves Ulysses degree 4 (sequence_parallel_size 4 / "
                          "1), which does not split the model's 6 query / 6 key-value heads"), msg
    assert "ring degree that works at SP 4: [2, 4]" in msg and "'auto' (2 here)" in msg
    msg = _err({"sequence_parallel_size": 4, "long_context": {"attention": {"ring_degree": 3}}},
               tiny_config(heads=6, kv_heads=6), world=4)
    assert msg.startswith("long_context.attention.ring_degree: 3 does not divide sequence_parallel_size 4"), msg


def test_kv_heads_neither_divide():
    from ds_longctx.patching.checks import ring_degree_for

    assert ring_degree_for(parse({"sequence_parallel_size": 4}), tiny_config(heads=12, kv_heads=6)) == 2
    msg = _err({"sequence_parallel_size": 4, "long_context": {"attention": {"ring_degree": 1}}},
               tiny_config(heads=12, kv_heads=6), world=4)
    assert "12 query / 6 key-value heads" in msg and "[2, 4]" in msg


def test_ring_sequence_length():
    """A ring cuts 2R zigzag chunks, each ring rank's into U shards: the length must divide by R x lcm(2, U)."""
    msg = _err({"sequence_parallel_size": 4, "long_context": {"sequence_length": 36}}, tiny_config(heads=1, kv_heads=1),
               world=4)
    assert msg.startswith("long_context.sequence_length: 36 is not divisible by 8: sequence_parallel_size 4 as "
                          "Ulysses 1 x ring 4"), msg
    assert "e.g. 40" in msg


def test_kv_replication_is_allowed():
    check_against(parse({"sequence_parallel_size": 4}), tiny_config(heads=8, kv_heads=2), 4)


def test_sequence_length_not_divisible():
    msg = _err({"sequence_parallel_size": 4, "long_context": {"sequence_length": 1000002}}, world=4)
    assert msg.startswith("long_context.sequence_length: 1000002 is not divisible by sequence_parallel_size=4")
    assert "1000004" in msg


def test_runtime_sequence_length_not_divisible():
    msg = _err({"sequence_parallel_size": 2}, seq=15)
    assert msg.startswith("sequence length: 15 is not divisible")


def test_eager_with_sp():
    msg = _err({"sequence_parallel_size": 2}, tiny_config(attn="eager"))
    assert msg.startswith("model.config._attn_implementation: 'eager' cannot run sequence parallel")
    assert "sdpa" in msg


def test_none_with_sp():
    msg = _err({"sequence_parallel_size": 2, "long_context": {"attention": {"implementation": "none"}}})
    assert msg.startswith("long_context.attention.implementation: 'none' cannot run with sequence_parallel_size=2")


def test_offload_without_checkpointing():
    msg = _err({"long_context": {"activation_checkpointing": {"offload": "cpu"}}})
    assert msg.startswith("long_context.activation_checkpointing.offload:")


def test_heads_per_chunk_auto_needs_a_sequence_length():
    msg = _err({"long_context": {"attention": {"implementation": "untied_ulysses", "heads_per_chunk": "auto"}}})
    assert msg.startswith("long_context.attention.heads_per_chunk: 'auto' is resolved by the memory planner")
    parse({"long_context": {"sequence_length": 64, "attention": {"heads_per_chunk": "auto"}}})


def test_heads_per_chunk_must_divide_local_heads():
    cfg = {"sequence_parallel_size": 2, "long_context": {"attention": {"implementation": "untied_ulysses",
                                                                       "heads_per_chunk": 3}}}
    msg = _err(cfg, tiny_config(heads=8, kv_heads=2))
    assert msg.startswith("long_context.attention.heads_per_chunk: 3 does not divide the 4 query heads per rank")
    assert "[1, 2, 4]" in msg


@pytest.mark.parametrize("section, start, fix", [
    ({"rms_norm": {"enabled": "yes"}}, "long_context.rms_norm.enabled: expected true or false, got 'yes'", "true/false"),
    ({"sequence_length": "512"}, "long_context.sequence_length: expected an integer, got '512'", "no quotes"),
    ({"tiled_mlp": {"shards": "4"}}, "long_context.tiled_mlp.shards: expected an integer or 'auto', got '4'", "'auto'"),
    ({"attention": {"heads_per_chunk": True}}, "long_context.attention.heads_per_chunk: expected an integer", "'auto'"),
    ({"sequence_length": 0}, "long_context.sequence_length: must be a positive integer, got 0", "tokens per sample"),
    ({"attention": {"heads_per_chunk": 0}}, "long_context.attention.heads_per_chunk: must be a positive integer",
     "most memory saving"),
    ({"tiled_loss": {"shards": -1}}, "long_context.tiled_loss.shards: must be a positive integer, got -1", "'auto'"),
])
def test_strict_types_and_bounds(section, start, fix):
    """No silent coercion ("yes" -> True, "512" -> 512); bounds come from the schema, one message each."""
    msg = _err({"long_context": section})
    assert msg.startswith(start) and fix in msg.split("Fix:")[1], msg


def test_every_field_is_documented():
    from pydantic import BaseModel

    from ds_longctx.config import LongContextConfig

    def walk(model):
        for name, field in model.model_fields.items():
            if name == "sequence_parallel_size":
                continue
            sub = field.annotation
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                yield from walk(sub)
            else:
                yield f"{model.__name__}.{name}", field.description

    undocumented = [name for name, doc in walk(LongContextConfig) if not doc]
    assert not undocumented


def test_kernel_values_come_from_the_kernel_registry():
    from typing import get_args

    from ds_longctx.attention.kernels import kernel_names
    from ds_longctx.config import AttentionConfig

    assert get_args(AttentionConfig.model_fields["kernel"].annotation) == kernel_names()
    assert set(kernel_names()) == {"auto", "flash_attention_3", "flash_attention_2", "sdpa_cuda_cudnn", "sdpa_cuda_flash",
                                   "sdpa"}
