"""``patch_model``: put the configured attention, memory stack and SP loss on a built HF causal LM.

Separate from the DeepSpeed orchestration (``initialize.py``) so that the planner and the benches
patch a model exactly as training does without importing DeepSpeed's engine; DeepSpeed pieces
(its Ulysses attention, ZeRO-3 leaf marking) are imported only by the installs that use them.
Issues no collectives: the planner runs it under a fake process group. The packed-batch forward wrapper it
installs last is sp_batch.install_document_forward (the batch rules live there).
"""
from __future__ import annotations

import contextlib
import types
from typing import List, Optional

import torch
import torch.distributed as dist

from ..dist import comm
from ..attention import registry
from ..attention.hf import install_untied
from ..attention.mixers import install_mixers
from ..attention.ulysses import install_ulysses
from ..data.batch import REAL_KEY
from ..dist.layout import shard_index
from .compat import causal_lm_output, fused_lm_head_output, replace_deepspeed_ulysses_registration
from ..errors import BatchError, ConfigError
from ..loss import causal_lm_loss_sum, shift_labels_of
from ..memory import apply_memory_stack
from ..memory.checkpointing import decoder_layers, text_body
from ..memory.tiling import tiled_causal_lm_loss_sum, tiled_token_fields
from ..models import supported_names, text_config
from ..models.adapters import hf_model_of
from ..models.logits import classify_forward, decoder_of, logit_transform
from ..models.moe import aux_loss_facts, install_router_tap
from ..models.rope import install as install_global_rope
from ..models.temperature import install as install_temperature, scale_query
from .sp_batch import install_document_forward
from .spec import LongContextSpec, ModelFacts


class PatchHandle:
    """Everything :func:`patch_model` installed on one model; ``remove()`` undoes all of it."""

    def __init__(self, model, spec: LongContextSpec):
        self.model = model
        self.spec = spec
        self.lc = spec.config
        self.attention = None   # registry.Installation (Ulysses / function-level untied) or UntiedInstall
        self.mixers = None      # attention.mixers.MixerInstall (hybrid models' Gated DeltaNet layers)
        self.memory = None      # memory.MemoryStackHandle
        self.loss_forward = False
        self.document_forward = False  # the packed-documents wrapper around the loss forward
        self.rope = None        # models.rope.RopeInstall: sequence-dependent RoPE on the group's length (SP > 1)
        self.temperature = None  # _Temperature: query scaling by global token index (Llama 4's NoPE layers)
        self.router_hooks = []  # models.moe.RouterTap's hooks (the router auxiliary loss)
        self.swapped: List[str] = []  # what was swapped in, for print(model)
        # an instance forward set before ours (TRL's add_fused_lm_head sets one): put back by remove()
        self.prior_forward = model.__dict__.get("forward")

    def remove(self) -> None:
        model = self.model
        if self.loss_forward or self.document_forward:
            # both are instance attributes (the document wrapper around the loss forward): popping
            # it lets the class's forward (or the instance forward that was there before) show through again
            model.__dict__.pop("forward", None)
            if self.prior_forward is not None:
                model.__dict__["forward"] = self.prior_forward
            self.loss_forward = self.document_forward = False
        for h in self.router_hooks:
            h.remove()
        self.router_hooks = []
        if self.memory is not None:
            self.memory.remove()
            self.memory = None
            model.__dict__.pop("_ds_longctx_memory", None)
        if self.attention is not None:
            self.attention.remove()
            self.attention = None
        if self.rope is not None:
            self.rope.remove()
            self.rope = None
        if self.temperature is not None:
            self.temperature.remove()
            self.temperature = None
        if self.mixers is not None:
            self.mixers.remove()
            self.mixers = None
        model.__dict__.pop("extra_repr", None)
        model.__dict__.pop("_ds_longctx_patch", None)
        self.swapped = []


class _Temperature:
    def __init__(self, install, undo):
        self.install, self.undo = install, undo

    def remove(self) -> None:
        self.undo()
        self.install.remove()


def _install_temperature(model, attention, spec: LongContextSpec) -> Optional[_Temperature]:
    """Query scaling by token index inside attention modules (Llama 4's NoPE temperature, models/temperature.py)
    moved into the SP attention function, where the shard's global indices are known."""
    inst = install_temperature(model)
    if inst is None:
        return None
    routed = getattr(attention, "function_level", attention)
    if not isinstance(routed, registry.Installation):
        inst.remove()
        raise ConfigError("long_context.attention.fuse_projections", "the model scales queries by token index "
                          "(attention temperature tuning), which the fused untied path does not apply",
                          "set long_context.attention.fuse_projections to false")
    group = spec.group

    def wrapper(fn):
        def scaled(module, query, *args, **kwargs):
            s = query.shape[2]
            rank = comm.sp_rank(group)
            tokens = rank * s if spec.ring == 1 else shard_index(s * spec.sp, spec.sp, spec.ring, rank)
            return fn(module, scale_query(module, query, tokens), *args, **kwargs)
        return scaled

    return _Temperature(inst, registry.wrap(routed, inst.modules, wrapper))


# ``model(..., fused_lm_head=True, logit_temperature=T)``: TRL's fused head's per-token fields under temperature T;
# without the keyword, the temperature TRL gave ``add_fused_lm_head`` (hf/rl.py records it on the model under
# FUSED_SETTINGS: ``{"temperature": T}``), else 1
TEMPERATURE_KWARG = "logit_temperature"
FUSED_SETTINGS = "_ds_longctx_fused_head"
# ``model(**shard, ds_longctx_hidden=True)``: the decoder's last hidden state of this shard (objectives/distill.py
# projects the student's and the teacher's through their lm_heads itself)
HIDDEN_KWARG = "ds_longctx_hidden"


def with_temperature(logit_fn, temperature: float):
    """The model's logit transform, then TRL's temperature: ``logits * (1 / T)`` in fp32
    (``trl.kernels.ChunkedLogProbFunction``'s order and arithmetic); ``logit_fn`` itself at T = 1."""
    t = float(temperature)
    if t == 1.0:
        return logit_fn
    if not t > 0:
        raise ConfigError("temperature", f"is {temperature!r}; the log-probabilities of logits / T need T > 0",
                          "give a positive temperature (TRL's GRPOConfig.temperature)")
    inv = 1.0 / t

    def fn(logits):
        return (logit_fn(logits) if logit_fn is not None else logits).float() * inv

    return fn


def _install_loss_forward(model, spec: LongContextSpec) -> None:
    """Make ``model(**batch).loss`` the SP-global token-mean loss computed from hidden states."""
    logit_fn = logit_transform(model)  # the model's own lm_head -> loss transform (ConfigError if unknown)
    decoder_of(model)  # found now (ConfigError at patch time, not at the first forward)
    sp_loss = comm.SPLoss(group=spec.group, grad_scale=spec.grad_scale, sp=spec.sp)
    sp = spec.sp
    tiled = spec.config.tiled_loss
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
        hidden_only = bool(kwargs.pop(HIDDEN_KWARG, False))
        temperature = kwargs.pop(TEMPERATURE_KWARG, None)
        if temperature is None:
            temperature = (getattr(self, FUSED_SETTINGS, None) or {}).get("temperature", 1.0)
        elif not fused:
            raise ConfigError(TEMPERATURE_KWARG, "is given without fused_lm_head=True; the loss is the model's own "
                              "cross entropy (temperature 1)", "ask for the per-token fields: fused_lm_head=True")
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
        if hidden_only:
            return out
        logits = None
        if fused:  # TRL's per-token fields, tile by tile (as TRL's own fused head: no [b, s, vocab] logits)
            fields = tiled_token_fields(hidden, self.lm_head, shift_labels, spec.loss_shards if tiled.enabled else None,
                                        with_temperature(logit_fn, temperature), shared=tied)
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


def _install_router_aux_loss(model, spec: LongContextSpec, handle: PatchHandle) -> bool:
    """The model's router auxiliary (load-balancing) loss, when its forward adds one (models.moe.aux_loss_facts),
    computed as one process computes it: HF's per-expert sums (top-k assignment counts, router-probability sums,
    rows) taken per shard and per tile by a models.moe.RouterTap and summed over the SP group, so the aux loss is the
    mean over every token of the global sequence and its gradient each rank's share of it. Outermost wrapper: it sees
    the caller's attention_mask (HF weights the sums by it). False when the model adds no auxiliary loss."""
    decoder = decoder_of(model)
    try:
        facts = aux_loss_facts(model, classify_forward(type(model))[1], decoder)
    except ValueError as e:
        raise ConfigError("model.config.output_router_logits", f"{type(model).__name__} adds a router auxiliary loss "
                          f"when output_router_logits is true, but {e}", "train this model without ds_longctx, or "
                          "set output_router_logits=False only if you mean to train without the load-balancing loss "
                          "(a different objective)") from None
    if facts is None:
        return False
    tap, handle.router_hooks = install_router_tap(decoder, facts)
    memory = getattr(model, "_ds_longctx_memory", None)
    if memory is not None and memory.tiling is not None:
        memory.tiling.tap = tap
    tc = text_config(model.config)
    group, sp, grad_scale = spec.group, spec.sp, spec.grad_scale
    inner = model.forward

    def forward(self, *args, **kwargs):
        want = kwargs.pop("output_router_logits", None)
        want = getattr(tc, "output_router_logits", False) if want is None else want
        if args or not want or (kwargs.get("labels") is None and kwargs.get("shift_labels") is None):
            return inner(*args, **kwargs)
        if kwargs.get("fused_lm_head"):
            raise ConfigError("model.config.output_router_logits", "TRL's fused LM head loss with the router "
                              "auxiliary loss is not computed by ds_longctx", "set output_router_logits=False for "
                              "TRL's fused head, or train without use_liger/fused heads")
        mask = kwargs.get("attention_mask")
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2):
            raise BatchError("batch.attention_mask", "is not a 2-D padding mask, and the router auxiliary loss weights "
                              "its sums by one", "feed 2-D padding masks (or none) with output_router_logits")
        real = kwargs.get(REAL_KEY)
        if mask is None and real is not None:  # shard_batch dropped the caller's padding mask: this shard's part of it
            rows = next(t for t in (kwargs.get("input_ids"), kwargs.get("shift_labels"), kwargs.get("labels"))
                        if t is not None)
            rank = dist.get_rank(group) if group is not None and sp > 1 else 0
            tokens = torch.tensor(shard_index(rows.shape[1] * sp, sp, spec.ring, rank))  # this shard's token indices
            mask = (tokens < real.reshape(-1, 1).cpu()).long()
        tap.reset()
        tap.weights = None if mask is None else mask.reshape(-1)
        tap.active = True
        try:  # HF's own recorder off: it would keep every router call's logits (tiles and probe included)
            out = inner(**kwargs, output_router_logits=False)
        finally:  # the weights stay until the next loss forward: the backward's recomputes (a tile's, a
            # checkpointed layer's) build the same weighted sums as this forward
            tap.active = False
        if tap.tile_probs is not None:  # router calls without autograd outside a tiled Function (eval)
            tap.probs.append(tap.tile_probs)
            tap.tile_probs = None
        aux = _sp_aux_loss(tap, out.loss.device, group, sp, grad_scale)
        out.loss = out.loss + facts.coef * aux
        out.aux_loss = aux  # as HF's output carries it (TRL logs it); its value is the whole sequence's
        return out

    model.forward = types.MethodType(forward, model)
    return True


def _sp_aux_loss(tap, device, group, sp: int, grad_scale: float):
    """HF's load_balancing_loss_func from this shard's sums: value = E * sum((counts / rows) * (probs / rows)) over the
    SP group's sums (one process); gradient: this shard's probability sums' share, times ``grad_scale`` (as SPLoss)."""
    e = tap.facts.num_experts
    probs = sum(tap.probs) if tap.probs else torch.zeros(e, dtype=torch.float32, device=device)
    probs = probs.to(device)
    stats = torch.cat([tap.counts.to(device), probs.detach(), tap.rows.to(device).reshape(1)])
    if group is not None and sp > 1:
        dist.all_reduce(stats, group=group)
    counts, total, rows = stats[:e], stats[e:2 * e], stats[2 * e]
    tap.reset()
    rows = torch.clamp(rows, min=1.0)
    tokens_per_expert = counts / rows
    value = torch.sum(tokens_per_expert * (total / rows).unsqueeze(0)) * e
    grad_part = torch.sum(tokens_per_expert * (probs / rows).unsqueeze(0)) * e * grad_scale
    return grad_part + (value - grad_part).detach()


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
    if sp > 1:
        # the loss forward hands the shard's global position_ids to the decoder; a decoder that takes none (BART-style
        # decoders as causal LMs, MusicGen) numbers every shard from 0 itself (tools/position_audit.py)
        import inspect

        decoder = decoder_of(model)
        params = inspect.signature(decoder.forward).parameters
        if "position_ids" not in params:
            raise ConfigError("model", f"{type(decoder).__name__}.forward takes no position_ids: under sequence "
                              "parallelism each rank would number its shard's positions from 0", "train this model at "
                              "sequence_parallel_size 1 (long_context.attention.implementation 'none')")
    impl = lc.attention.implementation
    if impl == "untied_ulysses" or (impl == "ulysses" and sp > 1):
        body = text_body(model)  # a multimodal model's vision tower is not ours
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
        if not decoder_layers(model):
            raise ConfigError("long_context.activation_checkpointing.enabled",
                              f"{type(model).__name__} has no transformers GradientCheckpointingLayer blocks to "
                              "checkpoint", f"use a transformers decoder model (e.g. {supported_names()}) or set "
                              "enabled=false")


def patch_model(model, spec: LongContextSpec) -> PatchHandle:
    """Install the configured attention, memory stack and SP loss on a built HF causal LM.

    ``spec``: a :class:`ds_longctx.patching.spec.LongContextSpec` (``spec.build_spec(lc, model.config, layout, group)``;
    what ``initialize`` builds), trusted as built: it must have been built for this model's config.

    Returns a :class:`PatchHandle` (also stored as ``model._ds_longctx_patch``) whose ``remove()``
    undoes every patch. Issues no collectives, so the planner can run it under a fake process group.
    """
    # a peft.PeftModel: patch the Hugging Face model inside (its forward is what the wrapper calls); the
    # handle lives there and is read through the wrapper (models/adapters.py)
    model = hf_model_of(model, getattr(getattr(spec, "layout", None), "sp", 1))
    if getattr(model, "_ds_longctx_patch", None) is not None:
        raise RuntimeError("model is already patched by ds_longctx (initialize it once, or call "
                           "model._ds_longctx_patch.remove() first)")
    if not isinstance(spec, LongContextSpec):
        raise TypeError(f"patch_model(model, spec): spec must be a ds_longctx.patching.spec.LongContextSpec, got "
                        f"{type(spec).__name__} (build one with ds_longctx.patching.spec.build_spec(lc, model.config, layout, "
                        "group))")
    config = getattr(model, "config", None)
    if spec.model is not None and config is not None and \
            ModelFacts.of(config, attention=spec.model.heads is not None) != spec.model:
        raise ConfigError("spec", f"was built for another model ({spec.model}) than this one "
                          f"({ModelFacts.of(config, attention=spec.model.heads is not None)})",
                          "build the spec from this model's config: build_spec(lc, model.config, ...)")
    lc = spec.config
    _check_model_against(model, lc, spec.sp)
    handle = PatchHandle(model, spec)
    impl = lc.attention.implementation
    sp = spec.sp
    try:
        if impl == "ulysses" and sp > 1:
            handle.attention = install_ulysses(model, spec)
            handle.swapped.append(f"attention=DeepSpeed Ulysses (sp={sp})")
        elif impl == "untied_ulysses":
            handle.attention = install_untied(model, spec)
            path = "fused projections" if handle.attention.fused else "attention-function level"
            if lc.attention.fuse_projections == "auto":
                path += " (fuse_projections 'auto'" + (f": {handle.attention.fused_off_because})"
                                                       if handle.attention.fused_off_because else ")")
            handle.swapped.append(f"attention=untied Ulysses ({path}, sp={sp}, heads_per_chunk="
                                  f"{spec.heads_per_chunk}, kernel={spec.kernel.name})")
        if sp > 1:
            handle.temperature = _install_temperature(model, handle.attention, spec)
            handle.rope = install_global_rope(model)  # dynamic / LongRoPE scale by the group's sequence, not the shard's
            if handle.rope is not None:
                handle.swapped.append(f"rope=scaled by the SP group's sequence length ({len(handle.rope.modules)} "
                                      "rotary embeddings)")
        # hybrid models' recurrent / conv layers: split by heads under our SP attention; at SP 1 run whole, but per
        # document for packed batches (transformers' torch reference ignores cu_seqlens: documents would leak)
        if spec.owns_attention or sp == 1:
            handle.mixers = install_mixers(model, spec)
            if handle.mixers is not None:
                handle.swapped.append(f"mixers={handle.mixers.label}")
        ac, tm = lc.activation_checkpointing, lc.tiled_mlp
        if ac.enabled or tm.enabled or lc.rms_norm.enabled:
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
        install_document_forward(model, spec)
        handle.document_forward = True
        if _install_router_aux_loss(model, spec, handle):
            handle.swapped.append("router auxiliary loss=SP-global load-balancing sums")
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
    model = getattr(model, "module", model)
    return getattr(model, "_ds_longctx_patch", None) or getattr(hf_model_of(model), "_ds_longctx_patch", None)


@contextlib.contextmanager
def suspended(model):
    """The model as transformers built it for the duration (generation: whole sequences on one rank, no SP
    attention, no memory stack, no loss forward), patched again after with the same spec. Every install is undone by
    its handle and patch_model issues no collectives, so this is local to the rank. A model ds_longctx did not patch
    is left as it is. Under ZeRO-3 enter it where DeepSpeed's hooks are off (TRL's ``unwrap_model_for_generation``):
    the untied attention marks its modules as ZeRO-3 leaves, unmarked and marked again here."""
    handle = get_patch(model)
    if handle is None:
        yield model
        return
    target, spec = handle.model, handle.spec
    handle.remove()
    # releasing our attention puts back a DeepSpeed Ulysses wrapper that register_with_transformers (Accelerate) had
    # written in transformers' table: keep it out while the model runs unpatched (it would all-to-all whole sequences)
    replace_deepspeed_ulysses_registration()
    try:
        yield model
    finally:
        patch_model(target, spec)


__all__ = ["patch_model", "PatchHandle", "get_patch", "suspended"]
