"""run_all.sh's bookkeeping after each step: the step's JSON gets the device, the date and the command at its top level
(and, per step that wrote into it, the step's name, exit code and seconds under "calls"); a step that wrote none gets one holding its log's tail, so
every step leaves a record. ``--merge-into``: the step's record goes under its name in a shared file (the device call
brings back 8 files at most). Pure Python, no torch (no device time spent importing it).

    python bench/device/stamp.py --file OUT/x.json --step NAME --command "..." --rc 0 --wall 12 [--log OUT/log.txt]
        [--skipped "why"] [--merge-into OUT/new_paths.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os


def _tail(path, marker, n=60):
    if not path or not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        lines = f.readlines()
    start = max((i for i, line in enumerate(lines) if marker in line), default=max(0, len(lines) - n))
    return "".join(lines[start:][-n:])


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--file", required=True)
    ap.add_argument("--step", required=True)
    ap.add_argument("--command", required=True)
    ap.add_argument("--rc", type=int, default=None)
    ap.add_argument("--wall", type=float, default=None)
    ap.add_argument("--budget-left", type=float, default=None)
    ap.add_argument("--log", default=None)
    ap.add_argument("--skipped", default=None, help="the step did not run: why")
    ap.add_argument("--merge-into", default=None)
    a = ap.parse_args(argv)
    rec = {}
    if os.path.exists(a.file):
        try:
            with open(a.file) as f:
                rec = json.load(f)
        except ValueError as e:
            rec = {"unreadable_json": f"{e}"}
    if not isinstance(rec, dict):
        rec = {"result": rec}
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    device = os.environ.get("RUN_ALL_DEVICE") or "unknown"
    rec.setdefault("device", device)
    rec.setdefault("date", now)
    rec.setdefault("command", a.command)
    call = {"step": a.step, "command": a.command, "rc": a.rc, "wall_s": a.wall, "budget_left_s": a.budget_left,
            "stamped": now, "device": device, "run_all": os.environ.get("RUN_ALL_COMMAND", "bash bench/device/run_all.sh")}
    if a.skipped:
        call["skipped"] = a.skipped
    # one entry per step that wrote into this file (two steps share issue48_mem8b.json)
    rec["calls"] = [c for c in rec.get("calls", []) if c.get("step") != a.step] + [call]
    if not a.skipped and a.rc not in (0, None) and "error" not in rec:
        rec["error"] = f"exit {a.rc}" + (" (124: the step's limit ended it)" if a.rc == 124 else "")
        rec["log_tail"] = _tail(a.log, f"== {a.step} (")
    target = a.merge_into or a.file
    if a.merge_into:
        merged = {}
        if os.path.exists(a.merge_into):
            with open(a.merge_into) as f:
                merged = json.load(f)
        merged.setdefault("device", device)
        merged.setdefault("date", now)
        merged.setdefault("command", os.environ.get("RUN_ALL_COMMAND", "bash bench/device/run_all.sh"))
        merged.setdefault("steps", {})[a.step] = rec
        rec = merged
        if os.path.exists(a.file) and os.path.abspath(a.file) != os.path.abspath(a.merge_into):
            os.remove(a.file)
    tmp = target + ".tmp"
    with open(tmp, "w") as f:
        json.dump(rec, f, indent=1, default=str)
    os.replace(tmp, target)


if __name__ == "__main__":
    main()
