"""Weight initialisation that does not depend on the parallel layout."""
from __future__ import annotations

import zlib

import torch

from . import text_config


@torch.no_grad()
def deterministic_init(model, seed: int) -> None:
    """Re-draw every weight from a generator keyed by (seed, parameter name), one parameter at a time.

    HF's own init draws from the global RNG in module order, and under ``zero.Init`` that order and
    the RNG stream differ from a plain build, so the same seed gave different weights per layout.
    Keyed draws make random init identical for every SP degree, ZeRO stage and process count.
    Distribution as HF's causal LMs: weights N(0, initializer_range), biases 0, norm weights 1.
    Under ZeRO-3 only one full parameter exists at a time, on rank 0, and is re-partitioned.
    """
    import deepspeed

    std = getattr(text_config(model.config), "initializer_range", 0.02)
    for mod_name, mod in model.named_modules():
        is_norm = "norm" in type(mod).__name__.lower()
        for pname, p in mod.named_parameters(recurse=False):
            # every rank draws the same values; under ZeRO-3 rank 0's copy is the one re-partitioned
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                if is_norm:
                    p.fill_(1.0)
                elif pname == "bias" or p.dim() < 2:
                    p.zero_()
                else:
                    key = f"{mod_name}.{pname}".encode()
                    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key))
                    p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).mul_(std).to(p.dtype))


__all__ = ["deterministic_init"]
