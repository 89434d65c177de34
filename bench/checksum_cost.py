"""What content-verified checkpoints cost per GB (issue 52; job/checkpoint/manifest.py), one process on this machine.

    python bench/checksum_cost.py --gb 1 --dir /the/checkpoint/filesystem --json bench/results/checksum_cost.json

Measured on a file of ``--gb`` GiB written by torch.save (a tensor of random floats, as an optimizer-states file):
* the hashes alone, in memory (XXH3-64, the one used; zlib's CRC-32 and SHA-256 for comparison), GB/s;
* a save: torch.save, then the durability pass as it was (open + fsync) and as it is now (read back from the page cache
  + XXH3 + fsync in one open: ``manifest.digest_file(fsync=True)``): the added seconds per GB;
* a resume: the verification (``manifest.digest_file``) with the file in the page cache (a resume right after a save)
  and cold (its pages dropped with posix_fadvise(DONTNEED): the drive's read speed), next to torch.load of the same
  file, seconds per GB.
Each figure is the best of ``--repeat`` runs. The drive's numbers are this machine's (a shared cloud disk here), not a
parallel filesystem's.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import time
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from ds_longctx.job.checkpoint import manifest  # noqa: E402


def best(fn, repeat):
    out = None
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        dt = time.perf_counter() - t
        out = dt if out is None else min(out, dt)
    return out


def drop_cache(path):
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=1.0)
    p.add_argument("--dir", default="/tmp")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json")
    a = p.parse_args(argv)
    import torch
    import xxhash

    n = int(a.gb * (1 << 30))
    gib = n / (1 << 30)
    data = os.urandom(256 << 20)
    mem = {}
    for name, fn in (("xxh3_64", lambda: xxhash.xxh3_64(data).digest()), ("crc32", lambda: zlib.crc32(data)),
                     ("sha256", lambda: hashlib.sha256(data).digest())):
        mem[name] = round(len(data) / best(fn, a.repeat) / 1e9, 2)
    path = os.path.join(a.dir, "ds_longctx_checksum_cost.pt")
    t = torch.empty(n // 4, dtype=torch.float32).uniform_()
    try:
        save_s = best(lambda: torch.save({"exp_avg": t}, path), a.repeat)
        size = os.path.getsize(path)

        def fsync_only():
            with open(path, "rb") as f:
                os.fsync(f.fileno())

        fsync_s = best(fsync_only, a.repeat)
        digest_fsync_s = best(lambda: manifest.digest_file(path, fsync=True), a.repeat)
        warm_s = best(lambda: manifest.digest_file(path), a.repeat)

        def cold():
            drop_cache(path)
            t0 = time.perf_counter()
            manifest.digest_file(path)
            return time.perf_counter() - t0

        cold_s = min(cold() for _ in range(a.repeat))

        def load_cold():
            drop_cache(path)
            t0 = time.perf_counter()
            torch.load(path, weights_only=True)
            return time.perf_counter() - t0

        load_warm_s = best(lambda: torch.load(path, weights_only=True), a.repeat)
        load_cold_s = min(load_cold() for _ in range(a.repeat))
    finally:
        try:
            os.remove(path)
        except OSError:
            pass
    per_gb = lambda s: round(s / gib, 3)  # noqa: E731
    fig = {
        "command": "python bench/checksum_cost.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{platform.node()}, {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "file_bytes": size,
        "load_average_1_5_15": [round(x, 1) for x in os.getloadavg()],
        "hash_in_memory_GBps": mem,
        "save_s_per_GiB": {"torch.save": per_gb(save_s), "fsync pass before": per_gb(fsync_s),
                           "read back + xxh3 + fsync now": per_gb(digest_fsync_s),
                           "added": per_gb(max(0.0, digest_fsync_s - fsync_s))},
        "resume_s_per_GiB": {"verify, page cache": per_gb(warm_s), "verify, cold": per_gb(cold_s),
                             "torch.load, page cache": per_gb(load_warm_s), "torch.load, cold": per_gb(load_cold_s)},
    }
    print(json.dumps(fig, indent=1))
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(fig, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
