"""A run of days, end to end (issue 29), with real launches (CPU, gloo, DeepSpeed ZeRO-3, SP=2, the whole memory
stack of ds_configs/tiny-cpu.json):

* periodic saves, kill -9 mid-run, --resume: every step after the resume equals the uninterrupted run's, at the
  same layout (bit-equal) and through DeepSpeed's universal checkpoint at 1 rank (SP 1) and at 4 ranks (SP 2 x
  DP 2) within summation-order tolerance (Adam's moments and the data position carried: a resume without them
  differs from step 2 on); DeepSpeed's csv and TensorBoard monitors hold every step;
* the preemption signal (SIGUSR1 to one rank, as SLURM's --signal sends) saves and exits 0 within one step, and a
  second run on the same --save directory is refused naming the holder;
* a disk that fills up during a save: one clear error on every rank, 'latest' and the previous tag intact and
  resumable, no partial tag left;
* --save-hf and `ds-longctx export` write what from_pretrained loads without ds_longctx, with logits equal to the
  trained engine's;
* the wheel (not an editable install) runs the demo with a shipped config."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from dist_utils import free_port, run_distributed
from launch_utils import (REFERENCE_ARGS, REFERENCE_STEPS, ROOT, TINY_CPU, TRAIN, _env, read_metrics,
                          run_train, side_by_side)
from test_faults import small_tmpfs  # noqa: F401  (fixture)

from ds_longctx.job import checkpoint

pytestmark = pytest.mark.distributed


def _config(tmp_path, name, **changes):
    cfg = json.load(open(TINY_CPU))
    cfg.update(changes)
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return str(path)


def _start(tmp_path, name, argv, nproc=2, config=TINY_CPU, env=None):
    """A launched train.py in the background (its own session: killpg ends the whole job), output to a file."""
    log = open(tmp_path / f"{name}.log", "w")
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(nproc), "--master_port",
           str(free_port()), TRAIN, "--deepspeed_config", config, "--no-progress", *argv]
    p = subprocess.Popen(cmd, cwd=ROOT, env=dict(_env(), **(env or {})), stdout=log, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True)
    p.log_path = tmp_path / f"{name}.log"
    return p


def _output(p):
    return p.log_path.read_text()


def _wait_for_steps(p, metrics, n, timeout=240):
    deadline = time.monotonic() + timeout
    while not (metrics.exists() and metrics.read_text().count("\n") >= n):
        assert p.poll() is None, _output(p)[-3000:]
        assert time.monotonic() < deadline, _output(p)[-3000:]
        time.sleep(0.2)
    return metrics.read_text().count("\n")


def _losses(path):
    return {r["step"]: r["loss"] for r in read_metrics(path)}


def _csv_column(path):
    import csv

    with open(path) as f:
        rows = list(csv.reader(f))
    return {int(r[0]): float(r[1]) for r in rows[1:]}


def _tensorboard_scalars(log_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)}


def test_kill9_then_resume_on_any_layout_equals_the_uninterrupted_run(tmp_path, copy_reference):
    """The run killed with SIGKILL (the whole job) past step 5 resumes through DeepSpeed's universal checkpoint at 1
    rank (SP 1) and at 4 ranks (SP 2 x DP 2), each step within summation-order tolerance of the uninterrupted run
    (tests/conftest.py's copy_reference: the same command line, not stopped). (kill -9 and --resume auto at the same
    layout, bit-equal losses, grad norms and final weights, the save at the end, the pruning: tests/test_soak.py,
    under the deepspeed runner and mpirun.)"""
    ck = tmp_path / "ck"
    args = REFERENCE_ARGS
    # the saving run, killed with SIGKILL once it is past step 5 (its last complete save is step 4 or later)
    killed = _start(tmp_path, "killed", [*args, "--steps", "100000", "--save", str(ck), "--save-every", "2",
                                         "--keep-last", "2", "--metrics", str(tmp_path / "k.jsonl")])
    try:
        _wait_for_steps(killed, tmp_path / "k.jsonl", 5)
    finally:
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait()
    tag, record, note = checkpoint.find_resume_tag(str(ck))
    saved = record["step"]
    assert note is None and 4 <= saved <= 8 and saved % 2 == 0, (tag, record, note)
    # --keep-last 2: pruned after each save (a kill between a save and its pruning leaves one more)
    assert len([e for e in os.listdir(ck) if e.startswith("step")]) <= 3, os.listdir(ck)
    copies = [tmp_path / "ck1", tmp_path / "ck4"]
    for c in copies:
        shutil.copytree(ck, c)
    sp1 = _config(tmp_path, "sp1.json", sequence_parallel_size=1)
    dp2 = _config(tmp_path, "dp2.json", train_micro_batch_size_per_gpu=2)  # 4 ranks: the same 4 samples per step
    steps = str(saved + 3)
    one, four = side_by_side(
        (run_train, (*args, "--steps", steps, "--resume", str(copies[0]), "--metrics", str(tmp_path / "d.jsonl")),
         {"nproc": 1, "config": sp1}),
        (run_train, (*args, "--steps", steps, "--resume", str(copies[1]), "--metrics", str(tmp_path / "e.jsonl")),
         {"nproc": 4, "config": dp2}))
    ref = dict(enumerate(copy_reference["losses"], 1))
    after = list(range(saved + 1, saved + 4))
    assert [ref[s] for s in after] != [ref[s - 1] for s in after]  # the steps really train
    for name, proc in (("d", one), ("e", four)):
        out = proc.stdout + proc.stderr
        assert f"resumed from {ck.parent / ('ck1' if name == 'd' else 'ck4') / tag} (step {saved}, {4 * saved} " \
               "samples consumed) through DeepSpeed's universal checkpoint" in out, out[-3000:]
        got = _losses(tmp_path / f"{name}.jsonl")
        assert sorted(got) == after, got
        for s in after:  # another summation order (SP 1; DP 2 all-reduces the gradients)
            assert abs(got[s] - ref[s]) <= 1e-5 * abs(ref[s]), (name, s, got[s], ref[s])
    assert "layout: world_size 2 -> 4, data_parallel_size 1 -> 2, micro_batch 4 -> 2" in four.stdout


def test_deepspeed_monitors_hold_every_step_with_the_metrics_values(copy_reference):
    """DeepSpeed's csv and TensorBoard monitors (ds_config csv_monitor, tensorboard) hold every step of a run, with
    --metrics' values (the uninterrupted run of copy_reference has them on)."""
    ref = dict(enumerate(copy_reference["losses"], 1))
    steps = list(range(1, REFERENCE_STEPS + 1))
    for field in ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "peak_mem_bytes", "host_rss_bytes"):
        col = _csv_column(os.path.join(copy_reference["csv"], f"Train_ds_longctx_{field}.csv"))
        assert sorted(col) == steps, (field, col)
    assert _csv_column(os.path.join(copy_reference["csv"], "Train_ds_longctx_loss.csv")) == pytest.approx(ref, rel=1e-6)
    tb = _tensorboard_scalars(copy_reference["tb"], "Train/ds_longctx/loss")
    assert sorted(tb) == steps and tb == pytest.approx(ref, rel=1e-6)


def _rank_pid(runner, local_rank):
    import psutil

    for child in psutil.Process(runner.pid).children(recursive=True):
        try:
            if f"--local_rank={local_rank}" in child.cmdline():
                return child.pid
        except psutil.NoSuchProcess:
            pass
    raise AssertionError(f"no rank {local_rank} under {runner.pid}")


def test_preemption_signal_saves_and_exits_0_and_one_run_per_save_directory(tmp_path):
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    args = ("--seq-len", "64", "--eval-samples", "0", "--log-every", "0")
    run = _start(tmp_path, "run", [*args, "--steps", "100000", "--save", str(ck), "--metrics", str(metrics)])
    try:
        _wait_for_steps(run, metrics, 2)
        second = run_train(*args, "--steps", "3", "--save", str(ck), check=False, timeout=300)
        out = second.stdout + second.stderr
        assert second.returncode != 0, out[-3000:]
        for r in (0, 1):
            assert f"[rank {r}] ds_longctx: error: --save: {str(ck)!r} is in use by another run (host " in out, \
                out[-3000:]
        assert f"pid {_rank_pid(run, 0)}" in out and "Traceback" not in out, out[-3000:]
        seen = _wait_for_steps(run, metrics, 3)
        os.kill(_rank_pid(run, 1), signal.SIGUSR1)  # one rank: every rank must stop at the same step
        code = run.wait(timeout=120)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    out = _output(run)
    assert code == 0, out[-3000:]
    last = read_metrics(metrics)[-1]["step"]
    assert seen <= last <= seen + 2, (seen, last)  # the step in flight, and at most the next one
    assert "[rank 1] ds_longctx: received SIGUSR1: finishing this step, saving a checkpoint" in out, out[-3000:]
    assert f"stopped after step {last} on a signal on another rank: saved; continue with --resume {ck}" in out \
        or f"stopped after step {last} on SIGUSR1" in out, out[-3000:]
    assert checkpoint.find_resume_tag(str(ck))[0] == f"step{last}"


def test_a_disk_full_during_a_save_keeps_the_previous_checkpoint(tmp_path, small_tmpfs):
    """A 4 MiB filesystem holds one 1.6 MiB checkpoint; rank 1 fills it while saving step 4 (a real ENOSPC from
    torch's writer, at a repeatable moment: the test hook DS_LONGCTX_TEST_FILL_AT). Every rank ends with one
    error naming the path and the space; 'latest' stays on step 2, which resumes; no partial tag is left."""
    ck = os.path.join(small_tmpfs, "ck")
    args = ("--seq-len", "64", "--eval-samples", "0", "--log-every", "0")
    proc = _start(tmp_path, "full", [*args, "--steps", "6", "--save", ck, "--save-every", "2"],
                  env={checkpoint.TEST_FILL_ENV: "1:before_file2@4"})
    proc.wait(timeout=300)
    out = _output(proc)
    assert proc.returncode != 0, out[-3000:]
    for r in (0, 1):
        line = next((x for x in out.splitlines() if x.startswith(f"[rank {r}] ds_longctx: error: --save: saving "
                                                                  f"step 4 to {ck!r} failed on rank ")), None)
        assert line is not None, out[-3000:]
        assert f": writing '{ck}/.tmp-step4/" in line and "(0 B free there now)" in line, line
        assert "was free there before the save, which needed about 1.5" in line, line  # MiB: both ranks' files
        assert f"the previous checkpoint 'step2' and 'latest' are intact: --resume {ck} continues from it" in line, line
    assert "Traceback" not in out, out[-3000:]
    assert sorted(e for e in os.listdir(ck) if not e.startswith(".ds_longctx")) == \
        sorted(["latest", "step2", "zero_to_fp32.py", "zero_to_torch.py"]), os.listdir(ck)
    os.remove(os.path.join(ck, checkpoint.TEST_FILLER))
    # it resumes; a learning rate changed in the ds_config takes effect (DeepSpeed restores the checkpoint's) and
    # is reported
    cfg = json.load(open(TINY_CPU))
    cfg["optimizer"]["params"]["lr"] = 0.001
    again = run_train(*args, "--steps", "3", "--resume", ck, "--metrics", str(tmp_path / "r.jsonl"), timeout=300,
                      config=_config(tmp_path, "lr.json", optimizer=cfg["optimizer"]))
    assert f"resumed from {ck}/step2 (step 2, 8 samples consumed)" in again.stdout, again.stdout[-3000:]
    assert "optimizer.params.lr: 0.003 in the checkpoint, 0.001 now: the ds_config's value takes effect" in \
        again.stdout, again.stdout[-3000:]
    assert [(r["step"], r["lr"]) for r in read_metrics(tmp_path / "r.jsonl")] == [(3, 0.001)]


def _train_and_export(rank, world, tmp):
    """2 ranks, SP 2, ZeRO-3, the whole stack of tiny-cpu.json, through the public API of a custom loop: 2 steps,
    a checkpoint (open_checkpoints), the export (export_hf), and the engine's own logits on one sample (each
    rank's sequence shard, gathered). Returns the bytes the save directory's check expected of this rank."""
    import torch
    import torch.distributed as dist

    import ds_longctx
    from ds_longctx.train import args as train_args
    from ds_longctx.train import job as train_job
    from ds_longctx.models import loading
    from ds_longctx.config import shipped
    from ds_longctx.config import load_ds_config
    from ds_longctx.data import LongRangeCopy, SampleStream, shard_batch

    ds_config = load_ds_config(TINY_CPU)
    args = train_args.parse_args(["--deepspeed_config", TINY_CPU, "--seq-len", "64"])
    model = train_job.build_model(args, ds_config, loading.load_model_config(shipped.default_model_config()))
    engine, *_ = ds_longctx.initialize(model=model, config=ds_config, model_parameters=list(model.parameters()))
    data = LongRangeCopy(64, model.config.vocab_size)
    stream = SampleStream(data, 4, sp_rank=rank, sp_size=2)
    for _ in range(2):
        loss = engine(**next(stream)).loss
        engine.backward(loss)
        engine.step()
    saves = ds_longctx.open_checkpoints(engine, os.path.join(tmp, "ck"), log=lambda *_: None)
    estimate = saves.per_rank_bytes
    saves.save(engine, 2, {"step": 2, "dtype": "fp32"}, hf_config=model.config)
    saves.close()
    ds_longctx.export_hf(engine, os.path.join(tmp, "hf"), log=lambda *_: None)
    sample = {k: v.unsqueeze(0) for k, v in data[5].items()}
    batch = shard_batch(sample, rank, 2)
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits.float()
    parts = [torch.empty_like(logits) for _ in range(world)]
    dist.all_gather(parts, logits)
    if rank == 0:
        torch.save({"logits": torch.cat(parts, dim=1), "input_ids": sample["input_ids"]},
                   os.path.join(tmp, "engine.pt"))
    return estimate


_FROM_PRETRAINED = """
import sys, json, torch
from transformers import AutoModelForCausalLM
ref = torch.load(sys.argv[1])
out = {}
for d in sys.argv[2:]:
    m = AutoModelForCausalLM.from_pretrained(d).eval()
    with torch.no_grad():
        out[d] = (m(input_ids=ref["input_ids"]).logits.float() - ref["logits"]).abs().max().item()
out["ds_longctx imported"] = any(k.startswith("ds_longctx") for k in sys.modules)
print("RESULT", json.dumps(out))
"""


def test_export_loads_without_ds_longctx_with_the_engines_logits(tmp_path):
    estimates = run_distributed(_train_and_export, 2, str(tmp_path), timeout=240)
    for r, estimate in enumerate(estimates):  # the free-space check's bytes vs what each rank wrote
        wrote = sum(os.path.getsize(tmp_path / "ck" / "step2" / f) for f in os.listdir(tmp_path / "ck" / "step2")
                    if f.startswith(f"zero_pp_rank_{r}_"))
        assert wrote <= estimate <= wrote + (64 << 10), (r, wrote, estimate)
    p = subprocess.run([sys.executable, "-m", "ds_longctx.cli", "export", str(tmp_path / "ck"), str(tmp_path / "hf2")],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, "-c", _FROM_PRETRAINED, str(tmp_path / "engine.pt"), str(tmp_path / "hf"),
                        str(tmp_path / "hf2")], cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, p.stdout[-2000:] + p.stderr[-3000:]
    res = json.loads(line[7:])
    assert res.pop("ds_longctx imported") is False
    for d, diff in res.items():  # fp32; untied attention and the tiled MLP/loss sum in another order than HF's
        assert diff < 1e-5, (d, diff)
    for d in ("hf", "hf2"):
        files = sorted(os.listdir(tmp_path / d))
        assert "model.safetensors" in files and "config.json" in files and "generation_config.json" in files, files
        saved = json.loads((tmp_path / d / "config.json").read_text())
        assert saved["model_type"] == "llama" and not any("long" in k or "ds_" in k for k in saved), saved
    from safetensors.torch import load_file

    a, b = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "hf2" / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)  # the engine's weights = the checkpoint's


def test_the_wheel_runs_the_demo_with_a_shipped_config(tmp_path):
    """A plain (non-editable) install of the wheel, run from another directory: the main job and the shipped
    configs come from the installed package."""
    wheels, site, work = tmp_path / "wheels", tmp_path / "site", tmp_path / "work"
    work.mkdir()
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", ROOT, "-w",
                        str(wheels)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    wheel = next(wheels.glob("ds_longctx-*.whl"))
    p = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    env = dict(os.environ, PYTHONPATH=str(site), OMP_NUM_THREADS="1")  # before the editable install's finder
    where = subprocess.run([sys.executable, "-c", "import ds_longctx; print(ds_longctx.__file__)"], cwd=str(work),
                           env=env, capture_output=True, text=True, timeout=120)
    assert where.stdout.strip() == str(site / "ds_longctx" / "__init__.py"), where.stdout + where.stderr
    p = subprocess.run([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port",
                        str(free_port()), "--module", "ds_longctx.train", "--deepspeed_config", "tiny-cpu.json",
                        "--seq-len", "64", "--steps", "2", "--eval-samples", "2"], cwd=str(work), env=env,
                       capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert "world=2 sp=2 dp=1 seq_len=64" in out and "final loss" in out, out[-3000:]


_STOP = """
import os, signal, sys, time
from ds_longctx.dist.runtime import graceful_stop, install_signal_handlers, stop_requested
install_signal_handlers()
first, second = signal.Signals[sys.argv[1]], signal.Signals[sys.argv[2]]
with graceful_stop():
    assert stop_requested() is None
    os.kill(os.getpid(), first)
    time.sleep(0.5)
    print("STOP", stop_requested(), flush=True)
    if sys.argv[3] == "inside":
        os.kill(os.getpid(), second)  # a second signal ends the rank at once
        time.sleep(10)
        print("NOT REACHED", flush=True)
print("OUTSIDE", stop_requested(), flush=True)
os.kill(os.getpid(), second)  # outside: the handlers it replaced (SIGTERM ends the rank)
time.sleep(10)
"""


def test_graceful_stop_records_the_first_signal_and_a_second_sigterm_ends_the_rank():
    for first, second, where in (("SIGUSR1", "SIGTERM", "inside"), ("SIGTERM", "SIGTERM", "outside")):
        p = subprocess.run([sys.executable, "-c", _STOP, first, second, where], cwd=ROOT, env=_env(),
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 143, (first, p.returncode, p.stdout, p.stderr[-2000:])
        assert f"STOP {first}" in p.stdout and "NOT REACHED" not in p.stdout, p.stdout
        assert ("OUTSIDE None" in p.stdout) == (where == "outside"), p.stdout
        assert f"ds_longctx: received {first}: finishing this step, saving a checkpoint, then exiting" in p.stderr
        assert "ds_longctx: received SIGTERM: ending this rank (exit 143)" in p.stderr, p.stderr[-2000:]
