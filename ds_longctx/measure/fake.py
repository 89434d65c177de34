"""Is a tensor the planner's stand-in (shapes and dtypes, no values)? The one definition, for the ops that
still branch on it (memory/tiling.py, memory/norm.py, attention/documents.py) and the live-bytes tracker.

Checked by type name, so importing this costs no ``torch._subclasses`` import and a tensor subclass that
wraps a fake one is not itself taken for fake."""
from __future__ import annotations

import torch


def is_fake(t) -> bool:
    """A ``FakeTensor`` (FakeTensorMode's tensor); a meta tensor is not."""
    return type(t).__name__ == "FakeTensor"


def is_simulated(t) -> bool:
    """A fake or a meta tensor: there are no values to compute on. None and non-tensors: False."""
    return isinstance(t, torch.Tensor) and (is_fake(t) or t.device.type == "meta")


__all__ = ["is_fake", "is_simulated"]
