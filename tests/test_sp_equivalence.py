"""Ulysses SP through ds_longctx.initialize equals single-process training: loss and SGD parameter
deltas (lr=1, no clipping) under ZeRO-1, 2 and 3, for MHA, GQA, MQA and KV replication."""
import math

import pytest
import torch

from dist_utils import result_or_raise, run_distributed_side_by_side
from sp_cases import reference_step, sample, sp_step

pytestmark = pytest.mark.distributed  # every test here spawns processes

SHAPES = {
    "mha": dict(heads=4, kv_heads=4),
    "gqa": dict(heads=4, kv_heads=2),
    "mqa": dict(heads=4, kv_heads=1),  # replicated KV for SP>1
    "gqa_repl": dict(heads=8, kv_heads=2, head_dim=4),  # SP=4 > 2 KV heads: replication x2
}
SEQ, VOCAB = 16, 64


def _cases(sp):
    shapes = ["mha", "gqa", "mqa"] if sp == 2 else ["mha", "gqa_repl", "mqa"]
    stages = [1, 2, 3]
    return [(s, z) for s in shapes for z in stages]


def _worker(rank, world, cases):
    out = {}
    for shape, stage in cases:
        batch = sample(SEQ, VOCAB, bsz=1)
        out[(shape, stage)] = sp_step(dict(SHAPES[shape], vocab=VOCAB), batch, stage, world,
                                      lc={"attention": {"implementation": "ulysses"}})
    return out


def _check(results, cases):
    for shape, stage in cases:
        ref_loss, ref_deltas, ref_init = reference_step(dict(SHAPES[shape], vocab=VOCAB), sample(SEQ, VOCAB))
        for rank_out in results:
            loss, deltas, init = rank_out[(shape, stage)]
            for n in ref_init:  # same seed -> same initial weights in every layout
                assert torch.equal(init[n], ref_init[n]), (shape, stage, n)
            assert math.isclose(loss, ref_loss, rel_tol=1e-6), (shape, stage, loss, ref_loss)
            for n, ref in ref_deltas.items():
                torch.testing.assert_close(deltas[n], ref, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{shape} zero{stage} {n}: {m}")


@pytest.fixture(scope="module")
def sp_results():
    """The SP 2 and SP 4 spawns started side by side, once; each test below checks its own."""
    runs = run_distributed_side_by_side(*[(_worker, sp, _cases(sp)) for sp in (2, 4)], return_exceptions=True)
    return dict(zip((2, 4), runs))


@pytest.mark.parametrize("sp", [2, 4])
def test_ulysses_matches_single_process(sp, sp_results):
    cases = _cases(sp)
    results = result_or_raise(sp_results[sp])
    _check(results, cases)
