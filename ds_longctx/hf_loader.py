"""The SP data loader adapter for a ds_longctx engine under Accelerate / HF Trainer / TRL.

Accelerate wraps the training loader in DeepSpeed's ``UlyssesSPDataLoaderAdapter`` when
``ParallelismConfig(sp_backend="deepspeed", sp_size=N)`` is set (``accelerate.Accelerator.
_prepare_deepspeed`` and ``Accelerator.deepspeed_ulysses_dl_adapter``, which the Trainer calls).
That adapter cannot take packed padding-free rows (TRL ``packing=True, padding_free=True``): its
``refill`` all-gathers every rank's row, and rows of different lengths fail (measured, gloo:
"ProcessGroupGloo::allgather: invalid tensor size at index 1 (expected (1, 5), got (1, 31))"); it also
reads dim 1 of every tensor, which TRL's 1-D ``cu_seq_lens_q`` does not have.

:class:`SPTurnsAdapter` keeps DeepSpeed's contract (same constructor, same order: the SP group takes
turns on each rank's batch, so an SP=N world trains the samples in the one-process order, and
``len`` is ``len(dl) * N``, ``len(dl)`` once a loader is found replicated) and shards with :func:`ds_longctx.data.shard_batch`: every rank gets the
sample's ``doc_cu_seqlens``, so attention runs per document. Each turn's batch goes from its owner
to the group by broadcast (after one small all-gather of shapes), so ranks may hold rows of any
length. A row whose length is not a multiple of SP is padded at the end with one ignored document.
Written rather than reused because DeepSpeed's adapter cannot take these rows (see above).

Evaluation takes the same turns: a full-length eval batch reaching the model (the HF Trainer's eval loop,
``engine.eval()`` in a plain loop) is sharded by :func:`shard_in_turns` (called from ``sp_batch``), so an eval
step's memory is a training step's forward.

Turns are right when each rank's loader holds different samples (the HF Trainer's loader is sharded over
all ranks). A plain Accelerate loop prepared with a ``ParallelismConfig`` shards its loader over the DP
dimension only, so every rank of an SP group holds the same batch, and turns would train each sample SP
times (DeepSpeed's adapter does that: measured, examples/accelerate_loop.py). So at each step the group
compares fingerprints of its batches: all equal at the first step means a replicated loader, and each
step's one batch is sharded once; a replicated loader that later gives different batches is an error.

:func:`ds_longctx.enable` installs :class:`RoutedSPAdapter` under DeepSpeed's class name; it picks
this adapter when the engine being trained is a ds_longctx engine and DeepSpeed's otherwise.
"""
from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from .batch import document_structure
from .errors import BatchError, LongContextError, error_class
from .loss import IGNORE_INDEX

# TRL's padding-free collator (trl.trainer.sft_trainer.DataCollatorForLanguageModeling) adds these
# for flash-attention varlen kernels and linear-attention layers. The same boundaries follow from
# position_ids (a document starts at position 0), which shard_batch turns into doc_cu_seqlens; they
# are checked against them and dropped (one [n+1] list cannot be cut per shard).
_VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def _varlen_checked(batch: dict) -> dict:
    """Drop TRL's varlen keys after checking they describe the documents the position_ids describe."""
    present = [k for k in _VARLEN_KEYS if k in batch]
    if not present:
        return batch
    out = {k: v for k, v in batch.items() if k not in _VARLEN_KEYS}
    ids, pos = batch["input_ids"], batch.get("position_ids")
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        cu = batch.get(key)
        if cu is None:
            continue
        if ids.shape[0] != 1 or pos is None:
            raise BatchError(f"batch.{key}", f"is given for input_ids {tuple(ids.shape)} "
                              f"{'without position_ids' if pos is None else '(more than one row)'}; "
                              "ds_longctx reads document boundaries from position_ids restarting per document",
                              "use TRL's padding-free collator as is (one flattened row with position_ids), or "
                              "drop cu_seq_lens_* and give position_ids")
        want = document_structure(ids, pos)[0][0].tolist()  # shard_batch's own reading of position_ids
        got = cu.detach().to("cpu", torch.long).flatten().tolist()
        if got != want:
            raise BatchError(f"batch.{key}", f"gives document boundaries {got[:8]}{'...' if len(got) > 8 else ''} "
                              f"but position_ids give {want[:8]}{'...' if len(want) > 8 else ''}",
                              "make position_ids restart at 0 exactly at every document start")
    return out


def _padded_to_multiple(batch: dict, sp: int) -> dict:
    """Pad a row whose length is not a multiple of SP with one ignored document at the end."""
    ids = batch["input_ids"]
    seq = ids.shape[1]
    extra = (-seq) % sp
    if extra == 0:
        return batch
    out = dict(batch)
    b = ids.shape[0]

    def cat(t, fill):
        return torch.cat([t, torch.full((b, extra), fill, dtype=t.dtype, device=t.device)], dim=1)

    mask = batch.get("attention_mask")
    if mask is None:
        mask = torch.ones_like(ids)
    out["attention_mask"] = cat(mask, 0)  # shard_batch: a right-padded tail is a document with ignored targets
    out["input_ids"] = cat(ids, 0)
    for key in ("labels", "shift_labels"):
        if key in batch:
            out[key] = cat(batch[key], IGNORE_INDEX)
    if "position_ids" in batch:
        out["position_ids"] = cat(batch["position_ids"], 0)  # replaced by shard_batch for the tail
    return out


def _checked_batch(batch, sp: int) -> dict:
    """What this rank contributes to the turns: validated, varlen keys folded in, padded to SP."""
    from .data import shard_batch

    if not isinstance(batch, dict):
        raise BatchError("batch", f"is a {type(batch).__name__}; the SP data loader takes dict batches",
                          "collate samples into a dict with input_ids (labels, position_ids)")
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise BatchError("batch.input_ids", f"expected a [batch, seq] tensor, got "
                          f"{tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__}",
                          "collate samples into a 2-D tensor")
    seq = ids.shape[1]
    for k, v in batch.items():
        if (k not in _VARLEN_KEYS and k not in ("input_ids", "labels", "shift_labels", "position_ids",
                                                 "attention_mask") and isinstance(v, torch.Tensor)
                and v.dim() >= 2 and v.shape[1] == seq):
            raise BatchError(f"batch.{k}", f"has the sequence dimension ({tuple(v.shape)}) but ds_longctx's SP "
                              "data loader only knows how to shard input_ids, labels, shift_labels, position_ids "
                              "and attention_mask", f"drop '{k}' from the collator's output if the model and loss do not "
                              "read it (a loss mask belongs in labels as -100, which the loader shards); a per-token "
                              "input the model needs has no SP path yet: train at sequence_parallel_size 1")
    batch = _padded_to_multiple(_varlen_checked(batch), sp)
    shard_batch(batch, 0, sp)  # every check shard_batch makes, here, before any collective
    return batch


def _fingerprint(batch: dict) -> str:
    """A digest of a batch's tensors and values: equal across ranks iff they hold the same batch."""
    import hashlib

    h = hashlib.blake2b(digest_size=16)
    for k in sorted(batch):
        v = batch[k]
        h.update(k.encode())
        if isinstance(v, torch.Tensor):
            h.update(str((tuple(v.shape), v.dtype)).encode())
            h.update(v.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(v).encode())
    return h.hexdigest()


def _describe(batch: dict) -> dict:
    return {k: (("tensor", tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else ("object", v))
            for k, v in batch.items()}


class SPTurnsAdapter:
    """DeepSpeed's ``UlyssesSPDataLoaderAdapter`` contract, sharded with ``shard_batch`` (module doc)."""

    def __init__(self, dl, sp_rank: int, sp_group, sp_world_size: int, device):
        self.dl = dl
        self.sp_rank, self.sp_group, self.sp_world_size = sp_rank, sp_group, sp_world_size
        self.device = device
        self.iter = None  # made at the first batch, after the Trainer's set_epoch
        self.micro_batches: deque = deque()
        self.replicated = None  # decided at the first batch (module doc)

    def __len__(self):
        return len(self.dl) * (1 if self.replicated else self.sp_world_size)

    def __iter__(self):
        return self

    def set_epoch(self, epoch: int):
        if hasattr(self.dl, "set_epoch"):
            self.dl.set_epoch(epoch)

    def __next__(self):
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self):
        from .data import shard_batch

        sp = self.sp_world_size
        if self.iter is None:
            self.iter = iter(self.dl)
        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = None
            batch = None
        batch, gathered = _exchange_descriptions(batch, sp, self.sp_group)
        descs = [d for d, _ in gathered]
        if all(d is None for d in descs):
            raise StopIteration
        if any(d is None for d in descs):
            ended = [r for r, d in enumerate(descs) if d is None]
            raise BatchError("train data loader", f"ran out on SP ranks {ended} while the other ranks of the SP "
                              "group still had batches (the group takes turns on each rank's batch)",
                              "give every rank the same number of batches (Accelerate's even_batches=True, "
                              "drop_last=True)")
        same = len({fp for _, fp in gathered}) == 1
        if self.replicated is None:
            self.replicated = same
        elif self.replicated and not same:
            raise BatchError("train data loader", "gave every rank of the SP group the same batches at first "
                              "(a loader sharded over data-parallel ranks only, each sample trained once) and "
                              "now different ones", "give the SP ranks of a group either always the same "
                              "batches or always different ones")
        if self.replicated:  # every rank holds this very batch: shard it, nothing to send
            local = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            self.micro_batches.append(shard_batch(local, self.sp_rank, sp))
            return
        self.micro_batches.extend(_turn_shards(batch, descs, self.sp_rank, self.sp_group, sp, self.device))


def _exchange_descriptions(batch, sp: int, group):
    """Check this rank's batch (None: out of batches) and all-gather (description, fingerprint) over the
    SP group; a bad batch on any rank is the same BatchError on every rank, raised after the exchange."""
    desc = None
    if batch is not None:
        try:
            batch = _checked_batch(batch, sp)
            desc = _describe(batch)
        except LongContextError as e:  # raised below on every rank of the group, before the broadcasts
            desc = ("error", e.key, e.problem, e.fix, type(e).__name__)
    gathered = [None] * sp
    dist.all_gather_object(gathered, (desc, _fingerprint(batch) if isinstance(desc, dict) else None), group=group)
    for r, (d, _) in enumerate(gathered):
        if isinstance(d, tuple):
            _, key, problem, fix, kind = d
            raise error_class(kind)(key, f"(SP rank {r}'s batch) {problem}", fix)
    return batch, gathered


def _turn_shards(batch, descs, sp_rank: int, group, sp: int, device) -> list:
    """Every rank's batch in turn, sent by its owner to the group: this rank's shard of each."""
    from .data import shard_batch

    out = []
    for r, d in enumerate(descs):
        src = dist.get_global_rank(group, r)
        full = {}
        for k, (kind, *spec) in d.items():
            if kind == "object":
                full[k] = spec[0]
                continue
            shape, dtype = spec
            if r == sp_rank:
                t = batch[k].to(device).contiguous()
            else:
                t = torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(t, src=src, group=group)
            full[k] = t
        out.append(shard_batch(full, sp_rank, sp))
    return out


def shard_in_turns(batch: dict, sp_rank: int, group, sp: int, device):
    """Full-length batches, one per rank of the SP group (evaluation: each rank's loader gave its own), as
    sequence shards: returns (this rank's shard of every turn's batch, the index of this rank's own batch).
    A batch every rank holds (replicated) is one turn. Same checks and errors as the training adapter."""
    from .data import shard_batch

    batch, gathered = _exchange_descriptions(batch, sp, group)
    if len({fp for _, fp in gathered}) == 1:
        local = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        return [shard_batch(local, sp_rank, sp)], 0
    return _turn_shards(batch, [d for d, _ in gathered], sp_rank, group, sp, device), sp_rank


class RoutedSPAdapter:
    """Installed under DeepSpeed's ``UlyssesSPDataLoaderAdapter`` name by ``enable()``.

    Accelerate builds the adapter before ``deepspeed.initialize`` in ``_prepare_deepspeed``, so the
    choice is made at the first batch: ours when the last ``deepspeed.initialize`` went through
    ds_longctx, DeepSpeed's otherwise (HF's own ALST path while enabled)."""

    def __init__(self, dl, sp_rank, sp_group, sp_world_size, device, _deepspeed_cls=None, _is_ours=None):
        self.dl = dl
        self._args = (dl, sp_rank, sp_group, sp_world_size, device)
        self._deepspeed_cls, self._is_ours = _deepspeed_cls, _is_ours
        self._impl = None

    def _resolve(self):
        if self._impl is None:
            cls = SPTurnsAdapter if self._is_ours() else self._deepspeed_cls
            self._impl = cls(*self._args)
        return self._impl

    def __len__(self):
        return len(self._impl) if self._impl is not None else len(self.dl) * self._args[3]

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._resolve())

    def __getattr__(self, name):  # e.g. set_epoch: ours has it, DeepSpeed's does not
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._resolve(), name)
