#!/usr/bin/env python
"""Planner figures for every shipped GPU config at its stated hardware (ds_configs/targets.json): the
peak per GPU (max of backward and optimizer step), the activation peak, and host/NVMe bytes per node.
README's "Shipped configs" table is this script's output.

    python bench/shipped_configs.py [--json bench/results/shipped_configs.json] [--configs a.json,b.json]
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


def main():
    from ds_longctx.planner import Planner, load_model_config
    from ds_longctx.planner.units import fmt_bytes

    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--configs", default=None, help="comma-separated names from targets.json (default: all)")
    a = ap.parse_args()
    targets = {k: v for k, v in json.load(open(os.path.join(ROOT, "ds_configs", "targets.json"))).items()
               if k != "_comment"}
    if a.configs:
        wanted = a.configs.split(",")
        unknown = sorted(set(wanted) - set(targets))
        if unknown:
            ap.error(f"--configs: {unknown} not in ds_configs/targets.json (it has {sorted(targets)})")
        targets = {k: targets[k] for k in wanted}
    rows = []
    print("| config | hardware | peak / GPU | activations | host / node | NVMe / node | planner s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, t in sorted(targets.items()):
        t0 = time.time()
        mc = load_model_config(os.path.join(ROOT, "ds_configs", t["model_config"]))
        p = Planner(os.path.join(ROOT, "ds_configs", name), mc, t["gpus"], gpu_mem=t["gpu_mem"],
                    host_mem=t["host_mem"], reserve=t["reserve"])
        r = p.run(p.lc.sequence_length)
        secs = time.time() - t0
        rows.append({"config": name, "target": t, "seconds": round(secs, 1), **r.to_dict()})
        act = r.activation_peak_bytes - r.breakdown["model_states"]
        print(f"| `{name}` | {t['gpus']} x {t['gpu_mem']} | {fmt_bytes(r.peak_device_bytes)} | {fmt_bytes(act)} | "
              f"{fmt_bytes(r.host_bytes_per_node)} | {fmt_bytes(r.nvme_bytes_per_node)} | {secs:.0f} |"
              + ("" if r.fits else " DOES NOT FIT"), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": f"{platform.node()} {os.cpu_count()} cores", "date": time.strftime("%Y-%m-%d"),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
