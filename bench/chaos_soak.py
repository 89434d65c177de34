"""The long chaos soak (issue 52): one run of the CPU demo hit by many faults at random steps, each restart the same
command line with --resume auto, checked against the uninterrupted run (tests/soak_utils.py: the faults, the checks).

    python bench/chaos_soak.py --steps 200 --faults 30 --seed 1 --json bench/results/chaos_soak.json
    python bench/chaos_soak.py --launcher mpirun --steps 60 --faults 8

The faults are drawn with ``--seed`` from soak_utils.FAULTS (kill -9 of a rank, SIGUSR1 / SIGTERM to the
``ds-longctx launch`` group, kill -9 of the wrapper, a full disk during a save, a frozen rank ended by the watchdog, a
byte flipped in the newest tag between two starts), each after a random 1-6 steps past the run's resume point (a full
disk: the first save from there); the save directory is on a tmpfs (root: the full-disk fault fills it; without root
that fault is skipped and said). Prints and writes the figure: faults injected by kind, starts, wall time, steps
trained in all (re-trained after a fallback included), and whether every logged loss and the final --save-hf weights
are bit-equal to the uninterrupted run's.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import random
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)

from soak_utils import FAULTS, Soak, reference_run, tmpfs  # noqa: E402


def plan_of(n: int, seed: int, kinds) -> list:
    """``n`` faults drawn from ``kinds`` (each kind at least once when n allows), each after 1-6 steps."""
    rng = random.Random(seed)
    faults = list(kinds)[:n] + [rng.choice(kinds) for _ in range(max(0, n - len(kinds)))]
    rng.shuffle(faults)
    return [(f, 0 if f == "corrupt" else rng.randint(1, 6)) for f in faults]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--faults", type=int, default=30)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--launcher", choices=("deepspeed", "mpirun"), default="deepspeed")
    p.add_argument("--kinds", default=",".join(FAULTS), help="fault kinds to draw from (default: all)")
    p.add_argument("--dir", default="/tmp/ds_longctx_chaos_soak", help="work directory (emptied first)")
    p.add_argument("--json", help="write the figure here")
    a = p.parse_args(argv)
    kinds = [k for k in a.kinds.split(",") if k]
    unknown = set(kinds) - set(FAULTS)
    if unknown:
        p.error(f"--kinds: unknown {sorted(unknown)} (known: {', '.join(FAULTS)})")
    plan = plan_of(a.faults, a.seed, kinds)
    need = sum(max(after, 1) for _, after in plan) + 2
    if need > a.steps:
        p.error(f"--steps {a.steps} leaves no room for {a.faults} faults (about {need} steps needed)")
    shutil.rmtree(a.dir, ignore_errors=True)
    os.makedirs(a.dir)
    t0 = time.monotonic()
    with tmpfs(os.path.join(a.dir, "tmpfs"), "32m") as mnt:
        ref_metrics, ref_hf = reference_run(os.path.join(a.dir, "ref"), a.steps, a.launcher)
        ref_s = time.monotonic() - t0
        soak = Soak(os.path.join(a.dir, "soak"), a.steps, a.launcher, save=os.path.join(mnt, "ck") if mnt else None,
                    can_fill=mnt is not None)
        t1 = time.monotonic()
        soak.run(plan, timeout=900)
        res = soak.final(ref_metrics, ref_hf)
        soak_s = time.monotonic() - t1
    # steps trained in all: each start from the tag it resumed to the last step it logged (a fallback re-trains)
    trained = sum(max(0, (s["steps"][1] or 0) - (s["resumed_at"] or 0)) for s in res["per_start"])
    figure = {
        "command": "python bench/chaos_soak.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{platform.node()} ({os.cpu_count()} CPUs)", "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                        time.gmtime()),
        "launcher": a.launcher, "steps": a.steps, "seed": a.seed, "plan": plan,
        "faults_injected": len(res["faults"]), "by_kind": dict(collections.Counter(res["faults"])),
        "skipped": res["skipped"], "starts": res["starts"], "steps_trained_in_all": trained,
        "losses_and_final_weights_bit_equal": not res["problems"] and res["weights_bit_equal"] is True,
        "weights_bit_equal": res["weights_bit_equal"], "problems": res["problems"],
        "soak_s": round(soak_s, 1), "reference_s": round(ref_s, 1), "per_start": res["per_start"],
    }
    print(json.dumps({k: v for k, v in figure.items() if k != "per_start"}, indent=1))
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(figure, f, indent=1)
    return 0 if figure["losses_and_final_weights_bit_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
