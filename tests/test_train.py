"""train.py end to end on 2 ranks with the real `deepspeed` launcher (CPU, gloo): the loss falls
below the no-attention floor on the embedded task, the metrics file is well formed, and --save then
--resume gives the same next-step loss as an uninterrupted run, and a resume with another layout is
refused."""
import json
import math

import pytest

from launch_utils import TINY_CPU, read_metrics, run_train, side_by_side

pytestmark = pytest.mark.distributed  # every test here spawns processes


def launch(*args, **kw):
    return run_train(*args, **kw).stdout


def test_loss_falls_and_metrics(tmp_path):
    metrics = tmp_path / "m.jsonl"
    out = launch("--steps", "140", "--seq-len", "128", "--metrics", str(metrics), "--eval-samples", "4")
    recs = read_metrics(metrics)
    assert [r["step"] for r in recs] == list(range(1, 141))
    keys = {"step", "loss", "tokens", "tokens_per_s", "tflops", "peak_mem_bytes", "lr"}
    for r in recs:
        assert keys <= set(r) and r["tokens"] == 4 * 128 and r["tokens_per_s"] > 0 and r["peak_mem_bytes"] > 0
        assert math.isfinite(r["loss"]) and r["tflops"] > 0 and r["lr"] == pytest.approx(3e-3)
    floor = math.log(64 - 2)  # no-attention floor of the copy task
    assert recs[0]["loss"] > floor - 0.1
    # only attention across the two sequence shards can take the loss well below the floor
    assert min(r["loss"] for r in recs[-10:]) < floor - 0.8, [round(r["loss"], 3) for r in recs[-10:]]
    assert "world=2 sp=2 dp=1" in out and "copy accuracy" in out


def test_save_resume_gives_the_same_next_step(tmp_path):
    ckpt = tmp_path / "ckpt"
    straight, resumed = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    side_by_side((run_train, ("--steps", "4", "--seq-len", "64", "--metrics", str(straight), "--eval-samples", "0"),
                  {}),  # the uninterrupted run and the saving run are independent jobs: started together
                 (run_train, ("--steps", "3", "--seq-len", "64", "--save", str(ckpt), "--eval-samples", "0"), {}))
    # another layout (SP 2 -> 1, world 2 -> 1) would read other samples and other ZeRO partitions:
    # refused before load_checkpoint, naming each difference. It and the resume only read the checkpoint
    # (no --save): started together
    cfg = json.load(open(TINY_CPU))
    cfg.update(sequence_parallel_size=1, long_context={})
    sp1 = tmp_path / "sp1.json"
    sp1.write_text(json.dumps(cfg))
    _, proc = side_by_side(
        (run_train, ("--steps", "4", "--seq-len", "64", "--resume", str(ckpt), "--metrics", str(resumed),
                     "--eval-samples", "0"), {}),
        (run_train, ("--steps", "4", "--seq-len", "64", "--resume", str(ckpt), "--eval-samples", "0"),
         {"nproc": 1, "config": str(sp1), "check": False, "timeout": 300}))
    a, b = read_metrics(straight), read_metrics(resumed)
    assert [r["step"] for r in b] == [4]
    assert b[0]["loss"] == a[3]["loss"], (a[3]["loss"], b[0]["loss"])
    assert a[3]["loss"] != a[2]["loss"]  # the step really trained
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert (f"--resume: {ckpt} was saved with a different layout: world_size 2 in the checkpoint vs 1 now, "
            "sequence_parallel_size 2 in the checkpoint vs 1 now") in out, out[-3000:]
    assert "Fix: resume with the number of processes = 2, sequence_parallel_size = 2" in out


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
