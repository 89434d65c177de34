"""Live-bytes tracker: counts the bytes of every tensor storage created while active and still alive.

Works on CPU and on fake tensors (the planner), because it watches storages created by dispatched
ops rather than an allocator. Peak is the maximum of live bytes seen at any op boundary.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Dict, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .fake import is_fake


def _storage_key_and_bytes(t: torch.Tensor):
    try:
        st = t.untyped_storage()
    except Exception:  # sparse / nested etc.
        return None, 0
    try:
        key = st.data_ptr() if t.device.type != "meta" and not is_fake(t) else id(st)
    except Exception:
        key = id(st)
    return (t.device.type, key, id(st)), st.nbytes()


class LiveBytesTracker(TorchDispatchMode):
    """Tracks live bytes of storages produced inside the mode, per device type, with a tag breakdown.

    ``tag`` lets callers attribute the peak to a phase ("attention", "mlp", "loss", ...): the tag
    active when a storage was created is charged for it until it dies.
    """

    def __init__(self, device_type: Optional[str] = None):
        super().__init__()
        self.device_type = device_type
        self.live = 0
        self.peak = 0
        self.live_by_tag: Dict[str, int] = {}
        self.peak_breakdown: Dict[str, int] = {}
        self._tag = "other"
        self._seen: Dict[tuple, int] = {}

    @contextmanager
    def tag(self, name: str):
        prev, self._tag = self._tag, name
        try:
            yield
        finally:
            self._tag = prev

    def reset_peak(self):
        self.peak = self.live
        self.peak_breakdown = dict(self.live_by_tag)

    def _track(self, t: torch.Tensor):
        if self.device_type is not None and t.device.type != self.device_type and not is_fake(t):
            return
        key, nbytes = _storage_key_and_bytes(t)
        if key is None or key in self._seen or nbytes == 0:
            return
        tag = self._tag
        self._seen[key] = nbytes
        self.live += nbytes
        self.live_by_tag[tag] = self.live_by_tag.get(tag, 0) + nbytes
        if self.live > self.peak:
            self.peak = self.live
            self.peak_breakdown = dict(self.live_by_tag)

        def _free(key=key, nbytes=nbytes, tag=tag, self_ref=weakref.ref(self)):
            me = self_ref()
            if me is None or key not in me._seen:
                return
            del me._seen[key]
            me.live -= nbytes
            me.live_by_tag[tag] -= nbytes

        weakref.finalize(t.untyped_storage(), _free)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(func, "is_view", False):
            # a view allocates nothing; its storage is its base's (which may predate the tracker)
            return out
        flat, _ = tree_flatten(out)
        for t in flat:
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out
