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
    """Every shipped GPU config planned at its stated hardware, in two planner processes side by side (the planner
    runs torch's fake process group, so not in pytest's own; each process plans half the configs: the box has two
    cores and pytest waits on one)."""
    out = tmp_path_factory.mktemp("shipped")
    names = sorted(TARGETS)
    halves = [names[0::2], names[1::2]]
    procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "bench", "shipped_configs.py"), "--json",
                               str(out / f"plans{i}.json"), "--configs", ",".join(half)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=dict(os.environ, PYTHONPATH=ROOT))
             for i, half in enumerate(halves)]
    try:
        texts = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:  # a timeout leaves no planner behind
            if p.poll() is None:
                p.kill()
                p.wait()
    rows = {}
    for i, (p, text) in enumerate(zip(procs, texts)):
        assert p.returncode == 0, text[-4000:]
        rows.update({row["config"]: row for row in json.load(open(out / f"plans{i}.json"))["rows"]})
    assert sorted(rows) == names
    return rows


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(TARGETS))
def test_config_fits_its_hardware(name, planned):
    out = planned[name]
    cfg = json.load(open(os.path.join(CONFIGS, name)))
    assert out["target"] == TARGETS[name]
    assert out["fits"] is True and out["peak_device_bytes"] > 0, out
    assert out["sequence_length"] == cfg["long_context"]["sequence_length"]
