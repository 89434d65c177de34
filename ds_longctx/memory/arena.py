"""Exact-size host blocks for offloaded layer inputs, pinned on CUDA, reused from step to step.

Why not ``torch.empty(..., pin_memory=True)``: that goes through torch's CachingHostAllocator, which
rounds every block up to a power of two and keeps freed blocks cached, so a 5 GiB layer input pins
8 GiB (the shipped 5M config pinned 256 GiB per rank instead of 160). Here a block is a plain CPU
tensor of exactly the requested size, page-locked in place with ``cudaHostRegister`` (no rounding,
no cache of our own beyond the free list), and blocks are handed back to the arena when autograd
drops the saved input, so step 2 reuses step 1's blocks: the pinned total is set by the first step
(or by :meth:`HostArena.reserve` from the plan) and never grows while the shapes stay the same.

On a machine without CUDA (tests, CI) nothing can be pinned; the arena is the same code on plain host
memory with the same exact-size accounting.
"""
from __future__ import annotations

import threading
import weakref
from typing import List, Optional

import torch



def _register(t: torch.Tensor) -> None:
    """Page-lock ``t``'s memory for DMA, as torch's own ``torch.cuda._pin_memory_utils.pin_memory``
    does (flags 1 = cudaHostRegisterPortable: pinned for every CUDA context). Not run on CPU CI."""
    nbytes = t.numel() * t.element_size()
    err = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 1))
    if err != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with cudaError {err} (out of lockable host "
                           "memory? check `ulimit -l` and the node's free RAM)")


def _unregister(raw: torch.Tensor) -> None:
    # the memory must not be freed while still registered; copies from it must be done (the arena
    # synchronizes before closing; a block dropped by garbage collection was idle by construction)
    try:
        torch.cuda.cudart().cudaHostUnregister(raw.data_ptr())
    except Exception:  # interpreter shutdown: the driver may already be gone; the OS frees the pages
        pass


class HostBlock:
    """One exact-size host buffer (``data``: uint8, ``nbytes`` long, ``align``-aligned start)."""

    __slots__ = ("data", "nbytes", "pinned", "event", "__weakref__")

    def __init__(self, nbytes: int, pin: bool, align: int):
        raw = torch.empty(nbytes, dtype=torch.uint8, device="cpu")
        if align > 1 and raw.data_ptr() % align:
            # torch's CPU allocator aligns to 64 bytes; stronger alignment (O_DIRECT staging: 4 KiB)
            # costs at most align-1 extra bytes
            raw = torch.empty(nbytes + align - 1, dtype=torch.uint8, device="cpu")
            off = (-raw.data_ptr()) % align
            data = raw[off:off + nbytes]
        else:
            data = raw
        self.data, self.nbytes, self.pinned, self.event = data, nbytes, False, None
        if pin:
            _register(raw)
            self.pinned = True
            weakref.finalize(self, _unregister, raw)

    def view(self, dtype: torch.dtype, shape) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        return self.data[:nbytes].view(dtype).view(shape)


class HostSlot:
    """What a host target hands the offloader for one layer input: the block and the typed view."""

    __slots__ = ("block", "view")

    def __init__(self, block: HostBlock, view: torch.Tensor):
        self.block, self.view = block, view

    @property
    def shape(self):
        return self.view.shape

    @property
    def dtype(self):
        return self.view.dtype


class HostArena:
    """A per-rank pool of exact-size host blocks.

    ``take(n)`` returns the smallest free block of at least ``n`` bytes, or allocates one of exactly
    ``n`` bytes; ``give`` returns it. With the same layer-input shape every step, step 1 allocates one
    block per offloaded layer and every later step reuses them: ``allocated_bytes`` is what is pinned,
    ``grown_bytes_last_step`` what the latest step added (0 in steady state).
    """

    def __init__(self, pin: bool = False, align: int = 64, limit_bytes: Optional[int] = None):
        self.pin = pin
        self.align = align
        self.limit_bytes = limit_bytes
        self._free: List[HostBlock] = []
        self._all: List[HostBlock] = []
        self._lock = threading.Lock()
        self.allocated_bytes = 0     # pinned (on CUDA) host bytes held by the arena
        self.in_use_bytes = 0        # block bytes holding a live layer input now
        self.in_use_peak = 0
        self.allocations = 0         # blocks allocated since creation
        self.reuses = 0              # takes served from the free list

    def _new(self, nbytes: int) -> HostBlock:
        if self.limit_bytes is not None and self.allocated_bytes + nbytes > self.limit_bytes:
            raise ValueError(f"host arena: it would grow to {self.allocated_bytes + nbytes} bytes, over its limit of "
                             f"{self.limit_bytes}; give the node more host memory, offload to NVMe, or raise the "
                             "limit the plan set")
        b = HostBlock(nbytes, self.pin, self.align)
        self._all.append(b)
        self.allocated_bytes += nbytes
        self.allocations += 1
        return b

    def reserve(self, nbytes: int, count: int) -> None:
        """Allocate ``count`` free blocks of ``nbytes`` up front (sized from the plan)."""
        with self._lock:
            for _ in range(count):
                self._free.append(self._new(nbytes))

    def take(self, nbytes: int) -> HostBlock:
        with self._lock:
            best = None
            for i, b in enumerate(self._free):
                if b.nbytes >= nbytes and (best is None or b.nbytes < self._free[best].nbytes):
                    best = i
                    if b.nbytes == nbytes:
                        break
            if best is not None:
                block = self._free.pop(best)
                self.reuses += 1
            else:
                block = self._new(nbytes)
            self.in_use_bytes += block.nbytes
            self.in_use_peak = max(self.in_use_peak, self.in_use_bytes)
            return block

    def give(self, block: HostBlock) -> None:
        with self._lock:
            self.in_use_bytes -= block.nbytes
            self._free.append(block)

    def stats(self) -> dict:
        return {"pinned_bytes": self.allocated_bytes if self.pin else 0, "arena_bytes": self.allocated_bytes, "arena_blocks": len(self._all),
                "arena_in_use_bytes": self.in_use_bytes, "arena_in_use_peak": self.in_use_peak,
                "arena_allocations": self.allocations, "arena_reuses": self.reuses, "arena_pinned": self.pin}

    def close(self) -> None:
        """Drop every block (unpinning it). Call with no layer input offloaded and no copy in flight."""
        if self.pin and torch.cuda.is_available():
            torch.cuda.synchronize()
        with self._lock:
            self._free.clear()
            self._all.clear()
            self.allocated_bytes = self.in_use_bytes = 0
