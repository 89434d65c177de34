"""What a batch must be at sequence parallelism > 1, agreed by the whole SP group before any collective.

Every rank first checks its own shard (no collectives), then the group all-gathers one small header per
rank: [fault, batch, local length, has doc_cu_seqlens, full-length eval batch]. A fault seen on any rank
(a custom or padding mask next to ``doc_cu_seqlens``, unshifted labels, missing position_ids, ...) is then
the same BatchError on every rank, naming that rank, and shards of different shapes (cut by hand to 17 and
16 tokens) are an error instead of a gloo abort in the first all-to-all. Without ``doc_cu_seqlens`` the
shards must be one contiguous causal sample over the group (a second tiny all-gather of each sample's first
and last position): the error then says which of packed, padded or unsharded it is.

A full-length batch in evaluation (eval mode, ``labels``, no ``doc_cu_seqlens``, under ``torch.no_grad()``:
the HF Trainer's eval loop, ``engine.eval()`` in a plain loop) is sharded here in turns, as the training
adapter (hf_loader) does: each rank's batch is cut over the group, so an eval step's memory is a training
step's forward, and each rank returns the loss of its own batch (one turn when every rank holds the same).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .errors import BatchError, LongContextError, error_class

_LOADER_FIX = ("feed batches from the loader returned by ds_longctx.initialize, or shard each full batch with "
               "ds_longctx.data.shard_batch(batch, sp_rank, sp_size)")


def is_full_eval_batch(training: bool, labels, shift_labels, cu) -> bool:
    return not training and cu is None and labels is not None and shift_labels is None


def local_fault(input_ids, attention_mask, position_ids, labels, shift_labels, cu, doc_lens, sp: int,
                training: bool, kwargs) -> Optional[LongContextError]:
    """This rank's own verdict on its shard (no collectives): the BatchError to raise, or None."""
    from .attention.documents import Documents
    from .batch import BATCH_KEY, LENS_KEY, custom_mask_error

    try:
        if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2):
            raise custom_mask_error(attention_mask)
        if is_full_eval_batch(training, labels, shift_labels, cu):
            if torch.is_grad_enabled():
                raise BatchError("batch.labels", "are unshifted and the batch has no 'doc_cu_seqlens': a full-length "
                                  "batch, which in eval mode is sharded over the SP group in turns, but gradients are "
                                  "enabled (each rank's backward would pair with another rank's turn)",
                                  "evaluate under torch.no_grad(); to train, " + _LOADER_FIX)
            tensors = sorted(k for k, v in kwargs.items() if isinstance(v, torch.Tensor))
            if input_ids is None or tensors:
                what = tensors[0] if tensors else "inputs_embeds"
                raise BatchError(f"batch.{what}", "cannot be sharded with a full-length eval batch",
                                 "give input_ids, labels, position_ids and attention_mask only (a loss mask "
                                 "belongs in labels as -100); a per-token input the model needs has no SP path yet: "
                                 "evaluate at sequence_parallel_size 1")
            return None  # sharded in turns: shard_batch checks it
        if doc_lens is not None:
            raise BatchError(f"batch.{LENS_KEY}", "given on a sequence shard", "pass the full batch through "
                              "ds_longctx.data.shard_batch (or the loader of initialize), which carries them")
        if cu is None and labels is not None and shift_labels is None:
            raise BatchError("batch.labels", "are unshifted and the batch has no 'doc_cu_seqlens': this is a "
                              "full-length batch, not this rank's sequence shard (the target of a shard's last "
                              "token lives on the next rank)", _LOADER_FIX + "; for evaluation, call the model in "
                              "eval mode under torch.no_grad(), which shards a full-length batch itself")
        if position_ids is None:
            raise BatchError("batch.position_ids", "missing on a sequence shard (RoPE needs global positions)",
                              _LOADER_FIX)
        if cu is not None:
            if attention_mask is not None and not bool((attention_mask == 1).all()):
                raise BatchError("batch.attention_mask", f"has padding next to {BATCH_KEY}",
                                 "pass the full batch with its attention_mask through ds_longctx.data.shard_batch (it "
                                 "turns right padding into an ignored document, its targets dropped) and give the "
                                 "model shard_batch's output without another mask")
            docs = Documents(cu)
            if input_ids is not None and (docs.batch != input_ids.shape[0] or docs.seq_len != input_ids.shape[1] * sp):
                raise BatchError(f"batch.{BATCH_KEY}", f"describes {docs.batch} samples of {docs.seq_len} tokens, "
                                  f"the batch has {tuple(input_ids.shape)} per rank at SP={sp}",
                                  "shard with ds_longctx.data.shard_batch")
    except LongContextError as e:
        return e
    return None


def agree(group, sp: int, fault: Optional[LongContextError], full_eval: bool, input_ids, position_ids, attention_mask,
          cu, kwargs) -> None:
    """One all-gather of every rank's header (module doc); raises the same error (its class too) on every rank."""
    from .comm import all_gather_ints, control_plane

    from .batch import token_input

    t = token_input(input_ids, position_ids, kwargs)
    b, s = (t.shape[0], t.shape[1]) if t is not None else (0, 0)
    # tiny: 5 integers per rank (control data: real even under the planner's fake tensors, see comm.control_plane)
    rows = all_gather_ints([int(fault is not None), b, s, int(cu is not None), int(full_eval)], group)
    if any(r[0] for r in rows):
        msgs = [None] * sp
        with control_plane():
            dist.all_gather_object(msgs, None if fault is None else (fault.key, fault.problem, fault.fix, type(fault).__name__),
                                   group=group)
        r = next(i for i, m in enumerate(msgs) if m is not None)
        key, problem, fix, kind = msgs[r]
        raise error_class(kind)(key, f"(SP rank {r}'s shard) {problem}", fix)
    if len({r[4] for r in rows}) > 1:
        which = [i for i, r in enumerate(rows) if r[4]]
        raise BatchError("batch", f"SP ranks {which} hold full-length eval batches (labels, no doc_cu_seqlens, eval "
                          "mode) and the others sequence shards", "give every rank of the SP group the same kind "
                          "of batch")
    if full_eval:
        return
    if len({r[3] for r in rows}) > 1:
        which = [i for i, r in enumerate(rows) if r[3]]
        raise BatchError("batch.doc_cu_seqlens", f"given on SP ranks {which} only", _LOADER_FIX)
    shapes = [(r[1], r[2]) for r in rows]
    if len(set(shapes)) > 1:
        raise BatchError("batch.input_ids", f"the SP ranks hold shards of [batch, tokens] {shapes}; the Ulysses "
                          "all-to-all needs shards of one shape on every rank of the group", _LOADER_FIX +
                          " (it cuts equal shards and refuses a length not divisible by the SP degree, saying how "
                          "to pad)")
    if cu is None:
        _check_contiguous(position_ids, attention_mask, group, sp)


def _check_contiguous(position_ids, attention_mask, group, sp: int) -> None:
    """Without doc_cu_seqlens the gathered sample must be one causal sequence: positions continuing by +1
    within and across the shards, no padding. Says which of unsharded, packed or padded it is."""
    from .batch import BATCH_KEY

    p = position_ids.detach().long()
    contiguous = ((p[:, 1:] - p[:, :-1]) == 1).all(1) if p.shape[1] > 1 else torch.ones(p.shape[0], dtype=torch.bool,
                                                                                         device=p.device)
    unpadded = ((attention_mask == 1).all(1) if attention_mask is not None
                else torch.ones(p.shape[0], dtype=torch.bool, device=p.device))
    mine = torch.stack([p[:, 0], p[:, -1], contiguous.long(), unpadded.long()], 1)
    parts = [torch.empty_like(mine) for _ in range(sp)]
    dist.all_gather(parts, mine, group=group)  # tiny: [b, 4] per rank
    allp = torch.stack(parts).cpu()  # [C, b, 4]
    continues = bool((allp[1:, :, 0] == allp[:-1, :, 1] + 1).all())
    if bool(allp[:, :, 2].all()) and bool(allp[:, :, 3].all()) and continues:
        return
    if not continues and bool((allp[:, :, :2] == allp[:1, :, :2]).all()) and bool((allp[:, :, 0] == 0).all()):
        problem = (f"every SP rank holds positions 0..{int(allp[0, 0, 1])}: a full-length (unsharded) batch, not "
                   "this rank's sequence shard")
        fix = _LOADER_FIX + ("; for evaluation give labels and call the model in eval mode under torch.no_grad(), "
                             "which shards a full-length batch itself")
        raise BatchError("batch", problem, fix)
    if not bool(allp[:, :, 3].all()):
        ranks = sorted({int(r) for r in (allp[:, :, 3] == 0).nonzero()[:, 0]})
        problem = f"the attention_mask on SP ranks {ranks} has padding"
    elif not bool(allp[:, :, 2].all()):
        ranks = sorted({int(r) for r in (allp[:, :, 2] == 0).nonzero()[:, 0]})
        problem = f"position_ids restart on SP ranks {ranks} (packed documents)"
    else:
        problem = "position_ids do not continue from one SP rank's shard to the next (packed documents)"
    raise BatchError("batch", f"{problem}, but the batch has no '{BATCH_KEY}': document boundaries are global and a "
                      "rank cannot see one on a shard edge", _LOADER_FIX)


def eval_in_turns(forward, group, sp: int, input_ids, attention_mask, position_ids, labels, kwargs):
    """This rank's own full-length eval batch, computed sharded over the SP group (module doc): its loss, and
    its full-length per-token outputs, each turn's shards gathered to the turn's owner as the turn ends:
    ``logits`` [b, seq, vocab] (equal to one process; with long_context.tiled_loss they are not computed and
    the output says so when they are used), or TRL's fused LM head fields (``fused_lm_head=True``: log_probs,
    entropy, is_top1, label_mask, [b, seq - 1] as TRL gives them for unshifted labels). A right-padded tail
    added to make the length divisible by the SP degree is cut off again."""
    from .comm import sp_rank
    from .compat import FUSED_FIELDS, causal_lm_output, fused_lm_head_output
    from .hf_loader import shard_in_turns

    batch = {"input_ids": input_ids, "labels": labels}
    if attention_mask is not None:
        batch["attention_mask"] = attention_mask
    if position_ids is not None:
        batch["position_ids"] = position_ids
    extra = dict(kwargs)  # no tensors here (local_fault)
    fused = bool(extra.get("fused_lm_head"))
    rank = sp_rank(group)
    shards, own = shard_in_turns(batch, rank, group, sp, input_ids.device)
    replicated = len(shards) == 1  # every rank holds this batch: every rank gets the whole of it
    loss, fields = None, {}
    for t, shard in enumerate(shards):
        out = forward(**shard, **extra)
        names = FUSED_FIELDS if fused else ("logits",)
        local = {k: out.get(k) for k in names}
        local = {k: v for k, v in local.items() if isinstance(v, torch.Tensor)}
        full = {k: _gather_sequence(v, group, sp, None if replicated else t) for k, v in local.items()}
        if t == own:
            loss, fields = out.loss, {k: v for k, v in full.items() if v is not None}
        del out, local, full
    seq = input_ids.shape[1] - (1 if fused else 0)  # TRL drops the last token (no target) for unshifted labels
    fields = {k: v[:, :seq] for k, v in fields.items()}
    if fused:
        return fused_lm_head_output(loss, fields)
    logits = fields.get("logits")
    tiled = logits is None
    return causal_lm_output(loss, logits, tiled, evaluating=True)


def _gather_sequence(t: torch.Tensor, group, sp: int, owner: Optional[int]):
    """A turn's [b, s_local, ...] shards, concatenated along the sequence on the turn's owner (SP rank; None:
    on every rank); None on the other ranks."""
    dtype = t.dtype
    t = t.detach().contiguous()
    if dtype == torch.bool:  # sent as bytes (not every backend reduces bool)
        t = t.to(torch.uint8)
    if owner is None:
        parts = [torch.empty_like(t) for _ in range(sp)]
        dist.all_gather(parts, t, group=group)
    else:
        from .comm import sp_rank

        mine = sp_rank(group) == owner
        parts = [torch.empty_like(t) for _ in range(sp)] if mine else None
        dist.gather(t, gather_list=parts, dst=dist.get_global_rank(group, owner), group=group)
        if not mine:
            return None
    return torch.cat(parts, dim=1).to(dtype)


__all__ = ["agree", "eval_in_turns", "is_full_eval_batch", "local_fault"]
