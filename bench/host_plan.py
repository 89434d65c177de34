#!/usr/bin/env python
"""Per-node host and NVMe bytes of the shipped Llama-3-8B configs for each offload target (planner).

For each config: one planned step as configured (simulated), and the planner's per-target figures
(host arena, NVMe, with the last k inputs kept on the device). Add ``--keep K`` to plan a config
again with ``keep_on_device=K`` simulated (not estimated).

    python bench/host_plan.py [--configs 3m 5m 8m-nvme] [--host-mem 2TiB] [--keep 5m=2] [--json out.json]
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


def main():
    from ds_longctx.config import load_ds_config
    from ds_longctx.planner import Planner, load_model_config
    from ds_longctx.planner.units import fmt_bytes

    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="+", default=["3m", "5m", "8m-nvme"])
    ap.add_argument("--host-mem", default="2TiB")
    ap.add_argument("--keep", nargs="*", default=[], help="NAME=K: also plan NAME with keep_on_device=K")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    targets = json.load(open(os.path.join(ROOT, "ds_configs", "targets.json")))
    mc = load_model_config(os.path.join(ROOT, "ds_configs", "models", "llama3-8b.json"))
    runs = [(name, None) for name in a.configs] + [(kv.split("=")[0], int(kv.split("=")[1])) for kv in a.keep]
    out, params = [], None
    for name, keep in runs:
        fname = f"llama3-8b-{name}.json"
        t = targets[fname]
        ds = copy.deepcopy(load_ds_config(os.path.join(ROOT, "ds_configs", fname)))
        if keep is not None:
            ds["long_context"]["activation_checkpointing"]["keep_on_device"] = keep
        t0 = time.perf_counter()
        p = Planner(ds, mc, t["gpus"], t["gpu_mem"], a.host_mem, t["reserve"], params=params)
        params = p.params
        r = p.run(ds["long_context"]["sequence_length"])
        row = {"config": fname, "keep_on_device": ds["long_context"]["activation_checkpointing"].get("keep_on_device", 0),
               "gpus": t["gpus"], "gpu_mem": t["gpu_mem"], "fits": r.fits, "peak_device_bytes": r.peak_device_bytes,
               "host_bytes_per_node": r.host_bytes_per_node, "nvme_bytes_per_node": r.nvme_bytes_per_node,
               "host": r.host, "offload": r.offload, "notes": r.notes, "seconds": round(time.perf_counter() - t0, 1)}
        out.append(row)
        print(f"== {fname} keep_on_device={row['keep_on_device']} ({t['gpus']} x {t['gpu_mem']}): fits={r.fits} "
              f"peak/GPU {fmt_bytes(r.peak_device_bytes)}, host/node {fmt_bytes(r.host_bytes_per_node)} "
              f"({r.host_bytes_per_node / 2**40:.3f} TiB), NVMe/node {fmt_bytes(r.nvme_bytes_per_node)}")
        for o in r.offload.get("options", []):
            print(f"   {o['target']:<5} keep {o['keep_on_device']:<2} host/node {o['host_bytes_per_node'] / 2**40:.3f} TiB"
                  f"  NVMe/node {o['nvme_bytes_per_node'] / 2**40:.3f} TiB  peak/GPU {fmt_bytes(o['peak_device_bytes'])}"
                  f"  {'fits' if o['fits'] else 'no'}")
        sys.stdout.flush()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": "python bench/host_plan.py " + " ".join(sys.argv[1:]), "machine": platform.node(),
                       "date": time.strftime("%Y-%m-%d"), "host_mem": a.host_mem, "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
