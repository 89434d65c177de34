"""SP x DP under the HF Trainer (world 4 = 2 SP groups x 2 data-parallel replicas, the shape of a
multi-node run): equals a one-process Trainer that sees each optimizer step's two samples as one batch
of 2; a run resumed from a save_steps checkpoint equals the uninterrupted one (as tests/test_trainer_resume.py
at SP=2); and a ParallelismConfig that leaves the replicas undeclared is a clear error on every rank
(Accelerate would hand DeepSpeed a batch size that fails its own assertion, naming neither)."""
import math

import pytest

from dist_utils import run_distributed_side_by_side
from eco_cases import assert_resumed_equal, delta_errors, deltas

STEPS = 2
# the Trainer shards the loader over all 4 ranks (sample i to rank i % 4) and each SP group takes turns
# on its ranks' samples: step 1 trains samples 0 (group 0) and 2 (group 1), step 2 samples 1 and 3
ONE_PROCESS_ORDER = [0, 2, 1, 3]


def _one_process(rank, world):
    import hf_trainer

    return hf_trainer.train(sp=1, use_ds_longctx=False, record_params=True, steps=STEPS, micro_batch=2,
                            sample_order=ONE_PROCESS_ORDER, output_dir="/tmp/ds_longctx_test_dpsp_ref")


def _dp_sp(rank, world):
    import hf_trainer
    from eco_cases import ProcessState, config_error

    state = ProcessState()
    kw = dict(sp=2, record_params=True, steps=STEPS, sample_order=list(range(4)),
              output_dir=f"/tmp/ds_longctx_test_dpsp{rank}")
    out = {"trained": hf_trainer.train(dp_replicate_size=2, **kw)}  # untied attention + memory stack
    state.reset()
    # resume: 8 samples = 2 per rank = 4 SP turns per epoch; after step 3, 1 batch + 1 turn to skip; 5 steps
    # cross into epoch 2. AdamW + a linear schedule (moments and rates must come back)
    import shutil

    import torch.distributed as dist

    from eco_cases import shared_tmpdir

    rkw = dict(sp=2, dp_replicate_size=2, record_params=True, steps=5, save_steps=3, samples=8, lr=0.01,
               optim="adamw_torch", lr_scheduler_type="linear", warmup_steps=1, output_dir=shared_tmpdir(rank))
    out["resume_full"] = hf_trainer.train(**rkw)
    state.reset()
    out["resumed"] = hf_trainer.train(**rkw, resume_from_checkpoint=f"{rkw['output_dir']}/checkpoint-3")
    state.reset()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(rkw["output_dir"], ignore_errors=True)
    out["undeclared"] = config_error(hf_trainer.train, **kw)
    state.reset()
    return out


@pytest.mark.distributed
def test_trainer_sp2_dp2_equals_one_process_batch_of_two():
    (ref,), res = run_distributed_side_by_side((_one_process, 1), (_dp_sp, 4))
    for rank, r in enumerate(res):
        got = r["trained"]
        # each DP replica logs its own sample's loss; their mean is the one-process batch's loss
        assert len(got["losses"]) == STEPS == len(ref["losses"]), (got["losses"], ref["losses"])
        # SP groups are ranks [0, 1] and [2, 3]; both ranks of a group report the group's loss
        assert got["losses"] == res[rank ^ 1]["trained"]["losses"]
        other_replica = res[(rank + 2) % 4]["trained"]["losses"]
        for a, b, want in zip(got["losses"], other_replica, ref["losses"]):
            assert math.isclose((a + b) / 2, want, rel_tol=1e-5), (got["losses"], other_replica, ref["losses"])
        assert all(d.abs().max() > 0 for d in deltas(ref).values())
        errs, _ = delta_errors(ref, got)
        worst = max(errs, key=errs.get)
        assert errs[worst] < 1e-5, (worst, errs[worst])  # measured 1.5e-7
        assert_resumed_equal(r["resume_full"], r["resumed"], 3, f"SP x DP rank {rank}", epoch_items=4)
        assert r["undeclared"] and "dp_replicate_size=2" in r["undeclared"] and "covers 2 of the 4 ranks" in \
            r["undeclared"], r["undeclared"]
