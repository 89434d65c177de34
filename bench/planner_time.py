#!/usr/bin/env python
"""Planner's predicted step time vs a measured CPU step (issue 20 item 2): the RATIO between two configurations.

One process, world 1, fp32 on CPU, a small Llama (hidden 256, 4 heads of 64, 2 kv heads, 4 layers, MLP 1024,
vocab 2048), our full stack through ``patch_model`` (untied attention u=1, checkpointing, tiled MLP and loss,
memory-efficient RMSNorm). Measured: forward + backward (what the planner simulates), median of --reps after
one warm-up round, the configurations alternated (A B C A B C). Predicted: the planner with device="cpu" and this
machine's own rates, measured here first (fp32 GEMM, copy bandwidth, the CPU flash attention op's fwd+bwd rate at
head_dim 64, and the host time per dispatched op: the same stack's step at 128 tokens over its counted ops).
Ratios: each variant against the first at the same length, and the first variant at each length against the
first length; each with and without the host (per-op) term.

    python bench/planner_time.py [--seqs 2048 4096 8192] [--variants full no-checkpointing untied-u2]
                                 [--json bench/results/planner_time_cpu.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

MODEL = dict(model_type="llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             num_hidden_layers=4, vocab_size=2048, intermediate_size=1024, max_position_embeddings=65536,
             rms_norm_eps=1e-6, tie_word_embeddings=False)
LC = {"attention": {"implementation": "untied_ulysses", "kernel": "auto", "heads_per_chunk": 1, "fuse_projections": True},
      "activation_checkpointing": {"enabled": True, "offload": "none"},
      "tiled_mlp": {"enabled": True, "shards": "auto"}, "tiled_loss": {"enabled": True, "shards": "auto"},
      "rms_norm": {"enabled": True}}


VARIANTS = {"full": {}, "no-checkpointing": {"activation_checkpointing": {"enabled": False}},
            "untied-u2": {"attention": dict(LC["attention"], heads_per_chunk=2)}}


def ds_config(seq, variant="full"):
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}, "sequence_parallel_size": 1,
            "long_context": dict(LC, sequence_length=seq, **VARIANTS[variant])}


def _median(f, reps):
    f()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def cpu_rates(seq):
    from ds_longctx.planner.rates import Rates

    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    gemm = 2 * 1024 ** 3 / _median(lambda: a @ b, 5) / 1e12
    x = torch.empty(2 ** 24)
    y = torch.empty_like(x)
    hbm = 2 * x.nbytes / _median(lambda: y.copy_(x), 5) / 1e9
    q = torch.randn(1, 1, seq, 64)
    aten = torch.ops.aten

    def attn():
        o, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, q, q, 0.0, True, scale=0.125)[:2]
        aten._scaled_dot_product_flash_attention_for_cpu_backward(o, q, q, q, o, lse, 0.0, True, scale=0.125)

    att = 3.5 * 2 * seq * seq * 64 / _median(attn, 3) / 1e12
    return Rates(name="this-cpu", peak_tflops=gemm, gemm_tflops=gemm, attention_tflops={64: att}, hbm_gbps=hbm,
                 a2a_intra_gbps=1e9, a2a_inter_gbps=1e9, pcie_gbps=hbm, nvme_gbps=hbm,
                 host_async=False,
                 sources={"all": "measured by bench/planner_time.py on this machine"})


def op_overhead_us(rates, seq=128, reps=5):
    """Host time per dispatched op of THIS code on this machine: the full stack's step at a length where the
    kernels' own work is small (``seq`` tokens), less the kernels' predicted time, divided by the ops the
    planner's simulation counts for that step (measure/flops.op_cost's filter: views and metadata excluded).
    It holds the dispatcher, autograd and the Python of our staged attention, tiling and checkpointing."""
    import dataclasses

    m = measure(seq, reps, "full")
    t = predict(seq, dataclasses.replace(rates, op_overhead_us=0.0), "full")
    return max(0.0, m - t["compute_s"]) / t["calls"]["ops"] * 1e6, {"seq": seq, "measured_s": m,
                                                                     "kernels_s": t["compute_s"],
                                                                     "ops": t["calls"]["ops"]}


def _build(seq, variant):
    from transformers import AutoConfig, AutoModelForCausalLM

    d = dict(MODEL)
    cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    model.train()
    return model


def measure_alternating(configs, reps):
    """Median step seconds of each (seq, variant), the configurations run in turn (A B C A B C ...: a load
    change on the shared box hits all of them alike), one warm-up round first. Each model is patched for its
    own steps and unpatched after them."""
    from ds_longctx.config import parse
    from ds_longctx.patching.patch import patch_model
    from ds_longctx.patching.spec import build_spec

    models = {c: _build(*c) for c in configs}
    inputs = {s: torch.randint(0, MODEL["vocab_size"], (1, s)) for s in {c[0] for c in configs}}
    times = {c: [] for c in configs}
    for rep in range(reps + 1):
        for c in configs:
            seq, variant = c
            model, ids = models[c], inputs[seq]
            patched = patch_model(model, build_spec(parse(ds_config(seq, variant)), model.config))
            pos = torch.arange(seq).unsqueeze(0)
            t0 = time.perf_counter()
            model(input_ids=ids, position_ids=pos, shift_labels=ids).loss.backward()
            dt = time.perf_counter() - t0
            model.zero_grad(set_to_none=True)
            patched.remove()
            if rep:
                times[c].append(dt)
    return {c: sorted(ts)[len(ts) // 2] for c, ts in times.items()}, times


def measure(seq, reps, variant):
    return measure_alternating([(seq, variant)], reps)[0][(seq, variant)]


def predict(seq, rates, variant):
    from ds_longctx.planner import Planner, load_model_config

    p = Planner(ds_config(seq, variant), load_model_config(dict(MODEL)), 1, gpu_mem="1TiB", reserve="0", device="cpu",
                full_depth=True, target=rates)
    return p.run(seq).time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--variants", nargs="+", default=["full"], choices=sorted(VARIANTS),
                    help="configurations compared at each length (the first is the ratios' base)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: on a small shared box, 2+ threads per op stall whenever another process "
                         "holds a core, and every extra stage's ops pay that stall)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import dataclasses

    torch.set_num_threads(a.threads)

    rates = cpu_rates(max(a.seqs))
    overhead, calib = op_overhead_us(rates)
    rates = dataclasses.replace(rates, op_overhead_us=overhead)
    print(f"host time per dispatched op: {overhead:.1f} us ({calib})", flush=True)
    configs = [(seq, v) for seq in a.seqs for v in a.variants]
    med, all_times = measure_alternating(configs, a.reps)
    rows = []
    for seq, variant in configs:
        t = predict(seq, rates, variant)
        m = med[(seq, variant)]
        rows.append({"seq": seq, "variant": variant, "measured_s": m, "measured_all_s": all_times[(seq, variant)],
                     "predicted_s": t["seconds"], "predicted_without_host_s": t["seconds"] - t["parts"]["host_overhead"],
                     "ops": t["calls"]["ops"], "parts": t["parts"]})
        print(f"seq {seq} {variant}: measured {m:.3f} s, predicted {t['seconds']:.3f} s ({t['seconds'] / m:.2f}x), "
              f"{t['calls']['ops']} ops; { {k: round(v, 3) for k, v in t['parts'].items()} }", flush=True)
    # pairs: each variant against the first at the same length; the first variant at each length against
    # the first length
    by = {(r["seq"], r["variant"]): r for r in rows}
    pairs = [((seq, v), (seq, a.variants[0])) for seq in a.seqs for v in a.variants[1:]]
    pairs += [((seq, a.variants[0]), (a.seqs[0], a.variants[0])) for seq in a.seqs[1:]]
    ratios = []
    for num, den in pairs:
        n, d = by[num], by[den]
        mr, pr = n["measured_s"] / d["measured_s"], n["predicted_s"] / d["predicted_s"]
        pr0 = n["predicted_without_host_s"] / d["predicted_without_host_s"]
        ratios.append({"pair": f"{num[0]} {num[1]} / {den[0]} {den[1]}", "measured": mr, "predicted": pr,
                       "error": pr / mr - 1, "predicted_without_host": pr0, "error_without_host": pr0 / mr - 1})
        print(f"ratio {ratios[-1]['pair']}: measured {mr:.3f}, predicted {pr:.3f} ({100 * (pr / mr - 1):+.1f}%; "
              f"without the host term {pr0:.3f}, {100 * (pr0 / mr - 1):+.1f}%)")
    out = {"machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
                      f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, torch threads {torch.get_num_threads()}",
           "date": time.strftime("%Y-%m-%d"), "command": "python bench/planner_time.py " + " ".join(sys.argv[1:]),
           "load_average": os.getloadavg(),
           "rates": {"gemm_tflops": rates.gemm_tflops, "hbm_gbps": rates.hbm_gbps,
                     "attention_tflops_d64": rates.attention_tflops[64], "op_overhead_us": rates.op_overhead_us,
                     "op_overhead_calibration": calib},
           "rows": rows, "ratios": ratios}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
