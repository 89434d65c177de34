"""Checkpoint every decoder layer, optionally offloading each layer's saved input to host memory.

HF's own ``activation_checkpointing_enable(offload=True)`` wraps checkpoint in ``save_on_cpu``: it
copies every saved tensor (the shared RoPE cos/sin again for every layer) on the compute stream and
never prefetches, and ArcticTraining's patch only reaches reentrant checkpointing. So we set each
layer's ``_gradient_checkpointing_func`` ourselves (transformers checkpoints ``forward`` with the
hidden states as the only positional argument) and wrap the checkpoint call in our offloader's hooks.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Callable, ContextManager, List, Optional

import torch
from torch.utils.checkpoint import checkpoint

from ..models import layer_role, supported_names
from .keep import KeptAttention
from .offload import CheckpointInputOffloader


def decoder_layers(model) -> List[torch.nn.Module]:
    """The repeated decoder blocks HF marks as checkpointable, in forward order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def text_body(model) -> torch.nn.Module:
    """The module that runs the sequence's decoder layers: ``get_decoder()`` (a multimodal model's language model:
    its vision tower runs on image features, not on the long sequence), else the model."""
    get_decoder = getattr(model, "get_decoder", None)
    body = get_decoder() if callable(get_decoder) else None
    return body if isinstance(body, torch.nn.Module) else model


# The observation seam: context-manager factories entered around every run of a checkpointed layer's
# function (its forward and its recompute in backward, which runs without the layer's module hooks).
# Owned here and changed only through around_checkpointed_runs (the planner's accountant uses it to charge
# a recompute to its layer), never by reassigning a layer's _gradient_checkpointing_func.
_AROUND: List[Callable[[], ContextManager]] = []


@contextlib.contextmanager
def around_checkpointed_runs(factory: Callable[[], ContextManager]):
    """Inside the block, every checkpointed layer function run (forward and its recompute) is wrapped in
    ``factory()``; the wrapping is fixed at the layer's forward, so its recompute gets the same."""
    _AROUND.append(factory)
    try:
        yield
    finally:
        _AROUND.remove(factory)


def _observed(function):
    if not _AROUND:
        return function
    factories = tuple(_AROUND)

    def run(*args, **kwargs):
        with contextlib.ExitStack() as stack:  # exits on checkpoint's early-stop exception too
            for f in factories:
                stack.enter_context(f())
            return function(*args, **kwargs)

    return run


def _checkpoint_fn(use_reentrant: bool, offloader: Optional[CheckpointInputOffloader], keep_attention: bool = False):
    def run(function, *args):
        function = _observed(function)
        offloaded = offloader is not None and args and isinstance(args[0], torch.Tensor)
        if keep_attention:
            # one frame per layer call: the first forward keeps the attention output and LSE where the layer
            # input goes (memory/keep.py), the recompute takes them instead of re-running attention
            function = KeptAttention(offloader if offloaded else None, torch.is_grad_enabled()).wrap(function)
        if not offloaded:
            return checkpoint(function, *args, use_reentrant=use_reentrant)
        with offloader.capture(args[0]):
            return checkpoint(function, *args, use_reentrant=use_reentrant)

    return run


def install_checkpointing(model, use_reentrant: bool = False, offloader: Optional[CheckpointInputOffloader] = None,
                          keep_on_device: int = 0, kept_attention_layers: int = 0):
    """Checkpoint every decoder layer of ``model``; returns (layers, hook handles). No collectives.

    ``use_reentrant``: torch.utils.checkpoint's; ``offloader``: where the layers' inputs go (None: they stay);
    with it, the last ``keep_on_device`` layers keep their input on the device (backward needs them first); the
    first ``kept_attention_layers`` keep their attention output and LSE (memory/keep.py). The counts are the spec's
    (``LongContextSpec.keep_on_device``, ``kept_attention_layers``), resolved and checked there."""
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"activation checkpointing: {type(model).__name__} has no transformers "
                         f"GradientCheckpointingLayer blocks to checkpoint; use a transformers decoder model (e.g. "
                         f"{supported_names()}) or turn activation checkpointing off")
    keep = min(keep_on_device, len(layers)) if offloader is not None else 0
    fns = {(off, k): _checkpoint_fn(use_reentrant, offloader if off else None, k)
           for off in (True, False) for k in (True, False)}
    for i, layer in enumerate(layers):
        _PREVIOUS.setdefault(layer, (layer.__dict__.get("gradient_checkpointing", _ABSENT),
                                     layer.__dict__.get("_gradient_checkpointing_func", _ABSENT)))
        layer._gradient_checkpointing_func = fns[i < len(layers) - keep, i < kept_attention_layers]
        layer.gradient_checkpointing = True
    hooks = []
    if (use_reentrant and hasattr(model, "enable_input_require_grads")
            and not getattr(model, "_require_grads_hooks", None)):
        # reentrant checkpoint only backpropagates into a block whose tensor input requires grad;
        # with frozen embeddings (PEFT) it would silently drop every parameter gradient. Undone with
        # the other hooks (a model that had it on before keeps it).
        model.enable_input_require_grads()
        hooks.append(_InputRequireGradsUndo(model))
    if offloader is not None:
        # the last layer's input is needed first in backward: start its H2D as soon as forward
        # leaves the decoder stack, so it overlaps the final norm, lm_head and loss
        def _prefetch_last(module, args, output):
            if offloader.prefetch:
                offloader.prefetch_newest()  # returns nothing: a forward hook's return replaces the output

        if keep < len(layers):
            # with kept layers this brings back the newest offloaded input k layers early: one more
            # layer input on the device during their backward (the planner counts it)
            hooks.append(layers[-1].register_forward_hook(_prefetch_last))
            # kept layers have no offloaded input, so only the offloaded ones carry the trigger
            hooks += _prefetch_after_attention(layers[:len(layers) - keep], offloader)
    return layers, hooks


def _attention_child(layer):
    found = [m for name, m in layer.named_children() if layer_role(name) == "attention"]
    return found[0] if len(found) == 1 else None


def _prefetch_after_attention(layers, offloader: CheckpointInputOffloader):
    """Bring the previous layer's input back once this layer's attention backward is done, not at this
    layer's unpack: the attention backward is the layer's peak and the prefetched input (one [s, hidden])
    would sit through it. The trigger is a hook on the gradient of the attention's input, registered in the
    layer's forward (non-reentrant checkpoint differentiates the forward's graph; the recompute's graph only
    supplies saved tensors, so a hook registered there never fires). Layers without one recognisable
    attention child keep the prefetch at unpack."""
    attns = [_attention_child(layer) for layer in layers]
    if not all(a is not None for a in attns):
        return []

    def pre(module, args, kwargs):
        x = args[0] if args else kwargs.get("hidden_states")
        if isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled() and offloader.prefetch:
            x.register_hook(_Trigger(offloader))

    offloader.defer_prefetch = True
    handles = [a.register_forward_pre_hook(pre, with_kwargs=True) for a in attns]
    handles.append(_Undo(offloader))
    return handles


class _Trigger:
    def __init__(self, offloader):
        self.offloader = offloader

    def __call__(self, grad):
        self.offloader.prefetch_pending()  # returns None: the gradient passes unchanged


class _Undo:
    """A hook handle that turns the deferral off again when the hooks are removed."""

    def __init__(self, offloader):
        self.offloader = offloader

    def remove(self):
        self.offloader.defer_prefetch = False


class _InputRequireGradsUndo:
    """A hook handle that turns off the input-gradient hooks install_checkpointing turned on."""

    def __init__(self, model):
        self.model = model

    def remove(self):
        self.model.disable_input_require_grads()


# each checkpointed layer's own gradient_checkpointing / _gradient_checkpointing_func before the first
# install (_ABSENT: the layer had none of its own), put back by uninstall_checkpointing
_ABSENT = object()
_PREVIOUS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def uninstall_checkpointing(layers):
    """Give each layer back the checkpointing flag and function it had before install_checkpointing."""
    for layer in layers:
        flag, func = _PREVIOUS.pop(layer, (_ABSENT, _ABSENT))
        for name, value in (("gradient_checkpointing", flag), ("_gradient_checkpointing_func", func)):
            if value is _ABSENT:
                layer.__dict__.pop(name, None)  # the class attribute (gradient_checkpointing = False) shows again
            else:
                setattr(layer, name, value)
