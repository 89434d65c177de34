"""The save directory of a run (:class:`SaveDir`): locked for the run, checked for room before every save, each
tag written under a temporary name and published atomically, the oldest pruned past ``--keep-last``."""
from __future__ import annotations

import errno
import itertools
import json
import os
import shutil
import socket
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from ...data.token_cache import atomic_write
from ...dist.layout import zero_stage
from ...errors import ConfigError
from ...planner.model_states import optimizer_states_per_param
from ...planner.units import fmt_bytes
from . import faults, manifest
from .tags import HF_CONFIG_DIR, LOCK_FILE, OLD_PREFIX, RECORD_FILE, TMP_PREFIX, UNIVERSAL_SUFFIX, exchange, free_bytes, fsync_dir, step_of, check_tag, tag_files, tag_for
from ...dist.verdicts import all_gather, broadcast, raise_everywhere, rank_world, ranks_text


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
        rank, _ = rank_world()
        token = uuid.uuid4().hex
        outcome = sd._lock_and_clean(token) if rank == 0 else None
        outcome, token = broadcast((outcome, token))
        if outcome is not None:
            sd.close()
        raise_everywhere(outcome)
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
        facts = all_gather({"host": socket.gethostname(), "shared": sees_marker, "problem": problem})
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
        rank, _ = rank_world()
        self.per_rank_bytes = estimate_bytes(engine)
        facts = all_gather({"host": socket.gethostname(), "free": free_bytes(self.path),
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
                                  f"{ranks_text(missing, noun=False)}): it was removed or renamed while this run saved to it, with "
                                  f"its checkpoints and lock; {what} was not written",
                                  "leave a --save directory in place while its run goes on; start again with --save "
                                  "on an existing or new directory (with --resume from a copy of the checkpoints, "
                                  "if one exists)")
            free = min(facts[r]["free"] for r in group)
            if need > free:
                hosts = sorted({facts[r]["host"] for r in group})
                raise ConfigError(self.name, f"{self.path!r} has {fmt_bytes(free)} free on {', '.join(hosts)}; {what} of "
                                  f"ranks {ranks_text(group, noun=False)} needs {fmt_bytes(need)} ({need} bytes)",
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
        with faults.saving(self.path, step):  # what the test hooks match (nothing happens outside tests)
            return self._save(engine, step, record, client_state, hf_config, tokenizer)

    def _save(self, engine, step, record, client_state, hf_config, tokenizer) -> str:
        rank, _ = rank_world()
        tag = tag_for(step)
        tmp = TMP_PREFIX + tag
        t0 = time.monotonic()
        # room for it, on every filesystem, before a byte is written
        facts = all_gather({"free": free_bytes(self.path) if os.path.isdir(self.path) else 0,
                             "missing": not os.path.isdir(self.path), "bytes": self.per_rank_bytes,
                             "host": socket.gethostname()})
        self._check_space(facts, f"the checkpoint of step {step}")
        if rank == 0 and os.path.exists(os.path.join(self.path, tmp)):
            shutil.rmtree(os.path.join(self.path, tmp), ignore_errors=True)
        written, errors = _save_files(engine, self.path, tmp, dict(client_state or {}, step=step,
                                                                   ds_longctx_layout=record), rank)
        faults.point(rank, "after_files")
        tmp_dir = os.path.join(self.path, tmp)
        sums = {}
        for path in written:  # durable before the rename makes the tag visible; read once for its checksum there
            try:
                sums[os.path.relpath(path, tmp_dir)] = manifest.digest_file(path, fsync=True)[1]
            except OSError as e:
                errors.append(f"{path}: reading it back for its checksum and fsync failed ({e.strerror})")
        gathered = all_gather({"errors": errors, "bytes": sum(os.path.getsize(p) for p in written
                                                              if os.path.exists(p)), "free": facts[rank]["free"],
                               "checksums": sums})
        failed = [(r, g["errors"][0]) for r, g in enumerate(gathered) if g["errors"]]
        outcome = None
        if rank == 0:
            if failed:
                shutil.rmtree(os.path.join(self.path, tmp), ignore_errors=True)
                group = next(g for g in self.groups if failed[0][0] in g)
                outcome = self._failure(step, failed, facts[failed[0][0]]["free"], sum(facts[r]["bytes"] for r in group))
            else:
                checksums = {rel: h for g in gathered for rel, h in g["checksums"].items()}
                outcome = self._publish(tag, tmp, dict(record, step=step), hf_config, tokenizer, rank, checksums)
        outcome = broadcast(outcome)
        raise_everywhere(outcome)
        self.per_rank_bytes = max(gathered[rank]["bytes"], 1)  # the next save writes what this one wrote
        self.last_save_s = time.monotonic() - t0
        faults.point(rank, "done")
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

    def _publish(self, tag: str, tmp: str, record: dict, hf_config, tokenizer, rank: int,
                 checksums: Optional[dict] = None):
        """Rank 0, after every rank's files are durable: record (with every file's checksum: ``checksums``, what
        each rank computed of its files, the HF side files' and any other file's here), rename, latest, prune."""
        tmp_dir, tag_dir = os.path.join(self.path, tmp), os.path.join(self.path, tag)
        checksums = dict(checksums or {})
        try:
            if hf_config is not None or tokenizer is not None:
                hf_dir = os.path.join(tmp_dir, HF_CONFIG_DIR)
                _save_hf_side_files(hf_dir, hf_config, tokenizer)
                for root, _, names in os.walk(hf_dir):
                    for n in names:
                        full = os.path.join(root, n)
                        checksums[os.path.relpath(full, tmp_dir)] = manifest.digest_file(full, fsync=True)[1]
            files = tag_files(tmp_dir)
            unknown = sorted(set(files) - set(checksums))  # a file no rank reported writing (DeepSpeed's own)
            checksums.update(manifest.digest_files(tmp_dir, unknown))
            faults.point(rank, "before_record")
            atomic_write(os.path.join(tmp_dir, RECORD_FILE), manifest.sealed_record_text(
                dict(record, files=files, checksums={"algorithm": manifest.ALGORITHM, "files": dict(sorted(
                    checksums.items()))})))
            faults.point(rank, "after_record")
            old = None
            if os.path.exists(tag_dir):  # the same step saved again: never write in place of a complete tag
                if exchange(tmp_dir, tag_dir):  # one atomic swap: the new tag in, the old one out at tmp
                    old = tmp_dir
                else:  # two renames; a kill between them leaves .old-<tag>, which resume and the next run use
                    old = os.path.join(self.path, OLD_PREFIX + tag)
                    shutil.rmtree(old, ignore_errors=True)
                    os.replace(tag_dir, old)
                    os.replace(tmp_dir, tag_dir)
            else:
                os.replace(tmp_dir, tag_dir)
            fsync_dir(self.path)
            faults.point(rank, "after_rename")
            atomic_write(os.path.join(self.path, "latest"), tag)
            fsync_dir(self.path)
            faults.point(rank, "after_latest")
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
            step = step_of(entry)
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
        faults.point(rank, f"before_file{n}")
        if errors:  # one failure is enough: write nothing more this save
            return None
        try:
            out = original_save(*a, **k)
        except Exception as e:  # OSError, or torch's zip writer: "unexpected pos ..." on a full disk
            reason = e.strerror if isinstance(e, OSError) and e.strerror else f"{type(e).__name__}: {e}"
            try:
                free = f"{fmt_bytes(free_bytes(os.path.dirname(path_)))} free there now"
            except OSError:
                free = "free space unknown"
            errors.append(f"writing {path_!r}: {str(reason).strip()[:300]} ({free})")
            try:
                os.remove(path_)
            except OSError:
                pass
            return None
        written.append(path_)
        faults.point(rank, f"after_file{n}")
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


def open_checkpoints(engine, save_dir: str, keep_last: Optional[int] = None, name: str = "save_dir",
                     log=print) -> SaveDir:
    """Every rank, after ``initialize`` and before step 1: the save directory checked (created, writable on every
    rank, room for one checkpoint, this run's lock), partial saves of killed runs removed. Then
    ``saves.save(engine, step, record)`` on every rank whenever the loop saves (``record``: the run's record with
    ``samples_consumed``), and ``saves.close()`` at the end."""
    return SaveDir.open(engine, save_dir, keep_last=keep_last, name=name, log=log)
