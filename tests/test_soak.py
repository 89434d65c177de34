"""Issue 52, item 3: a chaos soak in the suite. One run of the CPU demo (2 ranks, tiny-cpu.json, --save-every 2
--keep-last 2, the watchdog at 10 s) restarted with --resume auto after each of a sequence of faults, under
``ds-longctx launch`` over the deepspeed runner and over mpirun (side by side, with the uninterrupted reference they
share; tests/soak_utils.py has the faults and the checks):

* deepspeed: kill -9 of rank 1, SIGUSR1 and SIGTERM to the wrapper's process group, kill -9 of the wrapper, a full
  disk during a save (a 16 MiB tmpfs filled by rank 1 after its first file; skipped where no tmpfs can be mounted),
  a frozen rank (SIGSTOP) ended by the watchdog, a byte flip in the newest tag's optimizer states between two starts;
* mpirun: kill -9 of rank 1, SIGTERM to the wrapper's group, a byte flip between two starts.

Each passes when every step 1..N is in --metrics once with the uninterrupted run's loss and grad norm (bit-equal; the
run shared with other tests: tests/conftest.py copy_reference), the final --save-hf weights are bit-equal to the
uninterrupted run's, the last start saved step N at its end (N odd: no periodic save) and left the --keep-last newest
tags, each start stopped by SIGUSR1/SIGTERM to the wrapper's group saved its last step ('latest' on it) and every
process exited 0 (no rank ended before its save), no process of the run is left after any start, no `.tmp-` entry is
left, the save directory never holds more than --keep-last + 1 tags, no traceback, and the damaged tag was named and
skipped. (These carry what tests/test_long_runs.py's same-layout resume and tests/test_preemption.py's `ds-longctx
launch` resume asserted before.) The long soak (200 steps, 30 faults at random steps): bench/chaos_soak.py."""
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from launch_utils import REFERENCE_STEPS
from soak_utils import Soak, tmpfs

pytestmark = pytest.mark.distributed

STEPS = REFERENCE_STEPS  # the shared uninterrupted run's (tests/conftest.py copy_reference): odd, so that the end
# save is no periodic one
DEEPSPEED_PLAN = [("kill_rank", 2), ("sigusr1", 2), ("sigterm", 2), ("kill_wrapper", 2), ("disk_full", 2),
                  ("freeze_rank", 2), ("corrupt", 0)]
MPIRUN_PLAN = [("kill_rank", 2), ("sigterm", 3), ("corrupt", 0)]


@pytest.fixture(scope="module")
def soaks(tmp_path_factory, copy_reference):
    root = str(tmp_path_factory.mktemp("soak"))
    with tmpfs(os.path.join(root, "tmpfs")) as mnt, ThreadPoolExecutor(2) as pool:
        ds = Soak(os.path.join(root, "ds"), STEPS, "deepspeed", save=os.path.join(mnt, "ck") if mnt else None,
                  can_fill=mnt is not None)
        mpi = Soak(os.path.join(root, "mpi"), STEPS, "mpirun")
        runs = [pool.submit(ds.run, DEEPSPEED_PLAN), pool.submit(mpi.run, MPIRUN_PLAN)]
        errors = {}
        for name, job in zip(("deepspeed", "mpirun"), runs):
            try:
                job.result()
            except Exception as e:  # a start that could not be driven: that soak's test fails with it
                errors[name] = e
        ref_metrics, ref_hf = copy_reference["metrics"], copy_reference["hf"]
        return {name: errors.get(name) or soak.final(ref_metrics, ref_hf)
                for name, soak in (("deepspeed", ds), ("mpirun", mpi))}


@pytest.mark.parametrize("launcher", ["deepspeed", "mpirun"])
def test_a_run_hit_by_faults_in_sequence_ends_as_the_uninterrupted_run(soaks, launcher):
    res = soaks[launcher]
    if isinstance(res, Exception):
        raise res
    assert not res["problems"], "\n".join(res["problems"])
    plan = DEEPSPEED_PLAN if launcher == "deepspeed" else MPIRUN_PLAN
    done = [f for f, _ in plan if not any(s.startswith(f + ":") for s in res["skipped"])]
    assert res["faults"] == done, res
    assert res["weights_bit_equal"] is True and res["losses_bit_equal"] is True and res["grad_norms_bit_equal"] is True
    # the last start saved its end (step 25, no multiple of --save-every) and pruned to --keep-last 2
    assert res["latest"] == f"step{STEPS}" and res["tags"] == sorted([f"step{STEPS - 1}", f"step{STEPS}"]), res
    for start in res["per_start"]:  # a scheduler's signal to the wrapper: saved, and every process exited 0
        assert start["fault"] not in ("sigusr1", "sigterm") or start["code"] == 0, start
    print(launcher, res["starts"], "starts", round(res["seconds"]), "s", res["per_start"], res["skipped"])
