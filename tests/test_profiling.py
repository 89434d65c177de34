"""StepProfiler on CPU: metrics dict, FLOPs formula, trace and memory timeline for the chosen steps."""
import json
import os

import torch

from ds_longctx.config import ProfileConfig
from ds_longctx.measure.live_bytes import LiveBytesTracker
from ds_longctx.measure.profiler import StepProfiler, flops_per_sample
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
