"""The cost of issue 30's start-up agreement and of the watchdog's heartbeat, on CPU gloo ranks.

    python bench/agreement_cost.py                 # worlds 2 and 4, the shipped llama3-8b-5m ds_config
    python bench/agreement_cost.py --worlds 2 --calls 100

Per world, in one spawn: ``agreement.check_agreement`` (fingerprint + SHA-256 of the whole ds_config, CLI values
and a data identity, one all-gather of 128 bytes per rank; the watchdog not started) alternated call by call with
a bare ``dist.all_gather`` of the same 128 bytes (A B A B), and the heartbeat's store operations (one beat: a set
and three adds on the job's TCPStore through the watchdog's helper thread). Medians and 90th percentiles of rank
0's wall times. Writes bench/results/agreement_cost.json (command, machine, date).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)

from dist_utils import run_distributed  # noqa: E402

CONFIG = os.path.join(ROOT, "ds_configs", "llama3-8b-5m.json")


def _stats(xs):
    xs = sorted(xs)
    return {"median_ms": round(1e3 * xs[len(xs) // 2], 3), "p90_ms": round(1e3 * xs[int(0.9 * (len(xs) - 1))], 3),
            "n": len(xs)}


def _measure(rank, world, calls):
    import torch
    import torch.distributed as dist

    from ds_longctx.job.agreement import _all_gather_rows, _digest, check_agreement, fingerprint
    from ds_longctx.config import load_ds_config
    from ds_longctx.job.watchdog import Watchdog

    cfg = load_ds_config(CONFIG)
    cfg["sequence_parallel_size"] = world  # the bench's world; what is hashed is the whole config either way
    values = {"cli": {"--seq-len": 5242880, "--steps": 1000, "--seed": 0, "--model": "meta-llama/Llama-3.1-8B",
                      "--model-config": None, "--tokenizer": None, "--concat-documents": False, "--resume": None},
              "data": {"path": "/data/train.jsonl", "kind": "jsonl", "size": 10 ** 12, "sha256": "ab" * 32}}
    row = bytes(128)
    for _ in range(3):  # warm-up: connections, allocations
        check_agreement(cfg, values, start_watchdog=False)
        _all_gather_rows(row)
    agree, bare, local = [], [], []
    for _ in range(calls):
        dist.barrier()
        t0 = time.perf_counter()
        check_agreement(cfg, values, start_watchdog=False)
        agree.append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        _all_gather_rows(row)
        bare.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        _digest(fingerprint(cfg, values))
        local.append(time.perf_counter() - t0)
    # one heartbeat: what the watchdog thread does every interval (no thread started here)
    from ds_longctx.job.agreement import roster

    dog = Watchdog(600, roster(), rank)
    dog._where_text = "bench"
    dog._beat((rank + 1) % world)  # connect
    beats = []
    for _ in range(calls):
        t0 = time.perf_counter()
        ok, _ = dog._beat((rank + 1) % world)
        beats.append(time.perf_counter() - t0)
        assert ok
    dist.barrier()
    return {"check_agreement": _stats(agree), "bare_all_gather_128B": _stats(bare),
            "fingerprint_and_digest_local": _stats(local), "heartbeat_store_ops": _stats(beats),
            "config_keys": len(fingerprint(cfg, values)), "torch": torch.__version__}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "agreement_cost.json"))
    args = ap.parse_args(argv)
    out = {}
    for w in [int(x) for x in args.worlds.split(",")]:
        out[str(w)] = run_distributed(_measure, w, args.calls, timeout=600)[0]
        print(f"world {w}: {json.dumps(out[str(w)])}", flush=True)
    record = {"command": "python " + " ".join([os.path.relpath(__file__, ROOT)] + (argv or sys.argv[1:])),
              "machine": f"{platform.node()}: {os.cpu_count()} CPUs, {platform.platform()}, CPU only (gloo), shared "
                         "by 5 agents",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "config": os.path.relpath(CONFIG, ROOT), "worlds": out}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
