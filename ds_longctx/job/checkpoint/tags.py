"""The tag format and what is saved: names (``step<N>``, the record file, the HF config folder, the universal
suffix, temporary names), the filesystem steps a save relies on (fsync, atomic exchange, free bytes), and the
checks of a saved tag (:func:`check_tag`, :func:`find_resume_tag`: complete, readable, every file its size, and
with a content check every file its checksum: ``manifest``)."""
from __future__ import annotations

import json
import os
import zipfile
from typing import Callable, Dict, Optional, Tuple

from ...errors import ConfigError
from ...models import text_config
from . import manifest

# a content check of a tag: (save directory, tag, its record, the structural problem or None) -> the problem or None
Verify = Callable[[str, str, dict, Optional[str]], Optional[str]]


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


def step_of(tag: str) -> Optional[int]:
    return int(tag[4:]) if tag.startswith("step") and tag[4:].isdigit() else None


def fsync_dir(path: str) -> None:
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


def fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


_RENAME_EXCHANGE = 2


def exchange(a: str, b: str) -> bool:
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


def free_bytes(path: str) -> int:
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


def check_tag(path: str, tag: str, verify: Optional[Verify] = None) -> Tuple[Optional[dict], Optional[str]]:
    """(record, None) for a complete, readable tag, else (None, the problem naming its file). Checked here: the
    record (valid JSON, its own checksum), every file's presence and size, torch archives' directories. ``verify``:
    the content check (``manifest.verify_tag`` in one process, resume's every-rank check in a job), called with the
    structural problem too (a check that is a collective runs on every rank whatever this rank found)."""
    record, problem = _check_structure(path, tag)
    if verify is not None:
        problem = verify(path, tag, record or {}, problem)
    return (None, problem) if problem else (record, None)


def _check_structure(path: str, tag: str) -> Tuple[Optional[dict], Optional[str]]:
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
    problem = manifest.record_problem(record, rec_path)
    if problem:
        return None, problem
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


def is_tag_dir(path: str) -> bool:
    """``path`` is one tag (it holds a record), not a save directory: ``--resume ck/step40`` names that tag."""
    return os.path.isfile(os.path.join(path, RECORD_FILE))


def save_dir_of(path: str) -> str:
    """The save directory a resume path names: ``path`` itself, or its parent when ``path`` is one tag."""
    path = os.path.normpath(path)
    return os.path.dirname(path) if is_tag_dir(path) else path


def find_resume_tag(path: str, name: str = "--resume", verify: Optional[Verify] = None
                    ) -> Tuple[str, dict, Optional[str]]:
    """(tag, record, note) of the checkpoint a resume loads from ``path``: the tag in ``latest`` when it is
    complete, readable and (with ``verify``) its content matches its checksums, else the newest such tag
    (``note`` says why and which, naming the bad file); a ConfigError when there is none. ``path`` may be one tag
    (``ck/step40``): that tag or a ConfigError naming its problem (the tag is relative to :func:`save_dir_of`)."""
    if os.path.isdir(path) and is_tag_dir(path):
        parent, tag = os.path.split(os.path.normpath(path))
        record, problem = check_tag(parent, tag, verify)
        if problem:
            raise ConfigError(name, f"checkpoint {path!r}: {problem}", f"resume another tag, or the save directory "
                              f"{parent!r} (its newest complete tag)")
        return tag, record, None
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
                record, problem = check_tag(path, tag, verify)
                if problem is None:
                    return tag, record, None
                parked = OLD_PREFIX + tag  # a replace of T killed between its two renames: T is complete there
                if not os.path.exists(os.path.join(path, tag)) and _check_structure(path, parked)[0] is not None:
                    record, parked_problem = check_tag(path, parked, verify)
                    if parked_problem is None:
                        return parked, record, (f"{name}: {os.path.join(path, tag)!r} was being replaced when its "
                                                f"run ended; resuming from its complete copy "
                                                f"{os.path.join(path, parked)!r}")
    candidates = []
    for entry in os.listdir(path):
        if entry == tag or entry.startswith((TMP_PREFIX, OLD_PREFIX)) or entry.endswith(UNIVERSAL_SUFFIX) or \
                not os.path.isdir(os.path.join(path, entry)):
            continue
        record, _ = _check_structure(path, entry)  # cheap: the content only of the newest, in turn
        if record is not None:
            candidates.append((int(record.get("step", -1)), entry))
    skipped = []
    for step, entry in sorted(candidates, reverse=True):
        record, bad = check_tag(path, entry, verify)
        if bad is None:
            why = problem or "there is no 'latest' file"
            also = f"; skipped: {'; '.join(skipped)}" if skipped else ""
            note = (f"{name}: {why}; resuming from {os.path.join(path, entry)!r} (step {step}), the newest complete "
                    f"checkpoint{also}")
            return entry, record, note
        skipped.append(bad)
    if problem is None and not skipped:
        raise ConfigError(name, f"{path!r} holds no checkpoint (no 'latest' file)",
                          "give the directory passed to --save")
    problems = ([problem] if problem else []) + skipped
    what = f"checkpoint {tag!r} in {path!r}" if problem and tag else f"{path!r}"
    also = f" (the others: {'; '.join(problems[1:])})" if problems[1:] else ""
    raise ConfigError(name, f"{what}: {problems[0]}, and no other complete checkpoint is there{also}",
                      "resume a complete checkpoint saved by ds_longctx, or start a new run")


def verify_report(path: str, tag: Optional[str] = None) -> Tuple[list, bool]:
    """``ds-longctx verify``: every tag of the save directory ``path`` (or ``tag``; or ``path`` itself when it is
    one tag) checked whole, by content, in one process. Returns (lines, every checked tag intact)."""
    import time

    if os.path.isdir(path) and is_tag_dir(path):
        path, tag = os.path.split(os.path.normpath(path))
    if not os.path.isdir(path):
        raise ConfigError("checkpoint", f"{path!r} does not exist", "give a --save directory or one of its tags")
    if tag is not None:
        tags = [tag]
    else:
        tags = sorted((e for e in os.listdir(path) if os.path.isdir(os.path.join(path, e)) and
                       not e.startswith((TMP_PREFIX, OLD_PREFIX)) and not e.endswith(UNIVERSAL_SUFFIX) and
                       os.path.isfile(os.path.join(path, e, RECORD_FILE))), key=lambda e: (step_of(e) or -1, e))
        if not tags:
            raise ConfigError("checkpoint", f"{path!r} holds no tag (no directory with {RECORD_FILE})",
                              "give the directory passed to --save")
    lines, ok = [], True
    for t in tags:
        t0 = time.monotonic()
        record, problem = check_tag(path, t, manifest.verify_tag)
        if problem:
            ok = False
            lines.append(f"{t}: DAMAGED: {problem}")
            continue
        sums = manifest.checksums_of(record)
        if sums is None:
            lines.append(f"{t}: complete (sizes and archives checked; saved without checksums: content unchecked)")
            continue
        n = sum(os.path.getsize(os.path.join(path, t, rel)) for rel in sums)
        lines.append(f"{t}: intact ({len(sums)} files, {n} bytes, {manifest.ALGORITHM} in "
                     f"{time.monotonic() - t0:.2f} s)")
    if tag is None:
        try:
            chosen, _, note = find_resume_tag(path, name="--resume auto", verify=manifest.verify_tag)
            lines.append(f"--resume {path} loads {chosen}" + (f" ({note})" if note else ""))
        except ConfigError as e:
            lines.append(f"--resume {path} would fail: {e.problem}")
    return lines, ok


def model_facts(model_config) -> dict:
    """The shape facts a checkpoint must share with the model it is loaded into."""
    tc = text_config(model_config)
    heads = getattr(tc, "num_attention_heads", None)
    hidden = getattr(tc, "hidden_size", None)
    head_dim = getattr(tc, "head_dim", None) or (hidden // heads if hidden and heads else None)
    return {"model_type": getattr(tc, "model_type", None), "layers": getattr(tc, "num_hidden_layers", None),
            "heads": heads, "kv_heads": getattr(tc, "num_key_value_heads", None) or heads, "head_dim": head_dim,
            "hidden": hidden, "vocab": getattr(tc, "vocab_size", None)}
