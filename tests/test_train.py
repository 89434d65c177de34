"""train.py end to end on 2 ranks with the real `deepspeed` launcher (CPU, gloo): the loss falls below the
no-attention floor on the embedded task, the metrics file is well formed, and the profiler's records and traces.
(Saves, resumes on any layout, export, monitors, preemption: tests/test_long_runs.py.)"""
import json
import math

import pytest

from launch_utils import TINY_CPU, read_metrics, run_train

pytestmark = pytest.mark.distributed  # every test here spawns processes


def launch(*args, **kw):
    return run_train(*args, **kw).stdout


def test_loss_falls_and_metrics(tmp_path):
    metrics = tmp_path / "m.jsonl"
    out = launch("--steps", "140", "--seq-len", "128", "--metrics", str(metrics), "--eval-samples", "4")
    recs = read_metrics(metrics)
    assert [r["step"] for r in recs] == list(range(1, 141))
    keys = {"step", "loss", "tokens", "tokens_per_s", "tflops", "mfu", "peak_mem_bytes", "host_rss_bytes", "lr",
            "grad_norm", "step_time_s"}
    for r in recs:
        assert keys <= set(r) and r["tokens"] == 4 * 128 and r["tokens_per_s"] > 0 and r["peak_mem_bytes"] > 0
        assert math.isfinite(r["loss"]) and r["tflops"] > 0 and r["lr"] == pytest.approx(3e-3)
        assert r["grad_norm"] > 0 and r["mfu"] is None and r["host_rss_bytes"] > 0  # no MFU without a known GPU
    # host memory stays flat (itertools.cycle kept every batch it yielded; now nothing is kept between steps)
    rss = [r["host_rss_bytes"] for r in recs]
    assert max(rss[19:]) - rss[19] < 8 * 2**20, [round(b / 2**20, 1) for b in rss[19::20]]  # after warm-up
    floor = math.log(64 - 2)  # no-attention floor of the copy task
    assert recs[0]["loss"] > floor - 0.1
    # only attention across the two sequence shards can take the loss well below the floor
    assert min(r["loss"] for r in recs[-10:]) < floor - 0.8, [round(r["loss"], 3) for r in recs[-10:]]
    assert "world=2 sp=2 dp=1" in out and "copy accuracy" in out


def test_profile_writes_traces_and_metrics(tmp_path):
    """long_context.profile through train.py: per-step records on every rank, a torch.profiler trace and
    a memory timeline for the chosen step only (a CUDA memory snapshot too when on CUDA)."""
    import os

    out_dir = tmp_path / "prof"
    cfg = json.load(open(TINY_CPU))
    cfg["long_context"]["profile"] = {"enabled": True, "steps": [2], "output_dir": str(out_dir)}
    cfg_path = tmp_path / "ds.json"
    cfg_path.write_text(json.dumps(cfg))
    metrics = tmp_path / "m.jsonl"
    out = launch("--steps", "3", "--seq-len", "64", "--metrics", str(metrics), "--eval-samples", "0",
                 config=str(cfg_path))
    assert "profile: per-step records" in out
    for rank in (0, 1):
        with open(out_dir / f"trace_rank{rank}_step2.json") as f:
            assert len(json.load(f)["traceEvents"]) > 10
        assert (out_dir / f"memory_rank{rank}_step2.csv").read_text().count("\n") > 1
        steps = json.load(open(out_dir / f"steps_rank{rank}.json"))
        assert [r["step"] for r in steps] == [1, 2, 3]
        assert all(r["tflops_per_gpu"] > 0 and r["peak_memory_bytes"] > 0 for r in steps)
    assert not any("step1" in n or "step3" in n for n in os.listdir(out_dir))  # only the chosen step
    recs = read_metrics(metrics)
    assert [("profile_artifacts" in r) for r in recs] == [False, True, False]
    rank0 = json.load(open(out_dir / "steps_rank0.json"))
    assert [r["tflops"] for r in recs] == [r["tflops_per_gpu"] for r in rank0]  # one formula
    # rank 0's profiled step: executed FLOPs per category next to the planner's, printed and recorded
    assert "executed FLOPs per category, measured vs the planner's" in out
    f = rank0[1]["flops_by_category"]
    assert "flops_by_category" not in rank0[0] and "flops_by_category" in recs[1]
    assert f["attention_forward"]["measured"] == f["attention_forward"]["planned"] > 0, f
    assert abs(f["gemm_forward"]["ratio"] - 1) < 0.01, f
    # not asserted: this 2-rank ZeRO-3 SP=2 run measures ~7 lm_head-sized GEMMs more in the recompute and one
    # more in backward than the planner's fake step (in one process, SP=1, the counts agree exactly:
    # tests/test_profiling.py): a gap the table shows, not yet explained
