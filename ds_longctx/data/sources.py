"""Training text files as documents: the kinds read (``.txt``, ``.jsonl``, ``.parquet``, ``.arrow``, a ``datasets``
save_to_disk directory), their checks before any work (:func:`check_data_path`), streaming readers that hold at most
a block or one document, and the cutting of long documents into pieces at word boundaries (with left context)."""
from __future__ import annotations

import json
import os
import re
from typing import Dict, Iterator, List, Optional, Tuple

from ..errors import ConfigError


CACHE_DIRNAME = ".ds_longctx_cache"
BLOCK_BYTES = 1 << 20        # bytes read from a .txt per block


CHUNK_CHARS = 1 << 19        # characters per tokenized piece of a long document


BATCH_ROWS = 1024            # rows per table batch


KINDS = {".txt": "txt", ".jsonl": "jsonl", ".parquet": "parquet", ".arrow": "arrow"}


SUPPORTED = "a .txt, .jsonl, .parquet or .arrow file or a datasets save_to_disk directory"


PIP_DATA = "pip install 'ds_longctx[data]'"


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
    unreadable = [f for f, _ in data_files(path) if not os.access(f, os.R_OK)]
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


def read_documents(path: str, kind: str, column: str, flag: str) -> Iterator[Iterator[str]]:
    """Each document as an iterator of text blocks (a .txt file: one document read in blocks)."""
    if kind == "txt":
        yield _txt_blocks(path, flag)
        return
    docs = _jsonl_docs(path, column, flag) if kind == "jsonl" else \
        _column_docs(_table_batches(path, kind, column, flag), path, column, flag)
    for text in docs:
        yield iter((text,))


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


def cut_pieces(blocks: Iterator[str], chunk_chars: int, cuts: Dict[str, int]) -> Iterator[Tuple[str, str, bool]]:
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


def data_files(path: str) -> List[Tuple[str, str]]:
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
