"""Issue 22 under real launches (few and batched: each launch is ~15 s on CPU): SIGTERM to the deepspeed
runner alone ends every rank and leaves no NVMe file; a drive too small for the plan is one clear error
on every rank under mpirun, no file left; a save whose newest tag is incomplete resumes from the newest
complete one and says so, and the new save writes its record before 'latest'."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from dist_utils import free_port
from launch_utils import REFERENCE_ARGS, ROOT, TINY_CPU, TRAIN, _env, run_train, save_dir_at
from test_faults import _aio_available, small_tmpfs  # noqa: F401  (fixture)

from ds_longctx.job import checkpoint  # noqa: E402

pytestmark = pytest.mark.distributed


def _nvme_config(tmp_path, nvme_path, **ac):
    cfg = json.load(open(TINY_CPU))
    cfg["long_context"]["activation_checkpointing"].update(offload="nvme", nvme_path=nvme_path, **ac)
    path = tmp_path / "nvme.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.skipif(not _aio_available(), reason="DeepSpeed's async_io op needs libaio-dev")
def test_sigterm_to_the_runner_ends_every_rank_and_full_drive_is_one_error(tmp_path, small_tmpfs):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    metrics = tmp_path / "m.jsonl"
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()),
           TRAIN, "--deepspeed_config", _nvme_config(tmp_path, str(nvme)), "--no-progress", "--seq-len", "64",
           "--steps", "100000", "--eval-samples", "0", "--metrics", str(metrics)]
    runner = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert runner.poll() is None and time.monotonic() < deadline, runner.communicate()[0][-3000:]
            time.sleep(0.5)
        assert len(os.listdir(nvme)) == 2  # one activation directory per rank while training
        runner.send_signal(signal.SIGTERM)  # the runner alone, as a scheduler or a wrapper's Ctrl-C does
        # the job ends by itself: its process group is gone before a generous bound (a hang, not a slow box, fails;
        # no wall-clock figure is asserted)
        deadline, ended = time.monotonic() + 180, False
        while not ended and time.monotonic() < deadline:
            runner.poll()  # reap the runner (a zombie still counts as a member of the group)
            try:
                os.killpg(runner.pid, 0)  # launch.py and the ranks share the runner's process group
                time.sleep(0.2)
            except ProcessLookupError:
                ended = True
    finally:
        try:
            os.killpg(runner.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out = runner.communicate()[0]
    assert ended, out[-3000:]
    assert "ds_longctx: the launcher process" in out, out[-3000:]
    assert os.listdir(nvme) == [], out[-3000:]  # every rank removed its files on the way out
    # a 4 MiB drive for 2 ranks x (2 layer inputs of 1 MiB + the first layer's kept attention output and LSE, each
    # in a 4 KiB-aligned slot): refused before step 1 on every rank, nothing left
    proc = run_train("--seq-len", "2048", "--steps", "1", "--eval-samples", "0", launcher="mpirun",
                     config=_nvme_config(tmp_path, small_tmpfs, keep_attention_output=1), check=False, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    # micro 4 x 1024 tokens per rank, fp32: input 4 x 1024 x 64 x 4; output 4 x 1024 x (4 x 16) x 4; LSE 4 x 2 x 2048 x 4
    need = 2 * 4 * 1024 * 64 * 4 + 4 * 1024 * 64 * 4 + 4 * 2 * 2048 * 4 + 2 * 4096
    assert f"is too full for this rank's layer inputs: {need} bytes ({need / 2**20:.1f} MiB) needed in" in out, \
        out[-3000:]
    assert any(f"[rank {r}] ds_longctx: error: long_context.activation_checkpointing.nvme_path: rank " in out
               for r in (0, 1)), out[-3000:]
    assert "Traceback" not in out and "Assertion" not in out, out[-3000:]
    assert os.listdir(small_tmpfs) == []


@pytest.fixture(scope="module")
def saved_step2(copy_reference):
    """A job saved at step 2 (the shared uninterrupted run's tag step2, tests/conftest.py copy_reference): the
    checkpoint the two tests below start from (each on its own copy, launch_utils.save_dir_at)."""
    return copy_reference


def test_resume_skips_an_incomplete_newest_tag_and_saves_in_order(tmp_path, saved_step2):
    ck = tmp_path / "ck"
    args = (*REFERENCE_ARGS, "--save", str(ck))
    save_dir_at(saved_step2, ck, ["step2"])  # what run_train("--steps", "2", *args) leaves
    rec = json.loads((ck / "step2" / checkpoint.RECORD_FILE).read_text())
    assert rec["model"] == {"model_type": "llama", "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 16,
                            "hidden": 64, "vocab": 64}
    assert rec["files"] and all(os.path.getsize(ck / "step2" / f) == n for f, n in rec["files"].items())
    # a save killed after 'latest' moved but before the record (the old order): an incomplete newest tag
    shutil.copytree(ck / "step2", ck / "step3")
    (ck / "step3" / checkpoint.RECORD_FILE).unlink()
    (ck / "latest").write_text("step3")
    proc = run_train("--steps", "3", "--resume", str(ck), *args, timeout=300)
    out = proc.stdout + proc.stderr
    assert (f"--resume: {str(ck / 'step3' / checkpoint.RECORD_FILE)!r} is missing (the save did not finish, or the "
            f"checkpoint was not saved by ds_longctx); resuming from {str(ck / 'step2')!r} (step 2)") in out, \
        out[-3000:]
    assert (ck / "latest").read_text() == "step3" and (ck / "step3" / checkpoint.RECORD_FILE).exists()
    assert checkpoint.find_resume_tag(str(ck))[0::2] == ("step3", None)


def test_kill9_during_the_save_leaves_latest_on_a_complete_tag(tmp_path, saved_step2):
    """kill -9 of rank 1 between the two files DeepSpeed writes for it (ds_longctx.job.checkpoint's test hook
    DS_LONGCTX_TEST_KILL_AT): the launcher ends rank 0 in the save's barrier, 'latest' stays on the previous
    tag, which --resume loads without a warning; the incomplete save is a .tmp- tag with no record. (Every point
    of the save, both ranks, both launchers, each with a launched --resume: bench/fault_rerun.py --group
    kill_save.)"""
    ck = tmp_path / "ck"
    save_dir_at(saved_step2, ck, ["step2"])  # a complete save at step 2; the killed save is step 3's
    port = free_port()
    env = dict(_env(), DS_LONGCTX_TEST_KILL_AT="1:after_file1")
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(port), TRAIN,
           "--deepspeed_config", TINY_CPU, "--no-progress", *REFERENCE_ARGS, "--steps", "3", "--resume", str(ck),
           "--save", str(ck)]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-3000:]
    # the killed save's files are in its temporary tag (never under a tag's name), which the next run removes
    files = sorted(os.listdir(ck / (checkpoint.TMP_PREFIX + "step3")))
    complete = sorted(os.listdir(ck / "step2"))
    assert checkpoint.RECORD_FILE not in files and 0 < len(files) < len(complete) - 1, (files, complete)
    assert not (ck / "step3").exists() and (ck / "latest").read_text() == "step2"
    assert checkpoint.find_resume_tag(str(ck))[0::2] == ("step2", None)
