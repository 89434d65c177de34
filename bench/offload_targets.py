#!/usr/bin/env python
"""Step time of checkpointing with layer inputs kept (no offload), in the exact-size host arena
(offload="cpu") and on NVMe through DeepSpeed's async I/O (offload="nvme"), side by side in one run:
the three models share weights and batches and their steps are interleaved (ckpt, cpu, nvme, ckpt, ...)
so machine load hits all three alike. Reports the median step time of each and the ratios, plus
what each target holds (arena / staging / file bytes) after the last step.

    python bench/offload_targets.py [--layers 8] [--hidden 256] [--seq 4096] [--steps 12] \
        [--nvme-path DIR] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--nvme-path", default=None, help="directory for the NVMe target (default: a temp dir)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    from tiny_models import build, tiny_config

    from ds_longctx.config import parse
    from ds_longctx.memory import apply_memory_stack
    from ds_longctx.patching.spec import build_spec

    heads = a.hidden // 32
    cfg = tiny_config(heads=heads, kv_heads=max(1, heads // 2), head_dim=32, layers=a.layers, vocab=256,
                      intermediate=2 * a.hidden)
    tmp = tempfile.mkdtemp(prefix="bench_nvme_", dir=a.nvme_path)
    rows = {"ckpt (no offload)": {}, "cpu (host arena)": {"offload": "cpu"},
            "nvme (DeepSpeed aio)": {"offload": "nvme", "nvme_path": tmp}}
    models, handles, opts, times = {}, {}, {}, {k: [] for k in rows}
    for name, ac in rows.items():
        m = build(cfg, seed=0)
        handles[name] = apply_memory_stack(m, build_spec(parse({"long_context": {"activation_checkpointing":
                                                                                 dict({"enabled": True}, **ac)}}),
                                                            m.config))
        m.train()
        models[name], opts[name] = m, torch.optim.SGD(m.parameters(), lr=0.01)
    losses = {k: [] for k in rows}
    try:
        for step in range(a.steps + 1):  # step 0 is warm-up (arena/ring/file growth), not timed
            ids = torch.randint(0, cfg.vocab_size, (1, a.seq), generator=torch.Generator().manual_seed(step))
            for name in rows:
                m = models[name]
                t0 = time.perf_counter()
                m.zero_grad(set_to_none=True)
                loss = m(input_ids=ids, labels=ids).loss
                loss.backward()
                opts[name].step()
                dt = time.perf_counter() - t0
                if step:
                    times[name].append(dt)
                losses[name].append(loss.item())
        stats = {k: {kk: v for kk, v in handles[k].stats().items() if kk.endswith("bytes") or kk.startswith("nvme")}
                 for k in rows}
    finally:
        for h in handles.values():
            h.remove()
        os.rmdir(tmp)
    assert losses["cpu (host arena)"] == losses["ckpt (no offload)"] == losses["nvme (DeepSpeed aio)"], losses
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med["ckpt (no offload)"]
    layer_bytes = a.seq * a.hidden * 4
    out = {"command": "python bench/offload_targets.py " + " ".join(sys.argv[1:]), "machine": platform.node(),
           "cpus": os.cpu_count(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
           "layers": a.layers, "hidden": a.hidden, "seq": a.seq, "layer_input_bytes": layer_bytes,
           "steps_timed": a.steps, "median_step_s": med, "ratio_to_ckpt": {k: v / base for k, v in med.items()},
           "nvme_over_cpu": med["nvme (DeepSpeed aio)"] / med["cpu (host arena)"], "target_stats": stats,
           "losses_bit_equal": True}
    print(f"{'target':<24} {'median step s':>14} {'x ckpt':>8}")
    for k in rows:
        print(f"{k:<24} {med[k]:>14.3f} {med[k] / base:>8.3f}")
    print(f"nvme / cpu step time: {out['nvme_over_cpu']:.3f}; layer input {layer_bytes / 2**20:.1f} MiB x {a.layers}")
    print(json.dumps(stats, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
