"""Context extension through train.py (issues 35 and 39): --rope-scaling on the command line, a length-dependent
RoPE (dynamic NTK, which rescales past max_position_embeddings) trained at SP=2 equal to one process, step by step,
and --save-hf's config carrying the scaling, so from_pretrained gets the extended model."""
import json
import math
import os

import pytest

from launch_utils import ROOT, TINY_CPU, read_metrics, run_train, side_by_side

pytestmark = pytest.mark.distributed

STEPS, SEQ = 3, 64


def _configs(tmp_path):
    """The tiny preset with max_position_embeddings 32 (64-token samples run past it: dynamic rescales), and
    tiny-cpu.json at SP=1 for the one-process run."""
    with open(os.path.join(ROOT, "ds_configs", "models", "tiny-llama.json")) as f:
        model = json.load(f)
    model["max_position_embeddings"] = 32
    model_path = tmp_path / "tiny-llama-32.json"
    model_path.write_text(json.dumps(model))
    with open(TINY_CPU) as f:
        ds = json.load(f)
    ds["sequence_parallel_size"] = 1
    one = tmp_path / "tiny-cpu-sp1.json"
    one.write_text(json.dumps(ds))
    return str(model_path), str(one)


def test_dynamic_rope_flag_at_sp2_equals_one_process_and_exports(tmp_path):
    model, one = _configs(tmp_path)
    common = ("--model-config", model, "--rope-scaling", "dynamic:4", "--allow-beyond-max-position", "--seq-len",
              str(SEQ), "--steps", str(STEPS), "--eval-every", "0")
    sp2, sp1 = side_by_side(
        (run_train, common + ("--metrics", str(tmp_path / "sp2.jsonl"), "--save-hf", str(tmp_path / "hf")), {}),
        (run_train, common + ("--metrics", str(tmp_path / "sp1.jsonl")), {"nproc": 1, "config": one}))
    a, b = read_metrics(tmp_path / "sp2.jsonl"), read_metrics(tmp_path / "sp1.jsonl")
    la = [r["loss"] for r in a if "loss" in r][:STEPS]
    lb = [r["loss"] for r in b if "loss" in r][:STEPS]
    assert len(la) == len(lb) == STEPS, (a, b)
    for x, y in zip(la, lb):  # at 03d311a: 4.1727772 vs 4.1728458 at step 1 (rank 0 unscaled)
        assert math.isclose(x, y, rel_tol=1e-6), (la, lb)
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tmp_path / "hf")
    assert cfg.rope_parameters["rope_type"] == "dynamic" and cfg.rope_parameters["factor"] == 4.0, cfg.rope_parameters

