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
    gpu = [p for p in shipped if p.startswith("llama3")]
    assert sorted(TARGETS) == gpu
    for name in shipped:
        if name != "targets.json":
            parse(json.load(open(os.path.join(CONFIGS, name))))


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """Every shipped GPU config planned at its stated hardware, in one planner process (the planner
    runs torch's fake process group, so not in pytest's own; one process for all: ~35 s instead of 7 x 10)."""
    out = tmp_path_factory.mktemp("shipped") / "plans.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "shipped_configs.py"), "--json", str(out)],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return {row["config"]: row for row in json.load(open(out))["rows"]}


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(TARGETS))
def test_config_fits_its_hardware(name, planned):
    out = planned[name]
    cfg = json.load(open(os.path.join(CONFIGS, name)))
    assert out["target"] == TARGETS[name]
    assert out["fits"] is True and out["peak_device_bytes"] > 0, out
    assert out["sequence_length"] == cfg["long_context"]["sequence_length"]
