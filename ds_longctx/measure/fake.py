"""Is a tensor a ``FakeTensor``? For the live-bytes tracker (measure/live_bytes.py) only: a fake tensor's
storage has no address, so the tracker keys it by identity. No op branches on fake tensors: the planner
runs the training code itself (its simulation seams are planner/simulate.py's and memory/tiles.py's).

Checked by type name, so importing this costs no ``torch._subclasses`` import and a tensor subclass that
wraps a fake one is not itself taken for fake."""
from __future__ import annotations


def is_fake(t) -> bool:
    """A ``FakeTensor`` (FakeTensorMode's tensor); a meta tensor is not."""
    return type(t).__name__ == "FakeTensor"


__all__ = ["is_fake"]
