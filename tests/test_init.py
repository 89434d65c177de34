"""Same --seed -> same initial weights for every ZeRO stage and process count, also when ZeRO-3
partitions the model at construction (model_init), which no plain HF build guarantees."""
import torch

from dist_utils import run_distributed
from sp_cases import ds_config, full_params
from tiny_models import build, tiny_config
import pytest

pytestmark = pytest.mark.distributed  # every test here spawns processes


def _weights(rank, world, stages):
    """One spawn for every stage (engines of several stages follow each other in one process, as in
    tests/test_sp_equivalence.py)."""
    import ds_longctx
    from ds_longctx.models.weights import deterministic_init

    out = {}
    for stage in stages:
        cfg = ds_config(stage, world, optimizer={"type": "SGD", "params": {"lr": 1.0}})
        with ds_longctx.model_init(cfg):
            model = build(tiny_config(), seed=0)
        if stage == 3:  # really partitioned at construction: no rank holds a full weight
            assert all(p.numel() == 0 for p in model.parameters())
        deterministic_init(model, seed=7)
        engine, *_ = ds_longctx.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        out[stage] = full_params(engine.module)
        engine.destroy()
    return out


def test_same_seed_same_weights_across_layouts():
    from ds_longctx.models.weights import deterministic_init

    ref_model = build(tiny_config(), seed=123)  # a different global RNG state must not matter
    deterministic_init(ref_model, seed=7)
    ref = {n: p.detach() for n, p in ref_model.named_parameters()}
    assert ref["model.layers.0.self_attn.q_proj.weight"].std() > 0.01
    for rank_out in run_distributed(_weights, 2, (3, 1)):
        for stage in (3, 1):
            rank_weights = rank_out[stage]
            assert rank_weights.keys() == ref.keys(), stage
            for n, p in ref.items():
                assert torch.equal(rank_weights[n], p), (stage, n)
    other = build(tiny_config(), seed=0)
    deterministic_init(other, seed=8)
    assert not torch.equal(other.lm_head.weight, ref["lm_head.weight"])
