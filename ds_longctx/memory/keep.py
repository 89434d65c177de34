"""Keep each checkpointed layer's attention output and LSE from the first forward
(``long_context.activation_checkpointing.keep_attention_output``).

A checkpointed layer runs its forward twice: once in forward, once in backward to rebuild what its
backward needs. The untied attention's staged backward needs q, k, v (re-projected per stage anyway),
the attention output and the LSE, so the recomputed attention forward (its S^2 work) only rebuilds
two tensors it could have kept. With the switch on, the first forward hands ``out`` and ``lse`` to a
:class:`KeptAttention` frame, one per checkpointed layer call; they go where the layer's input goes
(the device for kept / not-offloaded layers, else the layer input's offload target, prefetched with
it); the recompute takes them back and skips the projections and the attention forward.

The frame is bound to one checkpoint call (the checkpointed function closes over it, so it lives as
long as that layer's checkpoint graph) and is made active around each run of the function; the
attention Functions find it with :func:`active`. No frame is active outside a checkpointed layer, so
the attention runs unchanged there.
"""
from __future__ import annotations

from typing import List, Optional

import torch

_STACK: List["KeptAttention"] = []  # not thread-local: the recompute runs on autograd's device thread


def active() -> Optional["KeptAttention"]:
    """The frame of the checkpointed layer whose function is running now, if it keeps attention."""
    return _STACK[-1] if _STACK else None


class KeptAttention:
    """What one checkpointed layer call keeps: per attention call of the layer, (out, lse) on the
    device or as offloader handles (``offloader`` None: on the device)."""

    __slots__ = ("offloader", "items", "runs", "cursor", "enabled", "__weakref__")

    def __init__(self, offloader=None, enabled: bool = True):
        self.offloader = offloader
        self.items: list = []
        self.runs = 0
        self.cursor = 0
        self.enabled = enabled  # False: the checkpoint ran without grad (nothing will be recomputed)

    def wrap(self, function):
        def run(*args, **kwargs):
            self.cursor = 0
            self.runs += 1
            _STACK.append(self)
            try:
                return function(*args, **kwargs)
            finally:
                _STACK.remove(self)

        return run

    @property
    def recomputing(self) -> bool:
        return self.runs > 1

    def take(self):
        """In a recompute: the next attention call's kept (out, lse), on the device; else None."""
        if not (self.enabled and self.recomputing) or self.cursor >= len(self.items):
            return None
        item = self.items[self.cursor]
        self.cursor += 1
        if self.offloader is None:
            return item
        return tuple(self.offloader.restore_kept(h) for h in item)

    def put(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        """In the first forward: keep this attention call's output and LSE."""
        if not self.enabled or self.recomputing:
            return
        if self.offloader is None:
            self.items.append((out, lse))
        else:
            self.items.append(tuple(self.offloader.keep(t) for t in (out, lse)))


def kept_or_computed(compute):
    """``compute()`` -> (out, lse), unless the active frame holds them from the first forward."""
    frame = active()
    got = frame.take() if frame is not None else None
    if got is not None:
        return got
    out, lse = compute()
    if frame is not None:
        frame.put(out, lse)
    return out, lse


__all__ = ["KeptAttention", "active", "kept_or_computed"]
