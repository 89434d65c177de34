"""What a tag's files hold, checked by content: each file's checksum (xxHash's XXH3, 64 bits: ~17 GB/s on one core of
a 2-core EPYC box, bench/RESULTS.md) recorded at the save and compared before every load, export and conversion.

A save: every rank hashes the files it wrote in the pass that fsyncs them (the bytes are in the page cache then),
rank 0 the HF side files it writes; the record (``ds_longctx_layout.json``) holds ``checksums`` (the algorithm and
``{relative path: hex digest}`` for every file of the tag but itself) and its own digest (``record_xxh3_64``: of its
canonical JSON without that key). A flip of any byte of any file is then a mismatch naming the file: a resume
treats it as it treats a truncated file (``--resume DIR``/``auto``: the newest tag that verifies; an explicit tag:
refused). Why our own: torch.load does not check its archive's CRCs (measured: 64 bytes flipped inside an
optimizer-states file load silently and train on; inside a model-states file, a MemoryError), DeepSpeed keeps no
checksum, and the HF side files and the record are not archives. XXH3 is a checksum against accidents (bit rot, a
partial copy, another run's file), not against an adversary: checkpoints are unpickled, resume only what you trust.
"""
from __future__ import annotations

import json
import mmap
import os
from typing import Dict, Iterable, List, Optional, Tuple

import xxhash

ALGORITHM = "xxh3_64"
RECORD_DIGEST = "record_xxh3_64"   # the record's own digest, a key of the record
_CHUNK = 8 << 20


def digest_file(path: str, fsync: bool = False) -> Tuple[int, str]:
    """(bytes, hex digest) of ``path``, read once through a read-only mapping (no copy out of the page cache: twice
    the speed of read() into a buffer, measured); ``fsync``: the file flushed to its device in the same open (the
    save's durability pass and its checksum together)."""
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                view = memoryview(m)
                try:
                    for i in range(0, size, _CHUNK):
                        h.update(view[i:i + _CHUNK])
                finally:
                    view.release()
        if fsync:
            os.fsync(f.fileno())
    return size, h.hexdigest()


def digest_files(root: str, rels: Iterable[str]) -> Dict[str, str]:
    return {rel: digest_file(os.path.join(root, rel))[1] for rel in rels}


def _canonical(record: dict) -> bytes:
    body = {k: v for k, v in record.items() if k != RECORD_DIGEST}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sealed_record_text(record: dict) -> str:
    """The record as written: JSON (``default=str`` for what JSON lacks), with its own digest added."""
    plain = json.loads(json.dumps(record, default=str))
    plain[RECORD_DIGEST] = xxhash.xxh3_64_hexdigest(_canonical(plain))
    return json.dumps(plain, indent=1)


def record_problem(record: dict, rec_path: str) -> Optional[str]:
    """None when the record's digest matches its content (or it has none: saved before ds_longctx kept one)."""
    saved = record.get(RECORD_DIGEST)
    if saved is None:
        return None
    got = xxhash.xxh3_64_hexdigest(_canonical(record))
    if got != saved:
        return (f"{rec_path!r} does not match its own checksum ({ALGORITHM} {got}, {saved} saved): its content "
                "changed after the save")
    return None


def checksums_of(record: dict) -> Optional[Dict[str, str]]:
    """The record's ``{relative path: digest}``, or None for a tag saved without checksums."""
    c = record.get("checksums")
    if not isinstance(c, dict) or not isinstance(c.get("files"), dict):
        return None
    if c.get("algorithm") != ALGORITHM:
        return None
    return c["files"]


def mismatch(tag_dir: str, rel: str, saved: str) -> Optional[str]:
    """None when ``tag_dir/rel`` hashes to ``saved``, else the problem naming the file."""
    full = os.path.join(tag_dir, rel)
    try:
        size, got = digest_file(full)
    except OSError as e:
        return f"{full!r} cannot be read ({e.strerror})"
    if got != saved:
        return (f"{full!r} does not match its checksum ({ALGORITHM} {got}, {saved} saved, {size} bytes): its "
                "content changed after the save (bit rot, a partial copy, another run's file)")
    return None


def verify(tag_dir: str, checksums: Dict[str, str], rels: Optional[Iterable[str]] = None) -> Optional[str]:
    """The first file of ``rels`` (default: all) whose content does not match, as a problem naming it; None."""
    for rel in sorted(checksums if rels is None else rels):
        problem = mismatch(tag_dir, rel, checksums[rel])
        if problem:
            return problem
    return None


def sizes_of(record: dict, checksums: Dict[str, str]) -> Dict[str, int]:
    """Bytes of each checksummed file as the record has them (the HF side files, not in ``files``: 0)."""
    files = record.get("files") if isinstance(record.get("files"), dict) else {}
    return {rel: int(files.get(rel) or 0) for rel in checksums}


def verify_tag(path: str, tag: str, record: dict, problem: Optional[str] = None) -> Optional[str]:
    """One process: every file of ``path/tag`` against the record's checksums (``problem``: the tag's structural
    problem, returned as it is). A tag saved without checksums passes (its sizes were checked)."""
    if problem is not None:
        return problem
    sums = checksums_of(record)
    return verify(os.path.join(path, tag), sums) if sums else None


def shares(sizes: Dict[str, int], world: int) -> List[List[str]]:
    """The files split over ``world`` ranks for a verification that reads each byte once per job: largest first,
    each to the least loaded rank (ties: the lower rank). The same split on every rank (it depends on the record)."""
    load = [0] * world
    out: List[List[str]] = [[] for _ in range(world)]
    for rel in sorted(sizes, key=lambda r: (-sizes[r], r)):
        r = min(range(world), key=lambda i: (load[i], i))
        out[r].append(rel)
        load[r] += sizes[rel]
    return out
