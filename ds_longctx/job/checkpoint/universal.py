"""DeepSpeed's universal checkpoint of a tag (``ds_to_universal``), written beside it under a temporary name and
renamed when complete; its worker processes end with the converting process."""
from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import sys
import time

from ...dist.runtime import proc_stat
from ...errors import ConfigError
from . import manifest
from .tags import TMP_PREFIX, UNIVERSAL_RECORD, UNIVERSAL_SUFFIX, fsync_dir, check_tag


_converting = False


_fork_hook = False


def _install_worker_death_signal() -> None:
    """DeepSpeed's ds_to_universal extracts and merges in ``multiprocessing.Pool`` workers (forked), which outlive a
    conversion killed with -9 (ppid 1, for good). Every process forked while a conversion runs asks the kernel for
    SIGKILL when its parent dies (PR_SET_PDEATHSIG). Linux; once per process (fork hooks cannot be removed, so the
    hook checks ``_converting``)."""
    global _fork_hook
    if _fork_hook or not sys.platform.startswith("linux") or not hasattr(os, "register_at_fork"):
        return

    def child():
        if _converting:
            try:
                import ctypes
                import signal

                ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
                if os.getppid() == 1:  # the parent died between the fork and the prctl
                    os._exit(1)
            except (OSError, AttributeError):
                pass

    os.register_at_fork(after_in_child=child)
    _fork_hook = True


def _remove_dead_conversions(path: str, out_tag: str) -> None:
    """Remove the partial conversions of ``out_tag`` a killed process left in ``path`` (``.tmp-<tag>.universal-<host>-
    <pid>``): those of this host whose pid is gone (another host's, or a live one, may still be writing)."""
    prefix = f"{TMP_PREFIX}{out_tag}-{socket.gethostname()}-"
    try:
        entries = os.listdir(path)
    except OSError:
        return
    for entry in entries:
        pid = entry[len(prefix):]
        if entry.startswith(prefix) and pid.isdigit() and int(pid) != os.getpid() and proc_stat(int(pid)) is None:
            shutil.rmtree(os.path.join(path, entry), ignore_errors=True)


def _reusable(out: str, marker: str, record: dict, log) -> bool:
    """An existing conversion is of this tag's content and its own files match the checksums it recorded (one
    process reads them all: a damaged conversion is converted again, said)."""
    try:
        with open(marker) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return False
    if saved.get("source_files") != record.get("files") or \
            saved.get("source_checksums") != manifest.checksums_of(record):
        return False
    sums = saved.get("checksums")
    problem = manifest.verify(out, sums) if isinstance(sums, dict) else None
    if problem:
        log(f"warning: the universal checkpoint {out!r} is damaged ({problem}): converting again")
        return False
    return True


def convert_to_universal(path: str, tag: str, workers: int = 1, log=print, verified: bool = False) -> str:
    """DeepSpeed's ``ds_to_universal`` of ``path/tag`` into ``path/tag.universal`` (written under a temporary
    name, renamed when complete; reused when already there and intact). The source tag is verified by content
    first (``verified``: the caller did, on every rank); the output's checksums go into its marker
    (:data:`UNIVERSAL_RECORD`). Returns the universal tag. One process."""
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    out_tag = tag + UNIVERSAL_SUFFIX
    out = os.path.join(path, out_tag)
    src = os.path.join(path, tag)
    marker = os.path.join(out, UNIVERSAL_RECORD)
    record, problem = check_tag(path, tag, None if verified else manifest.verify_tag)
    if problem:
        raise ConfigError("checkpoint", problem, "convert a complete checkpoint")
    if os.path.isfile(marker):
        if _reusable(out, marker, record, log):
            return out_tag
        shutil.rmtree(out)
    _remove_dead_conversions(path, out_tag)
    tmp = os.path.join(path, f"{TMP_PREFIX}{out_tag}-{socket.gethostname()}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.monotonic()
    args = type("Args", (), dict(input_folder=src, output_folder=tmp, num_extract_workers=workers,
                                 num_merge_workers=max(1, workers // 2), keep_temp_folder=False, strict=True,
                                 inject_missing_state=False))()
    import contextlib
    import io

    buf = io.StringIO()
    global _converting
    _install_worker_death_signal()
    try:
        _converting = True  # its multiprocessing pools' workers end with this process (kill -9 included)
        with contextlib.redirect_stdout(buf):  # its progress bars and prints: kept for the error message
            ds_to_universal(args)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError("checkpoint", f"DeepSpeed's ds_to_universal failed on {src!r} ({type(e).__name__}: "
                          f"{str(e)[:400]})", "resume with the layout the checkpoint was saved with") from None
    finally:
        _converting = False
        try:  # it writes <parent>/latest_universal naming its output folder (the temporary name): we load by tag
            os.remove(os.path.join(path, "latest_universal"))
        except OSError:
            pass
    sums = {}
    for root, _, names in os.walk(tmp):
        for n in names:
            full = os.path.join(root, n)
            sums[os.path.relpath(full, tmp)] = manifest.digest_file(full, fsync=True)[1]
    with open(os.path.join(tmp, UNIVERSAL_RECORD), "w") as f:
        json.dump({"source_tag": tag, "source_files": record.get("files"),
                   "source_checksums": manifest.checksums_of(record), "algorithm": manifest.ALGORITHM,
                   "checksums": sums, "seconds": time.monotonic() - t0}, f)
    try:
        os.rename(tmp, out)
    except OSError as e:  # another job converted the same tag meanwhile: theirs is complete (renamed last)
        shutil.rmtree(tmp, ignore_errors=True)
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not os.path.isfile(marker):
            raise
    fsync_dir(path)
    log(f"converted {src} to DeepSpeed's universal checkpoint {out} in {time.monotonic() - t0:.2f} s")
    return out_tag
