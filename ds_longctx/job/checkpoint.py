"""Checkpoints for runs of days: saved during the run, resumed on any layout, exported as a Hugging Face model.

The formats are DeepSpeed's and transformers'. A tag is DeepSpeed's own checkpoint (``engine.save_checkpoint``)
plus ds_longctx's record (:data:`RECORD_FILE`: the run's layout, its data position and data identity, the
model's shape facts and HF config, the optimizer and scheduler sections, each file's size). A resume on another
world size, SP or DP degree goes through DeepSpeed's universal checkpoint (``ds_to_universal``, then
``checkpoint.load_universal``). An export gathers the weights with DeepSpeed's own means (ZeRO-3's consolidated
16-bit state dict for a live engine, ``zero_to_fp32`` for a saved tag) and writes them with transformers'
``save_pretrained``: safetensors shards, config, generation config, tokenizer.

What a save guarantees (every rank calls it):

* A tag is written under a temporary name (``.tmp-<tag>``) and renamed once every rank's files, fsynced, and
  the record are there; ``latest`` moves after the rename. A save killed at any moment (SIGKILL, power) leaves
  the previous complete tag and ``latest`` as they were; the next run on the directory removes the partial one.
* A failed write (disk full, I/O error) does not raise inside DeepSpeed's save (the other ranks would wait in
  its barrier until the process-group timeout): it is recorded, every rank learns of it, the partial tag is
  removed, and every rank raises one ConfigError naming the path, the bytes and the free space.
* Free space is checked before every save against the bytes it will write (the previous save's, or before the
  first one the model states' estimate :func:`estimate_bytes`), per filesystem (a shared one holds every
  rank's files, a node-local one its node's).
* One run per save directory: :class:`SaveDir` holds a lock on it for the run; a second run is refused naming
  the holder (host, pid, start). The lock is an ``flock``: the kernel drops it when the holder dies.

Resume (:func:`plan_resume` before ``initialize``, :meth:`ResumePlan.load` after): the tag ``latest`` names when
it is complete, else the newest complete tag (said). Another world / SP / DP degree: converted once to
``<tag>.universal`` beside it (rank 0; ``ds-longctx convert`` does it offline) and loaded with DeepSpeed's
universal loader. Refused before any tensor is read, naming the difference: another model, other data, another
sequence length, another ZeRO stage (DeepSpeed's loaders cannot cross stages), another optimizer type. A changed
learning rate or schedule takes effect and is reported.

Checkpoints are unpickled by DeepSpeed (``torch.load(weights_only=False)``): resume only directories you trust.
"""
from __future__ import annotations

import copy
import errno
import itertools
import json
import os
import shutil
import socket
import sys
import time
import uuid
import zipfile
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from .._version import __version__
from ..data.corpus import atomic_write
from ..errors import ConfigError
from ..dist.layout import zero_stage
from ..models import text_config
from ..models.adapters import is_peft_model
from ..planner.model_states import optimizer_states_per_param
from ..planner.units import fmt_bytes
from ..dist.runtime import proc_stat

RECORD_FILE = "ds_longctx_layout.json"   # ds_longctx's record in every tag (the name older runs used)
HF_CONFIG_DIR = "hf"                      # the model's HF config (+ tokenizer, generation config) in every tag
UNIVERSAL_SUFFIX = ".universal"           # DeepSpeed's universal checkpoint of tag T: <dir>/T.universal
UNIVERSAL_RECORD = "ds_longctx_universal.json"
LOCK_FILE = ".ds_longctx.lock"
TMP_PREFIX, OLD_PREFIX = ".tmp-", ".old-"

# what must match the checkpoint for a plain (non-universal) DeepSpeed load: ZeRO partitions follow them
PARTITION_KEYS = ("world_size", "sequence_parallel_size", "data_parallel_size")
MODEL_KEYS = ("model_type", "layers", "heads", "kv_heads", "head_dim", "hidden", "vocab")


def tag_for(step: int) -> str:
    return f"step{step}"


def _step_of(tag: str) -> Optional[int]:
    return int(tag[4:]) if tag.startswith("step") and tag[4:].isdigit() else None


# ---------------------------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------------------------


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


_RENAME_EXCHANGE = 2


def _exchange(a: str, b: str) -> bool:
    """Swap two directory entries in one atomic step (Linux renameat2 RENAME_EXCHANGE); False where the kernel,
    libc or filesystem cannot (then the caller renames in two steps)."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    AT_FDCWD = -100
    return fn(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def _free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def tag_files(tag_dir: str) -> Dict[str, int]:
    """{relative path: size} of every file of a saved tag (the record and the HF config excepted)."""
    out = {}
    for root, _, names in os.walk(tag_dir):
        for n in names:
            full = os.path.join(root, n)
            rel = os.path.relpath(full, tag_dir)
            if rel != RECORD_FILE and not rel.startswith(HF_CONFIG_DIR + os.sep):
                out[rel] = os.path.getsize(full)
    return out


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _rank_world() -> Tuple[int, int]:
    dist = _dist()
    return (dist.get_rank(), dist.get_world_size()) if dist else (0, 1)


def _all_gather(obj) -> list:
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _broadcast(obj):
    """Rank 0's ``obj`` on every rank."""
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _raise_everywhere(outcome) -> None:
    """``outcome`` (the same on every rank) is None, or a ConfigError's (key, problem, fix)."""
    if outcome is not None:
        raise ConfigError(*outcome)


# Test hooks (tests and bench/fault_rerun.py only), for faults at a repeatable moment of a save (points:
# SAVE_POINTS; fileN counts the files DeepSpeed writes on that rank): DS_LONGCTX_TEST_KILL_AT="RANK:POINT" makes
# that rank SIGKILL itself there; DS_LONGCTX_TEST_FILL_AT="RANK:POINT" makes it fill the save directory's
# filesystem there (a real full disk: a file of zeros until ENOSPC). "RANK:POINT@STEP": only in the save of that
# step. Unset (always, outside tests), nothing changes.
TEST_KILL_ENV = "DS_LONGCTX_TEST_KILL_AT"
TEST_FILL_ENV = "DS_LONGCTX_TEST_FILL_AT"
TEST_FILLER = ".ds_longctx-test-filler"
SAVE_POINTS = ("before_fileN", "after_fileN", "after_files", "before_record", "after_record", "after_rename",
               "after_latest", "done")
_saving_into: Optional[str] = None


_saving_step: Optional[int] = None


def _hook_on(env: str, rank: int, point: str) -> bool:
    """``env`` is "RANK:POINT", or "RANK:POINT@STEP" for the save of that step only."""
    value = os.environ.get(env)
    if not value:
        return False
    where, _, step = value.partition("@")
    return where == f"{rank}:{point}" and (not step or str(_saving_step) == step)


def _kill_point(rank: int, point: str) -> None:
    if _saving_into and _hook_on(TEST_FILL_ENV, rank, point):
        try:
            with open(os.path.join(_saving_into, TEST_FILLER), "ab") as f:
                block = b"\0" * (1 << 16)
                while True:
                    f.write(block)
                    f.flush()
        except OSError:
            pass
    if _hook_on(TEST_KILL_ENV, rank, point):
        import signal

        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os.write(2, f"[rank {rank}] ds_longctx test hook: SIGKILL at {point}\n".encode())
        os.kill(os.getpid(), signal.SIGKILL)


# ---------------------------------------------------------------------------------------------
# reading what is saved
# ---------------------------------------------------------------------------------------------


def check_tag(path: str, tag: str) -> Tuple[Optional[dict], Optional[str]]:
    """(record, None) for a complete, readable tag, else (None, the problem naming its file)."""
    tag_dir = os.path.join(path, tag)
    if not os.path.isdir(tag_dir):
        return None, f"tag directory {tag_dir!r} does not exist"
    rec_path = os.path.join(tag_dir, RECORD_FILE)
    if not os.path.isfile(rec_path):
        return None, (f"{rec_path!r} is missing (the save did not finish, or the checkpoint was not saved by "
                      "ds_longctx)")
    try:
        with open(rec_path) as f:
            record = json.load(f)
        if not isinstance(record, dict):
            raise ValueError(f"a JSON {type(record).__name__}, not an object")
    except (ValueError, UnicodeDecodeError) as e:
        return None, f"{rec_path!r} is not a valid layout record ({e})"
    files = record.get("files")
    if isinstance(files, dict):
        for rel, size in sorted(files.items()):
            full = os.path.join(tag_dir, rel)
            if not os.path.isfile(full):
                return None, f"{full!r} is missing"
            if os.path.getsize(full) != size:
                return None, f"{full!r} has {os.path.getsize(full)} bytes, {size} were saved (truncated or replaced)"
    for rel in sorted(files if isinstance(files, dict) else tag_files(tag_dir)):
        full = os.path.join(tag_dir, rel)
        if rel.endswith((".pt", ".bin")):
            try:  # torch.save's zip archive: reading its directory catches truncation and foreign bytes cheaply
                zipfile.ZipFile(full).close()
            except (zipfile.BadZipFile, OSError) as e:
                return None, f"{full!r} is not a readable torch checkpoint file ({e})"
    return record, None


def find_resume_tag(path: str, name: str = "--resume") -> Tuple[str, dict, Optional[str]]:
    """(tag, record, note) of the checkpoint a resume loads from ``path``: the tag in ``latest`` when it is
    complete and readable, else the newest complete tag (``note`` says why and which); a ConfigError when
    there is none."""
    if not os.path.isdir(path):
        raise ConfigError(name, f"{path!r} holds no checkpoint (no such directory)", "give the directory passed to "
                          "--save")
    latest = os.path.join(path, "latest")
    problem = tag = None
    if os.path.isfile(latest):
        try:
            with open(latest) as f:
                tag = f.read().strip()
        except (OSError, UnicodeDecodeError) as e:
            problem = f"{latest!r} cannot be read ({e})"
        if tag is not None:
            if not tag or os.sep in tag:
                problem = f"{latest!r} does not name a tag (holds {tag!r})"
            else:
                record, problem = check_tag(path, tag)
                if problem is None:
                    return tag, record, None
                parked = OLD_PREFIX + tag  # a replace of T killed between its two renames: T is complete there
                if not os.path.exists(os.path.join(path, tag)) and check_tag(path, parked)[0] is not None:
                    return parked, check_tag(path, parked)[0], (f"{name}: {os.path.join(path, tag)!r} was being "
                                                                f"replaced when its run ended; resuming from its "
                                                                f"complete copy {os.path.join(path, parked)!r}")
    candidates = []
    for entry in os.listdir(path):
        if entry == tag or entry.startswith((TMP_PREFIX, OLD_PREFIX)) or entry.endswith(UNIVERSAL_SUFFIX) or \
                not os.path.isdir(os.path.join(path, entry)):
            continue
        record, _ = check_tag(path, entry)
        if record is not None:
            candidates.append((int(record.get("step", -1)), entry, record))
    if not candidates:
        if problem is None:
            raise ConfigError(name, f"{path!r} holds no checkpoint (no 'latest' file)",
                              "give the directory passed to --save")
        raise ConfigError(name, f"checkpoint {tag!r} in {path!r}: {problem}, and no other complete checkpoint is "
                          "there", "resume a complete checkpoint saved by ds_longctx, or start a new run")
    step, best, record = max(candidates)
    why = problem or "there is no 'latest' file"
    note = f"{name}: {why}; resuming from {os.path.join(path, best)!r} (step {step}), the newest complete checkpoint"
    return best, record, note


def model_facts(model_config) -> dict:
    """The shape facts a checkpoint must share with the model it is loaded into."""
    tc = text_config(model_config)
    heads = getattr(tc, "num_attention_heads", None)
    hidden = getattr(tc, "hidden_size", None)
    head_dim = getattr(tc, "head_dim", None) or (hidden // heads if hidden and heads else None)
    return {"model_type": getattr(tc, "model_type", None), "layers": getattr(tc, "num_hidden_layers", None),
            "heads": heads, "kv_heads": getattr(tc, "num_key_value_heads", None) or heads, "head_dim": head_dim,
            "hidden": hidden, "vocab": getattr(tc, "vocab_size", None)}


# ---------------------------------------------------------------------------------------------
# bytes a save writes
# ---------------------------------------------------------------------------------------------

_RECORD_SLACK = 64 << 10  # the record, the HF config, torch's archive overhead per file (zero_to_fp32.py: in it)


def checkpoint_bytes(ds_config: dict, n_params: int, lp_bytes: int = 2) -> int:
    """Bytes of one checkpoint of the whole job (every rank) by arithmetic: ZeRO's fp32 master weights and the
    optimizer's states (planner.model_states.optimizer_states_per_param: AdamW 2) for every parameter, plus the
    16-bit (``lp_bytes``) module that rank 0 saves without ZeRO-3. ZeRO-3's model-state files hold shapes only."""
    total = n_params * 4 * (1 + optimizer_states_per_param(ds_config))
    if zero_stage(ds_config) != 3:
        total += n_params * lp_bytes
    return int(total)


def estimate_bytes(engine) -> int:
    """Bytes this rank writes for one checkpoint, from its model states: its fp32 master partition and the
    optimizer's states of the same size (:func:`checkpoint_bytes`' rule, on this rank's partition), the module's
    weights on the rank that saves them (no ZeRO-3), plus a small allowance. Checked against real saves in
    tests/test_long_runs.py."""
    stage = engine.zero_optimization_stage()
    opt = engine.optimizer
    if stage == 3:
        numel = sum(t.numel() for t in getattr(opt, "fp32_partitioned_groups_flat", []))
    elif stage in (1, 2):
        numel = sum(t.numel() for t in getattr(opt, "single_partition_of_fp32_groups", []))
    else:
        numel = sum(p.numel() for p in engine.module.parameters()) if engine.global_rank == 0 else 0
    total = numel * 4 * (1 + optimizer_states_per_param(engine.config or {}))
    if stage != 3 and engine.global_rank == 0:  # the module's own (16-bit or fp32) weights in the model states
        total += sum(p.numel() * p.element_size() for p in engine.module.parameters())
    return int(total + _RECORD_SLACK)


# ---------------------------------------------------------------------------------------------
# the save directory of a run: lock, checks before step 1, saves
# ---------------------------------------------------------------------------------------------


def _holder_text(lock_path: str) -> str:
    try:
        with open(lock_path) as f:
            h = json.load(f)
        return (f"host {h.get('host')!r}, pid {h.get('pid')}, started {h.get('started')}"
                + (f", command {h.get('command')!r}" if h.get("command") else ""))
    except (OSError, ValueError):
        return "a process whose details could not be read"


@dataclass
class SaveDir:
    """The ``--save`` directory of one run (every rank holds one; rank 0 holds the lock).

    :meth:`acquire` (as soon as the process group exists) and :meth:`check_space` (after ``initialize``) run the
    checks before step 1, :meth:`open` both; :meth:`save` writes a tag; :meth:`close` releases the lock."""

    path: str
    name: str = "--save"
    keep_last: Optional[int] = None
    per_rank_bytes: int = 0                     # what this rank's save writes (estimate, then the last save's)
    groups: List[List[int]] = field(default_factory=list)  # ranks sharing one filesystem for the save
    _lock_fd: Optional[int] = None
    last_save_s: Optional[float] = None

    @classmethod
    def open(cls, engine, path: str, keep_last: Optional[int] = None, name: str = "--save",
             log=print) -> "SaveDir":
        """:meth:`acquire` then :meth:`check_space` (a custom loop, after ``initialize``)."""
        sd = cls.acquire(path, keep_last=keep_last, name=name)
        sd.check_space(engine, log=log)
        return sd

    # ---- before the model is built, then before step 1 ---------------------------------------------------
    @classmethod
    def acquire(cls, path: str, keep_last: Optional[int] = None, name: str = "--save") -> "SaveDir":
        """Every rank, as soon as the process group exists (before the model is built: a second run on the same
        directory fails in seconds, not after loading the model): the directory exists (created) and is writable
        on every rank, this run holds its lock (another run's is refused naming its holder), partial tags of
        killed runs are removed, and which ranks share a filesystem is known (rank 0 drops a marker, each rank
        looks for it)."""
        sd = cls(path=os.path.abspath(path), name=name, keep_last=keep_last)
        rank, _ = _rank_world()
        token = uuid.uuid4().hex
        outcome = sd._lock_and_clean(token) if rank == 0 else None
        outcome, token = _broadcast((outcome, token))
        if outcome is not None:
            sd.close()
        _raise_everywhere(outcome)
        sees_marker = os.path.exists(os.path.join(sd.path, f".ds_longctx.fs-{token}"))
        problem = None
        try:
            os.makedirs(sd.path, exist_ok=True)  # a node-local directory on another node
            probe = os.path.join(sd.path, f".ds_longctx.write-test-{rank}-{os.getpid()}")
            with open(probe, "w") as f:
                f.write("ok")
            os.remove(probe)
        except OSError as e:
            problem = f"{sd.path!r} is not writable on rank {rank} ({socket.gethostname()}): {e.strerror}"
        facts = _all_gather({"host": socket.gethostname(), "shared": sees_marker, "problem": problem})
        if rank == 0:
            try:
                os.remove(os.path.join(sd.path, f".ds_longctx.fs-{token}"))
            except OSError:
                pass
        problems = [f["problem"] for f in facts if f["problem"]]
        if problems:
            sd.close()
            raise ConfigError(name, problems[0] + (f" (and {len(problems) - 1} more ranks)" if len(problems) > 1
                                                   else ""), "give a directory every rank can write")
        # ranks that see rank 0's marker share its filesystem; the others are grouped by host (node-local)
        local: Dict[str, List[int]] = {}
        for r, f in enumerate(facts):
            if not f["shared"]:
                local.setdefault(f["host"], []).append(r)
        sd.groups = [[r for r, f in enumerate(facts) if f["shared"]]] + list(local.values())
        return sd

    def check_space(self, engine, log=print) -> None:
        """Every rank, after ``initialize``, before step 1: each filesystem holding the directory has room for one
        checkpoint of every rank writing there (this rank's bytes from its model states: :func:`estimate_bytes`);
        says how many bytes a save writes."""
        rank, _ = _rank_world()
        self.per_rank_bytes = estimate_bytes(engine)
        facts = _all_gather({"host": socket.gethostname(), "free": _free_bytes(self.path),
                             "bytes": self.per_rank_bytes})
        self._check_space(facts, "one checkpoint")
        if rank == 0:
            total = sum(f["bytes"] for f in facts)
            where = ("one filesystem shared by every rank" if len(self.groups) == 1
                     else f"{len(self.groups)} filesystems (node-local directories)")
            log(f"checkpoints: {self.path} ({where}): about {fmt_bytes(total)} per save ({fmt_bytes(self.per_rank_bytes)} "
                f"on rank 0, from the model states), {fmt_bytes(min(f['free'] for f in facts))} free"
                + (f"; keeping the last {self.keep_last}" if self.keep_last else ""))

    def _lock_and_clean(self, token: str):
        """Rank 0: create the directory, take the run's lock, drop a marker other ranks look for, remove partial
        tags. Returns None or a ConfigError's parts (broadcast: the same verdict on every rank)."""
        import fcntl

        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as e:
            return (self.name, f"cannot create {self.path!r} ({e.strerror})", "give a directory this user can create")
        lock_path = os.path.join(self.path, LOCK_FILE)
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            return (self.name, f"{self.path!r} is not writable ({e.strerror})", "give a directory this user can write")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return (self.name, f"{self.path!r} is in use by another run ({_holder_text(lock_path)})",
                        "give this run its own --save directory, or stop the other run first (the lock goes with "
                        "its process)")
            return (self.name, f"cannot lock {lock_path!r} ({e.strerror})", "use a filesystem with flock support")
        self._lock_fd = fd
        holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "command": " ".join(sys.argv)[:300]}
        try:
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps(holder).encode())
            os.fsync(fd)
            with open(os.path.join(self.path, f".ds_longctx.fs-{token}"), "w") as f:
                f.write("marker")
        except OSError as e:
            return (self.name, f"{self.path!r} is not writable ({e.strerror})", "give a directory with free space "
                    "this user can write")
        removed = []
        for entry in sorted(os.listdir(self.path)):
            if entry.startswith((TMP_PREFIX, OLD_PREFIX)) and os.path.isdir(os.path.join(self.path, entry)):
                # a complete tag parked as .old-T during a replace that was killed: put it back if T is missing
                orig = entry[len(OLD_PREFIX):]
                if entry.startswith(OLD_PREFIX) and not os.path.exists(os.path.join(self.path, orig)) and \
                        check_tag(self.path, entry)[0] is not None:
                    os.replace(os.path.join(self.path, entry), os.path.join(self.path, orig))
                    continue
                shutil.rmtree(os.path.join(self.path, entry), ignore_errors=True)
                removed.append(entry)
        if removed:
            print(f"[ds_longctx] {self.name}: removed partial checkpoint(s) an earlier run left: {', '.join(removed)}",
                  file=sys.stderr, flush=True)
        return None

    def _check_space(self, facts: List[dict], what: str) -> None:
        """Every filesystem group has room for ``what``: the same verdict on every rank (facts are gathered)."""
        for group in self.groups:
            if not group:
                continue
            need = sum(facts[r]["bytes"] for r in group)
            missing = [r for r in group if facts[r].get("missing")]
            if missing:  # statvfs of a removed directory would read as 0 B free
                hosts = sorted({facts[r]["host"] for r in missing})
                raise ConfigError(self.name, f"{self.path!r} no longer exists on {', '.join(hosts)} (ranks "
                                  f"{_ranks(missing)}): it was removed or renamed while this run saved to it, with "
                                  f"its checkpoints and lock; {what} was not written",
                                  "leave a --save directory in place while its run goes on; start again with --save "
                                  "on an existing or new directory (with --resume from a copy of the checkpoints, "
                                  "if one exists)")
            free = min(facts[r]["free"] for r in group)
            if need > free:
                hosts = sorted({facts[r]["host"] for r in group})
                raise ConfigError(self.name, f"{self.path!r} has {fmt_bytes(free)} free on {', '.join(hosts)}; {what} of "
                                  f"ranks {_ranks(group)} needs {fmt_bytes(need)} ({need} bytes)",
                                  "free space there or save to a larger filesystem (--keep-last N removes older "
                                  "checkpoints only after each save: the filesystem needs room for N+1 checkpoints, "
                                  "so it helps only where two fit)")

    def close(self) -> None:
        if self._lock_fd is not None:
            try:
                os.close(self._lock_fd)  # releases the flock
            except OSError:
                pass
            self._lock_fd = None

    # ---- one save -----------------------------------------------------------------------------
    def save(self, engine, step: int, record: dict, client_state: Optional[dict] = None, hf_config=None,
             tokenizer=None) -> str:
        """Save ``step`` as tag ``step<step>`` (every rank). ``record``: the run's layout and data position (JSON);
        ``hf_config``/``tokenizer``: saved into the tag so that ``ds-longctx export`` needs nothing else."""
        global _saving_into, _saving_step
        _saving_into, _saving_step = self.path, step  # for the test hooks only
        try:
            return self._save(engine, step, record, client_state, hf_config, tokenizer)
        finally:
            _saving_into = _saving_step = None

    def _save(self, engine, step, record, client_state, hf_config, tokenizer) -> str:
        rank, _ = _rank_world()
        tag = tag_for(step)
        tmp = TMP_PREFIX + tag
        t0 = time.monotonic()
        # room for it, on every filesystem, before a byte is written
        facts = _all_gather({"free": _free_bytes(self.path) if os.path.isdir(self.path) else 0,
                             "missing": not os.path.isdir(self.path), "bytes": self.per_rank_bytes,
                             "host": socket.gethostname()})
        self._check_space(facts, f"the checkpoint of step {step}")
        if rank == 0 and os.path.exists(os.path.join(self.path, tmp)):
            shutil.rmtree(os.path.join(self.path, tmp), ignore_errors=True)
        written, errors = _save_files(engine, self.path, tmp, dict(client_state or {}, step=step,
                                                                   ds_longctx_layout=record), rank)
        _kill_point(rank, "after_files")
        for path in written:  # durable before the rename makes the tag visible
            try:
                _fsync_file(path)
            except OSError as e:
                errors.append(f"{path}: fsync failed ({e.strerror})")
        gathered = _all_gather({"errors": errors, "bytes": sum(os.path.getsize(p) for p in written
                                                              if os.path.exists(p)), "free": facts[rank]["free"]})
        failed = [(r, g["errors"][0]) for r, g in enumerate(gathered) if g["errors"]]
        outcome = None
        if rank == 0:
            if failed:
                shutil.rmtree(os.path.join(self.path, tmp), ignore_errors=True)
                group = next(g for g in self.groups if failed[0][0] in g)
                outcome = self._failure(step, failed, facts[failed[0][0]]["free"], sum(facts[r]["bytes"] for r in group))
            else:
                outcome = self._publish(tag, tmp, dict(record, step=step), hf_config, tokenizer, rank)
        outcome = _broadcast(outcome)
        _raise_everywhere(outcome)
        self.per_rank_bytes = max(gathered[rank]["bytes"], 1)  # the next save writes what this one wrote
        self.last_save_s = time.monotonic() - t0
        _kill_point(rank, "done")
        return tag

    def _failure(self, step: int, failed, free_before: int, need: int):
        r, first = failed[0]
        latest = os.path.join(self.path, "latest")
        prev = open(latest).read().strip() if os.path.isfile(latest) else None
        keep = (f"the previous checkpoint {prev!r} and 'latest' are intact: --resume {self.path} continues from it"
                if prev else "no earlier checkpoint exists in this directory")
        return (self.name, f"saving step {step} to {self.path!r} failed on rank {r}: {first}"
                + (f" (and on {len(failed) - 1} more ranks)" if len(failed) > 1 else "")
                + f"; {fmt_bytes(free_before)} was free there before the save, which needed about {fmt_bytes(need)} (something "
                  f"else filled the filesystem meanwhile, or it failed); the partial save is removed; {keep}",
                "free space on that filesystem (or save elsewhere), then resume")

    def _publish(self, tag: str, tmp: str, record: dict, hf_config, tokenizer, rank: int):
        """Rank 0, after every rank's files are durable: record, rename, latest, prune."""
        tmp_dir, tag_dir = os.path.join(self.path, tmp), os.path.join(self.path, tag)
        try:
            if hf_config is not None or tokenizer is not None:
                _save_hf_side_files(os.path.join(tmp_dir, HF_CONFIG_DIR), hf_config, tokenizer)
            _kill_point(rank, "before_record")
            atomic_write(os.path.join(tmp_dir, RECORD_FILE),
                          json.dumps(dict(record, files=tag_files(tmp_dir)), indent=1, default=str))
            _kill_point(rank, "after_record")
            old = None
            if os.path.exists(tag_dir):  # the same step saved again: never write in place of a complete tag
                if _exchange(tmp_dir, tag_dir):  # one atomic swap: the new tag in, the old one out at tmp
                    old = tmp_dir
                else:  # two renames; a kill between them leaves .old-<tag>, which resume and the next run use
                    old = os.path.join(self.path, OLD_PREFIX + tag)
                    shutil.rmtree(old, ignore_errors=True)
                    os.replace(tag_dir, old)
                    os.replace(tmp_dir, tag_dir)
            else:
                os.replace(tmp_dir, tag_dir)
            _fsync_dir(self.path)
            _kill_point(rank, "after_rename")
            atomic_write(os.path.join(self.path, "latest"), tag)
            _fsync_dir(self.path)
            _kill_point(rank, "after_latest")
            if old:
                shutil.rmtree(old, ignore_errors=True)
            self._prune(keep=tag)
        except OSError as e:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            return (self.name, f"saving {tag} to {self.path!r} failed on rank 0 while writing its record ("
                    f"{e.strerror}: {e.filename}); 'latest' and the earlier tags are intact",
                    "free space on that filesystem (or save elsewhere), then resume")
        return None

    def _prune(self, keep: str) -> None:
        if not self.keep_last:
            return
        tags = []
        for entry in os.listdir(self.path):
            step = _step_of(entry)
            if step is not None and os.path.isfile(os.path.join(self.path, entry, RECORD_FILE)):
                tags.append((step, entry))
        for _, entry in sorted(tags)[:-self.keep_last]:
            if entry == keep:
                continue
            for name in (entry, entry + UNIVERSAL_SUFFIX):  # renamed first: a kill mid-delete leaves no half tag
                doomed = os.path.join(self.path, f"{TMP_PREFIX}pruned-{name}")
                try:
                    os.replace(os.path.join(self.path, name), doomed)
                except OSError:
                    continue
                shutil.rmtree(doomed, ignore_errors=True)


def _ranks(group: List[int]) -> str:
    return f"{group[0]}-{group[-1]}" if group == list(range(group[0], group[-1] + 1)) and len(group) > 2 else \
        ",".join(map(str, group))


def _save_files(engine, path: str, tag: str, client_state: dict, rank: int) -> Tuple[List[str], List[str]]:
    """DeepSpeed's ``save_checkpoint`` of ``tag`` (no ``latest``), with its file writes recorded: (files this
    rank wrote, errors). A failed write is recorded, its partial file removed, and not raised, so that this
    rank still reaches the barriers inside DeepSpeed's save. (DeepSpeed's own checkpoint engine would raise
    from inside the save; no engine option records instead.)"""
    ce = engine.checkpoint_engine
    counter = itertools.count(1)
    written: List[str] = []
    errors: List[str] = []
    own_save = "save" in vars(ce)
    original_save = ce.save
    own_copy = "_copy_recovery_script" in vars(engine)
    original_copy = engine._copy_recovery_script

    def save(*a, **k):  # DeepSpeed calls it positionally and as save(state_dict=..., path=...)
        path_ = k["path"] if "path" in k else a[1]
        n = next(counter)
        _kill_point(rank, f"before_file{n}")
        if errors:  # one failure is enough: write nothing more this save
            return None
        try:
            out = original_save(*a, **k)
        except Exception as e:  # OSError, or torch's zip writer: "unexpected pos ..." on a full disk
            reason = e.strerror if isinstance(e, OSError) and e.strerror else f"{type(e).__name__}: {e}"
            try:
                free = f"{fmt_bytes(_free_bytes(os.path.dirname(path_)))} free there now"
            except OSError:
                free = "free space unknown"
            errors.append(f"writing {path_!r}: {str(reason).strip()[:300]} ({free})")
            try:
                os.remove(path_)
            except OSError:
                pass
            return None
        written.append(path_)
        _kill_point(rank, f"after_file{n}")
        return out

    def copy_recovery_script(save_path):
        try:
            original_copy(save_path)
        except OSError as e:
            errors.append(f"copying DeepSpeed's zero_to_fp32.py into {save_path!r}: {e.strerror}")

    ce.save = save
    engine._copy_recovery_script = copy_recovery_script
    try:
        engine.save_checkpoint(path, tag=tag, client_state=client_state, save_latest=False)
    finally:
        if own_save:
            ce.save = original_save
        else:
            del ce.save
        if own_copy:
            engine._copy_recovery_script = original_copy
        else:
            del engine._copy_recovery_script
    return written, errors


def _save_hf_side_files(out_dir: str, hf_config, tokenizer) -> None:
    os.makedirs(out_dir, exist_ok=True)
    if hf_config is not None:
        hf_config.save_pretrained(out_dir)
        try:
            from transformers import GenerationConfig

            GenerationConfig.from_model_config(hf_config).save_pretrained(out_dir)
        except Exception:  # a config transformers cannot derive a generation config from: export says so
            pass
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)


# ---------------------------------------------------------------------------------------------
# resume
# ---------------------------------------------------------------------------------------------


@dataclass
class ResumePlan:
    """What a resume loads (decided on every rank from the same files, before ``initialize``)."""

    path: str
    tag: str
    record: dict
    note: Optional[str]
    universal: bool
    changes: List[str]              # layout or hyper-parameter changes, reported at load
    name: str = "--resume"
    new_stage: Optional[str] = None  # a new stage (train.py --new-stage): its data position, "restart" or "keep"

    @property
    def load_tag(self) -> str:
        return self.tag + UNIVERSAL_SUFFIX if self.universal else self.tag

    @property
    def step(self) -> int:
        return int(self.record["step"])

    @property
    def samples_consumed(self) -> int:
        """Global samples the checkpointed run consumed (the next one is the first to train)."""
        if "samples_consumed" in self.record:
            return int(self.record["samples_consumed"])
        r = self.record  # records of older runs: micro batches per rank x micro batch x DP degree
        return int(r.get("micro_batches_consumed", 0)) * int(r.get("micro_batch", 1)) * \
            int(r.get("data_parallel_size", 1))

    def ds_config(self, ds_config: dict) -> dict:
        """``ds_config`` with DeepSpeed's universal loading switched on when this resume needs it."""
        if not self.universal:
            return ds_config
        cfg = copy.deepcopy(ds_config)
        cfg.setdefault("checkpoint", {})["load_universal"] = True
        return cfg

    def load(self, engine, log=print) -> dict:
        """Load into ``engine`` (every rank); returns the client state saved with it (``step``, ...)."""
        t0 = time.monotonic()
        # a new stage: the weights and the optimizer state (moments, step counts) carried, the learning-rate
        # scheduler not: it starts over as the stage's own (what a fresh run's engine set is put back below)
        fresh_lrs = [g.get("lr") for g in getattr(engine.optimizer, "param_groups", None) or []]
        try:
            path, client = engine.load_checkpoint(self.path, tag=self.load_tag,
                                                  load_lr_scheduler_states=not self.new_stage)
        except Exception as e:  # DeepSpeed's and torch's load errors name no file
            raise ConfigError(self.name, f"loading {os.path.join(self.path, self.load_tag)!r} failed "
                              f"({type(e).__name__}: {str(e)[:500]})", "resume another tag or start a new run"
                              ) from None
        if client is None:
            raise ConfigError(self.name, f"DeepSpeed found no checkpoint in {os.path.join(self.path, self.load_tag)!r}",
                              "give the directory passed to --save")
        _apply_optimizer_config(engine)
        if self.new_stage:  # the checkpoint's param_groups carried its last lr: a fresh run's first lr instead
            for g, lr in zip(getattr(engine.optimizer, "param_groups", None) or [], fresh_lrs):
                g["lr"] = lr
        rank, _ = _rank_world()
        if rank == 0:
            if self.note:
                log(f"warning: {self.note}")
            how = " through DeepSpeed's universal checkpoint" if self.universal else ""
            log(f"resumed from {os.path.join(self.path, self.tag)} (step {self.step}, {self.samples_consumed} "
                f"samples consumed){how} in {time.monotonic() - t0:.2f} s" + "".join(f"\n  {c}" for c in self.changes))
        return client


def _apply_optimizer_config(engine) -> None:
    """The ds_config's optimizer hyper-parameters (lr, betas, eps, weight_decay, ...) take effect after a load
    (DeepSpeed restores the checkpoint's param_groups, so a changed learning rate would silently not apply);
    a scheduler sets lr from its own config at each step."""
    params = ((engine.config or {}).get("optimizer") or {}).get("params") or {}
    for g in getattr(engine.optimizer, "param_groups", None) or []:
        for k, v in params.items():
            if k in g and k != "params":
                g[k] = tuple(v) if isinstance(g[k], tuple) else v


def _diff(a, b, prefix="") -> List[Tuple[str, Any, Any]]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _diff(a.get(k), b.get(k), f"{prefix}.{k}" if prefix else k)
        return out
    return [] if a == b else [(prefix, a, b)]


def _saved_zero_stages(saved: dict) -> Tuple[int, ...]:
    """The ZeRO stage(s) a checkpoint can have been saved with: its record's; a record of an older ds_longctx has
    none, so DeepSpeed's file names tell: per-rank model states (``zero_pp_rank_*_model_states.pt``) are stage 3,
    one ``mp_rank_*_model_states.pt`` with partitioned optimizer states stage 1 or 2 (measured: across them
    DeepSpeed's loader fails with a bare AssertionError). () when neither tells."""
    if saved.get("zero_stage") is not None:
        return (saved["zero_stage"],)
    names = list(saved.get("files") or ())
    if any(n.startswith("zero_pp_rank_") and n.endswith("_model_states.pt") for n in names):
        return (3,)
    if any(n.startswith("mp_rank_") and n.endswith("_model_states.pt") for n in names) and \
            any(n.endswith("_optim_states.pt") for n in names):
        return (1, 2)
    return ()


def plan_resume(path: str, current: dict, name: str = "--resume", log=print,
                new_stage: Optional[str] = None) -> ResumePlan:
    """Decide what resuming from ``path`` means for this run (every rank, same files, same verdict; before
    ``initialize``). ``current``: this run's record as :func:`run_record` builds it. Refuses, naming the
    difference, another model, other data, another sequence length, another ZeRO stage or optimizer type;
    another world size, SP or DP degree is a universal resume (convert with :func:`ensure_universal`).

    ``new_stage`` ("restart" or "keep": train.py's ``--new-stage --stage-data``): the run continues as a new stage,
    so another sequence length is accepted; with "restart" (the data position back to 0) also other data, seed and
    --concat-documents (a stage may train on another mixture)."""
    if new_stage not in (None, "restart", "keep"):
        raise ValueError(f"new_stage: {new_stage!r}")
    tag, saved, note = find_resume_tag(path, name)
    where = os.path.join(path, tag)
    saved_model, now_model = saved.get("model"), current.get("model")
    if isinstance(saved_model, dict) and isinstance(now_model, dict):
        diffs = [k for k in MODEL_KEYS if saved_model.get(k) != now_model.get(k)]
        if diffs:
            what = ", ".join(f"{k} {saved_model.get(k)!r} in the checkpoint vs {now_model.get(k)!r} now" for k in diffs)
            raise ConfigError(name, f"{where} holds a different model: {what}",
                              "resume with the model (--model / --model-config) the checkpoint was saved with")
    refusals = []
    sd, cd = saved.get("data"), current.get("data")
    if new_stage == "restart":  # the new stage reads its data from the start: it may be other data
        pass
    elif isinstance(sd, dict) and isinstance(cd, dict):
        # tokenizer_sha256: recorded since the tokenizer is part of the data identity (a record without it resumes)
        keys = [k for k in sorted(set(sd) | set(cd)) if k != "path" and sd.get(k) != cd.get(k)
                and not (k == "tokenizer_sha256" and k not in sd)]
        if keys:
            refusals.append(("the data differ: " + ", ".join(f"{k} {sd.get(k)!r} in the checkpoint vs {cd.get(k)!r} "
                                                             "now" for k in keys),
                             "resume with the data the run trained on (a path may move; its content may not), or "
                             "start a new run from the weights (ds-longctx export, then --model)" +
                             (", or --stage-data restart (a new stage on other data from its start)"
                              if new_stage == "keep" else "")))
    elif isinstance(sd, str) and isinstance(cd, dict):  # a record of an older ds_longctx: the task or the path
        same = sd == cd.get("task") or (cd.get("path") and os.path.abspath(sd) == cd.get("path"))
        if not same:
            refusals.append((f"the data differ: {sd!r} in the checkpoint vs {cd.get('task') or cd.get('path')!r} now",
                             "resume with the --data the run trained on"))
    for key, flag in (("seq_len", "--seq-len"), ("seed", "--seed"), ("concat_documents", "--concat-documents")):
        if new_stage and (key == "seq_len" or new_stage == "restart"):
            continue
        if key in saved and key in current and saved[key] != current[key]:
            how = ((f"with {flag}" if saved[key] else f"without {flag}") if key == "concat_documents"  # a switch
                   else f"with {flag} {saved[key]!r}")
            if key == "seq_len":  # a context-extension stage is the reason to change it
                fix = (f"resume {how}, or continue the run at the new length as a new stage: add --new-stage (the "
                       "weights and optimizer state carried, the learning-rate schedule restarted, the data "
                       "position per --stage-data restart|keep)")
            else:
                fix = f"resume {how}, or start a new run from the weights (ds-longctx export, then --model)"
                if new_stage == "keep":
                    fix += ", or --stage-data restart (the new stage's data from its start)"
            refusals.append((f"{key} {saved[key]!r} in the checkpoint vs {current[key]!r} now (the samples and their "
                             "order depend on it)", fix))
    stages = _saved_zero_stages(saved)
    if stages and current.get("zero_stage") not in stages:
        said = " or ".join(map(str, stages))
        refusals.append((f"ZeRO stage {said} in the checkpoint vs {current.get('zero_stage')} now "
                         "(DeepSpeed's loaders, universal included, read only the stage a checkpoint was saved with)",
                         f"resume with zero_optimization.stage {said}, or start a new run from the "
                         "weights (ds-longctx export, then --model)"))
    s_opt = (saved.get("optimizer") or {}).get("type")
    c_opt = (current.get("optimizer") or {}).get("type")
    if s_opt is not None and c_opt is not None and str(s_opt).lower() != str(c_opt).lower():
        refusals.append((f"optimizer.type {s_opt!r} in the checkpoint vs {c_opt!r} now (its state cannot carry over)",
                         f"resume with optimizer.type {s_opt!r}, or start a new run from the weights"))
    if refusals:
        problem, fix = refusals[0]
        more = f" (and {len(refusals) - 1} more difference(s): " + "; ".join(p for p, _ in refusals[1:]) + ")" \
            if len(refusals) > 1 else ""
        raise ConfigError(name, f"{where} cannot continue this run: {problem}{more}", fix)
    universal = any(saved.get(k) != current.get(k) for k in PARTITION_KEYS if k in saved)
    changes = []
    layout = [(k, saved.get(k), current.get(k)) for k in PARTITION_KEYS + ("micro_batch", "gradient_accumulation_steps")
              if k in saved and saved.get(k) != current.get(k)]
    if layout:
        changes.append("layout: " + ", ".join(f"{k} {a} -> {b}" for k, a, b in layout))
        gb = lambda r: r.get("micro_batch", 1) * r.get("gradient_accumulation_steps", 1) * r.get("data_parallel_size", 1)  # noqa: E731
        if gb(saved) != gb(current):
            changes.append(f"the global batch changes from {gb(saved)} to {gb(current)} samples per step (the "
                           "learning-rate schedule goes on by steps)")
    for section in ("optimizer", "scheduler", "gradient_clipping"):
        for key, a, b in _diff(saved.get(section), current.get(section), section):
            if key != "optimizer.type":
                changes.append(f"{key}: {a!r} in the checkpoint, {b!r} now: the ds_config's value takes effect")
    if new_stage:
        changes.append(f"a new stage (--new-stage): seq_len {saved.get('seq_len')} -> {current.get('seq_len')}, the "
                       "weights and optimizer state carried, the learning-rate scheduler restarted, data "
                       f"position: {new_stage}")
    return ResumePlan(path=path, tag=tag, record=saved, note=note, universal=universal, changes=changes, name=name,
                      new_stage=new_stage)


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


def convert_to_universal(path: str, tag: str, workers: int = 1, log=print) -> str:
    """DeepSpeed's ``ds_to_universal`` of ``path/tag`` into ``path/tag.universal`` (written under a temporary
    name, renamed when complete; reused when already there). Returns the universal tag. One process."""
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    out_tag = tag + UNIVERSAL_SUFFIX
    out = os.path.join(path, out_tag)
    src = os.path.join(path, tag)
    marker = os.path.join(out, UNIVERSAL_RECORD)
    record, problem = check_tag(path, tag)
    if problem:
        raise ConfigError("checkpoint", problem, "convert a complete checkpoint")
    if os.path.isfile(marker):
        with open(marker) as f:
            if json.load(f).get("source_files") == record.get("files"):
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
    with open(os.path.join(tmp, UNIVERSAL_RECORD), "w") as f:
        json.dump({"source_tag": tag, "source_files": record.get("files"), "seconds": time.monotonic() - t0}, f)
    try:
        os.rename(tmp, out)
    except OSError as e:  # another job converted the same tag meanwhile: theirs is complete (renamed last)
        shutil.rmtree(tmp, ignore_errors=True)
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not os.path.isfile(marker):
            raise
    _fsync_dir(path)
    log(f"converted {src} to DeepSpeed's universal checkpoint {out} in {time.monotonic() - t0:.2f} s")
    return out_tag


def ensure_universal(plan: ResumePlan, log=print) -> None:
    """Rank 0 converts (once), every rank waits for its verdict and checks it sees the result (a resume on
    another layout needs a directory every rank reads)."""
    if not plan.universal:
        return
    rank, _ = _rank_world()
    outcome = None
    if rank == 0:
        try:
            convert_to_universal(plan.path, plan.tag, log=log)
        except ConfigError as e:
            outcome = (plan.name, e.problem, e.fix)
        except OSError as e:
            outcome = (plan.name, f"converting {os.path.join(plan.path, plan.tag)!r} to a universal checkpoint "
                       f"failed ({e.strerror}: {e.filename})", f"make {plan.path!r} writable, or convert it "
                       "elsewhere with `ds-longctx convert SRC DST` and resume from DST")
    _raise_everywhere(_broadcast(outcome))
    seen = os.path.isfile(os.path.join(plan.path, plan.load_tag, UNIVERSAL_RECORD))
    blind = [r for r, s in enumerate(_all_gather(seen)) if not s]
    if blind:
        raise ConfigError(plan.name, f"ranks {_ranks(blind)} do not see {os.path.join(plan.path, plan.load_tag)!r}, "
                          "written by rank 0 (a resume on another layout reads every rank's files)",
                          "put the checkpoint on a filesystem every node mounts")


def run_record(*, world_size: int, sp: int, dp: int, zero_stage: int, micro_batch: int, gas: int, seq_len: int,
               seed: int, data, concat_documents: bool, model_config, ds_config: dict) -> dict:
    """The record of a run: what a resume compares (layout, data, model, optimizer) and what it needs."""
    return {"world_size": world_size, "sequence_parallel_size": sp, "data_parallel_size": dp,
            "zero_stage": zero_stage, "micro_batch": micro_batch, "gradient_accumulation_steps": gas,
            "seq_len": seq_len, "seed": seed, "data": data, "concat_documents": concat_documents,
            "model": model_facts(model_config), "optimizer": ds_config.get("optimizer"),
            "scheduler": ds_config.get("scheduler"), "gradient_clipping": ds_config.get("gradient_clipping"),
            "dtype": _train_dtype(ds_config), "ds_longctx_version": _version()}


def rope_facts(model_config) -> dict:
    """The model's RoPE as a stage trains it: its parameters (theta, scaling type and factor) and
    max_position_embeddings."""
    tc = text_config(model_config)
    params = getattr(tc, "rope_parameters", None) or getattr(tc, "rope_scaling", None)
    if params is None and getattr(tc, "rope_theta", None) is not None:
        params = {"rope_theta": tc.rope_theta}
    return {"parameters": json.loads(json.dumps(params, default=str)) if params is not None else None,
            "max_position_embeddings": getattr(tc, "max_position_embeddings", None)}


def stage_of(record: dict) -> dict:
    """The stage a checkpoint's record was trained in (a record written before stages existed: stage 1 from step
    0 at its seq_len)."""
    return record.get("stage") or {"index": 1, "seq_len": record.get("seq_len"), "rope": None, "start_step": 0,
                                   "start_sample": 0, "data": "start"}


def stage_start_sample(mode: str, samples_consumed: int, old_len: int, new_len: int) -> int:
    """Where a new stage's data starts: "restart" at sample 0; "keep" at the token position the last stage reached
    (``samples_consumed`` samples of ``old_len`` tokens), as a sample index at ``new_len``, rounded up so that no
    token is trained twice (a corpus' samples are consecutive slices of its token stream: corpus.CorpusDataset)."""
    if mode == "restart":
        return 0
    return -(-samples_consumed * old_len // new_len)


def next_stage(saved: dict, seq_len: int, rope: dict, data: str, start_sample: int) -> Tuple[dict, List[dict]]:
    """A new stage after the checkpoint whose record is ``saved``: (the stage, the stages before it, each with
    the step it ended at). Recorded in every checkpoint of the stage (``stage``, ``stages``)."""
    prev = dict(stage_of(saved), end_step=int(saved["step"]))
    stage = {"index": int(prev["index"]) + 1, "seq_len": seq_len, "rope": rope, "start_step": int(saved["step"]),
             "start_sample": start_sample, "data": data}
    return stage, list(saved.get("stages") or []) + [prev]


def batch_sizes(ds_config: dict, dp: int) -> Tuple[int, int]:
    """(micro batch, gradient accumulation steps) as DeepSpeed derives them from the batch keys."""
    tbs, micro = ds_config.get("train_batch_size"), ds_config.get("train_micro_batch_size_per_gpu")
    gas = ds_config.get("gradient_accumulation_steps")
    if micro is None:
        micro = tbs // ((gas or 1) * dp) if tbs else 1
    if gas is None:
        gas = tbs // (micro * dp) if tbs else 1
    return int(micro), int(gas)


def layout_record(ds_config: dict, world_size: int, model_config=None, **extra) -> dict:
    """A custom loop's record from its ds_config and world size (the layout, ZeRO stage, optimizer; the model's
    facts when ``model_config`` is given); ``extra`` adds what the loop's data position depends on (``seq_len``,
    ``seed``, ``data``: a resume refuses a change of any key both records hold)."""
    sp = int(ds_config.get("sequence_parallel_size") or 1)
    dp = world_size // sp
    micro, gas = batch_sizes(ds_config, dp)
    rec = {"world_size": world_size, "sequence_parallel_size": sp, "data_parallel_size": dp,
           "zero_stage": zero_stage(ds_config), "micro_batch": micro, "gradient_accumulation_steps": gas,
           "optimizer": ds_config.get("optimizer"), "scheduler": ds_config.get("scheduler"),
           "gradient_clipping": ds_config.get("gradient_clipping"), "dtype": _train_dtype(ds_config),
           "ds_longctx_version": _version()}
    if model_config is not None:
        rec["model"] = model_facts(model_config)
    rec.update(extra)
    return rec


def resume(path: str, record: dict, name: str = "resume", log=print, new_stage: Optional[str] = None) -> ResumePlan:
    """Every rank, after the process group exists and before ``ds_longctx.initialize``: what resuming from
    ``path`` means for this run (``record``: :func:`layout_record`'s, or train's :func:`run_record`), converted to
    DeepSpeed's universal checkpoint when the world size, SP or DP degree changed (rank 0, once). Then::

        engine, *_ = ds_longctx.initialize(..., config=plan.ds_config(ds_config))
        client_state = plan.load(engine)        # plan.step, plan.samples_consumed: where to continue
    """
    plan = plan_resume(path, record, name=name, log=log, new_stage=new_stage)
    ensure_universal(plan, log=log)
    return plan


def open_checkpoints(engine, save_dir: str, keep_last: Optional[int] = None, name: str = "save_dir",
                     log=print) -> SaveDir:
    """Every rank, after ``initialize`` and before step 1: the save directory checked (created, writable on every
    rank, room for one checkpoint, this run's lock), partial saves of killed runs removed. Then
    ``saves.save(engine, step, record)`` on every rank whenever the loop saves (``record``: the run's record with
    ``samples_consumed``), and ``saves.close()`` at the end."""
    return SaveDir.open(engine, save_dir, keep_last=keep_last, name=name, log=log)


def _train_dtype(ds_config: dict) -> str:
    for key, name in (("bf16", "bf16"), ("fp16", "fp16")):
        if (ds_config.get(key) or {}).get("enabled"):
            return name
    return "fp32"


def _version() -> str:
    return __version__


# ---------------------------------------------------------------------------------------------
# export to a Hugging Face directory
# ---------------------------------------------------------------------------------------------


def _clean_config(hf_config):
    cfg = copy.deepcopy(hf_config)
    for attr in ("_name_or_path",):
        if hasattr(cfg, attr):
            setattr(cfg, attr, "")
    return cfg


def _config_has_dtype() -> bool:
    """transformers >= 4.56 names the config's dtype ``dtype`` (``torch_dtype`` warns)."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return (major, minor) >= (4, 56)


def _write_hf(out_dir: str, state_dict: dict, hf_config, tokenizer=None, dtype=None, generation_config=None,
              max_shard_size: str = "5GB") -> None:
    """transformers' ``save_pretrained`` of ``state_dict`` on an empty (meta) model of ``hf_config``: the
    model class's own key names, tied weights and sharding (safetensors)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    cfg = _clean_config(hf_config)
    if dtype is not None:
        state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
        if _config_has_dtype():
            cfg.dtype = dtype  # what from_pretrained(dtype="auto") picks (torch_dtype is deprecated since 4.56)
        else:
            cfg.torch_dtype = dtype
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    expected = set(model.state_dict())
    missing = sorted(expected - set(state_dict))
    tied = {k for k in missing if getattr(cfg, "tie_word_embeddings", False) and "lm_head" in k}
    if set(missing) - tied:
        raise ConfigError("export", f"the weights lack {sorted(set(missing) - tied)[:5]} of {type(model).__name__}",
                          "export a checkpoint of this model")
    unknown = sorted(set(state_dict) - expected)
    if unknown:
        raise ConfigError("export", f"the weights have names {type(model).__name__} does not know: {unknown[:5]}",
                          "report this: a ds_longctx patch renamed a parameter")
    os.makedirs(out_dir, exist_ok=True)
    # (save_pretrained empties the dict it is given as it writes the shards: a copy of the mapping)
    model.save_pretrained(out_dir, state_dict=dict(state_dict), safe_serialization=True, max_shard_size=max_shard_size)
    gen = generation_config
    if gen is None:
        try:
            gen = GenerationConfig.from_model_config(cfg)
        except Exception:
            gen = None
    if gen is not None:
        gen.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)


def _write_peft(out_dir: str, state_dict: dict, peft_model, tokenizer=None, dtype=None) -> None:
    """peft's own ``save_pretrained`` of a PeftModel from the gathered ``state_dict`` (it keeps the adapters'
    weights and writes adapter_config.json): ``PeftModel.from_pretrained(base_model, out_dir)`` loads it."""
    if dtype is not None:
        state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
    os.makedirs(out_dir, exist_ok=True)
    peft_model.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)


def export_hf(engine, out_dir: str, tokenizer=None, dtype=None, max_shard_size: str = "5GB", log=print) -> None:
    """Write the engine's current weights as a Hugging Face model directory (every rank calls it; rank 0 writes).

    Weights are gathered by DeepSpeed: ZeRO-3's consolidated 16-bit state dict (what HF Trainer's save_model and
    ``engine.save_16bit_model`` use), the module's own state dict otherwise. ds_longctx's patches leave parameter
    names and the config untouched (checked: the names must be the model class's). ``from_pretrained(out_dir)``
    needs no ds_longctx. A ``peft.PeftModel`` writes its adapters (peft's format: ``PeftModel.from_pretrained(base,
    out_dir)``)."""
    rank, _ = _rank_world()
    t0 = time.monotonic()
    if engine.zero_optimization_partition_weights():
        sd = engine._zero3_consolidated_16bit_state_dict()  # DeepSpeed's gather; the full dict on rank 0
    else:
        sd = engine.module.state_dict() if rank == 0 else None
    outcome = None
    if rank == 0:
        try:
            sd = {k: v.detach().to("cpu") for k, v in sd.items()}
            if is_peft_model(engine.module):  # an adapter run: the adapter directory PeftModel.from_pretrained loads
                _write_peft(out_dir, sd, engine.module, tokenizer=tokenizer, dtype=dtype)
            else:
                _write_hf(out_dir, sd, engine.module.config, tokenizer=tokenizer, dtype=dtype,
                          generation_config=getattr(engine.module, "generation_config", None),
                          max_shard_size=max_shard_size)
        except ConfigError as e:
            outcome = (e.key, e.problem, e.fix)
        except OSError as e:
            outcome = ("--save-hf", f"writing {out_dir!r} failed ({e.strerror}: {e.filename})",
                       "give a writable directory with free space")
    _raise_everywhere(_broadcast(outcome))
    if rank == 0:
        log(exported_line(out_dir, tokenizer, time.monotonic() - t0))


def exported_line(out_dir: str, tokenizer, seconds: float) -> str:
    """What an export wrote: the tokenizer only where the run has one (``--tokenizer``, a ``--model`` directory or
    hub id); the built-in copy task trains on token ids without one."""
    side = "config, generation config, tokenizer" if tokenizer is not None else \
        "config, generation config; no tokenizer: the run has none (the built-in task's token ids; --tokenizer " \
        "names one)"
    return f"exported the model to {out_dir} (safetensors, {side}; from_pretrained loads it) in {seconds:.1f} s"


def export_checkpoint(path: str, out_dir: str, tag: Optional[str] = None, dtype: Optional[str] = "auto",
                      model_config=None, tokenizer=None, log=print) -> str:
    """Export a saved tag (no GPU, one process): DeepSpeed's ``zero_to_fp32`` gathers the fp32 master weights,
    cast to ``dtype`` ("auto": the dtype the run trained in; "fp32"/"bf16"/"fp16"), written with the HF config
    and tokenizer saved in the tag (or ``model_config``/``tokenizer`` given). Returns the tag exported."""
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    if tag is None:
        tag, record, note = find_resume_tag(path, name="checkpoint")
        if note:
            log(f"warning: {note}")
    else:
        record, problem = check_tag(path, tag)
        if problem:
            raise ConfigError("--tag", problem, "export a complete tag (ds-longctx export DIR picks the newest)")
    side = os.path.join(path, tag, HF_CONFIG_DIR)
    if model_config is None:
        if not os.path.isfile(os.path.join(side, "config.json")):
            raise ConfigError("--model-config", f"{os.path.join(path, tag)!r} holds no HF config (saved before ds_longctx "
                              "kept one)", "pass --model-config (the config.json the run trained)")
        from transformers import AutoConfig

        model_config = AutoConfig.from_pretrained(side)
    if tokenizer is None and os.path.isfile(os.path.join(side, "tokenizer_config.json")):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(side)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if dtype == "auto":
        target = dtypes.get(record.get("dtype")) if record.get("dtype") else None
    elif dtype in dtypes:
        target = dtypes[dtype]
    elif dtype is None:
        target = None
    else:
        raise ConfigError("--dtype", f"unknown dtype {dtype!r}", "use auto, fp32, bf16 or fp16")
    t0 = time.monotonic()
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        sd = get_fp32_state_dict_from_zero_checkpoint(path, tag=tag)
    generation_config = None
    if os.path.isfile(os.path.join(side, "generation_config.json")):
        from transformers import GenerationConfig

        generation_config = GenerationConfig.from_pretrained(side)
    _write_hf(out_dir, dict(sd), model_config, tokenizer=tokenizer, dtype=target, generation_config=generation_config)
    log(f"exported {os.path.join(path, tag)} to {out_dir} in {time.monotonic() - t0:.2f} s")
    return tag


__all__ = ["SaveDir", "ResumePlan", "open_checkpoints", "resume", "plan_resume", "ensure_universal",
           "convert_to_universal", "export_hf", "export_checkpoint", "find_resume_tag", "check_tag", "estimate_bytes",
           "run_record", "layout_record", "batch_sizes", "model_facts", "RECORD_FILE", "tag_for"]
