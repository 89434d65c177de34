"""How a ds_longctx process ends: ``shutdown()`` at the end of every rank, ``main_guard()``/``run()``
so that an error on any rank ends the whole job with that rank's message.

Why ranks must not run interpreter finalization: gloo's worker threads
(``ProcessGroupGloo::runLoop``) still own finished async works at exit (the last one is ZeRO-3's
persistent-parameter all-gather issued by every ``engine.step()``). Destroying one decrefs a Python
tensor, which needs the GIL; once the main thread is in ``Py_FinalizeEx`` CPython ``pthread_exit``s
that worker, the forced unwind meets a noexcept frame and the process dies with SIGABRT
("terminate called without an active exception"). ``destroy_process_group()`` does not stop those
threads (DeepSpeed still references the groups). Repro without DeepSpeed:
/work/shared/repro/gloo_exit_abort.py. So every rank ends with ``os._exit`` after flushing.

Why errors need help: under mpirun a rank that raises runs mpi4py's exit-time ``MPI_Finalize``,
which waits for ranks that are themselves waiting for it in a gloo collective: the job hangs until
the collective times out. ``MPI_Abort`` ends every rank at once. The deepspeed launcher, torchrun and
``srun --kill-on-bad-exit=1`` kill the remaining ranks when one exits non-zero; a rank left waiting
on a peer that exited gets a gloo connection error, which the guard turns into its own exit.

Why cleanups have their own registry (``on_exit``): ``os._exit`` skips ``atexit``, and an error exit must
not run users' exit handlers (they may issue collectives on a broken job), yet files such as NVMe
activation files must go on every exit path. ``on_exit`` functions run on ``shutdown`` (any code), on
SIGTERM/SIGINT/SIGHUP (``install_signal_handlers``: the rank ends with 128+signal after its cleanups) and
when the launcher dies (``watch_launcher``). Only kill -9 skips them; the next run removes what it left
(see memory/nvme.py).
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import sys
import threading
import traceback
from typing import Any, Callable, Dict, Optional

from ..errors import ConfigError, LongContextError
from .launch import launched_world_size

# seconds an error exit may spend in MPI_Abort before the process ends itself
_ABORT_GRACE_S = 30.0
# seconds a rank that printed a bad-input error (ConfigError) waits before ending the job: the checks run on
# every rank before any collective and give the same verdict everywhere, but the launcher kills the other
# ranks as soon as one exits (mpirun at once), often before a slower rank has printed its own copy
_CONFIG_ERROR_GRACE_S = 3.0

_RANK_ENV = ("RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")


def rank() -> Optional[int]:
    """This process's global rank: from the process group once it exists, else from the launcher's
    environment; None when nothing says."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # reporting must never fail because torch is half torn down
        pass
    for name in _RANK_ENV:
        value = os.environ.get(name)
        if value is not None and value.lstrip("-").isdigit():
            return int(value)
    return None


def _prefix() -> str:
    r = rank()
    return f"[rank {r}] " if r is not None else ""


def _mpi():
    """mpi4py's MPI module when this process initialized MPI and has not finalized it, else None.
    (DeepSpeed imports mpi4py only for mpirun discovery; other launchers never load it.)"""
    if "mpi4py.MPI" not in sys.modules:
        return None
    MPI = sys.modules["mpi4py.MPI"]
    try:
        return MPI if MPI.Is_initialized() and not MPI.Is_finalized() else None
    except Exception:
        return None


def _flush() -> None:
    import logging

    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # a closed or broken stream must not keep the process alive
            pass
    try:
        logging.shutdown()  # flushes file handlers (what normal interpreter exit would do)
    except Exception:
        pass


def report(exc: BaseException) -> None:
    """Print ``exc`` to stderr, every line prefixed with this rank: a ConfigError or BatchError as its one-line
    message (it names the key and the fix), gloo's error for a peer that died (kill -9, a crash) as one
    line saying so, anything else as its full traceback."""
    if isinstance(exc, LongContextError):
        text = f"ds_longctx: error: {exc}\n"
    elif _peer_gone(exc):
        text = (f"ds_longctx: a peer process of this job ended during a collective ({_first_line(exc)}): ending "
                "this rank too; the launcher's log and the other ranks' lines name the one that failed\n")
    else:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    prefix = _prefix()
    lines = "".join(prefix + line + "\n" for line in text.rstrip("\n").split("\n"))
    _flush()
    try:
        os.write(2, lines.encode(errors="replace"))  # unbuffered: the process may end right after
    except OSError:
        pass


# what gloo raises in a rank whose peer process died (kill -9, a crash): the traceback says nothing more
_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _peer_gone(exc: BaseException) -> bool:
    """A gloo transport error from a peer that ended (not this rank's own fault)."""
    return isinstance(exc, RuntimeError) and "gloo" in str(exc) and any(m in str(exc) for m in _PEER_GONE)


_cleanups: Dict[int, Callable[[], None]] = {}
_cleanups_lock = threading.Lock()
_ending = threading.Lock()  # the first path that ends the process holds it (signal, watch, shutdown)


def on_exit(fn: Callable[[], None]) -> int:
    """Run ``fn()`` on every exit path of this rank (``shutdown`` with any code, a terminating signal,
    the launcher's death); returns a key for :func:`cancel_on_exit`. Must be quick and never raise."""
    with _cleanups_lock:
        key = id(fn)
        _cleanups[key] = fn
    return key


def cancel_on_exit(key: int) -> None:
    with _cleanups_lock:
        _cleanups.pop(key, None)


def run_cleanups() -> None:
    with _cleanups_lock:
        fns = list(_cleanups.values())
        _cleanups.clear()
    for fn in fns:
        try:
            fn()
        except BaseException:  # a cleanup must never keep the process alive or hide the real error
            pass


def _terminate(code: int, message: str) -> None:
    """End this rank now from a signal handler or a watch thread: cleanups, message, exit ``code``.
    (No barrier and no MPI_Abort: the launcher is ending the other ranks, or is gone.)"""
    if not _ending.acquire(blocking=False):
        return  # another path is already ending the process
    run_cleanups()  # first: the launcher may SIGKILL soon, and the message may block on a full pipe
    try:
        _flush()
        os.write(2, f"{_prefix()}ds_longctx: {message}\n".encode(errors="replace"))
    except OSError:
        pass
    _flush()
    os._exit(code)


_TERM_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP")
# set by launch/preemptible.py (`ds-longctx launch`) for its ranks: its pid (a launcher whose death ends them)
WRAPPER_ENV = "DS_LONGCTX_LAUNCHER_PID"


def _on_signal(signum, frame):
    name = signal.Signals(signum).name
    if _stop_saved and signum in (signal.SIGTERM, signal.SIGINT):
        # DeepSpeed's launch.py sends its ranks SIGTERM one after the other, each once the previous one ended: the
        # later ranks get it after the stop's save, on their way out
        _terminate(0, f"received {name} after the graceful stop's save ({_stop_saved}): ending this rank (exit 0)")
    _terminate(128 + signum, f"received {name}: ending this rank (exit {128 + signum})")


_stop_saved: Optional[str] = None


def stop_was_saved() -> bool:
    """A graceful stop's save is done: this rank's end from now on is a normal one (exit 0)."""
    return _stop_saved is not None


def stop_saved(what: str) -> None:
    """The training loop saved after a graceful stop (``what``: the tag): a SIGTERM or SIGINT from now on ends
    this rank with exit 0 (its work is saved)."""
    global _stop_saved
    _stop_saved = what


# ---------------------------------------------------------------------------------------------
# a graceful stop: the preemption signal lets the training loop finish its step and save
# ---------------------------------------------------------------------------------------------

STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")

# a SIGTERM/SIGINT that reaches a rank twice within this many seconds, while its parent is DeepSpeed's per-node
# launch.py, is one request: a signal to the whole process group reaches the rank directly and launch.py, whose
# handler sends every rank SIGTERM again (deepspeed/launcher/launch.py sigkill_handler, then SIGKILL after 30 s)
_LAUNCHER_REPEAT_S = 2.0
# seconds a rank whose launcher died may spend finishing its step and saving before it ends itself (nobody is
# left to kill it); DS_LONGCTX_ORPHAN_GRACE_S overrides
_ORPHAN_GRACE_S = 900.0
# the signal the kernel sends this rank when its parent (the launcher) dies (PR_SET_PDEATHSIG): not SIGTERM, so
# that the launcher's death during a graceful stop is not taken for a second SIGTERM (which ends the rank at once)
_LAUNCHER_GONE_SIGNAL = signal.SIGRTMIN + 5 if hasattr(signal, "SIGRTMIN") else None
LAUNCHER_GONE = "the launcher's exit"


class _Stop:
    """What :func:`graceful_stop` installed: the signal that asked for the stop (None while none did), when, the
    handlers it replaced, and whether the launcher's copy of the first signal was absorbed."""

    def __init__(self):
        self.signal: Optional[str] = None
        self.t0 = 0.0
        self.absorbed = False
        self.previous: Dict[int, Any] = {}
        self.lock = threading.Lock()


_stop: Optional[_Stop] = None


def _parent_forwards_signals() -> bool:
    """The parent is DeepSpeed's per-node launch.py (it sends its ranks SIGTERM when it gets SIGINT/SIGTERM)."""
    return "deepspeed.launcher.launch" in _cmdline(os.getppid())


def _say(text: str) -> None:
    try:
        _flush()
        os.write(2, f"{_prefix()}ds_longctx: {text}\n".encode(errors="replace"))
    except OSError:
        pass


def _request_stop(name: str) -> bool:
    """Record the first stop request; returns whether this was the first."""
    import time

    stop = _stop
    if stop is None:
        return False
    with stop.lock:
        first = stop.signal is None
        if first:
            stop.signal, stop.t0 = name, time.monotonic()
    return first


def _on_stop_signal(signum, frame):
    """First SIGTERM/SIGUSR1/SIGINT: remember it (the loop saves at the end of the step and exits 0). Then a
    SIGTERM or SIGINT ends this rank now, as without a graceful stop, except the launcher's copy of the first
    one (see ``_LAUNCHER_REPEAT_S``); a later SIGUSR1 changes nothing, and says so (a group's SIGUSR1 whose handler
    runs after the launcher-gone thread recorded the stop is still named in this rank's log)."""
    import time

    stop = _stop
    if stop is None:  # uninstalled meanwhile
        return _on_signal(signum, frame)
    name = signal.Signals(signum).name
    if _request_stop(name):
        _say(f"received {name}: finishing this step, saving a checkpoint, then exiting (send SIGTERM again to end "
             "now, without the save)")
        return
    if name not in ("SIGTERM", "SIGINT"):
        first = stop.signal
        _say(f"received {name} again: the save goes on" if first == name else
             f"received {name}: finishing this step, saving a checkpoint, then exiting (already asked by {first})")
        return
    with stop.lock:
        absorb = (not stop.absorbed and stop.signal in ("SIGTERM", "SIGINT")
                  and time.monotonic() - stop.t0 < _LAUNCHER_REPEAT_S and _parent_forwards_signals())
        stop.absorbed = stop.absorbed or absorb
    if absorb:
        _say(f"received {name} again from the deepspeed launcher (it forwards the group's signal): the save goes "
             "on (send SIGTERM again to end now)")
        return
    _on_signal(signum, frame)


def _on_launcher_gone(pid) -> None:
    """The launcher (``pid``, or the parent when None) exited. Inside a graceful stop: a stop request (the step is
    finished and saved; the launcher may have died of the same group signal, e.g. SIGUSR1's default action),
    bounded by ``_ORPHAN_GRACE_S``. Otherwise: end this rank so that it does not train on as an orphan."""
    what = f"the launcher process {pid}" if pid else "the launcher (parent) process"
    if _stop is None:
        if _stop_saved:
            _terminate(0, f"{what} exited after the graceful stop's save ({_stop_saved}): ending this rank (exit 0)")
        _terminate(143, f"{what} exited: ending this rank so that it does not train on as an orphan (exit 143)")
        return
    if _orphan_timer_started():
        return
    grace = float(os.environ.get("DS_LONGCTX_ORPHAN_GRACE_S", _ORPHAN_GRACE_S))
    if _request_stop(LAUNCHER_GONE):
        _say(f"{what} exited: finishing this step, saving a checkpoint, then exiting (at most {grace:.0f} s)")
    else:
        _say(f"{what} exited: the save goes on (at most {grace:.0f} s)")
    t = threading.Timer(grace, _terminate, (143, f"{what} exited and the save did not end within {grace:.0f} s "
                                            "(DS_LONGCTX_ORPHAN_GRACE_S): ending this rank (exit 143)"))
    t.daemon = True
    t.start()


_orphan_lock = threading.Lock()
_orphan_started = False


def _orphan_timer_started() -> bool:
    global _orphan_started
    with _orphan_lock:
        started, _orphan_started = _orphan_started, True
    return started


def _on_launcher_gone_signal(signum, frame):
    if _wakeup_thread is None:
        _on_launcher_gone(None)


def _python_stop_handler(signum, frame):
    # with the wakeup thread running, the thread already dispatched this delivery (the C-level handler
    # writes the signal number to the wakeup fd, then CPython calls this in the main thread)
    if _wakeup_thread is None:
        _on_stop_signal(signum, frame)


@contextlib.contextmanager
def graceful_stop():
    """While inside: the first SIGTERM, SIGUSR1 (SLURM's ``--signal=USR1@T`` before the time limit, a
    preemption notice) or SIGINT (Ctrl-C), or the launcher's death, does not end the rank; it is recorded, and
    :func:`stop_requested` says so. The training loop checks it at the end of every step on every rank, saves
    and exits 0. A second SIGTERM or SIGINT ends the rank at once with its cleanups (a stuck save cannot hold
    the job), except the deepspeed launcher's copy of the first (``_LAUNCHER_REPEAT_S``); a rank whose
    launcher died ends itself after ``_ORPHAN_GRACE_S``. Outside: the handlers it replaced are back."""
    global _stop
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("graceful_stop() must be entered in the main thread (signal handlers)")
    install_signal_handlers()  # the wakeup thread, so that a second signal ends a rank stuck in native code
    stop = _Stop()
    for name in STOP_SIGNALS:
        sig = getattr(signal, name, None)
        if sig is not None:
            stop.previous[int(sig)] = signal.getsignal(sig)
            signal.signal(sig, _python_stop_handler)
    _stop = stop
    try:
        yield stop
    finally:
        _stop = None
        for sig, handler in stop.previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def stop_requested() -> Optional[str]:
    """The name of the signal that asked this rank to stop gracefully, or None."""
    stop = _stop
    return stop.signal if stop is not None else None


_wakeup_thread: Optional[threading.Thread] = None


def _watch_wakeup_fd(fd: int) -> None:
    """Thread: the signal numbers CPython's C-level handler writes to the wakeup fd. A Python handler runs
    only in the main thread between bytecodes, so a main thread inside a long native call (a gloo wait, an
    NVMe read) would start the cleanups only when it returns: mpirun sends SIGKILL about a second after
    SIGTERM, which left NVMe files behind. This thread ends the rank at once (the main thread released the
    GIL in the native call)."""
    names = {int(getattr(signal, n)) for n in _TERM_SIGNALS if hasattr(signal, n)}
    while True:
        try:
            data = os.read(fd, 64)
        except OSError:
            return
        if not data:
            return
        for signum in data:
            handler = signal.getsignal(signum)
            if handler is _python_stop_handler:
                _on_stop_signal(signum, None)
            elif handler is _on_launcher_gone_signal:
                _on_launcher_gone(None)
            elif (signum in names or signum == signal.SIGUSR1) and handler is _on_signal:
                _on_signal(signum, None)


def install_signal_handlers() -> bool:
    """SIGTERM, SIGINT and SIGHUP end this rank cleanly: the ``on_exit`` cleanups, a one-line message, exit
    code 128+signal. Only replaces default handlers (SIG_DFL, Python's KeyboardInterrupt), only from
    the main thread; returns whether it installed them. Unless the process already has a wakeup fd
    (``signal.set_wakeup_fd``: asyncio's), one is set and a thread reads it, so that the rank ends within
    milliseconds even while the main thread is inside a native call."""
    global _wakeup_thread
    if threading.current_thread() is not threading.main_thread():
        return False
    installed = False
    for name in _TERM_SIGNALS:
        sig = getattr(signal, name, None)
        if sig is None:
            continue
        current = signal.getsignal(sig)
        if current in (signal.SIG_DFL, signal.default_int_handler, None) or current is _on_signal:
            signal.signal(sig, _on_signal)
            installed = True
    # under `ds-longctx launch` (launch/preemptible.py) the runner and launch.py ignore SIGUSR1 so that it reaches
    # only the ranks, which inherit the ignore: before the training loop's graceful stop it ends the rank
    if os.environ.get(WRAPPER_ENV) and signal.getsignal(signal.SIGUSR1) in (signal.SIG_IGN, signal.SIG_DFL):
        signal.signal(signal.SIGUSR1, _on_signal)
    if installed and _wakeup_thread is None and sys.platform != "win32":
        r, w = os.pipe()
        os.set_blocking(w, False)
        try:
            previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except (ValueError, OSError):
            previous = None
        if previous == -1:
            _wakeup_thread = threading.Thread(target=_watch_wakeup_fd, args=(r,), name="ds_longctx-signals",
                                              daemon=True)
            _wakeup_thread.start()
        else:  # someone else's wakeup fd: leave it (the main-thread handler still ends the rank)
            if previous is not None:
                signal.set_wakeup_fd(previous)
            os.close(r)
            os.close(w)
    return True


PR_SET_PDEATHSIG = 1
_watching = False


def proc_stat(pid: int) -> Optional[list]:
    """The fields of /proc/PID/stat after the command name (``[0]`` the state, ``[1]`` the parent pid, ``[19]`` the
    start time in clock ticks), None when the process is gone. The one reader of that file."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields if len(fields) > 19 else None


def proc_start_time(pid: int) -> Optional[str]:
    """Field 22 of /proc/PID/stat (start time in clock ticks): tells a live pid from a reused one."""
    fields = proc_stat(pid)
    return fields[19] if fields else None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _ppid_of(pid: int) -> Optional[int]:
    fields = proc_stat(pid)
    return int(fields[1]) if fields else None


def launcher_chain() -> list:
    """The processes whose death must end this rank: the parent, and when the parent is DeepSpeed's
    per-node ``deepspeed.launcher.launch``, also its parent (the ``deepspeed`` runner: SIGTERM to the
    runner alone makes it exit without stopping launch.py, whose ranks would train on as orphans), and the
    ``ds-longctx launch`` wrapper above them (``DS_LONGCTX_LAUNCHER_PID``)."""
    chain = []
    parent = os.getppid()
    if parent <= 1:
        return chain
    chain.append(parent)
    if "deepspeed.launcher.launch" in _cmdline(parent):
        grand = _ppid_of(parent)
        if grand and grand > 1:
            chain.append(grand)
    wrapper = os.environ.get(WRAPPER_ENV, "")
    if wrapper.isdigit() and int(wrapper) > 1 and int(wrapper) not in chain and proc_stat(int(wrapper)):
        chain.append(int(wrapper))
    return chain


def watch_launcher(interval_s: float = 0.5) -> bool:
    """React when a process of :func:`launcher_chain` dies: the kernel signals this rank when the parent dies
    (PR_SET_PDEATHSIG with ``_LAUNCHER_GONE_SIGNAL``, Linux), and a daemon thread polls the chain every
    ``interval_s`` (the parent check also covers a parent that died before prctl). Outside a graceful stop
    the rank ends (cleanups run, exit 143) so that it does not train on as an orphan; inside one
    (``train.py --save``), the step is finished and saved first (:func:`_on_launcher_gone`). Linux only;
    returns whether it is watching."""
    global _watching
    if _watching or not sys.platform.startswith("linux"):
        return _watching
    chain = [(pid, proc_start_time(pid)) for pid in launcher_chain()]
    if not chain:
        return False
    death_signal = signal.SIGTERM
    if _LAUNCHER_GONE_SIGNAL is not None and threading.current_thread() is threading.main_thread():
        signal.signal(_LAUNCHER_GONE_SIGNAL, _on_launcher_gone_signal)
        death_signal = _LAUNCHER_GONE_SIGNAL
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(death_signal), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # the watch thread below still ends the rank
    first_parent = chain[0][0]

    def watch():
        import time

        while True:
            time.sleep(interval_s)
            if os.getppid() != first_parent:
                gone = first_parent
            else:
                gone = next((pid for pid, start in chain if proc_start_time(pid) != start), None)
            if gone is not None:
                _on_launcher_gone(gone)  # ends the rank, or (graceful stop) arms the orphan deadline
                return

    threading.Thread(target=watch, name="ds_longctx-launcher-watch", daemon=True).start()
    _watching = True
    return True


def shutdown(code: int = 0, barrier: bool = True) -> None:
    """End this rank now, without interpreter finalization. Call it on every rank at the end of a
    training script (``ds_longctx.shutdown()``); it does not return.

    ``code == 0``: wait for the other ranks (``barrier``), run the ``atexit`` handlers, flush
    stdio and logging, ``MPI_Finalize`` when MPI was initialized, then ``os._exit(0)``.
    ``code != 0``: flush, then end the whole job: ``MPI_Abort(code)`` under MPI, else
    ``os._exit(code)`` (the deepspeed launcher, torchrun and ``srun --kill-on-bad-exit`` then stop
    the other ranks).
    """
    code = int(code)
    if code == 0:
        try:
            if barrier:
                _barrier()
            atexit._run_exitfuncs()  # what normal exit runs before finalization: users' handlers still run
        except BaseException as e:  # a peer died at the very end: this is an error exit after all
            report(e)
            code = 1
    _ending.acquire(blocking=False)  # a signal arriving now must not end the process half way
    run_cleanups()  # on error exits too (os._exit skips atexit): NVMe activation files, ...
    _flush()
    MPI = _mpi()
    if MPI is not None:
        if code == 0:
            MPI.Finalize()
        else:
            # a hung abort must not keep the process alive
            threading.Timer(_ABORT_GRACE_S, os._exit, (code,)).start()
            MPI.COMM_WORLD.Abort(code)
    os._exit(code)


def _barrier() -> None:
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    dist.barrier()


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int) and not isinstance(e.code, bool):
        return e.code
    return 1  # SystemExit("message"): Python prints it and exits 1


@contextlib.contextmanager
def main_guard():
    """Turn an exception on any rank into the end of the whole job::

        with ds_longctx.main_guard():
            main()
        ds_longctx.shutdown()

    An exception (or ``SystemExit`` with a non-zero code) prints this rank's traceback with a
    ``[rank N]`` prefix and calls ``shutdown(code)`` (exit code 1 for exceptions), so no rank is
    left waiting in a collective. A ConfigError (a bad input: one line naming the key and the fix) waits
    ``_CONFIG_ERROR_GRACE_S`` first when the job has several processes, so that every rank prints its copy
    before the launcher ends the others. ``SystemExit(0)`` ends the rank like ``shutdown(0)``.

    It also installs the signal handlers (:func:`install_signal_handlers`) and the launcher watch
    (:func:`watch_launcher`), so that SIGTERM/SIGINT or the launcher's death end the rank with its
    cleanups.
    """
    install_signal_handlers()
    watch_launcher()
    try:
        yield
    except SystemExit as e:
        code = _exit_code(e)
        if code and isinstance(e.code, str):
            _flush()
            os.write(2, f"{_prefix()}{e.code}\n".encode(errors="replace"))
        shutdown(code)
    except BaseException as e:
        report(e)
        _config_error_grace(e)
        shutdown(130 if isinstance(e, KeyboardInterrupt) else 1)


def _config_error_grace(exc: BaseException) -> None:
    """After a ConfigError on a job of several processes: wait ``_CONFIG_ERROR_GRACE_S`` so that every rank
    meeting the same check prints it before the launcher ends the job (a SIGTERM from the launcher still ends
    this rank at once, through its handler)."""
    if not isinstance(exc, ConfigError):
        return
    if launched_world_size() > 1:
        import time

        time.sleep(_CONFIG_ERROR_GRACE_S)


def run(main: Callable[..., Any], *args, **kwargs) -> None:
    """``main(*args, **kwargs)`` under ``main_guard()``, then ``shutdown(0)``: the whole entry point
    of a rank (``if __name__ == "__main__": ds_longctx.run(main)``). Does not return."""
    with main_guard():
        main(*args, **kwargs)
    shutdown(0)
