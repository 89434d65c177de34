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

from ..errors import ConfigError
from ..models import supported_names
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
                          "checkpoint", f"use a transformers decoder model (e.g. {supported_names()}) or set "
                          "enabled=false")
    fn = _checkpoint_fn(ac_cfg.use_reentrant, offloader)
    # the last `keep` layers' inputs stay on the device: backward needs them first
    keep = min(len(layers), getattr(ac_cfg, "keep_on_device", 0)) if offloader is not None else 0
    plain = _checkpoint_fn(ac_cfg.use_reentrant, None)
    for i, layer in enumerate(layers):
        layer._gradient_checkpointing_func = plain if i >= len(layers) - keep else fn
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

        if keep < len(layers):
            # with kept layers this brings back the newest offloaded input k layers early: one more
            # layer input on the device during their backward (the planner counts it)
            hooks.append(layers[-1].register_forward_hook(_prefetch_last))
    return layers, hooks


def uninstall_checkpointing(layers):
    for layer in layers:
        layer.gradient_checkpointing = False
        layer._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)
