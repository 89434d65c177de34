import os
import sys

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


# ---- per-file wall time (the suite's budget: README's test command within 25 min on CI's 2-core box) ----
_FILE_SECONDS: dict = {}


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + getattr(report, "duration", 0.0)


def pytest_terminal_summary(terminalreporter):
    """Seconds per test file (setup + call + teardown of its tests, module fixtures included), slowest first: where
    the suite's time goes, printed at the end of every run (bench/RESULTS.md records the table)."""
    if not _FILE_SECONDS:
        return
    total = sum(_FILE_SECONDS.values())
    rows = sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])
    terminalreporter.write_sep("-", f"seconds per test file ({total:.0f} s in all)")
    for path, seconds in rows[:40]:
        terminalreporter.write_line(f"{seconds:8.1f}  {path}")
    if len(rows) > 40:
        terminalreporter.write_line(f"{sum(s for _, s in rows[40:]):8.1f}  ({len(rows) - 40} other files)")
