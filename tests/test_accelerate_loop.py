"""A plain Accelerate loop (examples/accelerate_loop.py) with ParallelismConfig(sp_size=2) and
ds_longctx.enable(): losses and SGD parameter deltas equal the one-process loop over the same samples."""
import math

import pytest

from dist_utils import run_distributed_side_by_side
from eco_cases import delta_errors, deltas

STEPS = 3


def _run(rank, world, sp, **kw):
    import accelerate_loop

    return accelerate_loop.train(sp=sp, steps=STEPS, record_params=True, **kw)


def _one_process(rank, world):
    return _run(rank, world, 1, use_ds_longctx=False)


def _sp2(rank, world):
    return _run(rank, world, 2)  # untied attention + memory stack


@pytest.mark.distributed
def test_accelerate_loop_sp2_equals_one_process():
    (ref,), sp2 = run_distributed_side_by_side((_one_process, 1), (_sp2, 2))
    for got in sp2:
        assert len(got["losses"]) == len(ref["losses"]) == STEPS, (got["losses"], ref["losses"])
        for a, b in zip(got["losses"], ref["losses"]):
            assert math.isclose(a, b, rel_tol=1e-5), (got["losses"], ref["losses"])
        assert all(d.abs().max() > 0 for d in deltas(ref).values())
        errs, _ = delta_errors(ref, got)
        worst = max(errs, key=errs.get)
        assert errs[worst] < 1e-5, (worst, errs[worst])  # beyond 1 ulp per element: eco_cases.delta_errors
