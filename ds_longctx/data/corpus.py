"""Training text at scale: file sources, streaming tokenization into a memory-mapped cache, the dataset over it.

``open_corpus(path, tokenizer, seq_len)`` reads a ``.txt`` file (one document), a ``.jsonl`` file (one document per
line, a string field), a ``.parquet`` or ``.arrow`` file or a ``datasets`` ``save_to_disk`` directory (a string
column), tokenizes it once into a token cache beside the data and returns a torch ``Dataset`` of fixed-length
samples over that cache. A second start with the same data, tokenizer and options reads the cache and tokenizes
nothing.

The cache (DeepSpeed's / Megatron's ``MMapIndexedDataset`` ``.bin``/``.idx`` pair, one item per tokenized
piece, one document per source document, plus ``doc_starts.i64`` and ``meta.json``) lives in
``<data dir>/.ds_longctx_cache/``; when that cannot be written, in ``$DS_LONGCTX_DATA_CACHE`` or
``$XDG_CACHE_HOME/ds_longctx/data`` (``~/.cache/ds_longctx/data``). Its name holds a key over the data's content
hash and size, the tokenizer's serialized form, the column and the chunking. Exactly one process per cache
builds it, under a POSIX file lock (``fcntl.lockf``, no collective: every rank may call this before any), into a
``*.tmp-<host>-<pid>`` directory renamed when complete; the others wait on the lock, then read it. A crashed
build leaves only a ``.tmp-`` directory, which the next builder removes and nothing reads.

Memory: the text is read in blocks of ``BLOCK_BYTES`` and tokenized in pieces of at most ``chunk_chars``
characters, ``BATCH_CHARS`` characters per tokenizer call; a ``.jsonl`` line or a table cell is held whole
while its pieces are tokenized. The builder keeps one small integer per piece (DeepSpeed's index builder) and
nothing else that grows with the file.

Splitting a text changes tokenization only at the cut: a piece is cut before a single space between two
non-space characters (else after a newline, else anywhere: a "hard" cut, counted in meta.json), and the piece
after a cut is tokenized with the words before the cut as left context, whose tokens are then dropped: a
tokenizer that prefixes every input (SentencePiece's "▁", a ByteLevel prefix space) prefixes the context, not
the piece. A cut is *verified* when the context's own tokens are a prefix of the tokens of context + piece;
an unverified cut falls back to the piece tokenized alone and is counted. bench/data_cache.py measures the
result against whole-text tokenization.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import socket
import time
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import ConfigError

FORMAT = 1
BLOCK_BYTES = 1 << 20        # bytes read from a .txt per block
CHUNK_CHARS = 1 << 19        # characters per tokenized piece of a long document
BATCH_CHARS = 1 << 22        # characters per tokenizer call (many pieces or documents together)
BATCH_ROWS = 1024            # rows per table batch
CACHE_DIRNAME = ".ds_longctx_cache"
KINDS = {".txt": "txt", ".jsonl": "jsonl", ".parquet": "parquet", ".arrow": "arrow"}
SUPPORTED = "a .txt, .jsonl, .parquet or .arrow file or a datasets save_to_disk directory"
PIP_DATA = "pip install 'ds_longctx[data]'"

# ---------------------------------------------------------------------------------------------
# what the path is
# ---------------------------------------------------------------------------------------------


def data_kind(path: str) -> Optional[str]:
    """'txt' | 'jsonl' | 'parquet' | 'arrow' | 'datasets' (a save_to_disk directory), or None."""
    if os.path.isdir(path):
        return "datasets" if os.path.isfile(os.path.join(path, "state.json")) else None
    return KINDS.get(os.path.splitext(path)[1].lower())


def _pyarrow(flag: str, path: str):
    try:
        import pyarrow  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise ConfigError(flag, f"reading {path!r} needs pyarrow, which is not installed", PIP_DATA) from None
    import pyarrow

    return pyarrow


def _is_string(t) -> bool:
    import pyarrow as pa

    return pa.types.is_string(t) or pa.types.is_large_string(t) or getattr(pa.types, "is_string_view",
                                                                            lambda _: False)(t)


def _check_column(flag: str, path: str, schema, column: str) -> None:
    names = list(schema.names)
    strings = [n for n in names if _is_string(schema.field(n).type)]
    if column not in names:
        raise ConfigError(flag, f"{path} has no column {column!r} (columns: {names})",
                          f"name a text column with --data-column (string columns: {strings})")
    if column not in strings:
        raise ConfigError(flag, f"{path} column {column!r} has type {schema.field(column).type}, not a string",
                          f"name a text column with --data-column (string columns: {strings})")


def _arrow_reader(path: str):
    """A reader over an Arrow IPC file (random access format) or stream (what ``datasets`` writes)."""
    import pyarrow as pa

    source = pa.memory_map(path, "r")
    try:
        return pa.ipc.open_file(source)
    except pa.ArrowInvalid:
        source = pa.memory_map(path, "r")
        return pa.ipc.open_stream(source)


def check_data_path(flag: str, path: str, column: Optional[str] = "text") -> str:
    """What a CLI checks on every rank before any collective: ``path`` exists, is a supported kind, is readable,
    and (for tables) has the string column. Returns the kind. Cheap: reads no text (a table's schema only)."""
    if not os.path.exists(path):
        raise ConfigError(flag, f"{path!r} does not exist", f"give {SUPPORTED}")
    kind = data_kind(path)
    if kind is None:
        if os.path.isdir(path) and os.path.isfile(os.path.join(path, "dataset_dict.json")):
            splits = sorted(d for d in os.listdir(path) if os.path.isfile(os.path.join(path, d, "state.json")))
            raise ConfigError(flag, f"{path!r} is a datasets DatasetDict (splits {splits}), not one dataset",
                              f"give one split's directory, e.g. {os.path.join(path, splits[0] if splits else 'train')}")
        if os.path.isdir(path):
            raise ConfigError(flag, f"directory {path!r} holds no datasets save_to_disk dataset (no state.json)",
                              f"give {SUPPORTED}")
        raise ConfigError(flag, f"unsupported file type {path!r}", f"give {SUPPORTED}")
    unreadable = [f for f, _ in _data_files(path) if not os.access(f, os.R_OK)]
    if unreadable or not os.access(path, os.R_OK):
        raise ConfigError(flag, f"{(unreadable or [path])[0]!r} is not readable by this user",
                          "fix its permissions or give another path")
    if kind == "txt":
        if column not in (None, "text"):
            raise ConfigError(flag, f"{path} is a .txt file (one document, no columns); a column {column!r} was "
                              "given", "drop --data-column for a .txt file")
    elif kind in ("parquet", "arrow"):
        _pyarrow(flag, path)
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            schema = pq.read_schema(path) if kind == "parquet" else _arrow_reader(path).schema
        except (pa.ArrowException, OSError) as e:
            raise ConfigError(flag, f"{path} is not a readable {kind} file ({type(e).__name__}: {e})",
                              f"give a {kind} file written by pyarrow/pandas/datasets") from None
        _check_column(flag, path, schema, column or "text")
    elif kind == "datasets":
        import importlib.util

        if importlib.util.find_spec("datasets") is None:
            raise ConfigError(flag, f"reading the datasets directory {path!r} needs the datasets library, which "
                              "is not installed", PIP_DATA)
        info = os.path.join(path, "dataset_info.json")
        features = {}
        if os.path.isfile(info):
            try:
                with open(info) as f:
                    features = json.load(f).get("features") or {}
            except (OSError, ValueError):
                features = {}
        if features:
            col = column or "text"
            strings = [n for n, v in features.items() if isinstance(v, dict) and v.get("dtype") in
                       ("string", "large_string")]
            if col not in features:
                raise ConfigError(flag, f"{path} has no column {col!r} (columns: {sorted(features)})",
                                  f"name a text column with --data-column (string columns: {strings})")
            if col not in strings:
                raise ConfigError(flag, f"{path} column {col!r} is {features[col]}, not a string",
                                  f"name a text column with --data-column (string columns: {strings})")
    return kind


# ---------------------------------------------------------------------------------------------
# reading documents (bad input: one ConfigError naming the file, the line / row and the fix)
# ---------------------------------------------------------------------------------------------


def _utf8(raw: bytes, path: str, first_line: int = 1, flag: str = "--data", line_start: int = 0) -> str:
    """``raw`` decoded as UTF-8, or a ConfigError naming the file, the line and the byte. ``line_start``: bytes of
    the first line that came before ``raw`` (a block read from the middle of a line)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _utf8_error(raw, e, path, first_line, flag, line_start) from None


def _utf8_error(raw, e, path, first_line, flag, line_start=0):
    line = first_line + raw.count(b"\n", 0, e.start)
    nl = raw.rfind(b"\n", 0, e.start)
    col = e.start - (nl + 1) + 1 + (line_start if nl < 0 else 0)
    return ConfigError(f"{flag} {path} line {line}", f"is not UTF-8 (byte 0x{raw[e.start]:02x} at column {col}: "
                       f"{e.reason})", "re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)")


def _txt_blocks(path: str, flag: str, block_bytes: int = BLOCK_BYTES) -> Iterator[str]:
    """The file's text in blocks of about ``block_bytes``, decoded incrementally (a character split between two
    reads is carried to the next)."""
    carry = b""
    line, line_start = 1, 0  # line number at the start of ``carry``, bytes of that line before ``carry``
    with open(path, "rb") as f:
        while True:
            raw = f.read(block_bytes)
            buf = carry + raw
            if not buf:
                return
            try:
                text = buf.decode("utf-8")
                carry = b""
            except UnicodeDecodeError as e:
                if raw and e.reason == "unexpected end of data" and e.end == len(buf) and len(buf) - e.start < 4:
                    text, carry = buf[:e.start].decode("utf-8"), buf[e.start:]
                else:
                    raise _utf8_error(buf, e, path, line, flag, line_start) from None
            done = buf[:len(buf) - len(carry)]
            n = done.count(b"\n")
            line_start = len(done) - (done.rfind(b"\n") + 1) + (line_start if n == 0 else 0)
            line += n
            if text:
                yield text
            if not raw:
                return


def _jsonl_docs(path: str, column: str, flag: str) -> Iterator[str]:
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            line = _utf8(raw, path, n, flag)
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{flag} {path} line {n}", f"is not valid JSON ({e})", "write one JSON object "
                                  f'per line, {{"{column}": ...}}') from None
            if not isinstance(rec, dict) or not isinstance(rec.get(column), str):
                keys = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
                raise ConfigError(f"{flag} {path} line {n}", f'has no string "{column}" field (got {keys})',
                                  f'give every line a "{column}" string, e.g. {{"{column}": "..."}}'
                                  + ("" if column != "text" else ", or name the field with --data-column"))
            yield rec[column]


def _column_docs(batches, path: str, column: str, flag: str) -> Iterator[str]:
    row = 0
    batches = iter(batches)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except Exception as e:  # pyarrow's / datasets' read errors name neither the file nor the row
            raise ConfigError(f"{flag} {path} row {row}", f"cannot be read ({type(e).__name__}: {e})",
                              "rewrite the file (pyarrow, pandas or datasets) or remove the damaged part") from None
        values = batch.column(column).to_pylist()
        for v in values:
            if not isinstance(v, str):
                raise ConfigError(f"{flag} {path} row {row}", f"column {column!r} is {v!r}, not a string",
                                  "drop or fill the rows without text")
            row += 1
            yield v


def _table_batches(path: str, kind: str, column: str, flag: str):
    if kind == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).iter_batches(batch_size=BATCH_ROWS, columns=[column])
    if kind == "arrow":
        reader = _arrow_reader(path)
        if hasattr(reader, "num_record_batches"):  # the file format: random access
            return (reader.get_batch(i) for i in range(reader.num_record_batches))
        return iter(reader)
    try:
        import datasets
    except ImportError:
        raise ConfigError(flag, f"reading the datasets directory {path!r} needs the datasets library", PIP_DATA
                          ) from None
    ds = datasets.load_from_disk(path)
    if not isinstance(ds, datasets.Dataset):
        raise ConfigError(flag, f"{path!r} holds a {type(ds).__name__}, not one dataset",
                          "give one split's directory")
    return ds.select_columns([column]).with_format("arrow").iter(batch_size=BATCH_ROWS)


def _documents(path: str, kind: str, column: str, flag: str) -> Iterator[Iterator[str]]:
    """Each document as an iterator of text blocks (a .txt file: one document read in blocks)."""
    if kind == "txt":
        yield _txt_blocks(path, flag)
        return
    docs = _jsonl_docs(path, column, flag) if kind == "jsonl" else \
        _column_docs(_table_batches(path, kind, column, flag), path, column, flag)
    for text in docs:
        yield iter((text,))


# ---------------------------------------------------------------------------------------------
# cutting long documents into pieces
# ---------------------------------------------------------------------------------------------

_SPACE_CUT = re.compile(r"(?<=\S) (?=\S)")   # before a single space between two non-space characters
_NEWLINE_CUT = re.compile(r"(?<=\n)(?=\S)")  # after a newline, before a non-space character


def _last_match(pattern, text: str, lo: int, hi: int) -> int:
    """The last position p in [lo, hi] where ``pattern`` matches (searched in growing windows), or -1."""
    w = 4096
    while True:
        start = max(lo, hi - w)
        best = -1
        for m in pattern.finditer(text, start, hi + 1):
            best = m.start()
        if best >= 0 or start == lo:
            return best
        w *= 16


def _cut(text: str, start: int, target: int) -> Tuple[int, str]:
    """Where to end the piece text[start:] at most at ``target`` (text longer than target + 1), and how."""
    lo = max(start + 1, start + (target - start) // 2)
    for pattern, how in ((_SPACE_CUT, "space"), (_NEWLINE_CUT, "newline")):
        p = _last_match(pattern, text, lo, target)
        if p > 0:
            return p, how
    return target, "hard"


def _context(text: str, cut: int) -> str:
    """The words before ``cut`` that the next piece is tokenized behind (from a safe cut 16-512 characters back)."""
    lo = max(0, cut - 512)
    for pattern in (_SPACE_CUT, _NEWLINE_CUT):
        p = _last_match(pattern, text, lo, cut - 16) if cut - 16 > lo else -1
        if p > 0:
            return text[p:cut]
    return text[max(0, cut - 64):cut]


def _pieces(blocks: Iterator[str], chunk_chars: int, cuts: Dict[str, int]) -> Iterator[Tuple[str, str, bool]]:
    """(left context, piece, last piece of the document) for one document. Cuts move an index: a document given
    as one string (a 1 GB jsonl line) is sliced once per piece, never re-copied."""
    buf, pos, ctx = "", 0, ""
    for block in blocks:
        buf = buf[pos:] + block if buf else block
        pos = 0
        while len(buf) - pos > chunk_chars + 1:
            c, how = _cut(buf, pos, pos + chunk_chars)
            cuts[how] += 1
            yield ctx, buf[pos:c], False
            ctx = _context(buf, c)
            pos = c
    yield ctx, buf[pos:], True


# ---------------------------------------------------------------------------------------------
# identities: the data's and the tokenizer's
# ---------------------------------------------------------------------------------------------


def _data_files(path: str) -> List[Tuple[str, str]]:
    """(file, name) of every file the data consists of: the file itself, or a directory's regular files."""
    if not os.path.isdir(path):
        return [(path, os.path.basename(path))]
    out = []
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if d != CACHE_DIRNAME)
        for name in sorted(files):
            full = os.path.join(root, name)
            if os.path.isfile(full):
                out.append((full, os.path.relpath(full, path)))
    return out


def _stat_key(path: str) -> Tuple[str, int]:
    """A digest of (name, size, mtime, ctime, inode, device) of every data file, and the total size."""
    rows, size = [], 0
    for full, name in _data_files(path):
        st = os.stat(full)
        rows.append([name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev])
        size += st.st_size
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest(), size


def _content_hash(path: str) -> str:
    h = hashlib.sha256()
    for full, name in _data_files(path):
        if os.path.isdir(path):
            h.update(name.encode() + b"\0")
        with open(full, "rb") as f:
            fh = hashlib.file_digest(f, "sha256") if hasattr(hashlib, "file_digest") else _digest(f)
        h.update(fh.digest())
    return h.hexdigest()


def _digest(f):
    h = hashlib.sha256()
    for block in iter(lambda: f.read(1 << 22), b""):
        h.update(block)
    return h


_IDENTITIES: Dict[Tuple[str, str], dict] = {}  # (abs path, stat key) -> identity, this process


def _identity(path: str, root: str, verify: bool) -> dict:
    """The identity, from this process' memo or the record beside the cache when every file's (size, mtime,
    ctime, inode, device) is unchanged, else hashed now (and recorded). Called under the data's lock."""
    apath = os.path.abspath(path)
    key, size = _stat_key(path)
    if not verify and (apath, key) in _IDENTITIES:
        return dict(_IDENTITIES[(apath, key)])
    record = os.path.join(root, _base(apath) + ".identity.json")
    ident = None
    if not verify and os.path.isfile(record):
        try:
            with open(record) as f:
                rec = json.load(f)
            if rec.get("stat_key") == key and rec.get("path") == apath:
                ident = rec["identity"]
        except (OSError, ValueError, KeyError):
            ident = None
    if ident is None:
        ident = {"path": apath, "kind": data_kind(path), "size": size, "sha256": _content_hash(path)}
        atomic_write(record, json.dumps({"path": apath, "stat_key": key, "identity": ident}))
    _IDENTITIES[(apath, key)] = ident
    return dict(ident)


def data_identity(path: str, *, cache_dir: Optional[str] = None, verify: Optional[bool] = None) -> dict:
    """``{"path", "kind", "size", "sha256"}`` of the data at ``path`` (a directory: all its files, by name).

    The content hash is computed once per file version: later calls (this process, or a later start on a node
    that sees the same record) reuse it while every file's (size, mtime_ns, ctime_ns, inode, device) is
    unchanged. What that trusts: the kernel sets ctime on every write and no user can set it back, so a file
    written since has another ctime; it does not see a change made behind the file system (a block-device
    write, a restore of a snapshot onto the same inode with the same times). ``verify=True`` (or
    ``DS_LONGCTX_DATA_VERIFY=1``) re-hashes. No collective; one process per node hashes (the others wait on the
    data's lock, then read the record)."""
    if verify is None:
        verify = os.environ.get("DS_LONGCTX_DATA_VERIFY", "") not in ("", "0")
    root = cache_root(path, cache_dir)
    with _locked(root, _base(os.path.abspath(path)) + ".lock", "--data"):
        return _identity(path, root, verify)


def tokenizer_content_sha256(tokenizer) -> str:
    """The SHA-256 of what decides a tokenizer's ids, and nothing else (not its path: two nodes may mount the same
    files at different paths): its vocabulary and merges (a fast tokenizer's whole serialized pipeline, which holds
    them with its added tokens, normalizer and pre-tokenizer; else the sorted vocabulary) and its special tokens
    with their ids. Part of the data identity (train.data_identity): every rank agrees on it at start and a resume
    compares it."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "to_str"):
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted((str(k), int(v)) for k, v in tokenizer.get_vocab().items())).encode())
    specials = {str(k): [str(v), tokenizer.convert_tokens_to_ids(str(v))] if isinstance(v, str) else str(v)
                for k, v in (getattr(tokenizer, "special_tokens_map", None) or {}).items()}
    added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
    h.update(json.dumps({"special": specials, "added": sorted((str(t), int(i)) for t, i in added.items())},
                        sort_keys=True).encode())
    return h.hexdigest()


def tokenizer_fingerprint(tokenizer) -> dict:
    """What decides the ids a tokenizer gives: its serialized pipeline (a fast tokenizer's tokenizer.json, else
    its vocabulary), class, options and EOS, and the library versions (an upgrade rebuilds the cache)."""
    import transformers

    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "to_str"):
        h.update(backend.to_str().encode())
    elif hasattr(tokenizer, "get_vocab"):
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    else:
        h.update(repr(tokenizer).encode())
    init = getattr(tokenizer, "init_kwargs", None) or {}
    h.update(json.dumps(init, sort_keys=True, default=str).encode())
    try:
        import tokenizers

        tok_version = tokenizers.__version__
    except ImportError:
        tok_version = None
    return {"class": type(tokenizer).__name__, "name_or_path": str(getattr(tokenizer, "name_or_path", "")),
            "eos_token_id": getattr(tokenizer, "eos_token_id", None), "sha256": h.hexdigest(),
            "transformers": transformers.__version__, "tokenizers": tok_version}


# ---------------------------------------------------------------------------------------------
# where the cache lives, the lock, atomic writes
# ---------------------------------------------------------------------------------------------


def _base(apath: str) -> str:
    """A file-name-safe name for the data: its base name plus a digest of its absolute path."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", os.path.basename(apath.rstrip(os.sep)) or "data")[:80]
    return f"{name}.{hashlib.sha256(apath.encode()).hexdigest()[:10]}"


def _writable_dir(d: str) -> bool:
    try:
        os.makedirs(d, exist_ok=True)
    except OSError:
        return False
    return os.access(d, os.W_OK | os.X_OK)


def cache_root(path: str, cache_dir: Optional[str] = None) -> str:
    """Where the caches of ``path`` live: ``cache_dir``, else ``$DS_LONGCTX_DATA_CACHE``, else
    ``<data dir>/.ds_longctx_cache`` when it can be written, else ``$XDG_CACHE_HOME/ds_longctx/data``."""
    chosen = cache_dir or os.environ.get("DS_LONGCTX_DATA_CACHE")
    if chosen:
        if not _writable_dir(chosen):
            raise ConfigError("DS_LONGCTX_DATA_CACHE" if not cache_dir else "cache_dir",
                              f"{chosen!r} cannot be created or written", "give a writable directory")
        return chosen
    beside = os.path.join(os.path.dirname(os.path.abspath(path).rstrip(os.sep)), CACHE_DIRNAME)
    if _writable_dir(beside):
        return beside
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    fallback = os.path.join(home, "ds_longctx", "data")
    if not _writable_dir(fallback):
        raise ConfigError("--data", f"no writable place for the token cache of {path!r} ({beside!r} and "
                          f"{fallback!r} cannot be written)", "set DS_LONGCTX_DATA_CACHE to a writable directory")
    return fallback


@contextlib.contextmanager
def _locked(root: str, name: str, flag: str):
    """An exclusive POSIX lock on ``root/name`` (released by the kernel if the holder dies). Waiters say every
    60 s who holds it. Open the lock file once per process (closing any descriptor of it drops the lock).

    Ours rather than ``filelock`` (which transformers installs): waiters name the holder (host, pid, since when),
    and a file system without locks (Lustre without ``-o flock``) is one ConfigError naming the fix."""
    import fcntl

    path = os.path.join(root, name)
    with open(path, "a+") as f:
        start = last = time.time()
        while True:
            try:
                fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EACCES, errno.EAGAIN):
                    raise ConfigError(flag, f"cannot lock {path!r} ({os.strerror(e.errno)}): the file system "
                                      "of the token cache has no POSIX locks", "set DS_LONGCTX_DATA_CACHE to a "
                                      "directory on a file system with locks (a node-local disk, or NFS with "
                                      "locking)") from None
            if time.time() - last >= 60:
                f.seek(0)
                holder = f.read().strip() or "another process"
                print(f"[ds_longctx] waiting {time.time() - start:.0f} s for the token cache lock {path} "
                      f"(held by {holder})", flush=True)
                last = time.time()
            time.sleep(0.2)
        try:
            f.seek(0)
            f.truncate()
            f.write(f"host {socket.gethostname()} pid {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
            f.flush()
            yield
        finally:
            fcntl.lockf(f, fcntl.LOCK_UN)


def atomic_write(path: str, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: a temporary file (named by host and pid: writers on a shared
    filesystem never meet), fsynced, then renamed over ``path``."""
    tmp = f"{path}.tmp-{socket.gethostname()}-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# building the cache
# ---------------------------------------------------------------------------------------------


def _token_dtype(tokenizer):
    try:
        n = len(tokenizer)
    except TypeError:
        n = None
    return np.uint16 if n is not None and n < 65500 else np.int32  # DeepSpeed's best-fitting rule


def _encoder(tokenizer):
    """``texts -> ids`` equal to ``tokenizer(texts, add_special_tokens=False)["input_ids"]``. A transformers
    tokenizer over a ``tokenizers`` backend whose encoding transformers does not override is called through the
    backend's ``encode_batch_fast`` (what the wrapper runs, less the offsets nobody reads here: 4 MiB of text
    in 0.66 s instead of 1.9 s, 2-core CPU VM, 2026-11-27); anything else through its own ``__call__``."""
    def wrapper(texts):
        return tokenizer(texts, add_special_tokens=False, return_attention_mask=False,
                         return_token_type_ids=False)["input_ids"] if texts else []

    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return wrapper
    backend = getattr(tokenizer, "_tokenizer", None)
    cls = type(tokenizer)
    plain = (isinstance(tokenizer, TokenizersBackend) and cls._encode_plus is TokenizersBackend._encode_plus
             and cls.__call__ is TokenizersBackend.__call__ and hasattr(backend, "encode_batch_fast")
             and backend.truncation is None and backend.padding is None
             and backend.encode_special_tokens == bool(getattr(tokenizer, "split_special_tokens", False)))
    if not plain:
        return wrapper

    def fast(texts):
        return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)] if texts else []

    return fast


class _Writer:
    """Tokenizes (context, piece, last) items in batches and appends them to DeepSpeed's index builder."""

    def __init__(self, tokenizer, prefix: str, flag: str, path: str):
        from deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset import MMapIndexedDatasetBuilder

        self.tokenizer, self.flag, self.path = tokenizer, flag, path
        self.encode = _encoder(tokenizer)
        self.dtype = _token_dtype(tokenizer)
        self.limit = np.iinfo(self.dtype).max
        self.builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=self.dtype)
        self.starts = open(os.path.join(os.path.dirname(prefix), "doc_starts.i64"), "wb")
        self.eos = getattr(tokenizer, "eos_token_id", None)
        self.items: List[Tuple[str, str, bool]] = []
        self.chars = 0
        self.tokens = self.docs = 0
        self.max_id = -1
        self.new_doc = True
        self.unverified = 0

    def add(self, ctx: str, piece: str, last: bool) -> None:
        self.items.append((ctx, piece, last))
        self.chars += len(ctx) + len(piece)
        if self.chars >= BATCH_CHARS:
            self.flush()

    def flush(self) -> None:
        items, self.items, self.chars = self.items, [], 0
        if not items:
            return
        texts = [ctx + piece for ctx, piece, _ in items]
        with_ctx = [i for i, (ctx, _, _) in enumerate(items) if ctx]
        ids = self.encode(texts + [items[i][0] for i in with_ctx])
        ctx_ids = dict(zip(with_ctx, ids[len(items):]))
        for i, (ctx, piece, last) in enumerate(items):
            row = ids[i]
            if i in ctx_ids:
                k = len(ctx_ids[i])
                if row[:k] == ctx_ids[i]:
                    row = row[k:]
                else:  # the context's tokens changed with the piece behind them: the cut was not clean
                    self.unverified += 1
                    row = self.encode([piece])[0]
            arr = np.asarray(row, dtype=np.int64)
            if last and self.eos is not None:
                arr = np.append(arr, self.eos)
            if arr.size:
                top = int(arr.max())
                if top > self.limit or int(arr.min()) < 0:
                    raise ConfigError("--tokenizer", f"produced id {top} from {self.path}, outside the cache's "
                                      f"{np.dtype(self.dtype).name} range (len(tokenizer) = {len(self.tokenizer)})",
                                      "use a tokenizer whose ids are below its length")
                self.max_id = max(self.max_id, top)
            if self.new_doc:
                self.starts.write(np.int64(self.tokens).tobytes())
                self.docs += 1
                self.new_doc = False
            self.builder.add_item_numpy(arr.astype(self.dtype))
            self.tokens += arr.size
            if last:
                self.builder.end_document()
                self.new_doc = True
        del ids

    def finish(self, idx_path: str) -> None:
        self.flush()
        self.builder.finalize(idx_path)
        self.starts.close()


def _fsync_dir(d: str) -> None:
    for name in os.listdir(d):
        with open(os.path.join(d, name), "rb") as f:
            os.fsync(f.fileno())


def _build(path: str, kind: str, column: str, tokenizer, final: str, meta: dict, flag: str,
           chunk_chars: int) -> None:
    import shutil

    tmp = f"{final}.tmp-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    t0 = time.time()
    try:
        writer = _Writer(tokenizer, os.path.join(tmp, "tokens"), flag, path)
        cuts = {"space": 0, "newline": 0, "hard": 0}
        for blocks in _documents(path, kind, column, flag):
            for ctx, piece, last in _pieces(blocks, chunk_chars, cuts):
                writer.add(ctx, piece, last)
        writer.finish(os.path.join(tmp, "tokens.idx"))
        meta.update(dtype=np.dtype(writer.dtype).name, n_tokens=writer.tokens, n_docs=writer.docs,
                    max_id=writer.max_id, cuts=dict(cuts, unverified=writer.unverified),
                    built={"host": socket.gethostname(), "pid": os.getpid(), "seconds": round(time.time() - t0, 3),
                           "date": time.strftime("%Y-%m-%d %H:%M:%S")})
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
        _fsync_dir(tmp)
        os.rename(tmp, final)  # complete: visible under its name only now
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES):
            raise
        free = shutil.disk_usage(os.path.dirname(final)).free
        raise ConfigError(flag, f"writing the token cache of {path} into {os.path.dirname(final)} failed: "
                          f"{os.strerror(e.errno)} ({free / 2**30:.2f} GiB free there)",
                          "free space there or set DS_LONGCTX_DATA_CACHE to a directory with room (the cache takes "
                          "2 bytes per token for vocabularies under 65,500 tokens, else 4)") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    hard, bad = cuts["hard"], writer.unverified
    if hard or bad:
        print(f"[ds_longctx] warning: {path}: {hard} of {sum(cuts.values())} cuts of long documents fell inside a "
              f"word (no space or newline within {chunk_chars // 2} characters) and {bad} could not be verified: "
              "tokens at those cuts may differ from whole-text tokenization", flush=True)


def _cache_key(ident: dict, column: Optional[str], fp: dict, chunk_chars: int) -> str:
    blob = {"format": FORMAT, "sha256": ident["sha256"], "size": ident["size"], "kind": ident["kind"],
            "column": column, "tokenizer": fp, "chunk_chars": chunk_chars}
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()


def token_cache(path: str, tokenizer, *, column: Optional[str] = "text", flag: str = "--data",
                cache_dir: Optional[str] = None, chunk_chars: int = CHUNK_CHARS, verify: Optional[bool] = None
                ) -> Tuple[str, dict]:
    """The cache directory of ``path`` tokenized by ``tokenizer`` (built now if there is none) and its meta.
    No collective; one process per cache builds, the others wait on its lock."""
    kind = check_data_path(flag, path, column)
    column = None if kind == "txt" else (column or "text")
    if verify is None:
        verify = os.environ.get("DS_LONGCTX_DATA_VERIFY", "") not in ("", "0")
    root = cache_root(path, cache_dir)
    base = _base(os.path.abspath(path))
    with _locked(root, base + ".lock", flag):
        ident = _identity(path, root, verify)
        fp = tokenizer_fingerprint(tokenizer)
        key = _cache_key(ident, column, fp, chunk_chars)
        final = os.path.join(root, f"{base}.{key[:20]}.tokens")
        for name in os.listdir(root):  # a crashed build's leftovers (nobody else builds while we hold the lock)
            if name.startswith(os.path.basename(final) + ".tmp-"):
                import shutil

                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        if not os.path.isdir(final):
            meta = {"format": FORMAT, "key": key, "data": ident, "column": column, "tokenizer": fp,
                    "chunk_chars": chunk_chars}
            _build(path, kind, column, tokenizer, final, meta, flag, chunk_chars)
    return final, _read_meta(final, flag)


def _read_meta(final: str, flag: str) -> dict:
    fix = f"remove it (rm -r {final}); the next start rebuilds it"
    try:
        with open(os.path.join(final, "meta.json")) as f:
            meta = json.load(f)
        itemsize = np.dtype(meta["dtype"]).itemsize
        sizes = {"tokens.bin": meta["n_tokens"] * itemsize, "doc_starts.i64": meta["n_docs"] * 8}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(flag, f"the token cache {final} is damaged ({type(e).__name__}: {e})", fix) from None
    for name, want in sizes.items():
        p = os.path.join(final, name)
        have = os.path.getsize(p) if os.path.isfile(p) else None
        if have != want:
            raise ConfigError(flag, f"the token cache {final} is damaged ({name}: {have} bytes, expected {want})",
                              fix)
    return meta


# ---------------------------------------------------------------------------------------------
# the dataset
# ---------------------------------------------------------------------------------------------


class CorpusDataset(Dataset):
    """Fixed-length samples cut from a token cache: documents, each followed by EOS, concatenated and cut into
    samples of ``seq_len`` (the tail shorter than one sample is left out).

    Ours over DeepSpeed's files: its ``MMapIndexedDataset`` returns items (pieces), not windows across them, and
    prints on every open; a sample here is one slice of the ``.bin`` token stream.

    With ``documents=True`` every sample carries ``position_ids`` restarting at 0 at each document start and at
    the sample start, so attention stays inside documents (HF's packed convention; shard_batch turns it into
    the document structure). ``documents=False``: plain concatenation, no position_ids (attention across
    documents, pretraining style). The tokens are memory-mapped: a rank holds only the samples it reads."""

    def __init__(self, cache: str, meta: dict, seq_len: int, documents: bool = True):
        self.cache, self.meta, self.seq_len, self.documents = cache, meta, seq_len, documents
        self.n = meta["n_tokens"] // seq_len
        self._tokens = self._starts = None

    def __getstate__(self):  # DataLoader workers reopen the maps instead of pickling them
        state = dict(self.__dict__)
        state["_tokens"] = state["_starts"] = None
        return state

    def _open(self):
        self._tokens = np.memmap(os.path.join(self.cache, "tokens.bin"), dtype=self.meta["dtype"], mode="r",
                                 shape=(self.meta["n_tokens"],)) if self.meta["n_tokens"] else np.zeros(0, np.int64)
        self._starts = np.memmap(os.path.join(self.cache, "doc_starts.i64"), dtype=np.int64, mode="r",
                                 shape=(self.meta["n_docs"],)) if self.meta["n_docs"] else np.zeros(0, np.int64)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(f"sample {i} of {self.n}")
        if self._tokens is None:
            self._open()
        lo, seq = i * self.seq_len, self.seq_len
        ids = torch.from_numpy(self._tokens[lo:lo + seq].astype(np.int64))
        item = {"input_ids": ids, "labels": ids.clone()}
        if self.documents:
            a = int(np.searchsorted(self._starts, lo, "right"))
            b = int(np.searchsorted(self._starts, lo + seq, "left"))
            is_start = np.zeros(seq, dtype=bool)
            is_start[0] = True
            is_start[np.asarray(self._starts[a:b]) - lo] = True
            idx = np.arange(seq)
            last = np.maximum.accumulate(np.where(is_start, idx, 0))
            item["position_ids"] = torch.from_numpy(idx - last)
        return item


def check_tokenizer_vocab(tokenizer, vocab_size: int, top: Optional[int] = None, source: Optional[str] = None,
                          name: Optional[str] = None) -> None:
    """A tokenizer whose ids reach past the model's embedding is an error (before the engine starts:
    otherwise an IndexError deep in the forward). ``top``: the largest id it produced from ``source``."""
    n = len(tokenizer)
    past = top is not None and top >= vocab_size
    if n <= vocab_size and not past:
        return
    who = f"{name!r} " if name else "it "
    produced = f"{who}has {n} tokens and produced id {top} from {source}" if past else ""
    if n > vocab_size:
        problem = (f"has {n} tokens but the model's vocab_size is {vocab_size}: ids >= {vocab_size} would index "
                   "past the embedding" + (f" ({produced})" if past else ""))
    else:
        problem = f"{produced}, but the model's vocab_size is {vocab_size}"
    raise ConfigError("--tokenizer", problem, "use the model's own tokenizer or a model with vocab_size >= "
                      f"{max(n, (top or 0) + 1)}")


def open_corpus(path: str, tokenizer, seq_len: int, *, documents: bool = True, column: Optional[str] = "text",
                vocab_size: Optional[int] = None, tokenizer_name: Optional[str] = None, flag: str = "--data",
                cache_dir: Optional[str] = None, chunk_chars: int = CHUNK_CHARS) -> CorpusDataset:
    """The samples of ``path`` (see the module docstring for the kinds), tokenized once into the cache.

    Called on every rank; no collective. ``vocab_size``: the model's; a tokenizer or an id past it is a
    ConfigError (naming the largest id produced). ``flag``: the CLI flag named in errors (``--eval-data``)."""
    if seq_len < 1:
        raise ConfigError("--seq-len", f"must be >= 1, got {seq_len}", "give the global tokens per sample")
    cache, meta = token_cache(path, tokenizer, column=column, flag=flag, cache_dir=cache_dir,
                              chunk_chars=chunk_chars)
    if vocab_size is not None:  # checked on the ids produced, so the error can name the largest
        check_tokenizer_vocab(tokenizer, vocab_size, top=meta["max_id"] if meta["max_id"] >= 0 else None,
                              source=path, name=tokenizer_name)
    ds = CorpusDataset(cache, meta, seq_len, documents)
    # the text's own tokens: every document is followed by one EOS (when the tokenizer has one); a file whose
    # documents are empty would otherwise train on EOS-only samples
    eos = meta["n_docs"] if getattr(tokenizer, "eos_token_id", None) is not None else 0
    text_tokens = meta["n_tokens"] - eos
    if text_tokens < seq_len:
        what = (f"no text tokens: each of its {meta['n_docs']} document(s) is empty (only the end-of-document "
                f"token)" if text_tokens <= 0 else f"{text_tokens} text tokens besides its {eos} end-of-document "
                f"tokens, fewer than one sample of {seq_len}")
        where = f" (column {column!r})" if column and data_kind(path) not in (None, "txt") else ""
        raise ConfigError(flag, f"{path}{where} has {what}",
                          "give a file with more text in that column, or a smaller --seq-len")
    if len(ds) == 0:
        raise ConfigError(flag, f"{path} has {meta['n_tokens']} tokens, fewer than one sample of {seq_len}",
                          "use a larger file or a smaller --seq-len")
    return ds


__all__ = ["open_corpus", "CorpusDataset", "check_data_path", "data_identity", "token_cache", "cache_root",
           "check_tokenizer_vocab", "tokenizer_fingerprint", "data_kind"]
