"""Sequence sharding for SP, the data loader, the embedded long-context task and file datasets."""
from __future__ import annotations

import json
import os
from typing import Callable, Dict, Iterator, List, Optional

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from .errors import BatchError, ConfigError
from .loss import IGNORE_INDEX, shift_labels_of

# ---------------------------------------------------------------------------------------------
# sharding
# ---------------------------------------------------------------------------------------------


def shard_batch(batch: Dict[str, torch.Tensor], sp_rank: int, sp_size: int) -> Dict[str, torch.Tensor]:
    """Cut a full-sequence batch into this SP rank's contiguous sequence shard.

    Labels are shifted *before* cutting (``shift_labels``), so the target of a shard's last token is
    the first token of the next shard, and the sample's last position is ignored (-100).
    ``position_ids`` are global positions, so RoPE is right on every shard.

    Packed documents (position_ids restarting per document, or ``doc_lens``) and right padding
    (``attention_mask`` zeros at the end; the tail becomes a document whose targets are ignored) are
    described for the WHOLE sample in ``doc_cu_seqlens`` [batch, n+1], which every rank receives:
    a rank cannot tell a document boundary on a shard edge from its own position_ids.
    """
    from .batch import BATCH_KEY, LENS_KEY, document_structure, mask_padding_targets

    if "input_ids" not in batch:
        raise BatchError("batch", "has no 'input_ids'", "yield dicts with input_ids [batch, seq] (and labels)")
    input_ids = batch["input_ids"]
    if input_ids.dim() != 2:
        raise BatchError("batch.input_ids", f"expected shape [batch, seq], got {tuple(input_ids.shape)}",
                          "collate samples into a 2-D tensor")
    bsz, seq = input_ids.shape
    if seq % sp_size != 0:
        raise BatchError("batch.input_ids", f"sequence length {seq} is not divisible by "
                          f"sequence_parallel_size={sp_size}",
                          f"pad samples at the end to a multiple of {sp_size} (e.g. {(seq // sp_size + 1) * sp_size}) "
                          "with attention_mask 0 on the padding (shard_batch turns a right-padded tail into an "
                          "ignored document: no attention to it, no loss on it), or cut them")
    if BATCH_KEY in batch:
        raise BatchError(f"batch.{BATCH_KEY}", "is already set: this batch was sharded before",
                          "shard each full batch once")
    out: Dict[str, torch.Tensor] = {}
    if "shift_labels" in batch:
        shift = batch["shift_labels"]
    elif "labels" in batch:
        shift = shift_labels_of(batch["labels"])
    else:
        shift = shift_labels_of(input_ids)
    cu, pos, n_real = document_structure(input_ids, batch.get("position_ids"), batch.get("attention_mask"),
                                         batch.get(LENS_KEY))
    shift = mask_padding_targets(shift, n_real)
    chunk = seq // sp_size
    sl = slice(sp_rank * chunk, (sp_rank + 1) * chunk)
    # clone, not .contiguous(): with one sample (or SP=1) the slice is already contiguous and
    # .contiguous() returns a view that keeps the whole sample's storage alive
    out["input_ids"] = input_ids[:, sl].clone(memory_format=torch.contiguous_format)
    out["position_ids"] = pos[:, sl].clone(memory_format=torch.contiguous_format).to(input_ids.device)
    out["shift_labels"] = shift[:, sl].clone(memory_format=torch.contiguous_format)
    out[BATCH_KEY] = cu
    for k, v in batch.items():  # pass through anything else (e.g. per-sample metadata)
        if k not in ("input_ids", "labels", "shift_labels", "position_ids", "attention_mask", LENS_KEY):
            out[k] = v
    return out


class SPDataLoader:
    """Each data-parallel replica reads its own samples; every rank of an SP group reads the *same*
    sample and keeps its sequence shard.

    Written instead of DeepSpeed's ``UlyssesSPDataLoaderAdapter``: that adapter makes the SP group
    take turns on each rank's sample (the order and the epoch length change with the SP degree),
    while we need the same samples in the same order for every SP degree and process count so loss
    curves compare across layouts.
    """

    def __init__(self, dataset, batch_size: int, sp_rank: int = 0, sp_size: int = 1, dp_rank: int = 0,
                 dp_size: int = 1, collate_fn: Optional[Callable] = None, shuffle: bool = False, seed: int = 0,
                 drop_last: bool = True, num_workers: int = 0):
        self.sp_rank, self.sp_size = sp_rank, sp_size
        self.sampler = DistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=shuffle, seed=seed,
                                          drop_last=drop_last)
        self.loader = DataLoader(dataset, batch_size=batch_size, sampler=self.sampler, collate_fn=collate_fn,
                                 drop_last=drop_last, num_workers=num_workers)

    def set_epoch(self, epoch: int):
        self.sampler.set_epoch(epoch)

    def __len__(self):
        return len(self.loader)

    def __iter__(self) -> Iterator[Dict[str, torch.Tensor]]:
        for batch in self.loader:
            yield shard_batch(batch, self.sp_rank, self.sp_size)


class SampleStream:
    """The job's samples as one endless, resumable stream, the same for every layout: global position ``p``
    is sample ``order(p // N)[p % N]`` of an N-sample dataset (``order(e)`` is the identity, or with
    ``shuffle`` the permutation ``torch.randperm(N)`` seeded ``seed + e``, DistributedSampler's), and
    data-parallel replica ``r`` of ``dp`` reads positions ``start + r, start + r + dp, ...`` in micro batches
    of ``micro_batch``; every rank of an SP group reads the same samples and keeps its sequence shard.

    An optimizer step of ``gas`` micro batches consumes ``micro_batch * gas * dp`` positions: the global
    batch of step k is positions [k B, (k+1) B) whatever the layout, so a run resumed on another world size,
    SP or DP degree continues at ``start`` = the samples consumed (:attr:`position` after the last step)
    with none repeated and none skipped. With ``start = 0`` and one epoch this is :class:`SPDataLoader`'s
    order (DistributedSampler's); epochs run on without dropping the last ``N % dp`` samples.

    Written instead of a ``DistributedSampler`` with an offset: its epoch length depends on the DP degree
    (``N - N % dp``), so a position saved under one layout means another sample under the next.
    """

    def __init__(self, dataset, micro_batch: int, sp_rank: int = 0, sp_size: int = 1, dp_rank: int = 0,
                 dp_size: int = 1, start: int = 0, shuffle: bool = False, seed: int = 0,
                 collate_fn: Optional[Callable] = None):
        n = len(dataset)
        if n < 1:
            raise ConfigError("data", "the dataset is empty", "give a dataset with at least one sample")
        if start < 0:
            raise ConfigError("start", f"must be >= 0, got {start}", "give the number of samples consumed")
        self.dataset, self.n, self.micro = dataset, n, micro_batch
        self.sp_rank, self.sp_size, self.dp_rank, self.dp = sp_rank, sp_size, dp_rank, dp_size
        self.shuffle, self.seed = shuffle, seed
        self.collate = collate_fn or torch.utils.data.default_collate
        self.position = start  # the next global position of this replica's group (the job's samples consumed)
        self._order_epoch, self._order = None, None

    def _index(self, p: int) -> int:
        epoch, i = divmod(p, self.n)
        if not self.shuffle:
            return i
        if self._order_epoch != epoch:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            self._order, self._order_epoch = torch.randperm(self.n, generator=g).tolist(), epoch
        return self._order[i]

    def indices(self, position: int) -> List[int]:
        """This replica's sample indices of the micro batch that starts at global ``position``."""
        return [self._index(position + self.dp_rank + j * self.dp) for j in range(self.micro)]

    def __iter__(self) -> Iterator[Dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> Dict[str, torch.Tensor]:
        batch = self.collate([self.dataset[i] for i in self.indices(self.position)])
        self.position += self.micro * self.dp
        return shard_batch(batch, self.sp_rank, self.sp_size)


# ---------------------------------------------------------------------------------------------
# the embedded long-context task
# ---------------------------------------------------------------------------------------------

SEP = 1


class LongRangeCopy(Dataset):
    """A random block of tokens, a separator, then the same block again; only the copy is scored.

    Each copied token can only be predicted by attending to its source half a sequence back, which
    under SP lives on other ranks (with SP=2 the whole source is on rank 0, the whole copy on rank 1).
    Random tokens are uniform over ``vocab-2`` symbols, so without attention across shards the loss
    cannot go below ln(vocab-2). Sample i depends only on (seed, i): the same data for every layout.
    """

    def __init__(self, seq_len: int, vocab_size: int, num_samples: int = 100_000, seed: int = 0):
        if seq_len < 4 or seq_len % 2:
            raise ConfigError("--seq-len", f"the copy task needs an even length >= 4, got {seq_len}",
                              "use an even sequence length")
        if vocab_size < 4:
            raise ConfigError("model.vocab_size", f"the copy task needs vocab_size >= 4, got {vocab_size}",
                              "use a model with a larger vocabulary")
        self.seq_len, self.vocab, self.n, self.seed = seq_len, vocab_size, num_samples, seed

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        half = self.seq_len // 2
        block = torch.randint(2, self.vocab, (half - 1,), generator=g)
        ids = torch.cat([torch.tensor([SEP]), block, torch.tensor([SEP]), block])
        labels = ids.clone()
        labels[: half + 1] = IGNORE_INDEX  # score only the copy (its first token is predicted from the SEP)
        return {"input_ids": ids, "labels": labels}

    @property
    def chance_loss(self) -> float:
        import math

        return math.log(self.vocab - 2)


def _utf8(raw: bytes, path: str, first_line: int = 1) -> str:
    """``raw`` decoded as UTF-8, or a ConfigError naming the file, the line and the byte."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = first_line + raw.count(b"\n", 0, e.start)
        col = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise ConfigError(f"--data {path} line {line}", f"is not UTF-8 (byte 0x{raw[e.start]:02x} at column {col}: "
                          f"{e.reason})", "re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None


def _jsonl_texts(path: str):
    texts = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            line = _utf8(raw, path, n)
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--data {path} line {n}", f"is not valid JSON ({e})", "write one JSON object "
                                  'per line, {"text": ...}') from None
            if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                keys = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
                raise ConfigError(f"--data {path} line {n}", f'has no string "text" field (got {keys})',
                                  'give every line a "text" string, e.g. {"text": "..."}')
            texts.append(rec["text"])
    return texts


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


class TokenFileDataset(Dataset):
    """Fixed-length samples cut from a tokenized .txt or .jsonl ({"text": ...} per line) file.

    Documents (jsonl lines; a .txt file is one document) are tokenized, each followed by EOS, and
    the stream is cut into samples of ``seq_len``. With ``documents=True`` (default) every sample
    carries ``position_ids`` restarting at 0 at each document start (and at the sample start), so
    attention stays inside documents (HF's packed convention; shard_batch turns it into the
    document structure). ``documents=False``: plain concatenation, positions 0..seq_len-1 and
    attention across documents (pretraining style).
    """

    def __init__(self, path: str, tokenizer, seq_len: int, documents: bool = True, vocab_size: Optional[int] = None,
                 tokenizer_name: Optional[str] = None):
        if not os.path.exists(path):
            raise ConfigError("--data", f"file {path!r} does not exist", "give a .txt/.jsonl path or a task name")
        if path.endswith(".jsonl"):
            texts = _jsonl_texts(path)
        elif path.endswith(".txt"):
            with open(path, "rb") as f:
                texts = [_utf8(f.read(), path)]
        else:
            raise ConfigError("--data", f"unsupported file type {path!r}", "use a .txt or .jsonl file")
        ids, starts = [], []
        eos = tokenizer.eos_token_id
        for t in texts:
            starts.append(len(ids))
            ids.extend(tokenizer(t, add_special_tokens=False)["input_ids"])
            if eos is not None:
                ids.append(eos)
        if vocab_size is not None:  # checked on the ids produced, so the error can name the largest
            check_tokenizer_vocab(tokenizer, vocab_size, top=max(ids, default=None), source=path, name=tokenizer_name)
        n = len(ids) // seq_len
        if n == 0:
            raise ConfigError("--data", f"{path} has {len(ids)} tokens, fewer than one sample of {seq_len}",
                              "use a larger file or a smaller --seq-len")
        self.data = torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)
        self.positions = None
        if documents:
            # position of each token inside its document piece: restarts at document and sample starts
            is_start = torch.zeros(n * seq_len, dtype=torch.bool)
            is_start[[s for s in starts if s < n * seq_len]] = True
            is_start = is_start.view(n, seq_len)
            is_start[:, 0] = True
            idx = torch.arange(seq_len).expand(n, seq_len)
            last_start = torch.where(is_start, idx, torch.zeros_like(idx)).cummax(1).values
            self.positions = idx - last_start

    def __len__(self):
        return self.data.shape[0]

    def __getitem__(self, i):
        ids = self.data[i]
        item = {"input_ids": ids, "labels": ids.clone()}
        if self.positions is not None:
            item["position_ids"] = self.positions[i]
        return item


TASKS = {"copy": LongRangeCopy}
