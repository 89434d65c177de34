#!/usr/bin/env python
"""Redraw a `ds-longctx plan --compare --json` result as the --plot PNG (the same plot function), so
a figure can be re-rendered without re-running the planner:

    python bench/plot_compare.py bench/results/planner_compare_1m.json bench/results/planner_compare_1m.png
"""
import json
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(src, dst):
    from ds_longctx.planner.cli import plot

    obj = json.load(open(src))
    rows = []
    show_max = any("max_sequence_length" in c for c in obj["configs"])
    for c in obj["configs"]:
        rows.append((c["label"], SimpleNamespace(**{"binding": "", "time": {}, **c}), c.get("max_sequence_length")))
    plot(rows, dst, show_max)


if __name__ == "__main__":
    main(*sys.argv[1:3])
