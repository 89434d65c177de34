"""Issue 30, item 2, the units: the timeout key and its "auto" rule, where the main thread is, and the watchdog's
verdicts over a real store (torch's in-process HashStore for ranks that beat or stop; a TCP listener that never
answers for a store host that is frozen). The watchdog's exit is replaced by a record here; the launched kill
-STOP of a rank, with the real exit under the deepspeed launcher, is in tests/test_fail_fast_launched.py."""
import datetime
import socket
import threading
import time

import pytest

from ds_longctx.job import watchdog as wd
from ds_longctx.job.agreement import Member
from ds_longctx.config import ConfigError, parse


def test_timeout_key_and_auto_rule(monkeypatch):
    monkeypatch.delenv("DEEPSPEED_TIMEOUT", raising=False)
    assert wd.configured_timeout({}) == (wd.FLOOR_S, True) == (600.0, True)
    assert wd.configured_timeout({"long_context": {"watchdog": {"timeout_s": 30}}}) == (30.0, False)
    with pytest.raises(ConfigError, match=r"long_context.watchdog.timeout_s: must be a positive integer, got 0. "
                                          r"Fix: give whole seconds"):
        parse({"long_context": {"watchdog": {"timeout_s": 0}}})
    assert wd.auto_timeout(None) == wd.auto_timeout(float("nan")) == 600.0
    assert wd.auto_timeout(150.0) == 600.0 and wd.auto_timeout(248.6) == pytest.approx(745.8)
    assert wd.interval_for(600) == 10.0 and wd.interval_for(10) == 0.4 and wd.interval_for(1) == 0.2
    # the process groups wait the key plus 3 heartbeats: the heartbeat's verdict comes first
    assert wd.pg_timeout(10) == datetime.timedelta(seconds=11.2)
    assert wd.pg_timeout(600) == datetime.timedelta(seconds=630)
    monkeypatch.setenv("DEEPSPEED_TIMEOUT", "30")  # minutes, as DeepSpeed reads it: "auto" keeps a raised default
    assert wd.configured_timeout({}) == (1800.0, True) and wd.auto_timeout(248.6) == 1800.0


def _sleeping_in_here(seconds):
    time.sleep(seconds)


def test_where_the_main_thread_is():
    box = []
    t = threading.Thread(target=lambda: (time.sleep(0.1), box.append(wd.main_thread_where())))
    t.start()
    _sleeping_in_here(0.4)
    t.join()
    text, key = box[0]
    assert text.startswith("code outside torch.distributed, at tests/test_watchdog.py:"), text
    assert text.endswith("(_sleeping_in_here)") and key[0] is None, text


def test_a_wait_on_an_async_collective_handle_is_named(tmp_path):
    """A collective started with async_op=True is waited on in C++ (Work.wait): the innermost Python frame is the
    caller's ``handle.wait()`` line (DeepSpeed's ZeRO-3 gathers); it is named as that wait, not as code outside
    torch.distributed. Any other innermost line stays "code outside"."""
    src = tmp_path / "zero.py"
    src.write_text("def gather(handles):\n    for handle in handles:\n        handle.wait()\n    return 1\n")
    path = str(src)
    text, key = wd.describe_stack([(path, 3, "gather"), (path, 9, "forward")])
    assert text.startswith("a wait() on an asynchronous handle (torch.distributed's Work.wait") and key[0] == "wait"
    assert text.endswith("zero.py:3 (gather)"), text
    text, key = wd.describe_stack([(path, 4, "gather")])
    assert text.startswith("code outside torch.distributed, at ") and key[0] is None, text


class _Recorded(wd.Watchdog):
    """The watchdog with its exit replaced by a record of the verdict and this rank's line."""

    def _end(self, verdict):
        self.stopped.set()
        self.verdict, self.line = verdict, self.message(verdict)


def _roster(n):
    return [Member(r, "node-a" if r < 2 else "node-b", 1000 + r, 7) for r in range(n)]


def test_a_silent_rank_and_a_frozen_store_host_are_named():
    import torch.distributed as dist

    store = dist.HashStore()
    roster = _roster(3)
    timeout = 2  # interval 0.2 s, silence max(1, 2 - 1.6 - 2) = 1 s
    dogs = [_Recorded(timeout, roster, r, store_maker=(lambda: store, "hash store")) for r in range(3)]
    dogs[0].start()
    dogs[2].start()
    for _ in range(3):  # rank 1 beats a few times, then stops (its main thread frozen: no more beats)
        dogs[1]._where_text = "torch.distributed.all_reduce, called from train.py:600 (main)"
        assert dogs[1]._beat(2)[0]
        time.sleep(0.2)
    # a store host that stops answering: a TCP listener that accepts nothing and replies nothing
    frozen = socket.socket()
    frozen.bind(("127.0.0.1", 0))
    frozen.listen(8)
    port = frozen.getsockname()[1]

    def client():
        return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60),
                             wait_for_workers=False)
    lonely = _Recorded(timeout, _roster(2), 1, store_maker=(client, f"127.0.0.1:{port}"))
    lonely.start()
    t0 = time.monotonic()
    for d in (dogs[0], dogs[2], lonely):
        d.thread.join(30)
    took = time.monotonic() - t0
    frozen.close()
    # rank 0 watches rank 1: silent, named with its host, pid and last place; rank 2 (watching rank 0) agrees
    v = dogs[0].verdict
    assert v["silent"] == [1] and v["by"] == 0 and v["last"]["1"]["where"].startswith("torch.distributed.all_reduce")
    problem, fix = dogs[0].line
    assert problem.startswith("rank 1 (host node-a, pid 1001; it was last in torch.distributed.all_reduce, called from "
                              "train.py:600 (main)"), problem
    assert " went silent: no heartbeat for " in problem and "; this rank has been in " in problem, problem
    assert fix.startswith("find why rank 1 stopped") and fix.endswith("raise long_context.watchdog.timeout_s (now 2 s)")
    assert dogs[2].verdict["silent"] == [1] and dogs[2].message(dogs[2].verdict)[0].endswith(
        "; ending the job (exit 1)") and ", seen by rank 0" in dogs[2].message(dogs[2].verdict)[0]
    # the frozen store host: every operation timed out, so the verdict is rank 0 (its store's host)
    v = lonely.verdict
    assert v.get("store") and v["silent"] == [0]
    assert lonely.line[0].startswith(f"the job's store (127.0.0.1:{port}, served by rank 0's process or the launcher's "
                                     "agent) has not answered for "), lonely.line[0]
    assert took < 20, took  # each within its 2 s timeout (plus the thread's scheduling on a loaded machine)
    # a rank that ends by itself is not silent: its counter says so
    store2 = dist.HashStore()
    a, b = (_Recorded(2, _roster(2), r, store_maker=(lambda: store2, "hash store")) for r in (0, 1))
    b._where_text = ""
    b._beat(0)
    b.mark_ended()
    a.start()
    a.thread.join(1.8)
    assert a.thread.is_alive() and not hasattr(a, "verdict")
    a.stop()


def test_auto_timeout_posted_by_rank_0_is_adopted_by_every_rank():
    import torch.distributed as dist

    store = dist.HashStore()
    dogs = [_Recorded(2, _roster(2), r, store_maker=(lambda: store, "hash store"), auto=True) for r in range(2)]
    for d in dogs:
        d.start()
    assert wd.post_auto_timeout(dogs[0], wd.auto_timeout(248.6))  # what _predict_and_post posts on a CUDA machine
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(d.timeout_s != 745.8 for d in dogs):
        time.sleep(0.05)
    assert [d.timeout_s for d in dogs] == [745.8, 745.8] and [d.interval for d in dogs] == [10.0, 10.0]
    assert not any(hasattr(d, "verdict") for d in dogs)
    for d in dogs:
        d.stop()


def test_rank_0_whose_process_serves_the_store_leaves_last(monkeypatch):
    """Issue 38 item 11: at a successful exit rank 0 left the final barrier and exited while another rank's end mark
    was still on the wire to rank 0's store: that rank printed a C++ `TCPStore.cpp recvValue failed ... Connection
    reset by peer` trace (1 run in 8). Rank 0 now marks its end last: it waits for every other rank's mark; the
    others do not wait; a rank that never marks holds rank 0 at most LAST_OUT_S."""
    import torch.distributed as dist

    store = dist.HashStore()
    a, b = (_Recorded(2, _roster(2), r, store_maker=(lambda: store, "hash store")) for r in (0, 1))
    a.start()
    b.start()
    late = threading.Timer(0.8, b.mark_ended)  # rank 1 leaves the barrier 0.8 s after rank 0
    t0 = time.monotonic()
    late.start()
    a.mark_ended()
    took = time.monotonic() - t0
    late.join()
    assert 0.75 <= took < 5, took  # before: rank 0 returned at once (and its process exited)
    assert store.add(a._k("n1"), 0) >= wd.ENDED and store.add(a._k("n0"), 0) >= wd.ENDED
    assert not a.thread.is_alive() and not b.thread.is_alive()  # no beat left in flight
    t0 = time.monotonic()
    c = _Recorded(2, _roster(2), 1, store_maker=(lambda: dist.HashStore(), "hash store"))
    c.mark_ended()
    assert time.monotonic() - t0 < 0.5  # any other rank: no wait
    monkeypatch.setattr(wd, "LAST_OUT_S", 0.3)
    d = _Recorded(2, _roster(2), 0, store_maker=(lambda: dist.HashStore(), "hash store"))
    t0 = time.monotonic()
    d.mark_ended()
    assert 0.3 <= time.monotonic() - t0 < 2  # rank 1 never marked: bounded
    # a rank ended by a signal or its launcher's exit after a graceful stop's save ends normally: it marks its end
    from ds_longctx.dist import runtime

    for saved in (None, "step 3"):
        monkeypatch.setattr(runtime, "_stop_saved", saved)
        s3 = dist.HashStore()
        e = _Recorded(2, _roster(2), 1, store_maker=(lambda: s3, "hash store"))
        e._on_exit()
        assert (s3.add(e._k("n1"), 0) >= wd.ENDED) == bool(saved) and e.stopped.is_set()
