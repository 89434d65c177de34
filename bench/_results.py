"""One JSON record per CPU bench run: the command, the machine and the date next to the rows."""
import json
import sys
import time


def write_rows(path, rows, machine="2-core x86_64 CPU VM (shared)"):
    with open(path, "w") as f:
        json.dump({"command": "python " + " ".join(sys.argv), "machine": machine, "date": time.strftime("%Y-%m-%d"),
                   "rows": rows}, f, indent=1)
