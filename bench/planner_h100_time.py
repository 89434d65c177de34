#!/usr/bin/env python
"""Predicted step time and MFU of the shipped 8 x H100 configs (planner/rates.py's h100 target), at their own
length and at 1M tokens, next to public anchors (issue 20's "Measure"):

- TRL's Qwen3-8B at 1M tokens on 8 x H100: 364-380 s/step (trl PR #6845 / #6846);
- transformers PR #48324: MFU 34.7% at 1M tokens with cuDNN attention.

Rows: each 8-GPU config of ds_configs/targets.json at its sequence_length; the 1M config (shipped with
keep_attention_output true) with it false; and the 1M config on Qwen3-8B's public shape (the anchor's model),
with and without keep_attention_output. A
prediction, not a measurement: rates as planner/rates.py states them (GEMM, attention, HBM, PCIe measured
on a lent H100; NVLink all-to-all and per-op/collective fixed costs are stated figures).

    python bench/planner_h100_time.py [--json bench/results/planner_h100_time.json]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# Qwen3-8B's public config.json (Qwen/Qwen3-8B): the model of TRL's 1M anchor
QWEN3_8B = {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
            "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False}


def main():
    from ds_longctx.planner import Planner, load_model_config

    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--configs", nargs="*", default=None, help="only these ds_configs/ names")
    a = ap.parse_args()
    targets = json.load(open(os.path.join(ROOT, "ds_configs", "targets.json")))
    llama = os.path.join(ROOT, "ds_configs", "models", "llama3-8b.json")
    runs = []
    for name, t in sorted(targets.items()):
        if name == "_comment" or t["gpus"] != 8 or t["gpu_mem"] != "h100":
            continue
        cfg = json.load(open(os.path.join(ROOT, "ds_configs", name)))
        runs.append((name, "Llama-3-8B", load_model_config(os.path.join(ROOT, "ds_configs", t["model_config"])),
                     cfg, t))
    t1m = targets["llama3-8b-1m.json"]
    base = json.load(open(os.path.join(ROOT, "ds_configs", "llama3-8b-1m.json")))
    recompute = copy.deepcopy(base)  # as shipped it keeps the attention output; the recompute for comparison
    recompute["long_context"]["activation_checkpointing"]["keep_attention_output"] = False
    runs.append(("llama3-8b-1m.json, keep_attention_output false", "Llama-3-8B", load_model_config(llama), recompute,
                 t1m))
    runs.append(("llama3-8b-1m.json on Qwen3-8B", "Qwen3-8B", load_model_config(dict(QWEN3_8B)), copy.deepcopy(base),
                 t1m))
    runs.append(("llama3-8b-1m.json on Qwen3-8B, keep_attention_output false", "Qwen3-8B",
                 load_model_config(dict(QWEN3_8B)), copy.deepcopy(recompute), t1m))
    if a.configs:
        runs = [r for r in runs if any(r[0].startswith(c) for c in a.configs)]
    rows = []
    print("| config | model | tokens | predicted s/step | MFU | tokens/s/GPU | fits | parts (s) | planner s |")
    print("|---|---|---:|---:|---:|---:|---|---|---:|")
    for name, model, mc, cfg, t in runs:
        t0 = time.time()
        p = Planner(cfg, mc, t["gpus"], gpu_mem=t["gpu_mem"], host_mem=t["host_mem"], reserve=t["reserve"],
                    target="h100")
        seq = p.lc.sequence_length
        r = p.run(seq)
        tm = r.time
        secs = time.time() - t0
        top = sorted(tm["parts"].items(), key=lambda kv: -kv[1])[:6]
        rows.append({"config": name, "model": model, "sequence_length": seq, "fits": r.fits, "planner_s": secs,
                     "peak_device_bytes": r.peak_device_bytes, "time": tm})
        print(f"| {name} | {model} | {seq:,} | {tm['seconds']:.1f} | {100 * tm['mfu']:.1f}% | "
              f"{tm['tokens_per_s']:.0f} | {'yes' if r.fits else 'NO'} | "
              + ", ".join(f"{k} {v:.1f}" for k, v in top) + f" | {secs:.0f} |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": f"{platform.machine()} {os.cpu_count()} cores (the planner's simulation; the "
                                  "times are predictions for 8 x H100)", "date": time.strftime("%Y-%m-%d %H:%M UTC"),
                       "command": "python bench/planner_h100_time.py " + " ".join(sys.argv[1:]),
                       "anchors": {"trl_qwen3_8b_1m_8xh100_s_per_step": [364, 380],
                                   "transformers_pr48324_mfu_1m_cudnn": 0.347},
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
