"""Taking turns over an SP group: each rank's batch (a padded, packed or padding-free row, TRL's varlen keys checked
against its ``position_ids`` and dropped) is described to the group (one small all-gather of shapes), then broadcast
by its owner and sharded with :func:`ds_longctx.data.shard_batch`, so ranks may hold rows of any length and an SP=N
world trains the samples in the one-process order. The HF Trainer's loader adapter (``ds_longctx.hf.loader``) and the
patched forward's evaluation of a full-length batch (``patching.sp_batch``) both shard this way."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .loaders import shard_batch
from .batch import document_structure
from ..errors import BatchError, LongContextError, error_class
from ..loss import IGNORE_INDEX


# TRL's padding-free collator (trl.trainer.sft_trainer.DataCollatorForLanguageModeling) adds these
# for flash-attention varlen kernels and linear-attention layers. The same boundaries follow from
# position_ids (a document starts at position 0), which shard_batch turns into doc_cu_seqlens; they
# are checked against them and dropped (one [n+1] list cannot be cut per shard).
_VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def varlen_checked(batch: dict) -> dict:
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


def padded_to_multiple(batch: dict, sp: int) -> dict:
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


def checked_batch(batch, sp: int) -> dict:
    """What this rank contributes to the turns: validated, varlen keys folded in, padded to SP."""
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
    batch = padded_to_multiple(varlen_checked(batch), sp)
    shard_batch(batch, 0, sp)  # every check shard_batch makes, here, before any collective
    return batch


def fingerprint(batch: dict) -> str:
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


def describe(batch: dict) -> dict:
    return {k: (("tensor", tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else ("object", v))
            for k, v in batch.items()}


def exchange_descriptions(batch, sp: int, group):
    """Check this rank's batch (None: out of batches) and all-gather (description, fingerprint) over the
    SP group; a bad batch on any rank is the same BatchError on every rank, raised after the exchange."""
    desc = None
    if batch is not None:
        try:
            batch = checked_batch(batch, sp)
            desc = describe(batch)
        except LongContextError as e:  # raised below on every rank of the group, before the broadcasts
            desc = ("error", e.key, e.problem, e.fix, type(e).__name__)
    gathered = [None] * sp
    dist.all_gather_object(gathered, (desc, fingerprint(batch) if isinstance(desc, dict) else None), group=group)
    for r, (d, _) in enumerate(gathered):
        if isinstance(d, tuple):
            _, key, problem, fix, kind = d
            raise error_class(kind)(key, f"(SP rank {r}'s batch) {problem}", fix)
    return batch, gathered


def turn_shards(batch, descs, sp_rank: int, group, sp: int, device, first: int = 0) -> list:
    """Every rank's batch in turn from rank ``first`` on, sent by its owner to the group: this rank's shard of
    each."""
    out = []
    for r, d in enumerate(descs):
        if r < first:
            continue
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
    batch, gathered = exchange_descriptions(batch, sp, group)
    if len({fp for _, fp in gathered}) == 1:
        local = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        return [shard_batch(local, sp_rank, sp)], 0
    return turn_shards(batch, [d for d, _ in gathered], sp_rank, group, sp, device), sp_rank
