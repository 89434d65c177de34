"""What a checkpoint costs: measured on the tiny preset (CPU, 2 ranks, SP=2, ZeRO-3, the whole stack) and
predicted by arithmetic for Llama-3-8B on 8 x H100 (ds_configs/llama3-8b-1m.json).

    python bench/checkpoint_cost.py --json bench/results/checkpoint_cost_cpu.json

Measured (each from the job's own log line, wall seconds on this machine): a save (--save-every), the resume at
the same layout, the conversion to DeepSpeed's universal checkpoint and the resume at another layout (1 rank),
--save-hf's export at the end and `ds-longctx export` of a saved tag (a separate process: its time includes
Python's start and imports); sizes on disk. Predicted: the bytes of one save of the whole job
(checkpoint.checkpoint_bytes: fp32 master + the optimizer's states per parameter, ZeRO-3) and its write time at a
few filesystem write bandwidths per node (an assumption, stated; nothing here measured a drive).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
TINY = os.path.join(ROOT, "ds_configs", "tiny-cpu.json")


def _launch(nproc, argv, config=TINY, port=29731):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(nproc), "--master_port", str(port),
           os.path.join(ROOT, "train.py"), "--deepspeed_config", config, "--no-progress", "--log-every", "0",
           "--eval-samples", "0", "--seq-len", "64", *argv]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = p.stdout + p.stderr
    if p.returncode != 0:
        raise SystemExit(out[-3000:])
    return out


def _seconds(pattern, text):
    m = re.findall(pattern, text)
    if not m:
        raise SystemExit(f"no line matching {pattern!r}")
    return [float(x) for x in m]


def _du(path):
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def measure(work):
    ck, hf, hf2 = os.path.join(work, "ck"), os.path.join(work, "hf"), os.path.join(work, "hf2")
    out = _launch(2, ["--steps", "4", "--save", ck, "--save-every", "2", "--save-hf", hf])
    saves = _seconds(r"saved step\d+ \([^)]*\) to \S+ in ([\d.]+) s", out)
    export_live = _seconds(r"exported the model to \S+ \(safetensors; from_pretrained loads it\) in ([\d.]+) s", out)
    out2 = _launch(2, ["--steps", "5", "--resume", ck], port=29732)
    resume_same = _seconds(r"resumed from \S+ \(step 4, 16 samples consumed\) in ([\d.]+) s", out2)
    cfg = json.load(open(TINY))
    cfg["sequence_parallel_size"] = 1
    sp1 = os.path.join(work, "sp1.json")
    json.dump(cfg, open(sp1, "w"))
    ck1 = os.path.join(work, "ck1")
    shutil.copytree(ck, ck1)
    out3 = _launch(1, ["--steps", "5", "--resume", ck1], config=sp1, port=29733)
    convert = _seconds(r"converted \S+ to DeepSpeed's universal checkpoint \S+ in ([\d.]+) s", out3)
    resume_universal = _seconds(r"through DeepSpeed's universal checkpoint in ([\d.]+) s", out3)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "ds_longctx.cli", "export", ck, hf2], cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise SystemExit(p.stderr[-3000:])
    export_cli = time.monotonic() - t0
    return {
        "save_s": saves, "checkpoint_bytes": _du(os.path.join(ck, "step4")),
        "resume_same_layout_s": resume_same[0],
        "universal_convert_s": convert[0], "universal_bytes": _du(os.path.join(ck1, "step4.universal")),
        "resume_universal_1_rank_s": resume_universal[0],
        "export_live_s": export_live[0], "export_cli_wall_s": export_cli, "hf_bytes": _du(hf),
    }


def predict(gpus=8):
    import torch
    from transformers import AutoModelForCausalLM

    from ds_longctx.job.checkpoint import checkpoint_bytes
    from ds_longctx.models.loading import load_model_config

    cfg = load_model_config(os.path.join(ROOT, "ds_configs", "models", "llama3-8b.json"))
    with torch.device("meta"):
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    ds_config = json.load(open(os.path.join(ROOT, "ds_configs", "llama3-8b-1m.json")))
    total = checkpoint_bytes(ds_config, n)
    return {"model": "ds_configs/models/llama3-8b.json", "params": n, "ds_config": "ds_configs/llama3-8b-1m.json",
            "gpus": gpus, "bytes_per_save": total, "bytes_per_rank": total // gpus, "hf_export_bf16_bytes": 2 * n,
            "write_s_at_GBps_per_node": {str(bw): total / (bw * 1e9) for bw in (1, 2, 5, 10)},
            "assumption": "one node writes all 8 ranks' files at the filesystem's stated write bandwidth; a "
                          "universal conversion (another layout) reads them and writes the same bytes again"}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="ckcost-")
    try:
        res = {"command": "python bench/checkpoint_cost.py" + (f" --json {a.json}" if a.json else ""),
               "machine": f"{platform.node()}: {os.cpu_count()} CPU cores, {platform.machine()}",
               "date": time.strftime("%Y-%m-%d"), "measured_tiny_cpu": measure(work), "predicted_llama3_8b": predict()}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
