"""Issue 48 item 2: where the step time goes, the planner's step breakdown next to a measured step, and what would pay.

The planner's simulated step (planner/simulate.py) counts every op's FLOPs and bytes (measure/flops.py); planner/
rates.py turns them into seconds on a target. This script runs the same simulation, keeps each op's work apart by the
module running it (attention / mlp / loss / other: the simulation's categories), converts each part with the same
rates and roofline, adds what the simulation does not run (the optimizer step, ZeRO-3's gradient copies at world 1,
by arithmetic), and prints it next to a measured step time. Then each candidate change is predicted by re-running
the planner on the changed config, or, where no config key makes the change (a fused kernel, a faster attention
kernel), by removing or rescaling the parts it would change. Every figure here is a prediction unless it names a
measurement.

    python bench/step_breakdown.py --json bench/results/step_breakdown_1b_128k_h200.json      # ~2 min, 2-core CPU

Default case: the H200 call of 2026-11-28 (bench/RESULTS.md "GPU"): Llama-3.2-1B shape, 131,072 tokens, one GPU,
(c)'s picks pinned (heads_per_chunk 32, keep_on_device 16, keep_attention_output 16, tiled MLP 1 shard, tiled loss
2), torch AdamW, measured 12.48 s per step (steps 2-3), MFU 33.6%.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SHIPPED = os.path.join(ROOT, "ds_configs", "llama3.2-1b-1gpu.json")
MODEL = os.path.join(ROOT, "ds_configs", "models", "llama3.2-1b.json")
# (c)'s resolved picks in the H200 call (bench/results/alst_compare_h200.json part1; planner_vs_c_h200.txt)
PICKS_H200 = {"heads_per_chunk": 32, "keep_on_device": 16, "keep_attention_output": 16, "mlp_shards": 1,
              "loss_shards": 2}
MEASURED = {"step_s": 12.48, "mfu": 0.336, "tokens_per_s": 10499, "what": "H200, (c) steps 2-3, 2026-11-28 "
            "(bench/results/alst_compare_h200.json part1)", "max_memory_allocated": 141.33e9}


def config(picks=PICKS_H200, seq=131072, **changes) -> dict:
    c = json.load(open(SHIPPED))
    lc = c["long_context"]
    lc["sequence_length"] = seq
    lc["attention"]["heads_per_chunk"] = picks["heads_per_chunk"]
    ac = lc["activation_checkpointing"]
    ac["keep_on_device"] = picks["keep_on_device"]
    ac["keep_attention_output"] = picks["keep_attention_output"]
    lc["tiled_mlp"]["shards"] = picks["mlp_shards"]
    lc["tiled_loss"]["shards"] = picks["loss_shards"]
    for path, value in changes.items():
        d = lc
        keys = path.split(".")
        for k in keys[:-1]:
            d = d.setdefault(k, {})
        d[keys[-1]] = value
    return c


def by_category(model_config, ds_config, seq, world=1):
    """The simulated step's work keyed (category, kind, phase, key) (the Accountant's own (kind, phase, key) split by
    the module that ran each op), and the planner's StepMemory."""
    from ds_longctx.config import parse
    from ds_longctx.planner import host as host_plan
    from ds_longctx.planner import simulate as sim

    split = {}

    class Split(sim.Accountant):
        def _count(self, func, args, kwargs, out):
            before = {k: list(v) for k, v in self.work.items()}
            super()._count(func, args, kwargs, out)
            cat = self.category()
            for k, v in self.work.items():
                old = before.get(k, [0.0, 0.0, 0.0])
                d = [a - b for a, b in zip(v, old)]
                if any(d):
                    slot = split.setdefault((cat,) + k, [0.0, 0.0, 0.0])
                    for i in range(3):
                        slot[i] += d[i]

    orig = sim.Accountant
    sim.Accountant = Split
    try:
        with sim.no_memo():
            lc = host_plan.simulation_lc(parse(ds_config))
            L = model_config.num_hidden_layers
            r = sim.simulate_step(model_config, ds_config, lc, world, seq, L)
    finally:
        sim.Accountant = orig
    return split, r


def seconds(split, rates):
    """Each (category, kind, phase) part in seconds, as planner/rates.step_time converts the whole step."""
    hbm = rates.hbm_gbps * 1e9
    out = {}
    for (cat, kind, phase, key), (f, b, n) in split.items():
        if kind == "attention":
            s = f / (rates.attention_rate(int(key)) * 1e12)
            name = f"attention kernel {phase}"
        elif kind == "gemm":
            s = max(f / (rates.gemm_tflops * 1e12), b / hbm)
            name = f"GEMM {phase} ({cat})"
        elif kind == "other":
            s = b / hbm
            name = f"memory-bound ops ({cat})"
        else:
            s = b / (rates.a2a_intra_gbps * 1e9)
            name = "all-to-all"
        out[name] = out.get(name, 0.0) + s
    return out


def arithmetic_parts(params_total, rates, ds_config):
    """What the simulation does not run, by arithmetic on HBM bytes (a prediction): torch AdamW's step on the device
    (foreach: about 12 passes of fp32 over the parameters: grads, master, two states, read and written) and ZeRO-3's
    gradient handling at world 1 (each bf16 grad copied into the IPG bucket, the bucket's flat copy, the partition
    copy: ~4 passes of bf16)."""
    hbm = rates.hbm_gbps * 1e9
    zero = ds_config.get("zero_optimization") or {}
    on_device = (zero.get("offload_optimizer") or {}).get("device", "none") == "none"
    parts = {}
    if on_device:
        parts["optimizer step (torch AdamW on the device, ~12 fp32 passes)"] = params_total * 4 * 12 / hbm
    parts["ZeRO-3 gradient copies (world 1, ~4 bf16 passes)"] = params_total * 2 * 4 / hbm
    return parts


def planned(ds_config, mc, target, gpu_mem):
    from ds_longctx.planner.core import Planner

    return Planner(ds_config, mc, 1, gpu_mem, target=target).run(ds_config["long_context"]["sequence_length"])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=131072)
    ap.add_argument("--target", default="h200")
    ap.add_argument("--gpu-mem", default="139.8GiB", help="the device's usable memory (H200: 139.8 GiB)")
    ap.add_argument("--measured-step", type=float, default=MEASURED["step_s"])
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    from ds_longctx.models.loading import load_model_config
    from ds_longctx.planner.rates import target_rates

    t0 = time.time()
    rates = target_rates(a.target)
    mc = load_model_config(MODEL)
    base = config(seq=a.seq)
    plan = planned(base, mc, a.target, a.gpu_mem)
    split, step = by_category(mc, base, a.seq)
    parts = seconds(split, rates)
    from ds_longctx.planner.core import param_info

    P = param_info(mc).total
    extra = arithmetic_parts(P, rates, base)
    t = plan.time
    # the planner's step: compute (kernels, or host issue when longer) + overlapped transfers + serial ones
    model_flops = t["model_flops"]
    peak = rates.peak_tflops * 1e12
    rows = sorted(parts.items(), key=lambda kv: -kv[1]) + list(extra.items())
    total = sum(parts.values()) + sum(extra.values())
    report = {"bench": "step_breakdown", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
              "device": "2-core CPU box (the planner's simulation; every second here is predicted)",
              "target": a.target, "rates_sources": rates.sources, "seq": a.seq, "picks": PICKS_H200,
              "measured": dict(MEASURED, step_s=a.measured_step),
              "planner": {"step_s": t["seconds"], "mfu": t["mfu"], "parts": t["parts"],
                          "peak_device_bytes": plan.peak_device_bytes,
                          "reserved_device_bytes": plan.reserved_device_bytes, "allocator": plan.allocator,
                          "fits": plan.fits},
              "breakdown_s": {k: round(v, 4) for k, v in rows}, "breakdown_total_s": round(total, 3),
              "host_issue_s": t["parts"].get("host_overhead", 0.0),
              "model_tflop": model_flops / 1e12}
    report["unexplained_s"] = round(a.measured_step - total, 3)

    # candidate changes, each predicted; a config change re-runs the planner, a kernel change rescales parts
    def mfu(step_s):
        return model_flops / step_s / peak

    cands = []
    attn = sum(v for k, v in parts.items() if k.startswith("attention kernel"))
    loss_mem = parts.get("memory-bound ops (loss)", 0.0)
    loss_gemm = sum(v for k, v in parts.items() if k.startswith("GEMM") and "(loss)" in k)
    recompute = sum(v for k, v in parts.items() if "recompute" in k)
    ratio = a.measured_step / total  # measured over predicted: carried to each candidate (same unmodelled share)

    def add(name, saved, how, memory=None):
        step_pred = total - saved
        cands.append({"change": name, "predicted_saving_s": round(saved, 3), "predicted_step_s": round(step_pred, 3),
                      "predicted_mfu": round(mfu(step_pred), 4),
                      "predicted_measured_step_s": round(step_pred * ratio, 3),
                      "predicted_measured_mfu": round(mfu(step_pred * ratio), 4), "how": how,
                      **({"memory": memory} if memory else {})})

    add("attention kernel 10% faster at head_dim 64 (FA3-class; not in the lent image)", attn * (1 - 1 / 1.1),
        "attention kernel seconds / 1.1")
    add("attention kernel 25% faster at head_dim 64", attn * (1 - 1 / 1.25), "attention kernel seconds / 1.25")
    add("fused linear + cross-entropy for the loss (no fp32 [tokens, vocab] logits through HBM; Liger-style)",
        loss_mem * 0.8, "the loss's memory-bound seconds x 0.8 (its GEMMs stay)",
        memory="frees the loss's fp32 logit tiles (most of the breakdown's 'loss' bytes)")
    # config changes: the planner on the changed config
    alt = {}
    for name, changes, how in (
            ("tiled loss in 4 shards instead of 2", {"tiled_loss.shards": 4}, "planner on the changed config"),
            ("tiled loss in 1 shard", {"tiled_loss.shards": 1}, "planner on the changed config"),
            ("no activation checkpointing (no recompute; memory permitting)",
             {"activation_checkpointing.enabled": False, "activation_checkpointing.offload": "none",
              "activation_checkpointing.keep_on_device": 0, "activation_checkpointing.keep_attention_output": False},
             "planner on the changed config")):
        try:
            r = planned(config(seq=a.seq, **changes), mc, a.target, a.gpu_mem)
            alt[name] = r
            saved = t["seconds"] - r.time["seconds"]
            add(name, saved, how + f" (planner step {r.time['seconds']:.2f} s vs {t['seconds']:.2f} s)",
                memory=f"needs {r.allocator['need_bytes'] / 2**30:.1f} GiB (reserved {r.reserved_device_bytes / 2**30:.1f}"
                       f" GiB) of {(plan.device_budget_bytes - plan.reserve_bytes) / 2**30:.1f} GiB usable "
                       f"({'fits' if r.fits else 'does NOT fit'})")
        except Exception as e:  # a config the planner refuses: said so
            cands.append({"change": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
    add("CUDA graphs / fewer small ops (host issue time)", 0.0,
        f"host issue {report['host_issue_s']:.3f} s is already hidden under the kernels (async launch): no gain "
        "predicted")
    report["loss_memory_bound_s"] = round(loss_mem, 4)
    report["loss_gemm_s"] = round(loss_gemm, 4)
    report["recompute_s"] = round(recompute, 4)
    report["attention_kernel_s"] = round(attn, 4)
    report["candidates"] = cands
    report["mfu_ceiling_with_these_attention_rates"] = round(mfu(attn), 4)
    report["wall_s"] = round(time.time() - t0, 1)
    text = json.dumps(report, indent=1, default=str)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)
    print(f"{'part':<70} {'seconds':>8}")
    for k, v in rows:
        print(f"{k:<70} {v:8.3f}")
    print(f"{'total (predicted)':<70} {total:8.3f}   measured {a.measured_step:.2f} s, unexplained "
          f"{a.measured_step - total:.2f} s; planner's own step {t['seconds']:.2f} s")
    for c in cands:
        print(json.dumps(c))
    return report


if __name__ == "__main__":
    main()
