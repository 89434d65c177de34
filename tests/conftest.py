import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")



def pytest_sessionstart(session):
    """DeepSpeed's CPU shared-memory all-reduce op is switched off in every rank we start
    (ds_longctx.dist.comm.disable_cpu_shm_allreduce): no JIT build race, no leaked /dev/shm segments.
    Remove segments an older run may have left so they cannot fill /dev/shm (once, in pytest's main process: an
    xdist worker starting later must not remove what the other worker's ranks use)."""
    import glob
    import time

    _SESSION_START.append(time.monotonic())
    if hasattr(session.config, "workerinput"):
        return
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
_SESSION_START: list = []


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
    item._cpu_mark = _cpu_seconds()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Each phase's (setup, call, teardown) CPU seconds travel with its report (user_properties "cpu_s"): under
    pytest-xdist the worker measures, pytest's main process sums (tests/conftest.py's table)."""
    outcome = yield
    now = _cpu_seconds()
    outcome.get_result().user_properties.append(("cpu_s", now - getattr(item, "_cpu_mark", now)))
    item._cpu_mark = now


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + getattr(report, "duration", 0.0)
    _FILE_CPU[path] = _FILE_CPU.get(path, 0.0) + sum(v for k, v in getattr(report, "user_properties", ())
                                                     if k == "cpu_s")


def pytest_terminal_summary(terminalreporter):
    """Wall and CPU seconds per test file (setup + call + teardown of its tests, module fixtures included), slowest
    first: where the suite's time goes, printed at the end of every run (bench/RESULTS.md records the table)."""
    if not _FILE_SECONDS:
        return
    import time

    total, cpu = sum(_FILE_SECONDS.values()), sum(_FILE_CPU.values())
    rows = sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])
    elapsed = time.monotonic() - _SESSION_START[0] if _SESSION_START else total
    terminalreporter.write_sep("-", f"per test file: wall s, CPU s ({total:.0f} s wall, {cpu:.0f} s CPU in all; "
                                    f"the session {elapsed:.0f} s, load {os.getloadavg()[0]:.1f})")
    for path, seconds in rows[:40]:
        terminalreporter.write_line(f"{seconds:8.1f} {_FILE_CPU.get(path, 0.0):8.1f}  {path}")
    if len(rows) > 40:
        rest = [p for p, _ in rows[40:]]
        terminalreporter.write_line(f"{sum(_FILE_SECONDS[p] for p in rest):8.1f} "
                                    f"{sum(_FILE_CPU.get(p, 0.0) for p in rest):8.1f}  ({len(rest)} other files)")


@pytest.fixture(scope="session")
def copy_reference(tmp_path_factory):
    """launch_utils.reference_run, once per test run (the uninterrupted run the launched resume, preemption and soak
    tests compare with; read-only for them: a test that changes its save directory works on a copy). Under
    pytest-xdist the first worker that asks runs it, holding a lock file in the run's shared temporary directory; the
    other waits for the lock and reads the same files."""
    import fcntl
    import json
    import shutil

    from launch_utils import reference_run

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    root, done = shared / "copy_reference", shared / "copy_reference.json"
    with open(shared / "copy_reference.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(root, ignore_errors=True)
            done.write_text(json.dumps(reference_run(str(root))))
        return json.loads(done.read_text())
