"""The planner's simulated step as the training code sees it: one seam, a flag the planner sets around its step on
fake tensors (planner/simulate.py), never a look at the tensors themselves. Inside it tensors hold no values, so what
reads values (a mask's pattern, the largest position id, a router's auxiliary loss, a block's token-locality probe)
skips the reading: the planner's sample is one contiguous causal row on every rank, which those readings exist to
check in a real step. A meta tensor holds no values either, whoever made it."""
from __future__ import annotations

import contextlib

_ACTIVE = [False]  # the seam's one state; set only by simulated_step()


@contextlib.contextmanager
def simulated_step():
    """Inside: the planner's simulated step (undone after, nesting allowed)."""
    before = _ACTIVE[0]
    _ACTIVE[0] = True
    try:
        yield
    finally:
        _ACTIVE[0] = before


def holds_values(t) -> bool:
    """Whether ``t``'s values can be read: False inside the planner's simulated step and for meta tensors."""
    return not _ACTIVE[0] and getattr(getattr(t, "device", None), "type", None) != "meta"


__all__ = ["simulated_step", "holds_values"]
