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
def test_hf_trainer_example_and_readme_recipe_launched_equal_one_process():
    """The example (``use_cpu=True``: Accelerate starts torch.distributed only) and README's Trainer recipe as written
    (tests/readme_recipe.py: no ``use_cpu``, Accelerate starts deepspeed.comm; two Trainers in one process), each
    launched on 2 CPU ranks at SP=2 with nothing but ``ds_longctx.enable()`` (no examples/_common prelude: before,
    a bare AssertionError at parallel_state_sp.py ``assert dist.is_initialized()``, a hang in DeepSpeed's shm
    all-reduce JIT build, and "sequence parallel group is already initialized" for the second Trainer). Every
    Trainer's losses equal the one-process HF run; the second Trainer's equal the first's bit for bit."""
    script = os.path.join(EXAMPLES, "hf_trainer.py")
    readme = os.path.join(ROOT, "tests", "readme_recipe.py")
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:  # the one-process run and the launched ones are independent: together
        one = pool.submit(subprocess.run, [sys.executable, script, "--sp", "1", "--hf-alst"], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
        recipe = pool.submit(launch, [readme], nproc=2, launcher="deepspeed", timeout=300)
        got = launch([script], nproc=2, launcher="deepspeed", timeout=300)  # untied attention + memory stack
        one, recipe = one.result(), recipe.result()
    assert one.returncode == 0, one.stderr[-3000:]
    ref = _losses(one.stdout)
    assert got.returncode == 0, got.stdout[-2000:] + got.stderr[-3000:]
    losses = _losses(got.stdout)
    assert len(losses) == len(ref) == 3 and losses[0] != losses[-1]
    for a, b in zip(losses, ref):
        assert math.isclose(a, b, rel_tol=1e-5), (losses, ref)
    assert recipe.returncode == 0, recipe.stdout[-2000:] + recipe.stderr[-4000:]
    lines = [ln for ln in recipe.stdout.splitlines() if ln.startswith('{"readme_losses"')]
    assert len(lines) == 1, recipe.stdout[-3000:]
    first, second = json.loads(lines[0])["readme_losses"]
    assert first == second, (first, second)  # the second Trainer: same SP layout, same model, same data
    assert len(first) == 3
    for a, b in zip(first, ref):
        assert math.isclose(a, b, rel_tol=1e-5), (first, ref)
