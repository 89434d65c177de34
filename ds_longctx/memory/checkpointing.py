"""Checkpoint every decoder layer, optionally offloading each layer's saved input to host memory.

HF's own ``activation_checkpointing_enable(offload=True)`` wraps checkpoint in ``save_on_cpu``: it
copies every saved tensor (the shared RoPE cos/sin again for every layer) on the compute stream and
never prefetches, and ArcticTraining's patch only reaches reentrant checkpointing. So we set each
layer's ``_gradient_checkpointing_func`` ourselves (transformers checkpoints ``forward`` with the
hidden states as the only positional argument) and wrap the checkpoint call in our offloader's hooks.
"""
from __future__ import annotations

import functools
from typing import List, Optional

import torch
from torch.utils.checkpoint import checkpoint

from ..config import ConfigError
from .offload import CheckpointInputOffloader


def decoder_layers(model) -> List[torch.nn.Module]:
    """The repeated decoder blocks HF marks as checkpointable, in forward order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def _checkpoint_fn(use_reentrant: bool, offloader: Optional[CheckpointInputOffloader]):
    def run(function, *args):
        if offloader is None or not args or not isinstance(args[0], torch.Tensor):
            return checkpoint(function, *args, use_reentrant=use_reentrant)
        with offloader.capture(args[0]):
            return checkpoint(function, *args, use_reentrant=use_reentrant)

    return run


def install_checkpointing(model, ac_cfg, offloader: Optional[CheckpointInputOffloader] = None):
    """Checkpoint every decoder layer of ``model``; returns (layers, hook handles). No collectives."""
    layers = decoder_layers(model)
    if not layers:
        raise ConfigError("long_context.activation_checkpointing.enabled",
                          f"{type(model).__name__} has no transformers GradientCheckpointingLayer blocks to "
                          "checkpoint", "use a transformers decoder model (Llama, Mistral, Qwen2, Qwen3) or set "
                          "enabled=false")
    fn = _checkpoint_fn(ac_cfg.use_reentrant, offloader)
    for layer in layers:
        layer._gradient_checkpointing_func = fn
        layer.gradient_checkpointing = True
    if ac_cfg.use_reentrant and hasattr(model, "enable_input_require_grads"):
        # reentrant checkpoint only backpropagates into a block whose tensor input requires grad;
        # with frozen embeddings (PEFT) it would silently drop every parameter gradient
        model.enable_input_require_grads()
    hooks = []
    if offloader is not None:
        # the last layer's input is needed first in backward: start its H2D as soon as forward
        # leaves the decoder stack, so it overlaps the final norm, lm_head and loss
        def _prefetch_last(module, args, output):
            if offloader.prefetch:
                offloader.prefetch_newest()  # returns nothing: a forward hook's return replaces the output

        hooks.append(layers[-1].register_forward_hook(_prefetch_last))
        hooks += _prefetch_after_attention(layers, offloader)
    return layers, hooks


def _attention_child(layer):
    found = [m for name, m in layer.named_children()
             if "norm" not in name.lower() and (name.lower().endswith("attn") or name.lower().endswith("attention"))]
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


def uninstall_checkpointing(layers):
    for layer in layers:
        layer.gradient_checkpointing = False
        layer._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)
