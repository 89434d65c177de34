"""--data sources, the token cache and the dataset over it (ds_longctx/data/corpus.py), no distributed.

The samples equal those of the former whole-file TokenFileDataset (its code is kept below as the reference);
cutting long documents keeps whole-text tokenization for a byte-level BPE and a Llama-2-style (prepended "▁")
tokenizer trained here; a second start reads the cache; concurrent starts build it once; a crashed build
leaves nothing that is read as a cache; every bad input is one ConfigError naming the file, line/row, column."""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import torch

from ds_longctx.data import sources
from ds_longctx.data import token_cache as cache_mod
from ds_longctx.data.corpus import open_corpus
from ds_longctx.data.sources import check_data_path
from ds_longctx.data.token_cache import data_identity, token_cache
from ds_longctx.errors import ConfigError

CHARS = "abcdefghijklmnopqrstuvwxyz .,\n"
DOCS = ["hello world", "a", "", "packed documents attend within themselves",
        "the quick brown fox jumps over the lazy dog", "sequence parallel", "zz"] * 3


def char_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, **{c: i + 1 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # one token per character
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<eos>")


def _prose(n_words: int, seed: int = 0) -> str:
    import random

    rng = random.Random(seed)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "tokenization", "sequence",
             "parallel", "attention", "1234567", "3.14159", "(x)", "don't", "naïve", "über", "日本語", "--",
             "well,", "end."]
    return " ".join(rng.choice(words) for _ in range(n_words))


TEXT = _prose(3000)


def bpe_tokenizer(kind: str):
    """A byte-level BPE (GPT-2/Llama-3 style) or a Llama-2-style one (normalizer prepends "▁" and replaces spaces,
    no pre-tokenizer, byte fallback), trained on TEXT."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if kind == "bytelevel":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"],
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")  # SentencePiece splits by whitespace
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>", "<unk>"]))
    tok.pre_tokenizer = None  # ... and encodes as Llama-2's tokenizer.json does
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")


def reference_samples(texts, tokenizer, seq_len, documents=True):
    """The former TokenFileDataset (whole file in memory, one tokenizer call per document), as it was."""
    ids, starts = [], []
    eos = tokenizer.eos_token_id
    for t in texts:
        starts.append(len(ids))
        ids.extend(tokenizer(t, add_special_tokens=False)["input_ids"])
        if eos is not None:
            ids.append(eos)
    n = len(ids) // seq_len
    data = torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)
    positions = None
    if documents:
        is_start = torch.zeros(n * seq_len, dtype=torch.bool)
        is_start[[s for s in starts if s < n * seq_len]] = True
        is_start = is_start.view(n, seq_len)
        is_start[:, 0] = True
        idx = torch.arange(seq_len).expand(n, seq_len)
        last_start = torch.where(is_start, idx, torch.zeros_like(idx)).cummax(1).values
        positions = idx - last_start
    out = []
    for i in range(n):
        item = {"input_ids": data[i], "labels": data[i].clone()}
        if positions is not None:
            item["position_ids"] = positions[i]
        out.append(item)
    return out, max(ids)


def assert_same(ds, ref):
    assert len(ds) == len(ref)
    for i in range(len(ds)):
        got = ds[i]
        assert sorted(got) == sorted(ref[i]), i
        for k in ref[i]:
            assert got[k].dtype == torch.long and torch.equal(got[k], ref[i][k]), (i, k)


def write_jsonl(path, texts, key="text"):
    path.write_text("".join(json.dumps({key: t}) + "\n" for t in texts))
    return str(path)


@pytest.fixture(autouse=True)
def _fresh_identities():
    cache_mod._IDENTITIES.clear()  # each test starts as a new process would
    yield
    cache_mod._IDENTITIES.clear()


def test_same_samples_as_the_whole_file_path(tmp_path):
    tok = char_tokenizer()
    jsonl = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    txt = tmp_path / "one.txt"
    txt.write_text("\n".join(DOCS) * 4)
    for documents in (True, False):
        ref, top = reference_samples(DOCS, tok, 16, documents)
        assert_same(open_corpus(jsonl, tok, 16, documents=documents, vocab_size=64), ref)
        ref, _ = reference_samples([txt.read_text()], tok, 16, documents)
        # a .txt file is one document; cut into pieces of at most 40 characters here (exact for this tokenizer)
        assert_same(open_corpus(str(txt), tok, 16, documents=documents, chunk_chars=40), ref)
    long_docs = [DOCS[3] * 9, "x", " ".join(DOCS) * 3]  # documents longer than a piece: cut inside a line
    long_jsonl = write_jsonl(tmp_path / "long.jsonl", long_docs)
    assert_same(open_corpus(long_jsonl, tok, 16, chunk_chars=50), reference_samples(long_docs, tok, 16)[0])
    ds = open_corpus(jsonl, tok, 16)
    assert any(0 in ds[i]["position_ids"][1:].tolist() for i in range(len(ds)))  # really packed
    assert ds.meta["max_id"] == top and ds.meta["n_docs"] == len(DOCS)
    with pytest.raises(ConfigError, match=rf"--tokenizer: has {len(tok)} tokens but the model's vocab_size is {top}: "
                                          rf".*'tok' has {len(tok)} tokens and produced id {top} from .*docs.jsonl"):
        open_corpus(jsonl, tok, 16, vocab_size=top, tokenizer_name="tok")
    with pytest.raises(ConfigError, match=r"--data: .*docs.jsonl \(column 'text'\) has \d+ text tokens besides its "
                       r"21 end-of-document tokens, fewer than one sample of 100000"):
        open_corpus(jsonl, tok, 100_000)
    from ds_longctx.data import TokenFileDataset  # the former name, same samples

    assert_same(TokenFileDataset(jsonl, tok, 16, documents=True, vocab_size=64), reference_samples(DOCS, tok, 16)[0])


@pytest.mark.parametrize("kind", ["bytelevel", "llama2"])
def test_cut_documents_keep_whole_text_tokenization(tmp_path, kind):
    """A one-line document cut into ~30 pieces gives the ids of the whole text, cut by cut verified; without
    the left context a Llama-2-style tokenizer would add a "▁" token at every cut."""
    tok = bpe_tokenizer(kind)
    path = tmp_path / "long.txt"
    path.write_text(TEXT)
    cache, meta = token_cache(str(path), tok, chunk_chars=800)
    whole = tok(TEXT, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    got = np.fromfile(os.path.join(cache, "tokens.bin"), dtype=meta["dtype"]).tolist()
    assert meta["cuts"]["space"] >= 20 and meta["cuts"]["hard"] == meta["cuts"]["unverified"] == 0, meta["cuts"]
    assert got == whole
    pieces = [p for _, p, _ in sources.cut_pieces(iter([TEXT]), 800, {"space": 0, "newline": 0, "hard": 0})]
    naive = sum((tok(p, add_special_tokens=False)["input_ids"] for p in pieces), []) + [tok.eos_token_id]
    assert (naive == whole) == (kind == "bytelevel")
    assert cache_mod._encoder(tok).__name__ == "fast"  # the backend's encode_batch_fast, same ids as tok(...)
    # DeepSpeed's index over the same cache: one document, one item per piece
    from deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset import MMapIndexedDataset

    idx = MMapIndexedDataset(os.path.join(cache, "tokens"), skip_warmup=True)
    assert len(idx) == len(pieces) and idx.doc_idx.tolist() == [0, len(pieces)]
    assert np.concatenate([idx[i] for i in range(len(idx))]).tolist() == whole


def test_second_start_reads_the_cache_and_changed_data_rebuilds(tmp_path, monkeypatch):
    tok = char_tokenizer()
    jsonl = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    first = open_corpus(jsonl, tok, 16)
    ident = data_identity(jsonl)
    assert ident["size"] == os.path.getsize(jsonl) and ident["path"] == os.path.abspath(jsonl)
    assert ident["sha256"] == first.meta["data"]["sha256"] and ident["kind"] == "jsonl"
    assert first.cache.startswith(str(tmp_path / ".ds_longctx_cache"))
    cache_mod._IDENTITIES.clear()  # a new start: nothing in memory

    def no_tokenizing(tokenizer):
        raise AssertionError("tokenized again")

    def no_hashing(path):
        raise AssertionError("hashed again")

    with monkeypatch.context() as m:
        m.setattr(cache_mod, "_encoder", no_tokenizing)  # every tokenization goes through it
        m.setattr(cache_mod, "_content_hash", no_hashing)
        second = open_corpus(jsonl, tok, 16)
        assert data_identity(jsonl) == ident
    assert second.cache == first.cache
    assert_same(second, [first[i] for i in range(len(first))])
    write_jsonl(tmp_path / "docs.jsonl", DOCS[::-1])  # new content: a new hash, a new cache
    third = open_corpus(jsonl, tok, 16)
    assert third.cache != first.cache and data_identity(jsonl)["sha256"] != ident["sha256"]
    assert_same(third, reference_samples(DOCS[::-1], tok, 16)[0])
    assert data_identity(jsonl, verify=True) == data_identity(jsonl)
    # another place for the cache: the argument, then $DS_LONGCTX_DATA_CACHE
    assert open_corpus(jsonl, tok, 16, cache_dir=str(tmp_path / "c1")).cache.startswith(str(tmp_path / "c1"))
    monkeypatch.setenv("DS_LONGCTX_DATA_CACHE", str(tmp_path / "c2"))
    assert open_corpus(jsonl, tok, 16).cache.startswith(str(tmp_path / "c2"))


def test_pieces_cover_the_text_at_safe_cuts():
    import random

    rng = random.Random(1)
    text = TEXT[:20000] + "x" * 3000 + "\n" + TEXT[:2000].replace(" ", "\n")  # no space: newline, then hard cuts
    cuts_at = sorted(rng.sample(range(1, len(text)), 20))
    random_blocks = [text[a:b] for a, b in zip([0] + cuts_at, cuts_at + [len(text)])]
    for blocks in ([text], random_blocks):
        cuts = {"space": 0, "newline": 0, "hard": 0}
        items = list(sources.cut_pieces(iter(blocks), 1000, cuts))
        assert "".join(p for _, p, _ in items) == text and [last for *_, last in items][-1]
        assert all(0 < len(p) <= 1000 for _, p, _ in items)
        assert cuts["space"] > 10 and cuts["newline"] >= 1 and cuts["hard"] >= 2, cuts
        for (_, prev, _), (ctx, piece, _) in zip(items, items[1:]):
            assert prev.endswith(ctx) and ctx  # the context is the text right before the cut
            if piece.startswith(" "):
                assert not prev[-1].isspace() and not piece[1].isspace()


def _fork(fn):
    """Run ``fn()`` in a forked child; returns (pid, read end of a pipe holding its JSON result)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        os.close(r)
        code = 0
        try:
            out = json.dumps(fn())
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            out, code = json.dumps({"error": repr(e)}), 1
        os.write(w, out.encode())
        os._exit(code)
    os.close(w)
    return pid, r


def _join(pid, r):
    with os.fdopen(r) as f:
        out = f.read()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), (json.loads(out) if out else None)


def test_concurrent_starts_build_once_and_a_crashed_build_leaves_no_cache(tmp_path, monkeypatch):
    tok = char_tokenizer()
    txt = tmp_path / "one.txt"
    txt.write_text("abc def " * 20000)

    def crashing_build():
        def encode(texts):
            os._exit(7)  # the builder dies half-way: its lock goes with it

        cache_mod._encoder = lambda tokenizer: encode
        token_cache(str(txt), tok, chunk_chars=1000)

    code, _ = _join(*_fork(crashing_build))
    root = tmp_path / ".ds_longctx_cache"
    assert code == 7
    left = sorted(os.listdir(root))
    assert any(".tmp-" in n for n in left) and not any(n.endswith(".tokens") for n in left), left

    def start():
        cache, meta = token_cache(str(txt), tok, chunk_chars=1000)
        return {"pid": os.getpid(), "cache": cache, "builder": meta["built"]["pid"]}

    results = [_join(*c) for c in [_fork(start) for _ in range(3)]]
    assert all(code == 0 for code, _ in results), results
    out = [res for _, res in results]
    assert len({o["cache"] for o in out}) == 1
    assert sum(o["pid"] == o["builder"] for o in out) == 1  # one built, two waited and read
    left = sorted(os.listdir(root))
    assert not any(".tmp-" in n for n in left), left  # the crashed build's directory was removed
    assert_same(open_corpus(str(txt), tok, 64, chunk_chars=1000), reference_samples([txt.read_text()], tok, 64)[0])


def test_tables_and_datasets_directories(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tok = char_tokenizer()
    ref, _ = reference_samples(DOCS, tok, 16)
    table = pa.table({"id": list(range(len(DOCS))), "body": DOCS})
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=5)
    with pa.OSFile(str(tmp_path / "file.arrow"), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table, max_chunksize=4)
    with pa.OSFile(str(tmp_path / "stream.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table, max_chunksize=4)
    import datasets

    datasets.Dataset.from_dict({"body": DOCS}).save_to_disk(str(tmp_path / "hf"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": DOCS})}).save_to_disk(str(tmp_path / "dd"))
    for name in ("d.parquet", "file.arrow", "stream.arrow", "hf"):
        path = str(tmp_path / name)
        assert check_data_path("--data", path, "body") == ("datasets" if name == "hf" else name.split(".")[-1])
        assert_same(open_corpus(path, tok, 16, column="body"), ref)
        with pytest.raises(ConfigError, match=rf"--data: .*{name} has no column 'text' \(columns: .*body.*\)\. "
                                              r"Fix: name a text column with --data-column \(string columns: "
                                              r"\['body'\]\)"):
            check_data_path("--data", path, "text")
    with pytest.raises(ConfigError, match=r"d.parquet column 'id' has type int64, not a string"):
        check_data_path("--data", str(tmp_path / "d.parquet"), "id")
    with pytest.raises(ConfigError, match=r"hf column 'id'|hf has no column 'id'"):
        check_data_path("--data", str(tmp_path / "hf"), "id")
    with pytest.raises(ConfigError, match=r"dd' is a datasets DatasetDict \(splits \['train'\]\).*Fix: give one "
                                          r"split's directory, e.g. .*dd/train"):
        check_data_path("--data", str(tmp_path / "dd"))
    assert_same(open_corpus(str(tmp_path / "dd" / "train"), tok, 16, column="body"), ref)
    pq.write_table(pa.table({"text": ["ok", None, "x"]}), tmp_path / "nulls.parquet")
    with pytest.raises(ConfigError, match=r"--data .*nulls.parquet row 1: column 'text' is None, not a string"):
        open_corpus(str(tmp_path / "nulls.parquet"), tok, 2)
    # the identity of a directory covers all its files
    ident = data_identity(str(tmp_path / "hf"))
    assert ident["kind"] == "datasets" and ident["size"] == sum(
        os.path.getsize(tmp_path / "hf" / n) for n in os.listdir(tmp_path / "hf"))


def test_bad_inputs_are_one_clear_error(tmp_path, monkeypatch):
    tok = char_tokenizer()
    with pytest.raises(ConfigError, match=r"^--data: '/no/such.jsonl' does not exist\. Fix: give a \.txt"):
        check_data_path("--data", "/no/such.jsonl")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(ConfigError, match=r"^--eval-data: unsupported file type .*d.csv"):
        check_data_path("--eval-data", str(tmp_path / "d.csv"))
    with pytest.raises(ConfigError, match=r"holds no datasets save_to_disk dataset \(no state.json\)"):
        check_data_path("--data", str(tmp_path))
    (tmp_path / "t.txt").write_text("hello")
    with pytest.raises(ConfigError, match=r"is a .txt file \(one document, no columns\); a column 'body' was given"):
        check_data_path("--data", str(tmp_path / "t.txt"), "body")
    path = write_jsonl(tmp_path / "k.jsonl", ["a", "b"], key="body")
    with pytest.raises(ConfigError, match=r'--data .*k.jsonl line 1: has no string "text" field \(got \[\'body\'\]\)'
                                          r'.*or name the field with --data-column'):
        open_corpus(path, tok, 2)
    assert len(open_corpus(path, tok, 2, column="body")) == 2
    with monkeypatch.context() as m:  # pyarrow missing: the error names the extra
        m.setitem(sys.modules, "pyarrow", None)
        (tmp_path / "x.parquet").write_bytes(b"PAR1")
        with pytest.raises(ConfigError, match=r"needs pyarrow, which is not installed\. Fix: pip install "
                                              r"'ds_longctx\[data\]'"):
            check_data_path("--data", str(tmp_path / "x.parquet"))
    with pytest.raises(ConfigError, match=r"x.parquet is not a readable parquet file"):
        check_data_path("--data", str(tmp_path / "x.parquet"))
    # UTF-8 errors name the line and column, also past a block boundary and across a split character
    blob = ("é" * 700 + "\n") * 3 + "ab" + "\udcff"
    raw = blob.encode("utf-8", "surrogateescape")
    (tmp_path / "bad.txt").write_bytes(raw)
    with pytest.raises(ConfigError, match=r"--data .*bad.txt line 4: is not UTF-8 \(byte 0xff at column 3: "
                                          r"invalid start byte\)"):
        list(sources._txt_blocks(str(tmp_path / "bad.txt"), "--data", block_bytes=999))
    good = ("é" * 700 + "\n") * 3
    (tmp_path / "good.txt").write_text(good)
    assert "".join(sources._txt_blocks(str(tmp_path / "good.txt"), "--data", block_bytes=999)) == good
    with monkeypatch.context() as m:  # a file system without POSIX locks (Lustre without -o flock, old NFS)
        import errno
        import fcntl

        def no_locks(*a):
            raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

        m.setattr(fcntl, "lockf", no_locks)
        with pytest.raises(ConfigError, match=r"--data: cannot lock .*good.txt.*\.lock' \(No locks available\).*"
                                              r"Fix: set DS_LONGCTX_DATA_CACHE to a directory on a file system with"):
            open_corpus(str(tmp_path / "good.txt"), tok, 4)
    # a damaged cache is named, never read
    cache, meta = token_cache(str(tmp_path / "good.txt"), tok)
    with open(os.path.join(cache, "tokens.bin"), "r+b") as f:
        f.truncate(10)
    with pytest.raises(ConfigError, match=r"the token cache .* is damaged \(tokens.bin: 10 bytes, expected "
                                          rf"{meta['n_tokens'] * 2}\)\. Fix: remove it \(rm -r "):
        open_corpus(str(tmp_path / "good.txt"), tok, 4)


def test_unreadable_table_and_full_disk_are_named(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tok = char_tokenizer()
    path = tmp_path / "damaged.parquet"
    pq.write_table(pa.table({"text": DOCS * 50}), path, row_group_size=len(DOCS) * 10, compression="none")
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2:len(raw) // 2 + 64] = b"\xff" * 64  # a page in the middle
    path.write_bytes(bytes(raw))
    with pytest.raises(ConfigError, match=r"--data .*damaged.parquet row \d+: cannot be read \(.*\)\. Fix: rewrite "):
        open_corpus(str(path), tok, 16)
    txt = tmp_path / "big.txt"
    txt.write_text("abc def " * 20000)

    def full_disk():  # writes past 64 KiB fail (EFBIG) as on a full drive
        import resource
        import signal

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
        try:
            token_cache(str(txt), tok)
        except ConfigError as e:
            return str(e)
        return "no error"

    code, msg = _join(*_fork(full_disk))
    assert code == 0 and "--data: writing the token cache of" in msg and "File too large" in msg, msg
    assert "GiB free there). Fix: free space there or set DS_LONGCTX_DATA_CACHE" in msg
    assert not any(".tmp-" in n or n.endswith(".tokens") for n in os.listdir(tmp_path / ".ds_longctx_cache"))


def test_samples_are_memory_mapped_and_picklable(tmp_path):
    import pickle

    tok = char_tokenizer()
    ds = open_corpus(write_jsonl(tmp_path / "docs.jsonl", DOCS), tok, 16)
    ds[0]
    assert isinstance(ds._tokens, np.memmap)
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._tokens is None and len(pickle.dumps(ds)) < 4096
    assert_same(clone, [ds[i] for i in range(len(ds))])
    with pytest.raises(IndexError):
        ds[len(ds)]
