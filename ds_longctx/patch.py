"""``patch_model``: put the configured attention, memory stack and SP loss on a built HF causal LM.

Separate from the DeepSpeed orchestration (``initialize.py``) so that the planner and the benches
patch a model exactly as training does without importing DeepSpeed's engine; DeepSpeed pieces
(its Ulysses attention, ZeRO-3 leaf marking) are imported only by the installs that use them.
Issues no collectives: the planner runs it under a fake process group.
"""
from __future__ import annotations

import types
from typing import List, Optional

import torch

from . import comm
from .errors import BatchError, ConfigError
from .loss import causal_lm_loss_sum, shift_labels_of
from .spec import LongContextSpec, spec_for_group


class PatchHandle:
    """Everything :func:`patch_model` installed on one model; ``remove()`` undoes all of it."""

    def __init__(self, model, spec: LongContextSpec):
        self.model = model
        self.spec = spec
        self.lc = spec.config
        self.attention = None   # registry.Installation (Ulysses / function-level untied) or UntiedInstall
        self.memory = None      # memory.MemoryStackHandle
        self.loss_forward = False
        self.document_forward = False  # the packed-documents wrapper around the loss forward
        self.swapped: List[str] = []  # what was swapped in, for print(model)

    def remove(self) -> None:
        model = self.model
        if self.loss_forward or self.document_forward:
            # both are instance attributes (the document wrapper around the loss forward): popping
            # it lets the class's forward show through again
            model.__dict__.pop("forward", None)
            self.loss_forward = self.document_forward = False
        if self.memory is not None:
            self.memory.remove()
            self.memory = None
            model.__dict__.pop("_ds_longctx_memory", None)
        if self.attention is not None:
            self.attention.remove()
            self.attention = None
        model.__dict__.pop("extra_repr", None)
        model.__dict__.pop("_ds_longctx_patch", None)
        self.swapped = []


def _install_loss_forward(model, spec: LongContextSpec) -> None:
    """Make ``model(**batch).loss`` the SP-global token-mean loss computed from hidden states."""
    from .compat import causal_lm_output
    from .models.logits import decoder_of, logit_transform

    logit_fn = logit_transform(model)  # the model's own lm_head -> loss transform (ConfigError if unknown)
    decoder_of(model)  # found now (ConfigError at patch time, not at the first forward)
    sp_loss = comm.SPLoss(group=spec.group, grad_scale=spec.grad_scale, sp=spec.sp)
    sp = spec.sp
    tiled = spec.config.tiled_loss
    if tiled.enabled:
        from .memory.tiling import tiled_causal_lm_loss_sum
    # lm_head parameters the model uses elsewhere too (tied input embeddings: Llama-3.2, Gemma, Qwen small)
    uses = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    tied = tuple(p for p in model.lm_head.parameters() if uses.get(id(p), 0) > 1)
    orig_forward = model.forward

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, shift_labels=None,
                **kwargs):
        if labels is None and shift_labels is None:
            return orig_forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                **kwargs)
        fused = bool(kwargs.pop("fused_lm_head", False))  # TRL's fused LM head (SFTTrainer's loss and metrics)
        unshifted = shift_labels is None
        if shift_labels is None:
            if sp > 1:
                raise BatchError("batch.labels", "unshifted labels on a sequence shard lose the target of the "
                                  "shard's last token", "feed batches from the loader returned by "
                                  "ds_longctx.initialize, or shard with ds_longctx.data.shard_batch")
            shift_labels = shift_labels_of(labels)
        if sp > 1 and position_ids is None:
            raise BatchError("batch.position_ids", "missing on a sequence shard (RoPE needs global positions)",
                              "feed batches from the loader returned by ds_longctx.initialize, or shard with "
                              "ds_longctx.data.shard_batch")
        kwargs.pop("use_cache", None)
        kwargs.pop("logits_to_keep", None)
        out = decoder_of(self)(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 use_cache=False, **kwargs)
        hidden = out.last_hidden_state
        logits = None
        if fused:  # TRL's per-token fields, tile by tile (as TRL's own fused head: no [b, s, vocab] logits)
            from .compat import fused_lm_head_output
            from .memory.tiling import tiled_token_fields

            fields = tiled_token_fields(hidden, self.lm_head, shift_labels,
                                        spec.loss_shards if tiled.enabled else "auto", logit_fn, shared=tied)
            if unshifted:  # TRL's shape for unshifted labels: [b, seq - 1] (the last token has no target)
                fields = {k: v[:, :-1] for k, v in fields.items()}
            loss = sp_loss(-fields["log_probs"].sum(), fields["label_mask"].sum())
            return fused_lm_head_output(loss, fields)
        if tiled.enabled:
            loss_sum, count = tiled_causal_lm_loss_sum(hidden, self.lm_head, shift_labels, spec.loss_shards,
                                                       logit_fn, shared=tied)
        else:
            loss_sum, count, logits = causal_lm_loss_sum(hidden, self.lm_head, shift_labels, logit_fn)
        return causal_lm_output(sp_loss(loss_sum, count), logits, tiled.enabled, evaluating=not self.training)

    model.forward = types.MethodType(forward, model)


def _show_in_repr(model, handle: PatchHandle) -> None:
    """``print(model)`` names what ds_longctx swapped in (Liger-Kernel's extra_repr habit)."""
    cls_repr = type(model).extra_repr

    def extra_repr(self):
        base = cls_repr(self)
        mine = "ds_longctx: " + "; ".join(handle.swapped)
        return f"{base}\n{mine}" if base else mine

    model.extra_repr = types.MethodType(extra_repr, model)


def _check_model_against(model, lc, sp: int) -> None:
    """What the config asks of the built model (not of its config): refused before anything is installed."""
    impl = lc.attention.implementation
    if impl == "untied_ulysses" or (impl == "ulysses" and sp > 1):
        get_decoder = getattr(model, "get_decoder", None)
        body = get_decoder() if callable(get_decoder) else model  # a multimodal model's vision tower is not ours
        # a config flag (models.windows.is_bidirectional) misses models whose attention modules are built
        # bidirectional (RoBERTa-style LM heads without is_decoder=True): our SP attention is causal only
        both = sorted({type(m).__name__ for m in body.modules() if getattr(m, "is_causal", None) is False})
        if both:
            raise ConfigError("long_context.attention.implementation",
                              f"{type(model).__name__}'s attention modules {both} attend bidirectionally "
                              f"(is_causal=False), and {impl!r} computes causal attention only",
                              "for a causal LM built from an encoder (RoBERTa, BERT-generation, ...) set "
                              "is_decoder=True in its config; a bidirectional model has no SP path yet: train it at "
                              "sequence_parallel_size 1 with long_context.attention.implementation 'none'")
    if lc.activation_checkpointing.enabled:
        from .memory.checkpointing import decoder_layers, supported_names

        if not decoder_layers(model):
            raise ConfigError("long_context.activation_checkpointing.enabled",
                              f"{type(model).__name__} has no transformers GradientCheckpointingLayer blocks to "
                              "checkpoint", f"use a transformers decoder model (e.g. {supported_names()}) or set "
                              "enabled=false")


def patch_model(model, spec, group=None, grad_scale: float = 1.0) -> PatchHandle:
    """Install the configured attention, memory stack and SP loss on a built HF causal LM.

    ``spec``: a :class:`ds_longctx.spec.LongContextSpec` (``spec.build_spec``; what ``initialize`` builds),
    trusted as built. The older form ``patch_model(model, lc, group=None, grad_scale=1.0)`` (a parsed
    ``LongContextConfig``, the SP group or None for SP 1, the SP loss's gradient scale) builds the spec
    through the same builder first (``spec.spec_for_group``: ``heads_per_chunk`` and the kernel checked there).

    Returns a :class:`PatchHandle` (also stored as ``model._ds_longctx_patch``) whose ``remove()``
    undoes every patch. Issues no collectives, so the planner can run it under a fake process group.
    """
    if getattr(model, "_ds_longctx_patch", None) is not None:
        raise RuntimeError("model is already patched by ds_longctx (initialize it once, or call "
                           "model._ds_longctx_patch.remove() first)")
    if not isinstance(spec, LongContextSpec):
        spec = spec_for_group(spec, getattr(model, "config", None), group, grad_scale)
    elif group is not None:
        raise TypeError("patch_model(model, spec): the SP group travels in the spec (build_spec(..., group=...) or "
                        "spec.with_group(group)), not as an argument")
    lc = spec.config
    _check_model_against(model, lc, spec.sp)
    handle = PatchHandle(model, spec)
    impl = lc.attention.implementation
    sp = spec.sp
    try:
        if impl == "ulysses" and sp > 1:
            from .attention.ulysses import install_ulysses

            handle.attention = install_ulysses(model, spec)
            handle.swapped.append(f"attention=DeepSpeed Ulysses (sp={sp})")
        elif impl == "untied_ulysses":
            from .attention.hf import install_untied

            handle.attention = install_untied(model, spec)
            a = lc.attention
            path = "fused projections" if a.fuse_projections else "attention-function level"
            handle.swapped.append(f"attention=untied Ulysses ({path}, sp={sp}, heads_per_chunk="
                                  f"{spec.heads_per_chunk}, kernel={spec.kernel.name})")
        ac, tm = lc.activation_checkpointing, lc.tiled_mlp
        if ac.enabled or tm.enabled or lc.rms_norm.enabled:
            from .memory import apply_memory_stack

            handle.memory = apply_memory_stack(model, spec)
            model._ds_longctx_memory = handle.memory
            st = handle.memory.stats()
            handle.swapped.append(f"memory: checkpointed_layers={st['checkpointed_layers']} "
                                  f"(offload={ac.offload}), tiled_mlps={st['tiled_mlps']}, "
                                  f"rms_norms={st['rms_norms']}")
        _install_loss_forward(model, spec)
        handle.loss_forward = True

        # packed documents / padding -> per-document attention (ours reads them; "none" is HF's packed path)
        own = spec.owns_attention
        install_document_forward(model, spec.group, own_attention=own)
        handle.document_forward = True
        handle.swapped.append("documents=" + ("per-document attention" if own else "HF's packed path"))
        tl = lc.tiled_loss
        handle.swapped.append(f"loss=SP token mean (grad_scale={spec.grad_scale}, "
                              f"tiled={'shards=' + str(tl.shards) if tl.enabled else 'off'})")
    except BaseException:
        handle.remove()
        raise
    _show_in_repr(model, handle)
    model._ds_longctx_patch = handle
    return handle


def get_patch(model) -> Optional[PatchHandle]:
    """The handle of a patched model (accepts a DeepSpeed engine too)."""
    return getattr(getattr(model, "module", model), "_ds_longctx_patch", None)

# ---------------------------------------------------------------------------------------------
# the model forward wrapper: batch -> Documents keyword (a batch-level concern: it lives here, above
# attention, so attention/documents.py keeps only the Documents structure and the kernel adapters, and
# batch.py the batch's document structure)
# ---------------------------------------------------------------------------------------------


def install_document_forward(model, group, own_attention: bool) -> None:
    """Wrap ``model.forward`` (already ds_longctx's loss forward) so packed batches attend per document.

    ``own_attention``: attention is ours (Ulysses at SP>1, untied), which reads the documents; then
    HF is given an all-ones padding mask so it does not build its packed [b, 1, s, s] mask from the
    restarting position_ids (quadratic memory, and ignored by our attention). With "none" HF's own
    packed mask is the attention.

    * batch with ``doc_cu_seqlens`` (from shard_batch): used as is; a padding mask next to it is an error.
    * SP=1 without it: derived from this (full) batch's position_ids / doc_lens / right padding.
    * SP>1: every rank checks its shard and the group agrees on the verdicts and shapes with one small
      all-gather (``sp_batch.agree``) before any collective; without ``doc_cu_seqlens`` the gathered sample
      must be one contiguous document without padding (a rank cannot see a boundary on a shard edge). A
      full-length eval batch is sharded over the group in turns (``sp_batch.eval_in_turns``).
    """
    from .attention.documents import DOCS_KWARG, Documents, no_mask
    from .batch import (BATCH_KEY, LENS_KEY, custom_mask_error, document_structure, mask_padding_targets,
                        token_input)
    from .comm import sp_world_size
    from .loss import shift_labels_of

    sp = sp_world_size(group)
    inner = model.forward
    no_hf_mask = hands_hf_no_mask(model, own_attention)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, shift_labels=None,
                **kwargs):
        cu = kwargs.pop(BATCH_KEY, None)
        doc_lens = kwargs.pop(LENS_KEY, None)
        if sp > 1:
            # every rank's verdict on its shard, agreed over the group before any collective (sp_batch)
            from . import sp_batch

            full_eval = sp_batch.is_full_eval_batch(self.training, labels, shift_labels, cu)
            fault = sp_batch.local_fault(input_ids, attention_mask, position_ids, labels, shift_labels, cu, doc_lens,
                                         sp, self.training, kwargs)
            sp_batch.agree(group, sp, fault, full_eval, input_ids, position_ids, attention_mask, cu, kwargs)
            if full_eval:
                return sp_batch.eval_in_turns(types.MethodType(forward, self), group, sp, input_ids, attention_mask,
                                              position_ids, labels, kwargs)
        if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2):
            if sp == 1 and not own_attention and cu is None and doc_lens is None:
                # SP=1 on transformers' own attention: HF applies the custom mask itself, exactly
                return inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             labels=labels, shift_labels=shift_labels, **kwargs)
            raise custom_mask_error(attention_mask)  # before any collective (same batch structure on every rank)
        docs = None
        if cu is not None:
            if attention_mask is not None and not bool((attention_mask == 1).all()):
                raise BatchError("batch.attention_mask", f"has padding next to {BATCH_KEY}",
                                 "pass the full batch with its attention_mask through ds_longctx.data.shard_batch (it "
                                 "turns right padding into an ignored document, its targets dropped) and give the "
                                 "model shard_batch's output without another mask")
            attention_mask = None
            docs = Documents(cu)
            if input_ids is not None and (docs.batch != input_ids.shape[0] or docs.seq_len != input_ids.shape[1] * sp):
                raise BatchError(f"batch.{BATCH_KEY}", f"describes {docs.batch} samples of {docs.seq_len} tokens, "
                                  f"the batch has {tuple(input_ids.shape)} per rank at SP={sp}",
                                  "shard with ds_longctx.data.shard_batch")
        elif sp == 1 and input_ids is not None and (position_ids is not None or doc_lens is not None
                                                   or attention_mask is not None):
            cu, position_ids, n_real = document_structure(input_ids, position_ids, attention_mask, doc_lens)
            position_ids = position_ids.to(input_ids.device)
            attention_mask = None
            if labels is not None or shift_labels is not None:
                shift = shift_labels if shift_labels is not None else shift_labels_of(labels)
                shift_labels, labels = mask_padding_targets(shift, n_real), None
            docs = Documents(cu)
        # sp > 1 without doc_cu_seqlens: checked above (sp_batch.agree: one contiguous causal sample)
        if docs is not None and not docs.dense:
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
        elif own_attention and docs is not None and not docs.dense and input_ids is not None:
            attention_mask = torch.ones_like(input_ids)  # no packed mask from the restarting position_ids
        return inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, labels=labels,
                     shift_labels=shift_labels, **kwargs)

    model.forward = types.MethodType(forward, model)


def hands_hf_no_mask(model, own_attention: bool) -> bool:
    """Whether the forward hands transformers a 4-D no-mask (attention.documents.no_mask) instead of letting it
    build its own: only under our attention, and only for the architectures of ds_longctx.models, whose decoders
    pass HF's mask to the attention function alone (others read it elsewhere too: OPT's position embeddings, Doge's
    dynamic mask; those keep transformers' own mask, which our attention checks)."""
    from .models import ARCHITECTURES, text_config

    return own_attention and text_config(model.config).model_type in ARCHITECTURES


__all__ = ["patch_model", "PatchHandle", "get_patch"]
