"""PEFT adapters (LoRA and the rest) under ds_longctx: what the patch sees through, and what the fused path applies.

Two places read a model in a way an adapter wrapper would hide from them:

* the patch itself (loss forward, logit transform, attention install) needs the Hugging Face causal LM, not the
  ``PeftModel`` around it: :func:`hf_model_of` unwraps it (the wrapper's forward still runs: it calls the HF
  model's forward, which is the one ds_longctx patches). Prompt-learning methods (prefix tuning, prompt tuning,
  p-tuning, ...) add virtual tokens to the sequence, which SP shards; they are refused under SP.
* the fused untied attention (attention/hf.py) runs q/k/v/o as GEMMs against the projections' weights inside its
  stage loop, so it never calls the projection modules. A PEFT ``lora.Linear`` read as ``module.weight`` gives its
  frozen base weight: the adapters would never run (issue 35). :func:`effective_linear` gives the weight and bias
  the module's forward applies, ``W + sum(scaling * B @ A)`` over the active adapters, as a differentiable
  expression of the base weight and the adapter weights, so the staged GEMMs compute the adapted projection and
  autograd takes dW to A and B. Exact up to summation order (``x @ (W + sBA)^T`` vs ``x @ W^T + s (x A^T) B^T``).
  What that cannot reproduce (LoRA dropout in training, DoRA and other LoRA variants, other PEFT layer types) is
  found at install by :func:`fused_adapter_problem` and refused there, naming the module and the fix.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..errors import ConfigError


def is_peft_model(model) -> bool:
    return any(c.__module__.startswith("peft.") and c.__name__ == "PeftModel" for c in type(model).__mro__)


def hf_model_of(model, sp: int = 1):
    """The Hugging Face model inside a ``peft.PeftModel`` (or ``model`` itself). Refuses a prompt-learning
    adapter under SP > 1: its virtual tokens are not part of the sharded sequence."""
    if not is_peft_model(model):
        return model
    cfg = getattr(model, "active_peft_config", None)
    if sp > 1 and getattr(cfg, "is_prompt_learning", False):
        raise ConfigError("model", f"is a PEFT {cfg.peft_type} model: prompt-learning adapters add "
                          f"{getattr(cfg, 'num_virtual_tokens', '?')} virtual tokens to every sequence, which "
                          "sequence parallelism shards", "use a weight adapter (LoRA and its kin) under SP, or "
                          "train the prompt adapter at sequence_parallel_size 1")
    return model.get_base_model()


def _is_plain_linear(module) -> bool:
    return isinstance(module, torch.nn.Linear) and type(module).forward is torch.nn.Linear.forward


def _is_peft_layer(module) -> bool:
    return type(module).__module__.startswith("peft.")


def _is_lora_linear(module) -> bool:
    return (_is_peft_layer(module) and type(module).__name__ == "Linear" and hasattr(module, "lora_A")
            and hasattr(module, "get_delta_weight") and hasattr(module, "base_layer"))


def _active_lora(module):
    """The adapters a lora.Linear's forward adds now: none when disabled or merged into the base weight."""
    if getattr(module, "disable_adapters", False) or getattr(module, "merged", False):
        return []
    return [a for a in module.active_adapters if a in module.lora_A.keys()]


def fused_adapter_problem(module, name: str, zero_stage: int = 0) -> Optional[str]:
    """Why the fused path cannot apply ``module``'s forward as ``x @ W^T + b`` (None: it can)."""
    if _is_plain_linear(module):
        return None
    if _is_lora_linear(module):
        if zero_stage == 3 and _active_lora(module):
            # DeepSpeed reduces a ZeRO-3 leaf module's gradients (the fused attention is one) from a full backward
            # hook that fires when its input gradient is formed: before autograd has taken dW to the adapters, so
            # their gradients would be zero-filled, reduced, then met by the real ones
            return f"{name} carries LoRA adapters, which the fused path cannot train under ZeRO-3 (a leaf module)"
        if getattr(module, "disable_adapters", False) and getattr(module, "merged", False):
            return f"{name} is a LoRA layer with adapters merged and disabled (its forward unmerges them)"
        if not _is_plain_linear(module.base_layer):
            return f"{name} is a LoRA layer around a {type(module.base_layer).__name__}, not a plain Linear"
        for a in _active_lora(module):
            if a in getattr(module, "lora_variant", {}):
                return (f"{name}'s adapter {a!r} is a LoRA variant ({type(module.lora_variant[a]).__name__}, e.g. "
                        "DoRA), which is not a weight delta")
            drop = module.lora_dropout[a]
            if not isinstance(drop, torch.nn.Identity) and getattr(drop, "p", 0.0) > 0:
                return (f"{name}'s adapter {a!r} has lora_dropout {drop.p}: dropout on the adapter's input "
                        "is not a weight delta")
        return None
    if _is_peft_layer(module):
        return (f"{name} is a PEFT {type(module).__module__.split('.')[2]} {type(module).__name__} layer, not a "
                "weight delta the fused GEMMs can apply")
    return f"{name} is a {type(module).__name__}, not a plain Linear"


class _LoraDelta(torch.autograd.Function):
    """``scaling * B @ A`` (transposed for fan_in_fan_out), peft's ``get_delta_weight``, whose backward reads copies
    of A and B taken in forward (r x hidden: nothing next to the activations), not parameters a ZeRO stage may
    have released by then."""

    @staticmethod
    def forward(ctx, a, b, scaling: float, fan_in_fan_out: bool):
        a, b = a.detach(), b.detach()
        ctx.save_for_backward(a.clone(), b.clone())
        ctx.scaling, ctx.fan_in_fan_out = scaling, fan_in_fan_out
        delta = (b @ a) * scaling
        return delta.T if fan_in_fan_out else delta

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        if ctx.fan_in_fan_out:
            g = g.T
        g = g * ctx.scaling
        return b.T @ g if ctx.needs_input_grad[0] else None, g @ a.T if ctx.needs_input_grad[1] else None, None, None


def effective_linear(module) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(weight, bias) of what ``module``'s forward applies: a plain Linear's own, or a LoRA layer's base weight
    plus each active adapter's delta (as peft's ``get_delta_weight``: ``scaling * B @ A``, fan_in_fan_out honoured)
    and lora_B's bias (``lora_bias``) times its scaling. Checked first by :func:`fused_adapter_problem`."""
    if _is_plain_linear(module):
        return module.weight, module.bias
    base = module.base_layer
    weight, bias = base.weight, base.bias
    for a in _active_lora(module):
        delta = _LoraDelta.apply(module.lora_A[a].weight, module.lora_B[a].weight, float(module.scaling[a]),
                                 bool(module.fan_in_fan_out))
        weight = weight + delta.to(weight.dtype)
        b = module.lora_B[a].bias
        if b is not None:
            b = (b * module.scaling[a]).to(weight.dtype)
            bias = b if bias is None else bias + b
    return weight, bias


def is_linear_forward(module) -> bool:
    """``module``'s forward is a per-token linear map: an nn.Linear, or a PEFT lora.Linear around a plain Linear whose
    active adapters are plain weight deltas (no dropout, no variant: :func:`fused_adapter_problem` finds none).
    What the tiled MLP's form check (models._common.pointwise_mlp_form) asks of an MLP's projections."""
    if isinstance(module, torch.nn.Linear):
        return True
    return _is_lora_linear(module) and fused_adapter_problem(module, "") is None


def read_weight_problem(module, name: str) -> Optional[str]:
    """Why ds_longctx cannot read ``module.weight`` / ``module.bias`` as what its forward applies (None: it can).
    The SP mixers (attention/mixers.py) run a hybrid layer's depthwise conv as ``causal_conv1d_fn`` on this rank's
    channels of the conv's weight; a PEFT layer around the conv (LoRA on a Conv1d, peft allows it when the rank is a
    multiple of the channels) answers ``.weight`` with its frozen base weight, so its adapters would never run.
    peft's ``ModulesToSaveWrapper`` answers with the active trainable copy: readable."""
    if not _is_peft_layer(module) or type(module).__name__ == "ModulesToSaveWrapper":
        return None
    if _is_lora_linear(module) or hasattr(module, "lora_A"):
        if not _active_lora(module):
            return None
    return (f"{name} is a PEFT {type(module).__module__.split('.')[2]} {type(module).__name__} layer: ds_longctx's "
            "SP path reads its weight directly (this rank's channels), which would drop the adapters")


__all__ = ["hf_model_of", "is_peft_model", "fused_adapter_problem", "effective_linear", "is_linear_forward",
           "read_weight_problem"]
