"""Every shipped GPU config fits its stated hardware according to the planner (which runs our real
attention, checkpointing, offload and tiling code on fake tensors), and every shipped config parses."""
import glob
import json
import os
import subprocess
import sys

import pytest

from ds_longctx.config import parse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "ds_configs")
TARGETS = {k: v for k, v in json.load(open(os.path.join(CONFIGS, "targets.json"))).items() if k != "_comment"}


def test_every_gpu_config_has_a_target_and_every_config_parses():
    shipped = sorted(os.path.basename(p) for p in glob.glob(os.path.join(CONFIGS, "*.json")))
    gpu = [p for p in shipped if p.startswith("llama3-8b")]
    assert sorted(TARGETS) == gpu
    for name in shipped:
        if name != "targets.json":
            parse(json.load(open(os.path.join(CONFIGS, name))))


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(TARGETS))
def test_config_fits_its_hardware(name):
    t = TARGETS[name]
    cmd = [sys.executable, "-m", "ds_longctx.planner.cli", "plan", "--config", os.path.join(CONFIGS, name),
           "--model-config", os.path.join(CONFIGS, t["model_config"]), "--gpus", str(t["gpus"]),
           "--gpu-mem", t["gpu_mem"], "--reserve", t["reserve"], "--host-mem", t["host_mem"], "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = json.loads(proc.stdout[proc.stdout.index("{"):])
    cfg = json.load(open(os.path.join(CONFIGS, name)))
    assert out["fits"] is True and out["peak_device_bytes"] > 0
    assert out["sequence_length"] == cfg["long_context"]["sequence_length"]
