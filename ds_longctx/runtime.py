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
"""
from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import traceback
from typing import Any, Callable, Optional

# seconds an error exit may spend in MPI_Abort before the process ends itself
_ABORT_GRACE_S = 30.0

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
    """Print ``exc`` to stderr, every line prefixed with this rank: a ConfigError as its one-line
    message (it names the key and the fix), anything else as its full traceback."""
    from .errors import ConfigError

    if isinstance(exc, ConfigError):
        text = f"ds_longctx: error: {exc}\n"
    else:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    prefix = _prefix()
    lines = "".join(prefix + line + "\n" for line in text.rstrip("\n").split("\n"))
    _flush()
    try:
        os.write(2, lines.encode(errors="replace"))  # unbuffered: the process may end right after
    except OSError:
        pass


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
    left waiting in a collective. ``SystemExit(0)`` ends the rank like ``shutdown(0)``.
    """
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
        shutdown(130 if isinstance(e, KeyboardInterrupt) else 1)


def run(main: Callable[..., Any], *args, **kwargs) -> None:
    """``main(*args, **kwargs)`` under ``main_guard()``, then ``shutdown(0)``: the whole entry point
    of a rank (``if __name__ == "__main__": ds_longctx.run(main)``). Does not return."""
    with main_guard():
        main(*args, **kwargs)
    shutdown(0)
