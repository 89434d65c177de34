"""The batch a patched model accepts, and the forward wrapper that checks it (``install_document_forward``,
installed last by ``patch.patch_model``): packed documents become the ``Documents`` our attention reads.

The one rule for a batch carrying ``doc_cu_seqlens`` (:func:`documents_of`): no padding mask next to it, and it
describes the batch's samples at the global length. At SP = 1 a batch without it gets its document structure
derived from its position_ids / doc_lens / right padding (batch.document_structure).

At sequence parallelism > 1 every rank first checks its own shard (no collectives), then the group all-gathers one small header per
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

A full-length batch that every rank of the group holds (checked by one all-gather of a digest), in training or with
gradients, or padded on the left (TRL's prompt + completion batches: the RL and preference trainers, the reference
and old-policy forwards), is packed (left and right padding dropped, one document per row), sharded, run, and its
per-token outputs gathered back on every rank: ``objectives.replicated``. At SP 1 a left-padded labelled batch takes
the same path (``document_structure`` reads right padding only).
"""
from __future__ import annotations

import types
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from ..attention.documents import DOCS_KWARG, Documents, no_mask
from ..data.batch import (BATCH_KEY, LENS_KEY, REAL_KEY, RING_KEY, custom_mask_error, document_structure,
                          mask_padding_targets, token_input)
from ..dist.comm import all_gather_ints, control_plane, sp_rank
from ..dist.layout import gathered_order
from ..measure.simulation import holds_values
from .compat import FUSED_FIELDS, causal_lm_output, fused_lm_head_output
from ..errors import BatchError, LongContextError, error_class
from ..data.turns import shard_in_turns
from ..loss import shift_labels_of
from ..models import ARCHITECTURES, text_config
from ..models.packing import mask_ignores_positions
from ..models.rope import group_positions, local_max_position, sequence_dependent_rotaries
from ..objectives.pack import has_left_padding
from ..objectives.replicated import batch_digest, group_differs, replicated_forward

_LOADER_FIX = ("feed batches from the loader returned by ds_longctx.initialize, or shard each full batch with "
               "ds_longctx.data.shard_batch(batch, sp_rank, sp_size)")


def is_full_eval_batch(training: bool, labels, shift_labels, cu) -> bool:
    return not training and is_full_batch(labels, shift_labels, cu)


def is_full_batch(labels, shift_labels, cu) -> bool:
    """Unshifted labels and no ``doc_cu_seqlens``: a whole batch (no rank's shard carries unshifted labels)."""
    return cu is None and labels is not None and shift_labels is None


def documents_of(cu, attention_mask, input_ids, sp: int) -> Documents:
    """The batch rule for ``doc_cu_seqlens`` (the one home of it: the forward wrapper at SP 1, :func:`local_fault`
    at SP > 1): no padding mask next to it (shard_batch turned the padding into an ignored document), and it
    describes this batch's samples at the global length (``sp`` shards of this rank's tokens)."""
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
    return docs


def local_fault(input_ids, attention_mask, position_ids, labels, shift_labels, cu, doc_lens, sp: int,
                training: bool, kwargs) -> Tuple[Optional[LongContextError], Optional[Documents]]:
    """This rank's own verdict on its shard (no collectives): (the BatchError to raise or None, the batch's
    documents when it carries ``doc_cu_seqlens``)."""
    docs = None
    try:
        if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2):
            raise custom_mask_error(attention_mask)
        if is_full_batch(labels, shift_labels, cu):
            # whether it runs (every rank holds it, or evaluation in turns) is decided over the group: full_batch_route
            tensors = sorted(k for k, v in kwargs.items() if isinstance(v, torch.Tensor))
            if input_ids is None or tensors:
                what = tensors[0] if tensors else "inputs_embeds"
                raise BatchError(f"batch.{what}", "cannot be sharded with a full-length batch",
                                 "give input_ids, labels, position_ids and attention_mask only (a loss mask "
                                 "belongs in labels as -100); a per-token input the model needs has no SP path yet: "
                                 "evaluate at sequence_parallel_size 1")
            if doc_lens is not None:
                raise BatchError(f"batch.{LENS_KEY}", "given with a full-length batch under SP", "mark the documents "
                                 "with position_ids restarting at 0 per document instead")
            return None, None  # sharded in turns or as a replicated batch: shard_batch and pack check it
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
            docs = documents_of(cu, attention_mask, input_ids, sp)
    except LongContextError as e:
        return e, None
    return None, docs


def agree(group, sp: int, fault: Optional[LongContextError], full_eval: bool, input_ids, position_ids, attention_mask,
          cu, kwargs, positions: bool = False, ring: int = 1, cut: int = 1) -> Optional[int]:
    """One all-gather of every rank's header (module doc); raises the same error (its class too) on every rank.
    ``positions``: also agree on the group's sequence length as RoPE sees it (max position + 1 over the group, for
    sequence-dependent rotary embeddings: models/rope.py), returned (None when not asked or not known). ``ring``:
    the model's ring degree, ``cut``: the one this rank's shard was cut for (its ``doc_shard_ring``, 1 without)."""
    t = token_input(input_ids, position_ids, kwargs)
    b, s = (t.shape[0], t.shape[1]) if t is not None else (0, 0)
    top = local_max_position(position_ids) if positions and fault is None else 0
    # tiny: 7 integers per rank (control data: real even under the planner's fake tensors, see comm.control_plane)
    rows = all_gather_ints([int(fault is not None), b, s, int(cu is not None), int(full_eval), top, cut], group)
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
        raise BatchError("batch", f"SP ranks {which} hold full-length batches (labels, no doc_cu_seqlens) and the "
                          "others sequence shards", "give every rank of the SP group the same kind of batch")
    if full_eval:
        return None
    cuts = sorted({r[6] for r in rows})
    if cuts != [ring]:
        how = "contiguous shards" if cuts == [1] else f"the zigzag shards of ring degree {cuts}"
        raise BatchError("batch", f"holds {how}, but the model runs sequence_parallel_size {sp} as Ulysses "
                         f"{sp // ring} x ring {ring} ({'zigzag' if ring > 1 else 'contiguous'} shards): attention "
                         "would pair the wrong tokens", "cut each full batch with ds_longctx.data.shard_batch in this "
                         "process (it reads the ring degree of the SP groups), or the loader of initialize")
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
    return max(r[5] for r in rows) or None  # 0: no values (the planner's fake positions): the shard's own


def _check_contiguous(position_ids, attention_mask, group, sp: int) -> None:
    """Without doc_cu_seqlens the gathered sample must be one causal sequence: positions continuing by +1
    within and across the shards, no padding. Says which of unsharded, packed or padded it is."""
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


def full_batch_route(forward, training: bool, group, sp: int, grad_scale: float, input_ids, attention_mask,
                     position_ids, labels, kwargs, ring: int = 1):
    """A full-length batch on every rank of the group (agreed by :func:`agree`): the same batch everywhere (one
    all-gather of a digest) in training, with gradients, or left-padded -> ``objectives.replicated`` (module doc); in
    evaluation without gradients -> each rank's own batch in turns (:func:`eval_in_turns`; one turn when it is the
    same); else the same BatchError on every rank."""
    differ = group_differs(batch_digest(input_ids, attention_mask, position_ids, labels), group, sp)
    grad = torch.is_grad_enabled()
    if not differ and (training or grad or has_left_padding(attention_mask)):
        return replicated_forward(forward, group, sp, grad_scale, input_ids, attention_mask, position_ids, labels,
                                  kwargs, evaluating=not training, ring=ring)
    if not training and not grad:
        return eval_in_turns(forward, group, sp, input_ids, attention_mask, position_ids, labels, kwargs, ring)
    why = ("gradients are enabled in eval mode" if not training else "the model is in training mode")
    raise BatchError("batch.labels", f"are unshifted and the batch has no 'doc_cu_seqlens': a full-length batch, not "
                     f"this rank's sequence shard, and SP ranks {differ} hold another batch than SP rank 0 while "
                     f"{why} (the target of a shard's last token lives on the next rank; a full batch is sharded "
                     "here only when every rank of the group holds it, or in evaluation, in turns)",
                     _LOADER_FIX + "; or give every rank of the SP group the same full batch (it is then sharded "
                     "here, e.g. after generation); for evaluation, call the model in eval mode under "
                     "torch.no_grad(), which shards each rank's own full-length batch in turns")


def eval_in_turns(forward, group, sp: int, input_ids, attention_mask, position_ids, labels, kwargs, ring: int = 1):
    """This rank's own full-length eval batch, computed sharded over the SP group (module doc): its loss, and
    its full-length per-token outputs, each turn's shards gathered to the turn's owner as the turn ends:
    ``logits`` [b, seq, vocab] (equal to one process; with long_context.tiled_loss they are not computed and
    the output says so when they are used), or TRL's fused LM head fields (``fused_lm_head=True``: log_probs,
    entropy, is_top1, label_mask, [b, seq - 1] as TRL gives them for unshifted labels). A right-padded tail
    added to make the length divisible by the SP degree is cut off again."""
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
        full = {k: _gather_sequence(v, group, sp, None if replicated else t, ring) for k, v in local.items()}
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


def _gather_sequence(t: torch.Tensor, group, sp: int, owner: Optional[int], ring: int = 1):
    """A turn's [b, s_local, ...] shards, concatenated along the sequence on the turn's owner (SP rank; None:
    on every rank) in token order (zigzag shards put back: dist.layout.gathered_order); None on the other ranks."""
    dtype = t.dtype
    t = t.detach().contiguous()
    if dtype == torch.bool:  # sent as bytes (not every backend reduces bool)
        t = t.to(torch.uint8)
    if owner is None:
        parts = [torch.empty_like(t) for _ in range(sp)]
        dist.all_gather(parts, t, group=group)
    else:
        mine = sp_rank(group) == owner
        parts = [torch.empty_like(t) for _ in range(sp)] if mine else None
        dist.gather(t, gather_list=parts, dst=dist.get_global_rank(group, owner), group=group)
        if not mine:
            return None
    full = torch.cat(parts, dim=1).to(dtype)
    if ring > 1:
        order = gathered_order(full.shape[1], sp, ring).to(full.device)
        full = torch.empty_like(full).index_copy_(1, order, full)  # token order[i] is the gathered i-th
    return full


# ---------------------------------------------------------------------------------------------
# the model forward wrapper: batch -> Documents keyword (above attention: attention/documents.py keeps the
# Documents structure and the kernel adapters, batch.py the batch's document structure)
# ---------------------------------------------------------------------------------------------


def install_document_forward(model, spec) -> None:
    """Wrap ``model.forward`` (already ds_longctx's loss forward) so packed batches attend per document.

    Under our attention (``spec.owns_attention``: Ulysses at SP>1, untied), which reads the documents, HF is given
    a no-mask (or an all-ones padding mask) so it does not build its packed [b, 1, s, s] mask from the restarting
    position_ids (quadratic memory, and ignored by our attention). With "none" HF's own packed mask is the
    attention.

    * batch with ``doc_cu_seqlens`` (from shard_batch): used as is (:func:`documents_of`).
    * SP=1 without it: derived from this (full) batch's position_ids / doc_lens / right padding.
    * SP>1: every rank checks its shard and the group agrees on the verdicts and shapes with one small
      all-gather (:func:`agree`) before any collective; without ``doc_cu_seqlens`` the gathered sample
      must be one contiguous document without padding (a rank cannot see a boundary on a shard edge). A
      full-length eval batch is sharded over the group in turns (:func:`eval_in_turns`).
    """
    sp, group, own_attention, ring = spec.sp, spec.group, spec.owns_attention, spec.ring
    inner = model.forward
    # RoPE that rescales by the longest position it sees (dynamic, LongRoPE) is given the group's (models/rope.py)
    global_rope = sp > 1 and bool(sequence_dependent_rotaries(model))
    no_hf_mask = hands_hf_no_mask(model, own_attention)
    # under transformers' own attention ("none") a packed batch is exact only where HF builds its mask from the
    # restarting position_ids; where it does not (models/packing.py), refuse it rather than attend across documents
    blind = None if own_attention else mask_ignores_positions(model) and type(model).__name__

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, shift_labels=None,
                **kwargs):
        cu = kwargs.pop(BATCH_KEY, None)
        kwargs.pop(REAL_KEY, None)  # read by the router auxiliary loss's wrapper (patch.py), where there is one
        cut = kwargs.pop(RING_KEY, None)
        cut = int(cut.reshape(-1)[0]) if isinstance(cut, torch.Tensor) and holds_values(cut) else \
            (ring if cut is not None else 1)  # the planner's fake batch: cut as the spec runs
        doc_lens = kwargs.pop(LENS_KEY, None)
        docs = None
        global_len = None
        if sp == 1 and is_full_batch(labels, shift_labels, cu) and has_left_padding(attention_mask):
            return replicated_forward(types.MethodType(forward, self), None, 1, spec.grad_scale, input_ids,
                                      attention_mask, position_ids, labels, kwargs, evaluating=not self.training)
        if sp > 1:
            # every rank's verdict on its shard, agreed over the group before any collective
            full = is_full_batch(labels, shift_labels, cu)
            fault, docs = local_fault(input_ids, attention_mask, position_ids, labels, shift_labels, cu, doc_lens, sp,
                                      self.training, kwargs)
            global_len = agree(group, sp, fault, full, input_ids, position_ids, attention_mask, cu, kwargs,
                               positions=global_rope, ring=ring, cut=cut)
            if full:
                return full_batch_route(types.MethodType(forward, self), self.training, group, sp, spec.grad_scale,
                                        input_ids, attention_mask, position_ids, labels, kwargs, ring)
        with group_positions(global_len):
            return _inner(self, input_ids, attention_mask, position_ids, labels, shift_labels, cu, doc_lens, docs,
                          kwargs)

    def _inner(self, input_ids, attention_mask, position_ids, labels, shift_labels, cu, doc_lens, docs, kwargs):
        if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2):
            if sp == 1 and not own_attention and cu is None and doc_lens is None:
                # SP=1 on transformers' own attention: HF applies the custom mask itself, exactly
                return inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             labels=labels, shift_labels=shift_labels, **kwargs)
            raise custom_mask_error(attention_mask)  # before any collective (same batch structure on every rank)
        if cu is not None:
            docs = docs if docs is not None else documents_of(cu, attention_mask, input_ids, sp)
            attention_mask = None
        elif sp == 1 and input_ids is not None and (position_ids is not None or doc_lens is not None
                                                   or attention_mask is not None):
            cu, position_ids, n_real = document_structure(input_ids, position_ids, attention_mask, doc_lens)
            position_ids = position_ids.to(input_ids.device)
            attention_mask = None
            if labels is not None or shift_labels is not None:
                shift = shift_labels if shift_labels is not None else shift_labels_of(labels)
                shift_labels, labels = mask_padding_targets(shift, n_real), None
            docs = Documents(cu)
        # sp > 1 without doc_cu_seqlens: checked above (agree: one contiguous causal sample)
        if docs is not None and not docs.dense:
            if blind and _later_documents_scored(docs, shift_labels if shift_labels is not None else
                                                  shift_labels_of(labels) if labels is not None else None):
                raise BatchError("batch", f"holds packed documents, but {blind}'s causal mask is built "
                                 "without position_ids: under attention implementation 'none' (transformers' own "
                                 "attention) every token would attend across documents",
                                 "set long_context.attention.implementation to 'untied_ulysses' (per-document "
                                 "attention), or feed one document per sample without padding")
            if kwargs.get("use_cache"):
                raise BatchError("use_cache", "is true for a packed batch: HF ignores packed position_ids when it "
                                  "builds a KV cache, so attention would cross documents", "call with use_cache=False")
            kwargs["use_cache"] = False  # HF detects packing (implementation "none") only without a cache
            kwargs[DOCS_KWARG] = docs
        if no_hf_mask and (attention_mask is None or attention_mask.dim() == 2):  # 2-D: all ones by now
            # our attention applies causality, windows and documents itself: HF builds no [s, s] mask of its own
            # (a windowed layer's would be s_local^2 bytes per forward; a packed one from restarting position_ids)
            t = token_input(input_ids, position_ids, kwargs)
            if t is not None:
                attention_mask = no_mask(t.shape[0], t.shape[1], t.device)
        elif own_attention and input_ids is not None and ((docs is not None and not docs.dense) or ring > 1):
            # no packed mask from the restarting position_ids (nor from a zigzag shard's jump in them)
            attention_mask = torch.ones_like(input_ids)
        return inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, labels=labels,
                     shift_labels=shift_labels, **kwargs)

    model.forward = types.MethodType(forward, model)


def _later_documents_scored(docs, shift) -> bool:
    """Whether a sample has a document after its first whose tokens count (a target, or no targets given): under a
    plain causal mask those attend to the documents before them. A right-padded tail (no targets) does not count."""
    for i, spans in enumerate(docs.bounds):
        if len(spans) > 1 and (shift is None or bool((shift[i, spans[0][1]:] != -100).any())):
            return True
    return False


def hands_hf_no_mask(model, own_attention: bool) -> bool:
    """Whether the forward hands transformers a 4-D no-mask (attention.documents.no_mask) instead of letting it
    build its own: only under our attention, and only for the architectures of ds_longctx.models, whose decoders
    pass HF's mask to the attention function alone (others read it elsewhere too: OPT's position embeddings, Doge's
    dynamic mask; those keep transformers' own mask, which our attention checks)."""
    return own_attention and text_config(model.config).model_type in ARCHITECTURES


__all__ = ["agree", "documents_of", "eval_in_turns", "hands_hf_no_mask", "install_document_forward",
           "is_full_eval_batch", "local_fault"]
