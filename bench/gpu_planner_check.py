"""Planner vs torch.cuda.max_memory_allocated on one CUDA GPU.

Runs a small Llama (bf16, ZeRO-3, world 1) through ds_longctx.initialize for each switch of the
memory stack, two training steps each, and compares the second step's peak with the planner's
prediction for the same config (simulated on the meta stand-in device, as ``ds-longctx plan`` does).
Prints one JSON object. Each case is isolated: an error is recorded, not raised.

    python bench/gpu_planner_check.py [--seq 32768] [--out result.json]

The planner runs first, in a child process (its fake process group needs a process to itself).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODEL = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 8,
         "num_key_value_heads": 4, "head_dim": 128, "num_hidden_layers": 4, "vocab_size": 32000,
         "max_position_embeddings": 1 << 20, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
         "rope_theta": 500000.0}

CASES = {
    "plain": {"attention": {"implementation": "none"}},
    "ckpt": {"attention": {"implementation": "none"}, "activation_checkpointing": {"enabled": True}},
    "ckpt_offload": {"attention": {"implementation": "none"},
                     "activation_checkpointing": {"enabled": True, "offload": "cpu"}},
    "tiled": {"attention": {"implementation": "none"}, "activation_checkpointing": {"enabled": True, "offload": "cpu"},
              "tiled_mlp": {"enabled": True}, "tiled_loss": {"enabled": True}},
    "untied": {"attention": {"implementation": "untied_ulysses", "heads_per_chunk": 1},
               "activation_checkpointing": {"enabled": True, "offload": "cpu"},
               "tiled_mlp": {"enabled": True}, "tiled_loss": {"enabled": True}},
}


def ds_config(lc: dict) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3}, "sequence_parallel_size": 1, "steps_per_print": 10**9,
            "zero_allow_untested_optimizer": True, "long_context": copy.deepcopy(lc)}


def predict(seq: int) -> dict:
    from ds_longctx.planner import Planner, load_model_config

    mc = load_model_config(dict(MODEL))
    out, params = {}, None
    for name, lc in CASES.items():
        t = time.perf_counter()
        try:
            p = Planner(ds_config(lc), mc, 1, "1TiB", params=params, full_depth=True)
            params = p.params
            r = p.run(seq)
            out[name] = {"peak_device_bytes": r.peak_device_bytes, "breakdown": r.breakdown,
                         "activation_bytes": sum(v for k, v in r.breakdown.items() if k != "model_states"),
                         "host_bytes": r.host_bytes, "seconds": round(time.perf_counter() - t, 2)}
        except Exception as e:  # noqa: BLE001 - recorded per case
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    return out


def measure(seq: int, names=None) -> dict:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29531 + (abs(hash(str(names))) % 1000)))
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    import torch
    import deepspeed
    from transformers import AutoConfig, AutoModelForCausalLM

    import ds_longctx

    deepspeed.init_distributed(dist_backend="nccl", auto_mpi_discovery=False)
    d = dict(MODEL)
    mc = AutoConfig.for_model(d.pop("model_type"), **d)
    out = {}
    for name, lc in CASES.items():
        if names is not None and name not in names:
            continue
        try:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(mc, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
            engine, _, _, _ = ds_longctx.initialize(model=model, optimizer=opt, config=ds_config(lc))
            ids = torch.randint(0, mc.vocab_size, (1, seq), device="cuda")
            batch = {"input_ids": ids, "position_ids": torch.arange(seq, device="cuda")[None],
                     "shift_labels": torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)}
            peaks = []
            for _ in range(2):  # the first step allocates optimizer state and buckets lazily
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                t = time.perf_counter()
                loss = engine(**batch).loss
                engine.backward(loss)
                engine.step()
                torch.cuda.synchronize()
                # reserved = allocated + the caching allocator's slack/fragmentation, which the planner's
                # --reserve has to cover
                peaks.append({"max_allocated": torch.cuda.max_memory_allocated(), "allocated_before": base,
                              "max_reserved": torch.cuda.max_memory_reserved(),
                              "seconds": round(time.perf_counter() - t, 3)})
            out[name] = {"steps": peaks, "loss": float(loss.detach())}
            engine.destroy() if hasattr(engine, "destroy") else None
            del engine, model, opt, loss
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--out", default=None)
    ap.add_argument("--predict-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--measure-case", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--one-process", action="store_true",
                    help="measure every case in this process (faster; an engine's leftovers then raise the "
                    "next cases' baselines, so only activation ratios compare)")
    a = ap.parse_args()
    if a.predict_only:
        print("@@" + json.dumps(predict(a.seq)))
        return
    if a.measure_case:
        print("@@" + json.dumps(measure(a.seq, [a.measure_case])))
        return
    t0 = time.perf_counter()
    child = subprocess.run([sys.executable, os.path.abspath(__file__), "--predict-only", "--seq", str(a.seq)],
                           capture_output=True, text=True, timeout=600)
    line = [ln for ln in child.stdout.splitlines() if ln.startswith("@@")]
    planned = json.loads(line[-1][2:]) if line else {"error": child.stderr[-2000:]}
    t_plan = time.perf_counter() - t0
    if a.one_process:
        measured = measure(a.seq)
    else:
        # one process per case: DeepSpeed engines leave buffers behind, which would count in the next
        # case's totals
        measured = {}
        for name in CASES:
            try:
                r = subprocess.run([sys.executable, os.path.abspath(__file__), "--measure-case", name, "--seq",
                                    str(a.seq)], capture_output=True, text=True, timeout=300)
                got = [ln for ln in r.stdout.splitlines() if ln.startswith("@@")]
                measured.update(json.loads(got[-1][2:]) if got else {name: {"error": r.stderr[-1500:]}})
            except subprocess.TimeoutExpired:
                measured[name] = {"error": "timed out after 300 s"}
    import torch

    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "seq": a.seq, "model": MODEL,
              "planner_seconds": round(t_plan, 1), "cases": {}}
    for name in CASES:
        p, m = planned.get(name, {}), measured.get(name, {})
        row = {"planned": p, "measured": m}
        if "steps" in m and "peak_device_bytes" in p:
            s = m["steps"][-1]
            row["total_ratio"] = p["peak_device_bytes"] / s["max_allocated"]
            # activations: the step's peak above what was allocated before it (model states, buffers)
            row["activation_ratio"] = p["activation_bytes"] / max(1, s["max_allocated"] - s["allocated_before"])
            row["within_10pct_total"] = abs(row["total_ratio"] - 1) <= 0.10
        result["cases"][name] = row
    result["wall_seconds"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
