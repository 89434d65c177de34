"""The job's watchdog: a rank that goes silent ends the whole job in bounded time, with a diagnosis.

A rank frozen by ``kill -STOP``, a hung node or a lost host leaves the others waiting in their next collective
until the process group's timeout (DeepSpeed's default: 10 minutes), then a raw gloo/NCCL traceback that names
neither the silent rank nor what was awaited. Here:

* ``long_context.watchdog.timeout_s`` (``T``) is carried to every process group of the job
  (``torch.distributed._set_pg_timeout``: the world group at the agreement, DeepSpeed's groups after
  ``deepspeed.initialize``; ``init_distributed(timeout=...)`` when initialize starts the group), plus three
  heartbeat intervals so that the heartbeat's verdict, with its diagnosis, comes first.
* every rank runs one daemon thread that beats every ``interval`` (``T / 25``, 0.2 to 10 s) through the job's
  rendezvous store (the TCPStore every launcher's ``env://`` start already has; no collective, so a rank
  waiting in a collective still beats): it increments its own counter and publishes where its main thread is
  (the ``torch.distributed`` call it waits in and the caller, read from ``sys._current_frames``). Each rank
  reads its ring successor's counter and the job's verdict counter: 4 small store operations per interval.
* a successor whose counter has not moved for ``T - 8 intervals - 2 s`` is silent: its watcher re-reads every
  rank's counter twice (3 intervals apart) to name every silent rank, posts the verdict, and every live rank prints one line —
  which rank(s) went silent (host, pid, where each last was) and which collective this rank waits in — then
  the job ends: after a grace of 2 intervals (so every rank prints), a silent rank on this host that is
  stopped (``T``/``t`` state: it acts on no signal but SIGKILL) is sent SIGKILL, and this rank ends through
  ``runtime.shutdown(1)`` (``MPI_Abort`` under mpirun; the deepspeed launcher, torchrun and
  ``srun --kill-on-bad-exit`` end the others). The whole takes at most about ``T`` after the freeze.
* rank 0's process serves the store: when rank 0 freezes no store operation returns (a TCPStore client waits
  forever for its reply), so every store operation runs in a helper thread awaited for one interval; a store
  that has not answered as long is rank 0 (or its node) gone silent, judged by every live rank
  on its own.

A rank that ends normally (``runtime.shutdown(0)``, interpreter exit) marks its counter ended, so a rank that
finishes first is not called silent. Ranks alive but stuck (two ranks in different collectives) keep beating:
the process groups' timeout ends those.

"auto" timeout: the floor (DeepSpeed's default process-group timeout: ``FLOOR_S``, or ``DEEPSPEED_TIMEOUT``
minutes when set, as DeepSpeed reads it) until the planner's predicted step time is known, then
``max(floor, STEP_MULTIPLE x predicted step)``: on a CUDA machine rank 0 runs the planner (planner/rates
``h100`` or ``h200`` rates) for the resolved config in a background thread and posts the result through the
store; every rank adopts it at its next beat. On a CPU machine the planner's GPU rates do not describe the
machine: the floor applies.
"""
from __future__ import annotations

import atexit
import datetime
import json
import linecache
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ..dist import runtime
from ..config import parse, resolved_ds_config
from ..errors import ConfigError
from ..planner.core import Planner, load_model_config

logger = logging.getLogger("ds_longctx")

KEY = "long_context.watchdog.timeout_s"
FLOOR_S = 600.0        # DeepSpeed's own default process-group timeout (10 minutes; DEEPSPEED_TIMEOUT overrides)
STEP_MULTIPLE = 3.0    # "auto": this many predicted steps (a rank may wait a whole step in one native call)
INTERVALS_BEFORE = 8   # silence threshold = T - 8 intervals - ENDING_S: scan (3) + grace (2) + observation lag (2) + 1
ENDING_S = 2.0         # ... and the launcher's own time to notice the exit and end the rest
ENDED = 1 << 40        # added to a rank's counter when it ends normally
LAST_OUT_S = 2.0       # rank 0 (its process serves the store) waits at most this long for the others' end marks
PG_MARGIN_INTERVALS = 3


def interval_for(timeout_s: float) -> float:
    return min(10.0, max(0.2, timeout_s / 25.0))


def configured_timeout(ds_config: dict) -> Tuple[float, bool]:
    """(seconds, is_auto): ``long_context.watchdog.timeout_s`` as set, or the floor for "auto" (the default)."""
    value = parse(ds_config).watchdog.timeout_s
    if value == "auto":
        return floor_s(), True
    return float(value), False


def auto_timeout(predicted_step_s: Optional[float]) -> float:
    """"auto": ``max(floor, STEP_MULTIPLE x predicted step seconds)`` (the floor when there is no prediction)."""
    if not predicted_step_s or predicted_step_s != predicted_step_s:  # None, 0 or NaN
        return floor_s()
    return max(floor_s(), STEP_MULTIPLE * float(predicted_step_s))


def floor_s() -> float:
    """"auto"'s floor: DeepSpeed's default process-group timeout, ``DEEPSPEED_TIMEOUT`` minutes when set (as
    deepspeed.constants reads it: a user who raised it for long saves keeps it), else ``FLOOR_S``."""
    raw = os.environ.get("DEEPSPEED_TIMEOUT", "")
    if raw.strip().isdigit() and int(raw) > 0:
        return 60.0 * int(raw)
    return FLOOR_S


def pg_timeout(timeout_s: float) -> datetime.timedelta:
    """What the process groups get: the key plus a margin of heartbeats (the verdict, with its diagnosis, first)."""
    return datetime.timedelta(seconds=timeout_s + PG_MARGIN_INTERVALS * interval_for(timeout_s))


def apply_to_groups(timeout_s: float) -> int:
    """Set every existing process group's timeout (torch's ``_set_pg_timeout``: gloo's and NCCL's default timeout
    for the works issued later). Returns how many groups were set."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not (dist.is_available() and dist.is_initialized()):
        return 0
    n = 0
    for pg in list(c10d._world.pg_map):
        try:
            if c10d._rank_not_in_group(pg):
                continue
            c10d._set_pg_timeout(pg_timeout(timeout_s), pg)
            n += 1
        except Exception:  # a backend without a settable timeout: the heartbeat still bounds the job
            pass
    return n


# ------------------------------------------------------------------ where the main thread is ----------------------
def _short(path: str) -> str:
    for mark in ("site-packages/", "dist-packages/"):
        if mark in path:
            return path.split(mark, 1)[1]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
    if path.startswith(root + os.sep):
        return os.path.relpath(path, root)
    return os.path.join(*path.split(os.sep)[-2:]) if os.sep in path else path


def _internal(path: str) -> bool:
    p = path.replace(os.sep, "/")
    return "/torch/" in p or "/deepspeed/comm/" in p or p.endswith("ds_longctx/job/watchdog.py")


def main_thread_where() -> Tuple[str, tuple]:
    """(text, identity) of what the main thread is doing: the ``torch.distributed`` function it is inside and the
    first caller outside torch / DeepSpeed's comm wrappers, else its innermost frame."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    stack = []
    while frame is not None:
        stack.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    if not stack:
        return "nowhere (the main thread has ended)", ()
    return describe_stack(stack)


def describe_stack(stack) -> Tuple[str, tuple]:
    """main_thread_where's words for a stack of (file, line, function), innermost first."""
    coll = next((i for i, (f, _, _) in enumerate(stack) if f.endswith("distributed_c10d.py")), None)
    start = coll if coll is not None else 0
    caller = next(((f, ln, fn) for f, ln, fn in stack[start:] if not _internal(f)), stack[start])
    at = f"{_short(caller[0])}:{caller[1]} ({caller[2]})"
    if coll is not None:
        name = stack[coll][2]
        return f"torch.distributed.{name}, called from {at}", (name, caller)
    # a collective started with async_op=True is waited on in C++ (Work.wait): no Python frame of torch's, the
    # innermost one is the caller's `handle.wait()` line (DeepSpeed's ZeRO-3 gathers)
    if re.search(r"\.wait\(\s*\)", linecache.getline(stack[0][0], stack[0][1] or 0)):  # (3.11: a line may be None)
        return (f"a wait() on an asynchronous handle (torch.distributed's Work.wait, for a collective started with "
                f"async_op=True), called from {at}", ("wait", caller))
    return f"code outside torch.distributed, at {at}", (None, caller)


# ------------------------------------------------------------------ the store, with timeouts ---------------------
class _Store:
    """The job's store, every operation in a helper thread awaited for ``wait_s`` (a TCPStore client waits
    forever for the reply of a server whose process is stopped). At most one helper is outstanding: while one
    is stuck, calls fail at once."""

    def __init__(self, make: Callable[[], object]):
        self._make, self._store, self._busy = make, None, None

    def call(self, fn: Callable[[object], object], wait_s: float):
        if self._busy is not None and self._busy.is_alive():
            return False, None
        box: list = []

        def run():
            try:
                if self._store is None:
                    self._store = self._make()
                box.append((True, fn(self._store)))
            except Exception as e:  # noqa: BLE001 (a store error is a failed beat, judged by time)
                box.append((False, e))

        t = threading.Thread(target=run, name="ds_longctx-watchdog-store", daemon=True)
        t.start()
        t.join(wait_s)
        if t.is_alive():
            self._busy = t
            return False, None
        self._busy = None
        return box[0] if box else (False, None)


def _default_store_maker():
    """A client of the job's TCPStore with its own connection (the process group's client stays untouched); the
    default store itself when it is not a TCPStore (file store)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()
    inner = store
    while hasattr(inner, "underlying_store"):
        inner = inner.underlying_store
    if isinstance(inner, dist.TCPStore):
        host, port = inner.host, inner.port

        def make():
            return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=60),
                                 wait_for_workers=False)
        return make, f"{host}:{port}"
    return (lambda: store), "the process group's store"


# ------------------------------------------------------------------ the watchdog ----------------------------------
def _proc_state(pid: int) -> Optional[Tuple[str, int]]:
    fields = runtime.proc_stat(pid)
    return (fields[0], int(fields[19])) if fields else None


class Watchdog:
    def __init__(self, timeout_s: float, roster: Sequence, rank: int, store_maker=None, auto: bool = False):
        self.roster, self.rank, self.world = list(roster), rank, len(roster)
        self.auto = auto
        self.host = socket.gethostname()
        make, self.store_where = store_maker or _default_store_maker()
        self.store = _Store(make)
        first = self.roster[0]
        self.prefix = f"ds_longctx/watchdog/{first.pid}-{first.start}/"
        self._set_timeout(timeout_s)
        self.stopped = threading.Event()
        self.ended = False
        self.thread: Optional[threading.Thread] = None
        self.where_key, self.where_since, self._where_text = None, time.monotonic(), ""

    # --- keys
    def _k(self, name) -> str:
        return self.prefix + str(name)

    def _set_timeout(self, timeout_s: float) -> None:
        self.timeout_s = float(timeout_s)
        self.interval = interval_for(self.timeout_s)
        self.silence_s = max(self.timeout_s / 2, self.timeout_s - INTERVALS_BEFORE * self.interval - ENDING_S)

    # --- the thread
    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="ds_longctx-watchdog", daemon=True)
        self.thread.start()
        # an error exit or a signal (runtime's cleanups) only stops the beat: no store call there, where it would
        # delay the removal of the NVMe files while the launcher is ending the process. A normal end (shutdown(0)
        # runs the atexit handlers after its barrier; interpreter exit) marks the rank ended.
        runtime.on_exit(self._on_exit)
        atexit.register(self.mark_ended)

    def stop(self) -> None:
        self.stopped.set()

    def _on_exit(self) -> None:
        # a rank that ends through a signal or its launcher's exit after a graceful stop's save ends normally (exit
        # 0): its mark spares rank 0 the wait for it (LAST_OUT_S)
        if runtime.stop_was_saved():
            self.mark_ended()
        else:
            self.stop()

    def mark_ended(self) -> None:
        """This rank ends normally: its counter says so, so that a rank still finishing is not told it went silent
        (one store call, awaited 0.25 s at most), after the beat in flight, if any: no store call of this rank
        follows. Rank 0's process serves the store, and it leaves last: it waits (at most ``LAST_OUT_S``) until
        every other rank has marked its end. Before, rank 0 often left the final barrier first and exited while
        another rank's mark (or beat) was still on the wire: that rank's client printed a C++ ``TCPStore.cpp
        recvValue failed ... Connection reset by peer`` trace with its ``frame #`` lines on a successful run."""
        if self.ended:
            return
        self.ended = True
        self.stopped.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(min(self.interval, 2.0) + 0.5)  # its beat in flight ends (a store call awaits <= interval)
        self.store.call(lambda s: s.add(self._k(f"n{self.rank}"), ENDED), 0.25)
        if self.rank != 0:
            return
        others = [r for r in range(self.world) if r != self.rank]
        deadline = time.monotonic() + LAST_OUT_S
        while others and time.monotonic() < deadline:
            ok, counts = self.store.call(lambda s: [s.add(self._k(f"n{r}"), 0) for r in others], 0.5)
            if ok:
                others = [r for r, n in zip(others, counts) if n < ENDED]
            if others:
                time.sleep(0.02)

    def _where(self) -> str:
        text, key = main_thread_where()
        now = time.monotonic()
        if key != self.where_key:
            self.where_key, self.where_since = key, now
        return text

    def _beat(self, successor: int):
        rec = json.dumps({"where": self._where_text, "for_s": round(time.monotonic() - self.where_since, 1)})

        def ops(s):
            s.set(self._k(f"w{self.rank}"), rec)
            s.add(self._k(f"n{self.rank}"), 1)
            return (s.add(self._k(f"n{successor}"), 0), s.add(self._k("verdicts"), 0), s.add(self._k("auto_ms"), 0))
        return self.store.call(ops, self.interval)

    def _run(self) -> None:
        successor = (self.rank + 1) % self.world
        last_ok = seen_at = time.monotonic()
        seen_n = None
        while not self.stopped.is_set():
            t0 = time.monotonic()
            self._where_text = self._where()
            ok, res = self._beat(successor)
            now = time.monotonic()
            if ok:
                last_ok = now
                n, verdicts, auto_ms = res
                if n != seen_n:
                    seen_n, seen_at = n, now
                if n >= ENDED:
                    seen_at = now  # the successor ended normally: not silent
                if auto_ms and self.auto and abs(auto_ms / 1000.0 - self.timeout_s) > 1e-3:
                    self._adopt(auto_ms / 1000.0)
                if verdicts:
                    self._verdict_posted()
                    return
                if now - seen_at > self.silence_s:
                    self._detect(successor, now - seen_at)
                    return
            elif now - last_ok > self.silence_s:
                self._store_silent(now - last_ok)
                return
            self.stopped.wait(max(0.0, self.interval - (time.monotonic() - t0)))

    def _adopt(self, timeout_s: float) -> None:
        self._set_timeout(timeout_s)
        apply_to_groups(timeout_s)

    # --- verdicts
    def _counters(self):
        return self.store.call(lambda s: [s.add(self._k(f"n{r}"), 0) for r in range(self.world)],
                               max(self.interval, 0.01 * self.world))

    def _detect(self, successor: int, silent_for: float) -> None:
        """The successor is silent: name every silent rank (counters read twice, 3 intervals apart), post."""
        silent = {successor}
        ok1, a = self._counters()
        time.sleep(3 * self.interval)
        ok2, b = self._counters()
        if ok1 and ok2:
            silent |= {r for r in range(self.world) if r != self.rank and a[r] == b[r] and b[r] < ENDED}

        def last(s):
            out = {}
            for r in sorted(silent):
                k = self._k(f"w{r}")
                if s.check([k]):
                    out[str(r)] = json.loads(s.get(k))
            return out
        ok, lasts = self.store.call(last, self.interval)
        verdict = {"silent": sorted(silent), "for_s": round(silent_for, 1), "by": self.rank,
                   "last": lasts if ok else {}}

        def post(s):
            s.set(self._k("verdict"), json.dumps(verdict))
            s.add(self._k("verdicts"), 1)
        self.store.call(post, self.interval)
        self._end(verdict)

    def _verdict_posted(self) -> None:
        ok, text = self.store.call(lambda s: s.get(self._k("verdict")), self.interval)
        verdict = json.loads(text) if ok else {"silent": [], "for_s": None, "by": None, "last": {}}
        self._end(verdict)

    def _store_silent(self, silent_for: float) -> None:
        self._end({"silent": [0], "for_s": round(silent_for, 1), "by": self.rank, "last": {}, "store": True})

    def message(self, verdict: dict) -> Tuple[str, str]:
        """(problem, fix) of this rank's line."""
        silent = [int(r) for r in verdict["silent"]] or [-1]
        names = []
        for r in silent[:4]:
            if 0 <= r < self.world:
                m = self.roster[r]
                last = (verdict.get("last") or {}).get(str(r))
                where = (f"; it was last in {last['where']}" + (f" (for {last['for_s']} s)" if last.get("for_s") else "")
                         if last else "")
                names.append(f"rank {r} (host {m.host}, pid {m.pid}{where})")
        more = f" and {len(silent) - 4} more" if len(silent) > 4 else ""
        who = ", ".join(names) + more if names else "a rank"
        if verdict.get("store"):
            what = (f"the job's store ({self.store_where}, served by rank 0's process or the launcher's agent) has "
                    f"not answered for {verdict['for_s']} s: {who} went silent (stopped, hung, or its node lost)")
        else:
            what = (f"{who} went silent: no heartbeat for {verdict['for_s']} s (stopped, hung, or its node lost)")
            if verdict.get("by") is not None and verdict["by"] != self.rank:
                what += f", seen by rank {verdict['by']}"
        waiting = time.monotonic() - self.where_since
        text, _ = main_thread_where()
        here = f"this rank has been in {text} for {waiting:.1f} s"
        problem = f"{what}; {here}; ending the job (exit 1)"
        silent_ranks = ", ".join(str(r) for r in silent[:8])
        fix = (f"find why rank {silent_ranks} stopped (its node's logs; dmesg: the OOM killer, a hung file system, a "
               f"debugger or kill -STOP); if it was only slow, raise {KEY} (now {self.timeout_s:g} s)")
        return problem, fix

    def _end(self, verdict: dict) -> None:
        self.stopped.set()
        self.ended = True  # no "ended normally" mark: this is an error exit
        problem, fix = self.message(verdict)
        runtime.report(ConfigError(KEY, problem, fix))
        time.sleep(2 * self.interval)  # every live rank sees the verdict (one beat) and prints its line
        self._kill_stopped_here([int(r) for r in verdict.get("silent") or []])
        runtime.shutdown(1, barrier=False)

    def _kill_stopped_here(self, ranks: List[int]) -> None:
        """A silent rank on this host that is stopped (state T or t) acts on no signal but SIGKILL: the launcher's
        SIGTERM would wait until it is continued (the deepspeed launcher kills 30 s later)."""
        for r in ranks:
            if not (0 <= r < self.world) or r == self.rank:
                continue
            m = self.roster[r]
            if m.host != self.host:
                continue
            st = _proc_state(m.pid)
            if st is not None and st[1] == m.start and st[0] in ("T", "t"):
                try:
                    os.kill(m.pid, signal.SIGKILL)
                except OSError:
                    pass


# ------------------------------------------------------------------ the one watchdog of this process -------------
_WATCHDOG: Dict[str, Optional[Watchdog]] = {"dog": None}


def start(ds_config: dict, roster: Sequence) -> Optional[Watchdog]:
    """Start this process's watchdog for the job of ``roster`` (agreement.check_agreement calls it), or update the
    timeout of the running one; sets every existing process group's timeout. Returns the watchdog."""
    import torch.distributed as dist

    timeout_s, auto = configured_timeout(ds_config)
    dog = _WATCHDOG["dog"]
    if dog is not None:
        if not auto and timeout_s != dog.timeout_s:
            dog._adopt(timeout_s)
        return dog
    apply_to_groups(timeout_s)
    if len(roster) < 2:
        return None
    dog = Watchdog(timeout_s, roster, dist.get_rank(), auto=auto)
    dog.start()
    _WATCHDOG["dog"] = dog
    return dog


def current() -> Optional[Watchdog]:
    return _WATCHDOG["dog"]


def after_initialize(ds_config: dict, lc, model_config, world: int) -> None:
    """``initialize``'s call after ``deepspeed.initialize``: DeepSpeed's groups get the timeout; with "auto" on a
    CUDA machine rank 0 predicts the step time (the planner, in the background) and posts the timeout."""
    dog = _WATCHDOG["dog"]
    timeout_s = dog.timeout_s if dog is not None else configured_timeout(ds_config)[0]
    apply_to_groups(timeout_s)
    if dog is None or not dog.auto or dog.rank != 0:
        return
    import torch

    if not torch.cuda.is_available() or not getattr(lc, "sequence_length", None):
        return
    threading.Thread(target=_predict_and_post, args=(dog, ds_config, lc, model_config, world),
                     name="ds_longctx-watchdog-plan", daemon=True).start()


def predicted_step_seconds(ds_config: dict, lc, model_config, world: int, gpu_mem: int, target: str,
                           gpus_per_node: Optional[int] = None) -> float:
    """The planner's predicted step seconds for this config, with ``lc`` (the section as initialize resolved it:
    "auto" values written in), on ``target``'s rates."""
    p = Planner(resolved_ds_config(ds_config, lc), load_model_config(model_config), world, gpu_mem=gpu_mem,
                reserve="0", gpus_per_node=gpus_per_node, target=target)
    return float(p.run(int(lc.sequence_length)).time["seconds"])


def _predict_and_post(dog: Watchdog, ds_config, lc, model_config, world) -> None:
    import multiprocessing as mp

    import torch

    log = logger
    try:
        name = torch.cuda.get_device_name(torch.cuda.current_device()).lower()
        target = "h200" if "h200" in name else "h100"
        mem = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        mc = model_config.to_dict() if hasattr(model_config, "to_dict") else model_config
        with mp.get_context("spawn").Pool(1) as pool:  # the simulation's fake group needs a process of its own
            step = pool.apply(predicted_step_seconds, (ds_config, lc, mc, world, mem, target))
    except Exception as e:  # noqa: BLE001 (no prediction: the floor stays, said once)
        log.warning(f"ds_longctx: {KEY} 'auto': no predicted step time ({type(e).__name__}: {e}); the floor "
                    f"{floor_s():g} s applies")
        return
    timeout_s = auto_timeout(step)
    log.info(f"ds_longctx: {KEY} 'auto': {timeout_s:g} s = max({floor_s():g} s, {STEP_MULTIPLE:g} x the planner's "
             f"predicted step {step:.4g} s on {target} rates)")
    post_auto_timeout(dog, timeout_s)


def post_auto_timeout(dog: Watchdog, timeout_s: float) -> bool:
    """Rank 0 posts the "auto" timeout (milliseconds, in a store counter every rank reads at each beat); every
    rank's watchdog adopts it at its next beat (heartbeat interval, silence, process groups)."""
    ms = int(round(timeout_s * 1000))
    return dog.store.call(lambda s: s.add(dog._k("auto_ms"), ms - s.add(dog._k("auto_ms"), 0)), 10.0)[0]


__all__ = ["start", "current", "after_initialize", "configured_timeout", "auto_timeout", "apply_to_groups",
           "main_thread_where", "describe_stack", "Watchdog", "KEY", "FLOOR_S", "STEP_MULTIPLE"]
