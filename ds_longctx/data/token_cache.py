"""The token cache: the data's identity (content hash and size, hashed once per file version) and the tokenizer's
(its serialized form), where the cache lives and its lock (one builder per cache, no collective), and the build
into DeepSpeed's / Megatron's ``MMapIndexedDataset`` ``.bin``/``.idx`` pair under a temporary name."""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import numpy as np
import os
import re
import socket
import time
from typing import Dict, List, Optional, Tuple

from ..errors import ConfigError
from .sources import CACHE_DIRNAME, CHUNK_CHARS, check_data_path, cut_pieces, data_files, data_kind, read_documents


FORMAT = 1


BATCH_CHARS = 1 << 22        # characters per tokenizer call (many pieces or documents together)




def _stat_key(path: str) -> Tuple[str, int]:
    """A digest of (name, size, mtime, ctime, inode, device) of every data file, and the total size."""
    rows, size = [], 0
    for full, name in data_files(path):
        st = os.stat(full)
        rows.append([name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev])
        size += st.st_size
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest(), size


def _content_hash(path: str) -> str:
    h = hashlib.sha256()
    for full, name in data_files(path):
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
        for blocks in read_documents(path, kind, column, flag):
            for ctx, piece, last in cut_pieces(blocks, chunk_chars, cuts):
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
