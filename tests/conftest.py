import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")



def pytest_sessionstart(session):
    """DeepSpeed's CPU shared-memory all-reduce op is switched off in every rank we start
    (ds_longctx.dist.comm.disable_cpu_shm_allreduce): no JIT build race, no leaked /dev/shm segments.
    Remove segments an older run may have left so they cannot fill /dev/shm."""
    import glob
    import os

    for path in glob.glob("/dev/shm/deepspeed_allreduce_buffer_*"):
        try:
            os.unlink(path)
        except OSError:
            pass


# ---- per-file wall and CPU time (the suite's budget: README's test command within 25 min on CI's 2-core box) ----
# CPU seconds (this process, the processes it started and reaped: launched jobs with their ranks, and the spawn
# forkserver's reaped ranks) do not depend on what else the machine runs, so they show where the suite's work is
# even on a shared box; on a 2-core box a file's wall time is at least its CPU seconds / 2.
_FILE_SECONDS: dict = {}
_FILE_CPU: dict = {}


def _cpu_seconds() -> float:
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
    try:  # the forkserver reaps the spawned ranks: their CPU is its children's (tests/dist_utils.py)
        from multiprocessing import forkserver

        pid = forkserver._forkserver._forkserver_pid
        if pid:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            tick = os.sysconf("SC_CLK_TCK")
            total += sum(int(v) for v in fields[11:15]) / tick  # utime, stime, cutime, cstime
    except (OSError, AttributeError, ValueError, IndexError):
        pass
    return total


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before = _cpu_seconds()
    yield
    path = item.nodeid.split("::", 1)[0]
    _FILE_CPU[path] = _FILE_CPU.get(path, 0.0) + _cpu_seconds() - before


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + getattr(report, "duration", 0.0)


def pytest_terminal_summary(terminalreporter):
    """Wall and CPU seconds per test file (setup + call + teardown of its tests, module fixtures included), slowest
    first: where the suite's time goes, printed at the end of every run (bench/RESULTS.md records the table)."""
    if not _FILE_SECONDS:
        return
    total, cpu = sum(_FILE_SECONDS.values()), sum(_FILE_CPU.values())
    rows = sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])
    terminalreporter.write_sep("-", f"per test file: wall s, CPU s ({total:.0f} s wall, {cpu:.0f} s CPU in all)")
    for path, seconds in rows[:40]:
        terminalreporter.write_line(f"{seconds:8.1f} {_FILE_CPU.get(path, 0.0):8.1f}  {path}")
    if len(rows) > 40:
        rest = [p for p, _ in rows[40:]]
        terminalreporter.write_line(f"{sum(_FILE_SECONDS[p] for p in rest):8.1f} "
                                    f"{sum(_FILE_CPU.get(p, 0.0) for p in rest):8.1f}  ({len(rest)} other files)")
