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

The modules: ``sources`` (the files read as documents, cut into pieces), ``token_cache`` (identity, location,
lock, build) and this one (the dataset over the cache).
"""
from __future__ import annotations

import numpy as np
import os
import torch
from torch.utils.data import Dataset
from typing import Optional

from ..errors import ConfigError
from .sources import CHUNK_CHARS, data_kind
from .token_cache import token_cache


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
