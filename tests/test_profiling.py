"""StepProfiler on CPU: metrics dict, FLOPs formula, trace and memory timeline for the chosen steps."""
import functools
import json
import os

import torch

from ds_longctx.config import ProfileConfig
from ds_longctx.measure.live_bytes import LiveBytesTracker
from ds_longctx.job.profiler import StepProfiler
from ds_longctx.measure.formula import flops_per_sample
from tiny_models import build, tiny_config


def test_flops_formula():
    f = flops_per_sample(1000, 10, 2, 8)
    assert f["dense"] == 6 * 10 * 1000 and f["attention"] == 6 * 2 * 8 * 1000**2


def test_step_profiler_cpu(tmp_path):
    cfg = tiny_config()
    model = build(cfg)
    tracker = LiveBytesTracker()
    prof = StepProfiler(ProfileConfig(enabled=True, steps=[1], output_dir=str(tmp_path)), cfg, world_size=1,
                        sp_size=1, model=model, tracker=tracker)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recs = []
    for step in range(2):
        ids = torch.randint(0, cfg.vocab_size, (1, 64))
        prof.start_step(step)
        with tracker:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        opt.step()
        opt.zero_grad()
        recs.append(prof.end_step(step, tokens=64))
    r0, r1 = recs
    for r in recs:
        assert r["step_time_s"] > 0 and r["tokens_per_s_per_gpu"] > 0 and r["tflops_per_gpu"] > 0
        assert r["peak_memory_source"] == "live_bytes_tracker" and r["peak_memory_bytes"] > 0
    assert "artifacts" not in r0
    names = {os.path.basename(p) for p in r1["artifacts"]}
    assert "trace_rank0_step1.json" in names and "memory_rank0_step1.csv" in names
    with open(tmp_path / "trace_rank0_step1.json") as f:
        assert json.load(f)["traceEvents"]
    assert json.load(open(prof.write_summary()))[1]["step"] == 1


def test_profiler_reports_measured_flops_per_category_next_to_the_planners(tmp_path):
    """A profiled step (full stack: untied attention u=1, checkpointing, tiled MLP and loss, RMSNorm) counted
    op by op (measure/flops.WorkCounter) against the planner's fake step of the same config and length:
    attention forward / recompute / backward FLOPs equal (same formulas, same calls), GEMMs within 1% (the
    planner's tiled ops run one representative tile), and the table prints every category."""
    from ds_longctx.config import parse
    from ds_longctx.job.profiler import format_flops
    from tiny_models import patch
    from ds_longctx.planner import planned_work

    cfg = tiny_config(heads=4, kv_heads=2, head_dim=8, layers=2)
    seq = 128
    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}, "sequence_parallel_size": 1,
          "long_context": {"sequence_length": seq,
                           "attention": {"implementation": "untied_ulysses", "heads_per_chunk": 1},
                           "activation_checkpointing": {"enabled": True},
                           "tiled_mlp": {"enabled": True, "shards": 4}, "tiled_loss": {"enabled": True, "shards": 4},
                           "rms_norm": {"enabled": True}}}
    model = build(cfg)
    patched = patch(model, parse(ds), None, 1.0)
    prof = StepProfiler(ProfileConfig(enabled=True, steps=[1], output_dir=str(tmp_path)), cfg, world_size=1,
                        sp_size=1, model=model, seq_len=seq, plan_work=functools.partial(planned_work, ds, cfg, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recs = []
    try:
        for step in range(2):
            ids = torch.randint(0, cfg.vocab_size, (1, seq))
            prof.start_step(step)
            model(input_ids=ids, position_ids=torch.arange(seq).unsqueeze(0), shift_labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            recs.append(prof.end_step(step, tokens=seq))
    finally:
        patched.remove()
    assert "flops_by_category" not in recs[0]  # only the profiled steps are counted
    f = recs[1]["flops_by_category"]
    for k in ("attention_forward", "attention_recompute", "attention_backward"):
        assert f[k]["measured"] == f[k]["planned"] > 0, (k, f[k])
    assert f["attention_backward"]["measured"] == f["attention_forward"]["measured"] * 5 // 2
    for k in ("gemm_forward", "gemm_recompute", "gemm_backward"):
        assert abs(f[k]["ratio"] - 1) < 0.01, (k, f[k])
    assert abs(f["total"]["ratio"] - 1) < 0.01
    lines = format_flops(f)
    assert lines[-1].startswith("total") and any(line.startswith("attention_recompute") for line in lines)
