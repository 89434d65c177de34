"""Issue 48 item 1: the Llama-3-8B layer's step (2 layers, ds_configs/llama3-8b-1gpu-512k.json with torch AdamW, the
shape the H100/H200 calls measured: bench/RESULTS.md "GPU") replayed through the caching-allocator model, on CPU.

The planner simulates the step on fake tensors (planner/simulate.py), records every device allocation and free in
order, and replays them through measure/allocator.py in both allocator modes: the predicted max_memory_allocated,
max_memory_reserved, the floor no out-of-memory retry can release, and the requests that stranded memory (mapped new
memory while the pool held free blocks too small for them), by "category/op". Next to the measured figures where a
GPU call measured them.

    python bench/reserved_replay.py --json bench/results/reserved_replay_cpu.json          # ~3 min, 2-core CPU
    python bench/reserved_replay.py --gpu OUT/issue32.json    # a device call's part 4 (profile.allocator_check):
                                                              # the real per-stream reserved and the frames that
                                                              # stranded memory, next to this replay
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CFG_8B = os.path.join(ROOT, "ds_configs", "llama3-8b-1gpu-512k.json")
MODEL_8B = os.path.join(ROOT, "ds_configs", "models", "llama3-8b.json")
# measured: (max_memory_allocated, max_memory_reserved, machine/date) of train.py's one step, expandable segments
MEASURED = {131072: (12787572736, 31450988544, "H100 2026-11-27 (alst_compare_h100.json part 4)"),
            262144: (17153318912, 48284827648, "H200 2026-11-28 (alst_compare_h200.json part 4)")}


def part4_config(seq: int) -> dict:
    """What bench/alst_compare.py part 4 trains: the shipped 8B config with torch's AdamW, at ``seq``."""
    c = json.load(open(CFG_8B))
    c["long_context"]["sequence_length"] = seq
    c["optimizer"]["params"]["torch_adam"] = True
    return c


def model(depth: int):
    from ds_longctx.models.loading import load_model_config

    m = json.load(open(MODEL_8B))
    m["num_hidden_layers"] = depth
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"reserved_replay_8b_{depth}.json")
    with open(path, "w") as f:
        json.dump(m, f)
    return load_model_config(path)


def replay_case(seq: int, depth: int, all_tiles: bool = False) -> dict:
    from ds_longctx.planner import simulate as sim
    from ds_longctx.planner.core import Planner

    out = {"seq": seq, "depth": depth, "all_tiles": all_tiles}
    t0 = time.time()
    ctx = contextlib.nullcontext()
    if all_tiles:  # every tile of every tiled loop, not the first standing for all (memory/tiles.representative)
        ctx = _every_tile(sim)
    with ctx, sim.no_memo() if all_tiles else contextlib.nullcontext():
        for mode in ("expandable", "classic"):
            r = Planner(part4_config(seq), model(depth), 1, "h100", allocator=mode).run(seq)
            al = r.allocator
            out[mode] = {"peak_device_bytes": r.peak_device_bytes, "reserved_device_bytes": r.reserved_device_bytes,
                         "ratio": round(r.reserved_device_bytes / r.peak_device_bytes, 4),
                         "floor_bytes": al["floor_bytes"], "activation_peak_bytes": r.activation_peak_bytes,
                         "activation_slack_bytes": al["activation_slack_bytes"],
                         "activation_ratio": round((r.activation_peak_bytes - r.breakdown["model_states"]
                                                    + al["activation_slack_bytes"]) /
                                                   max(1, r.activation_peak_bytes - r.breakdown["model_states"]), 4),
                         "model_states_bytes": r.breakdown["model_states"], "stranded": al["stranded"]}
    out["wall_s"] = round(time.time() - t0, 1)
    m = MEASURED.get(seq)
    if m and depth == 2:
        out["measured"] = {"max_memory_allocated": m[0], "max_memory_reserved": m[1], "ratio": round(m[1] / m[0], 4),
                           "where": m[2]}
        e = out["expandable"]
        out["predicted_over_measured"] = {"allocated": round(e["peak_device_bytes"] / m[0], 4),
                                          "reserved": round(e["reserved_device_bytes"] / m[1], 4)}
    return out


@contextlib.contextmanager
def _every_tile(sim):
    orig = sim.representative
    sim.representative = contextlib.nullcontext
    try:
        yield
    finally:
        sim.representative = orig


def from_gpu(path: str) -> dict:
    """The allocator_model records of a device call's part 4 (train.py metrics with profile.allocator_check)."""
    d = json.load(open(path))
    rows = []
    for run in (d.get("part4") or {}).get("runs", []):
        for s in run.get("steps", []):
            am = s.get("allocator_model")
            if not am:
                continue
            ex = am.get("explain", {})
            rows.append({"variant": run.get("variant"), "step": s.get("step"),
                         "max_memory_allocated": am.get("measured_peak_allocated"),
                         "max_memory_reserved": am.get("measured_peak_reserved"),
                         "model_reserved": am.get("peak_reserved"), "model_floor": ex.get("floor"),
                         "reserved_by_stream_start": am.get("real_reserved_by_stream_start"),
                         "reserved_by_stream_end": am.get("real_reserved_by_stream_end"),
                         "stranded_by_frame": ex.get("stranded_by_label")})
    return {"source": path, "steps": rows}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, nargs="+", default=[131072, 262144, 524288])
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--all-tiles", action="store_true", help="also replay 256K with every tile run (slow)")
    ap.add_argument("--gpu", default=None, help="a device call's issue32.json: summarize its allocator records")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.gpu:
        res = from_gpu(a.gpu)
        print(json.dumps(res, indent=1))
        return res
    report = {"bench": "reserved_replay", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
              "device": f"2-core CPU box (the planner's fake-tensor step; {os.cpu_count()} cores visible)",
              "config": "ds_configs/llama3-8b-1gpu-512k.json + torch_adam, ds_configs/models/llama3-8b.json at "
                        f"{a.depth} layers (bench/alst_compare.py part 4)", "cases": []}
    for seq in a.seq:
        c = replay_case(seq, a.depth)
        report["cases"].append(c)
        e, k = c["expandable"], c["classic"]
        print(f"{seq:>8} expandable: allocated {e['peak_device_bytes'] / 1e9:.2f} GB reserved "
              f"{e['reserved_device_bytes'] / 1e9:.2f} GB ({e['ratio']:.3f}x; activations {e['activation_ratio']:.3f}x)"
              f" floor {e['floor_bytes'] / 1e9:.2f} | classic: reserved {k['reserved_device_bytes'] / 1e9:.2f} GB "
              f"({k['ratio']:.3f}x; activations {k['activation_ratio']:.3f}x)"
              + (f" | measured {c['measured']['max_memory_allocated'] / 1e9:.2f} / "
                 f"{c['measured']['max_memory_reserved'] / 1e9:.2f} GB ({c['measured']['ratio']:.2f}x)"
                 if "measured" in c else ""), flush=True)
    if a.all_tiles:
        c = replay_case(262144, a.depth, all_tiles=True)
        report["all_tiles_262144"] = c
        print("every tile, 262144:", json.dumps({m: c[m]["ratio"] for m in ("expandable", "classic")}), flush=True)
    text = json.dumps(report, indent=1)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)
    return report


if __name__ == "__main__":
    main()
