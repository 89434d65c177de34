"""The examples as README shows them: started by the deepspeed launcher (2 CPU ranks, SP=2), their
losses equal the one-process run of the same script. (tests/test_ecosystem.py imports the examples
and checks parameters too; this catches what only a launched script meets, e.g. who initialises
deepspeed.comm.)"""
import json
import math
import os
import subprocess
import sys

import pytest

from launch_utils import ROOT, _env, launch

EXAMPLES = os.path.join(ROOT, "examples")


def _losses(stdout: str):
    lines = [ln for ln in stdout.splitlines() if ln.startswith('{"losses"')]
    assert len(lines) == 1, stdout[-3000:]  # printed by rank 0 only
    return json.loads(lines[0])["losses"]


@pytest.mark.distributed
def test_hf_trainer_example_launched_equals_one_process():
    script = os.path.join(EXAMPLES, "hf_trainer.py")
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:  # the one-process run and the launched one are independent: together
        one = pool.submit(subprocess.run, [sys.executable, script, "--sp", "1", "--hf-alst"], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
        got = launch([script], nproc=2, launcher="deepspeed", timeout=300)  # untied attention + memory stack
        one = one.result()
    assert one.returncode == 0, one.stderr[-3000:]
    ref = _losses(one.stdout)
    assert got.returncode == 0, got.stdout[-2000:] + got.stderr[-3000:]
    losses = _losses(got.stdout)
    assert len(losses) == len(ref) == 3 and losses[0] != losses[-1]
    for a, b in zip(losses, ref):
        assert math.isclose(a, b, rel_tol=1e-5), (losses, ref)
