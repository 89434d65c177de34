"""Bad input through ds_longctx.initialize raises the same clear error on every rank, before any
SP group or DeepSpeed engine is built (so no collective can hang)."""

from dist_utils import run_distributed
from sp_cases import ds_config
from tiny_models import build, tiny_config
import pytest

pytestmark = pytest.mark.distributed  # every test here spawns processes


def _bad_initialize(rank, world, case):
    import ds_longctx
    from ds_longctx.dist.comm import sp_group

    model = build(tiny_config(**case["model"]))
    try:
        ds_longctx.initialize(model=model, model_parameters=model.parameters(), config=case["config"])
    except ds_longctx.ConfigError as e:
        assert sp_group() is None, "groups were built before the check"
        return str(e)
    return None


CASES = {
    "world": dict(model=dict(heads=4, kv_heads=2), config=ds_config(3, 4)),
    # past the heads 'auto' rings (issue 47): a ring degree of 1 named is the refusal
    "heads": dict(model=dict(heads=3, kv_heads=3, head_dim=4), config=ds_config(3, 2, {"attention": {"ring_degree": 1}})),
    "kv": dict(model=dict(heads=6, kv_heads=3, head_dim=4), config=ds_config(3, 2, {"attention": {"ring_degree": 1}})),
    "impl": dict(model=dict(), config=ds_config(3, 2, {"attention": {"implementation": "tied"}})),
    "eager": dict(model=dict(attn="eager"), config=ds_config(3, 2)),
}
EXPECTED = {
    "world": "sequence_parallel_size: 4 does not divide the world size 2",
    "heads": "long_context.attention.ring_degree: 1 leaves Ulysses degree 2 (sequence_parallel_size 2 / 1), which does "
             "not split the model's 3 query / 3 key-value heads",
    "kv": "long_context.attention.ring_degree: 1 leaves Ulysses degree 2 (sequence_parallel_size 2 / 1), which does not "
          "split the model's 6 query / 3 key-value heads",
    "impl": "long_context.attention.implementation: 'tied' is not allowed",
    "eager": "model.config._attn_implementation: 'eager' cannot run sequence parallel",
}


def _all_cases(rank, world):
    return {name: _bad_initialize(rank, world, case) for name, case in CASES.items()}


def test_errors_on_every_rank():
    results = run_distributed(_all_cases, 2, timeout=300)
    for name, expected in EXPECTED.items():
        for rank, res in enumerate(results):
            assert res[name] is not None and res[name].startswith(expected), (name, rank, res[name])
