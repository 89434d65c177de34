"""Test hooks (the tests and bench/fault_rerun.py only) for faults at a repeatable moment of a save, kept out of the
save path: it calls :func:`point` at each of :data:`SAVE_POINTS` inside :func:`saving`, and nothing happens unless
an environment variable asks for it (always unset outside tests).

``DS_LONGCTX_TEST_KILL_AT="RANK:POINT"`` makes that rank SIGKILL itself there; ``DS_LONGCTX_TEST_FILL_AT="RANK:POINT"``
makes it fill the save directory's filesystem there (a real full disk: a file of zeros until ENOSPC);
``"RANK:POINT@STEP"``: only in the save of that step. ``fileN`` counts the files DeepSpeed writes on that rank."""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Optional

TEST_KILL_ENV = "DS_LONGCTX_TEST_KILL_AT"
TEST_FILL_ENV = "DS_LONGCTX_TEST_FILL_AT"
TEST_FILLER = ".ds_longctx-test-filler"
SAVE_POINTS = ("before_fileN", "after_fileN", "after_files", "before_record", "after_record", "after_rename",
               "after_latest", "done")


class _Save:
    into: Optional[str] = None   # the save directory of the save in progress
    step: Optional[int] = None


@contextlib.contextmanager
def saving(path: str, step: int):
    """The save of ``step`` into ``path`` is in progress (what :func:`point` fills and which step it matches)."""
    _Save.into, _Save.step = path, step
    try:
        yield
    finally:
        _Save.into = _Save.step = None


def _hook_on(env: str, rank: int, where: str) -> bool:
    """``env`` is "RANK:POINT", or "RANK:POINT@STEP" for the save of that step only."""
    value = os.environ.get(env)
    if not value:
        return False
    at, _, step = value.partition("@")
    return at == f"{rank}:{where}" and (not step or str(_Save.step) == step)


def point(rank: int, where: str) -> None:
    """The save reached ``where`` on ``rank``: a fault the environment asks for happens here."""
    if _Save.into and _hook_on(TEST_FILL_ENV, rank, where):
        try:
            with open(os.path.join(_Save.into, TEST_FILLER), "ab") as f:
                block = b"\0" * (1 << 16)
                while True:
                    f.write(block)
                    f.flush()
        except OSError:
            pass
    if _hook_on(TEST_KILL_ENV, rank, where):
        import signal

        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os.write(2, f"[rank {rank}] ds_longctx test hook: SIGKILL at {where}\n".encode())
        os.kill(os.getpid(), signal.SIGKILL)
