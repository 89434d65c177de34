"""Sequence sharding for SP, the data loader, the embedded long-context task; file datasets are in corpus.py."""
from __future__ import annotations

from typing import Callable, Dict, Iterator, List, Optional

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from .batch import BATCH_KEY, LENS_KEY, REAL_KEY, RING_KEY, document_structure, mask_padding_targets
from ..dist.comm import ring_degree
from ..dist.layout import ring_length_multiple, shard_index
from ..errors import BatchError, ConfigError
from ..loss import IGNORE_INDEX, shift_labels_of

# ---------------------------------------------------------------------------------------------
# sharding
# ---------------------------------------------------------------------------------------------


def shard_batch(batch: Dict[str, torch.Tensor], sp_rank: int, sp_size: int,
                ring: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """Cut a full-sequence batch into this SP rank's sequence shard: contiguous, or with a ring (``ring`` > 1;
    None: the ring degree of this process's groups, dist.comm.ring_degree, 1 without) the zigzag shard of
    ``dist.layout.shard_index`` (the batch then carries ``doc_shard_ring``, which the patched forward checks
    against the model's ring degree).

    Labels are shifted *before* cutting (``shift_labels``), so the target of a shard's last token is
    the first token of the next shard, and the sample's last position is ignored (-100).
    ``position_ids`` are global positions, so RoPE is right on every shard.

    Packed documents (position_ids restarting per document, or ``doc_lens``) and right padding
    (``attention_mask`` zeros at the end; the tail becomes a document whose targets are ignored) are
    described for the WHOLE sample in ``doc_cu_seqlens`` [batch, n+1], which every rank receives:
    a rank cannot tell a document boundary on a shard edge from its own position_ids.
    """
    if "input_ids" not in batch:
        raise BatchError("batch", "has no 'input_ids'", "yield dicts with input_ids [batch, seq] (and labels)")
    input_ids = batch["input_ids"]
    if input_ids.dim() != 2:
        raise BatchError("batch.input_ids", f"expected shape [batch, seq], got {tuple(input_ids.shape)}",
                          "collate samples into a 2-D tensor")
    bsz, seq = input_ids.shape
    ring = ring_degree() if ring is None else ring
    if ring < 1 or sp_size % ring:
        raise BatchError("ring", f"{ring} does not divide sequence_parallel_size={sp_size}",
                         "give the ring degree the SP groups were built for (None: this process's)")
    multiple = ring_length_multiple(sp_size, ring)
    if seq % multiple != 0:
        what = f"sequence_parallel_size={sp_size}" if ring == 1 else (
            f"{multiple} (sequence_parallel_size={sp_size} as Ulysses {sp_size // ring} x ring {ring}: {2 * ring} "
            f"zigzag chunks, each ring rank's two cut into {sp_size // ring} equal shards)")
        raise BatchError("batch.input_ids", f"sequence length {seq} is not divisible by {what}",
                          f"pad samples at the end to a multiple of {multiple} (e.g. {(seq // multiple + 1) * multiple}) "
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
    if ring > 1:  # zigzag (dist.layout.shard_index): an index, not a slice
        idx = torch.tensor(shard_index(seq, sp_size, ring, sp_rank), dtype=torch.long)
        cut = lambda t: t[:, idx.to(t.device)]  # noqa: E731  (a gather: a copy of its own)
        out[RING_KEY] = torch.tensor([ring], dtype=torch.long)
    else:
        # clone, not .contiguous(): with one sample (or SP=1) the slice is already contiguous and
        # .contiguous() returns a view that keeps the whole sample's storage alive
        cut = lambda t: t[:, sp_rank * chunk:(sp_rank + 1) * chunk].clone(  # noqa: E731
            memory_format=torch.contiguous_format)
    out["input_ids"] = cut(input_ids)
    out["position_ids"] = cut(pos).to(input_ids.device)
    out["shift_labels"] = cut(shift)
    out[BATCH_KEY] = cu
    if any(n < seq for n in n_real):  # the padded tail is a document; the router's auxiliary loss must not count it
        out[REAL_KEY] = torch.tensor(n_real, dtype=torch.long)
    for k, v in batch.items():  # pass through anything else (e.g. per-sample metadata)
        if k not in ("input_ids", "labels", "shift_labels", "position_ids", "attention_mask", LENS_KEY, RING_KEY):
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


# file datasets live in corpus.py (sources, the token cache, the dataset); these names stay importable from here
from .corpus import check_tokenizer_vocab  # noqa: E402,F401
from .corpus import CorpusDataset, open_corpus  # noqa: E402


class TokenFileDataset(CorpusDataset):
    """Fixed-length samples of a text file or table, tokenized once into a cache (``corpus.open_corpus``, which
    documents the kinds, the cache and the sample layout). The former whole-file constructor's signature."""

    def __init__(self, path: str, tokenizer, seq_len: int, documents: bool = True, vocab_size: Optional[int] = None,
                 tokenizer_name: Optional[str] = None, column: str = "text"):
        ds = open_corpus(path, tokenizer, seq_len, documents=documents, column=column, vocab_size=vocab_size,
                         tokenizer_name=tokenizer_name)
        super().__init__(ds.cache, ds.meta, seq_len, documents)


TASKS = {"copy": LongRangeCopy}
