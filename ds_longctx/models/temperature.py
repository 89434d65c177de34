"""Position-dependent query scaling inside a model's attention forward, given global token indices under SP.

Llama 4's NoPE layers (``attn_temperature_tuning`` and not ``use_rope``) scale each query by
``log1p(floor((i + 1) / floor_scale)) * attn_scale + 1`` where ``i`` is the token's index in the sequence, taken in
transformers' forward as ``torch.arange(hidden_states.shape[1])``: under SP that is the index inside the rank's
shard, so every rank but the first scaled by the wrong positions (issue 35; past 8192 tokens with the released
``floor_scale`` 8192). :func:`install` switches the module's own scaling off (its attribute, restored by the
handle) and :func:`scale_query` applies the same formula, with the same dtype steps, to the query the attention
function receives, with the shard's global token indices (``offset`` = SP rank x shard length: ds_longctx's and
DeepSpeed's loaders cut contiguous equal shards). Elementwise, so bit-equal to one process.
"""
from __future__ import annotations

from typing import List

import torch


def temperature_modules(model) -> List[torch.nn.Module]:
    """Attention modules that scale their queries by the token index (Llama 4's NoPE temperature tuning)."""
    return [m for m in model.modules() if getattr(m, "attn_temperature_tuning", False)
            and not getattr(m, "use_rope", True) and hasattr(m, "floor_scale") and hasattr(m, "attn_scale")]


class TemperatureInstall:
    def __init__(self, modules):
        self.modules = modules

    def remove(self) -> None:
        for m in self.modules:
            m.attn_temperature_tuning = True
            m.__dict__.pop("_ds_longctx_temperature", None)
        self.modules = []


def install(model):
    """Move each temperature-tuned module's query scaling out of its forward (see :func:`scale_query`);
    None when the model has none."""
    mods = temperature_modules(model)
    for m in mods:
        m.__dict__["_ds_longctx_temperature"] = (float(m.floor_scale), float(m.attn_scale))
        m.attn_temperature_tuning = False
    return TemperatureInstall(mods) if mods else None


def scale_query(module, query: torch.Tensor, offset) -> torch.Tensor:
    """``query`` [b, heads, s, d] (the attention function's layout) scaled as the module's forward would with
    token indices ``offset .. offset + s - 1`` (``offset`` an int), or the indices given (a list of s: a zigzag
    shard's) (transformers' formula and dtype steps); unchanged for a module :func:`install` did not touch."""
    t = module.__dict__.get("_ds_longctx_temperature")
    if t is None:
        return query
    floor_scale, attn_scale = t
    s = query.shape[2]
    positions = (torch.arange(s, device=query.device) + offset if isinstance(offset, int) else
                 torch.tensor(offset, device=query.device))
    scales = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
    # in transformers' layout ([b, s, heads, d] memory, handed on transposed): the kernels after it then see the
    # same strides as in one process (their summation order may depend on them)
    q = query.transpose(1, 2)
    return (q * scales.view(1, s, 1, 1)).to(query.dtype).transpose(1, 2)


__all__ = ["install", "scale_query", "temperature_modules", "TemperatureInstall"]
