"""Agreement at start: every rank of the job holds the same ds_config, CLI values and data, or none starts.

A config or data file that differs between nodes is the usual multi-node mistake, and nothing else catches it:
a different learning rate or data file trains silently (the metrics and the checkpoint record name rank 0's
values), a different ``tiled_mlp`` or checkpointing setting hangs the first collective the two ranks issue
differently, a different ``heads_per_chunk`` aborts inside gloo. So the job's first collective is this one:

* every rank flattens what must be equal (the whole ds_config as resolved by the caller, the CLI values that
  shape training, the identity of the data it reads) into ``{key path: canonical JSON}``, hashes it (SHA-256)
  and all-gathers one fixed 128-byte row: the digest plus its host, pid and process start time (the
  watchdog's roster). One small all-gather (measured: bench/pending/h30.md).
* digests all equal: done. Any two differ: every rank saw it, so every rank takes the second round (only on
  a mismatch): the flattened values are all-gathered and every rank raises the same ConfigError naming each
  differing key or file, its values and the ranks (and hosts) holding each.

``check_agreement`` then starts the job's watchdog (watchdog.py), which needs the roster. ``initialize``
runs the ds_config part itself (custom loops, the HF Trainer path) unless this process already checked the
identical ds_config.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from . import watchdog
from ..config import load_ds_config
from ..errors import ConfigError
from ..dist.runtime import proc_start_time
from ..dist.verdicts import all_gather_blobs, all_gather_rows, ranks_text

ROW_BYTES = 128  # digest 32, pid 8, start time 8, host name up to 80 (utf-8, zero padded)
_HOST_BYTES = ROW_BYTES - 48
SHOWN_KEYS = 6   # differing keys spelled out in the error (the rest counted)
SHOWN_CHARS = 80  # of one value

# what this process already agreed on: the ds_config part's digest and the roster
_STATE: Dict[str, Any] = {"config_digest": None, "roster": None}


@dataclass(frozen=True)
class Member:
    """One rank of the job as it reported itself at the agreement."""
    rank: int
    host: str
    pid: int
    start: int   # /proc/<pid>/stat start time (clock ticks since boot): tells the process from a reused pid
    digest: bytes = b""


def this_member(rank: int = 0) -> Member:
    pid = os.getpid()
    return Member(rank, socket.gethostname(), pid, int(proc_start_time(pid) or 0))


# ------------------------------------------------------------------ what must be equal --------------------------
def _canon(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=repr)


def _flatten(obj, prefix: str, out: Dict[str, str]) -> None:
    """Leaves of nested dicts as ``{"a.b.c": canonical JSON}`` (lists are leaves)."""
    if isinstance(obj, dict) and obj:
        for k, v in obj.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    else:
        out[prefix] = _canon(obj)


def _compared(section: str, value):
    """A values section as compared: a data identity with a content hash is compared without its ``path`` (two
    nodes may mount the same file at different paths); everything else as given."""
    if section != "cli" and isinstance(value, dict) and "sha256" in value:
        return {k: v for k, v in value.items() if k != "path"}
    return value


def fingerprint(ds_config: dict, values: Optional[dict] = None) -> Dict[str, str]:
    """``{key: canonical JSON}`` of everything compared: the ds_config's leaves by key path (``optimizer.params.lr``),
    ``values["cli"]`` by flag (``cli\\0--seq-len``), any other section (``data``) whole (``data``)."""
    flat: Dict[str, str] = {}
    _flatten(ds_config or {}, "", flat)
    for section, value in (values or {}).items():
        if section == "cli" and isinstance(value, dict):
            for flag, v in value.items():
                flat[f"cli\0{flag}"] = _canon(v)
        else:
            flat[f"{section}\0"] = _canon(_compared(section, value))
            flat[f"{section}\0shown"] = _canon(value)  # what the error shows (the path too); not digested
    return flat


def _digest(flat: Dict[str, str]) -> bytes:
    h = hashlib.sha256()
    for k in sorted(flat):
        if not k.endswith("\0shown"):
            h.update(k.encode())
            h.update(b"\1")
            h.update(flat[k].encode())
            h.update(b"\2")
    return h.digest()


def config_digest(ds_config: dict) -> bytes:
    return _digest(fingerprint(ds_config))


# ------------------------------------------------------------------ the collective --------------------------------
def _row(digest: bytes, me: Member) -> bytes:
    host = me.host.encode(errors="replace")[:_HOST_BYTES]
    return digest + struct.pack("<qq", me.pid, me.start) + host.ljust(_HOST_BYTES, b"\0")


def _member(rank: int, row: bytes) -> Member:
    pid, start = struct.unpack("<qq", row[32:48])
    return Member(rank, row[48:].rstrip(b"\0").decode(errors="replace"), pid, start, row[:32])


# ------------------------------------------------------------------ the error -------------------------------------
def _hosts_text(ranks: Sequence[int], roster: Sequence[Member]) -> str:
    hosts = list(dict.fromkeys(roster[r].host for r in sorted(ranks)))
    shown = ", ".join(hosts[:4]) + (f" and {len(hosts) - 4} more" if len(hosts) > 4 else "")
    return ("host " if len(hosts) == 1 else "hosts ") + shown


def _shown(raw: Optional[str]) -> str:
    if raw is None:
        return "(absent)"
    value = json.loads(raw)
    if isinstance(value, dict) and "sha256" in value:  # a data identity
        sha = str(value.get("sha256", ""))[:16]
        return f"{value.get('path')!r} ({value.get('size')} bytes, sha256 {sha}...)"  # the path whole
    return raw if len(raw) <= SHOWN_CHARS else raw[:SHOWN_CHARS - 3] + "..."


def _display_key(k: str) -> str:
    if k.startswith("cli\0"):
        return k[4:]
    if k.endswith("\0"):
        return {"data": "data (the data this rank reads)",
                "tokenizer": "tokenizer (the sha256 of its vocabulary, merges and special tokens)"}.get(k[:-1], k[:-1])
    return k


_FIXES = {
    "config": "give every rank the same ds_config (a file that differs between nodes: copy one file to every node, "
              "or read it from a shared file system)",
    "cli": "launch every rank with the same arguments",
    "data": "let every rank read the same data (copy the file to every node, or read it from a shared file system)",
    "tokenizer": "let every rank load the same tokenizer files (copy the tokenizer directory to every node, or read "
                 "it from a shared file system)",
}


def _kind(k: str) -> str:
    if k.startswith("cli\0"):
        return "cli"
    if k == "tokenizer\0":
        return "tokenizer"
    return "data" if k.endswith("\0") else "config"


def disagreement(flats: Sequence[Dict[str, str]], roster: Sequence[Member]) -> ConfigError:
    """The one error every rank raises: each differing key (ds_config keys in file order, then the CLI values,
    then the data), its values and the ranks and hosts holding each."""
    keys: List[str] = []
    for flat in flats:
        for k in flat:
            if not k.endswith("\0shown") and k not in keys:
                keys.append(k)
    order = {"config": 0, "cli": 1, "data": 2, "tokenizer": 3}
    differing = sorted((k for k in keys if len({f.get(k) for f in flats}) > 1),
                       key=lambda k: (order[_kind(k)], keys.index(k)))
    parts = []
    for k in differing[:SHOWN_KEYS]:
        groups: Dict[Optional[str], List[int]] = {}
        for rank, flat in enumerate(flats):
            groups.setdefault(flat.get(k), []).append(rank)
        shown_key = k + "shown" if k.endswith("\0") else None
        held = []
        for value, ranks in groups.items():
            shown = flats[ranks[0]].get(shown_key, value) if shown_key else value
            held.append(f"{_shown(shown)} on {ranks_text(ranks)} ({_hosts_text(ranks, roster)})")
        parts.append(("" if not parts else f"{_display_key(k)}: ") + "; ".join(held))
    more = len(differing) - SHOWN_KEYS
    problem = ("differs between the ranks of this job: " + parts[0]
               + ("" if len(parts) == 1 else " | also differing: " + " | ".join(parts[1:]))
               + (f" | and {more} more differing key(s)" if more > 0 else ""))
    fix = "; ".join(dict.fromkeys(_FIXES[_kind(k)] for k in differing))
    return ConfigError(_display_key(differing[0]), problem, fix)


# ------------------------------------------------------------------ the entry points ------------------------------
def check_agreement(ds_config: dict, values: Optional[dict] = None, group=None, start_watchdog: bool = True):
    """Every rank holds the same ``ds_config`` and ``values``, or every rank raises the same ConfigError.

    ``ds_config``: the resolved ds_config dict (or a path: loaded as ``initialize`` loads it), compared whole.
    ``values``: ``{"cli": {flag: value} for the flags that shape training, "data": the identity of the data this
    rank reads (corpus.data_identity: path, size, sha256; compared without the path)}``; any other section is
    compared whole. Call it right after the process group starts, before any other collective: one all-gather
    of 128 bytes per rank (a second round only on a mismatch). Then starts the job's watchdog
    (``long_context.watchdog.timeout_s``, watchdog.py) with the roster. Returns the roster (one
    :class:`Member` per rank). A single process (no process group, or a world of one) has nothing to compare.
    """
    import torch.distributed as dist

    ds_config = load_ds_config(ds_config) if not isinstance(ds_config, dict) else ds_config
    flat = fingerprint(ds_config, values)
    digest = _digest(flat)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        roster = [this_member(0)]
    else:
        me = this_member(dist.get_rank())
        roster = [_member(r, row) for r, row in enumerate(all_gather_rows(_row(digest, me), group))]
        if len({m.digest for m in roster}) > 1:
            blobs = all_gather_blobs(json.dumps(flat).encode(), group)
            raise disagreement([json.loads(b) for b in blobs], roster)
    _STATE.update(config_digest=config_digest(ds_config), roster=roster)
    if start_watchdog and len(roster) > 1:
        watchdog.start(ds_config, roster)
    return roster


def check_config(ds_config: dict, group=None):
    """``initialize``'s part: the ds_config alone, unless this process already agreed on the identical one
    (``check_agreement`` from the training script). Returns the roster."""
    if _STATE["config_digest"] is not None and _STATE["config_digest"] == config_digest(ds_config):
        return _STATE["roster"]
    return check_agreement(ds_config, None, group)


def roster() -> Optional[List[Member]]:
    """The ranks as they reported themselves at the last agreement (None before it)."""
    return _STATE["roster"]


__all__ = ["check_agreement", "check_config", "fingerprint", "disagreement", "roster", "Member"]
