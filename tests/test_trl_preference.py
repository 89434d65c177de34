"""Issue 51, item 3: TRL 1.16's DPOTrainer (sigmoid, IPO, and the RPO term: loss_type [sigmoid, sft]) and
DistillationTrainer (on-policy generalised JSD to a teacher, the teacher under SP too) through ``ds_longctx.enable()``
at SP=2 equal a one-process TRL run (TRL + DeepSpeed on one rank): per-step losses and SGD deltas over 2 optimizer
steps (tests/trl_preference_cases.py). DPO: the chosen and rejected rows of each batch are packed as documents and
sharded inside the model call, their log-probability sums taken by TRL from the gathered per-token values; the live
reference model runs sharded too. Distillation: both models' hidden states of this shard through TRL's own chunked
divergence, the shards' sums added over the group (objectives/distill.py; ZeRO-2, see CASES).

Tolerance as tests/test_trl_rl.py (measured here: deltas within 1.5e-7 absolute of deltas up to 0.4)."""
import math

import pytest
import torch

from trl_preference_cases import CASES

SP = 2


def _worker(rank, world, cases, use_ds_longctx):
    import trl_preference_cases
    from eco_cases import ProcessState

    out = {}
    for case in cases:
        state = ProcessState()
        out[case] = trl_preference_cases.train(case, world, rank, use_ds_longctx=use_ds_longctx)
        state.reset()
    trl_preference_cases.cleanup(rank)
    return out


@pytest.fixture(scope="module")
def runs():
    from dist_utils import run_distributed_side_by_side

    cases = sorted(CASES)
    return run_distributed_side_by_side((_worker, SP, cases, True), (_worker, 1, cases, False), timeout=1500,
                                        return_exceptions=True)


@pytest.mark.distributed
@pytest.mark.parametrize("case", sorted(CASES))
def test_preference_and_distillation_equal_one_process(case, runs):
    from dist_utils import result_or_raise

    want = result_or_raise(runs[1])[0][case]
    moved = {n: want["after"][n] - want["before"][n] for n in want["after"]}
    assert max(float(d.abs().max()) for d in moved.values()) > 0, case
    for rank, r in enumerate(result_or_raise(runs[0])):
        got = r[case]
        err = max(float((got["after"][n] - got["before"][n] - moved[n]).abs().max()) for n in moved)
        print(f"RESULT {case} rank={rank} losses={got['losses']} ref={want['losses']} delta_err={err:.2e} "
              f"delta_max={max(float(d.abs().max()) for d in moved.values()):.2e}")
        assert len(got["losses"]) == len(want["losses"]) == 2, (case, got["losses"])
        for a, b in zip(got["losses"], want["losses"]):
            assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6), (case, got["losses"], want["losses"])
        bad = {n: float((got["after"][n] - got["before"][n] - moved[n]).abs().max()) for n in moved
               if not torch.allclose(got["after"][n] - got["before"][n], moved[n], rtol=1e-4, atol=1e-6)}
        assert not bad, (case, rank, bad)
        if CASES[case][0] == "distill":
            assert got["sharded"] > 0 and want["sharded"] == 0, (got["sharded"], want["sharded"])
