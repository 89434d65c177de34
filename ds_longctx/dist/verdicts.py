"""One way to say a thing on every rank: what one rank decides, every rank learns, and an error is raised on every
rank alike (a rank that raised alone would leave the others waiting in the next collective until the timeout).

``all_gather`` / ``broadcast`` (picklable objects), ``all_gather_blobs`` (bytes through tensors: any backend, no
pickling), ``any_rank`` (a MAX of flags: every rank takes the same branch), ``world_sum``, ``decided_on_rank0`` (rank
0 computes, every rank gets its value or its error) and ``raise_everywhere``. Without a process group (one process)
each is the identity. Used by the checkpoint code, the agreement check, host-memory planning, ``initialize``'s
"auto" values, the kernel autotuner and the training loop."""
from __future__ import annotations

import os
import struct
from typing import Callable, List, Optional, Sequence, Tuple, TypeVar

from ..errors import ConfigError, LongContextError

T = TypeVar("T")


def active():
    """``torch.distributed`` when a process group is up, else None."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def rank_world() -> Tuple[int, int]:
    dist = active()
    return (dist.get_rank(), dist.get_world_size()) if dist else (0, 1)


def all_gather(obj, group=None) -> list:
    """Every rank's ``obj`` (picklable), in rank order."""
    dist = active()
    if dist is None or dist.get_world_size(group) == 1:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast(obj, src: int = 0, group=None):
    """Rank ``src``'s ``obj`` on every rank."""
    dist = active()
    if dist is None or dist.get_world_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def raise_everywhere(outcome) -> None:
    """``outcome`` (the same on every rank) is None, a ConfigError's (key, problem, fix), or a LongContextError."""
    if outcome is None:
        return
    if isinstance(outcome, LongContextError):
        raise outcome
    raise ConfigError(*outcome)


def decided_on_rank0(decide: Callable[[], T]) -> T:
    """``decide()`` on rank 0 only (a pure computation that costs time: the planner's "auto" values), its value on
    every rank, or its ConfigError raised on every rank."""
    dist = active()
    box = None
    if dist is None or dist.get_rank() == 0:
        try:
            box = ("value", decide())
        except ConfigError as e:
            box = ("error", e)
    box = broadcast(box)
    if box[0] == "error":
        raise box[1]
    return box[1]


def any_rank(flags: Sequence[bool], group=None) -> List[bool]:
    """Each flag true where it is true on any rank (one small MAX all-reduce): every rank takes the same branch."""
    import torch

    dist = active()
    t = torch.tensor([int(bool(f)) for f in flags], dtype=torch.int32)
    if dist is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [bool(v) for v in t.tolist()]


def world_sum(t):
    """Sum of the tensor ``t`` over every rank of the job (in place, one collective), or ``t`` alone."""
    dist = active()
    if dist is not None and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t


def collective_device(group=None):
    """Where this group's collectives take their tensors: the device it is bound to, else the accelerator's for
    NCCL-like backends (this rank's LOCAL_RANK), else the CPU."""
    import torch
    import torch.distributed as dist

    pg = dist.distributed_c10d._get_default_group() if group is None else group
    bound = getattr(pg, "bound_device_id", None)
    if bound is not None:
        return bound
    if dist.get_backend(group) in ("gloo", "mpi"):
        return torch.device("cpu")
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().device_name(int(os.environ.get("LOCAL_RANK", "0"))))


def all_gather_rows(row: bytes, group=None) -> List[bytes]:
    """One all-gather of equal-length byte rows (tensors: no pickling, any backend)."""
    import torch
    import torch.distributed as dist

    dev = collective_device(group)
    t = torch.frombuffer(bytearray(row), dtype=torch.uint8).to(dev)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return [bytes(o.cpu().numpy().tobytes()) for o in out]


def all_gather_blobs(blob: bytes, group=None) -> List[bytes]:
    """All-gather byte strings of any length (the lengths first, then, unless all are empty, rows padded to the
    longest)."""
    sizes = [struct.unpack("<q", r)[0] for r in all_gather_rows(struct.pack("<q", len(blob)), group)]
    if not max(sizes):
        return [b""] * len(sizes)
    rows = all_gather_rows(blob.ljust(max(sizes), b"\0"), group)
    return [r[:n] for r, n in zip(rows, sizes)]


def ranks_text(ranks: Sequence[int], noun: Optional[bool] = True) -> str:
    """[0, 1, 2, 5] -> "ranks 0-2, 5" ("0-2, 5" with ``noun=False``)."""
    runs, start, prev = [], None, None
    for r in sorted(ranks):
        if start is None:
            start = prev = r
        elif r == prev + 1:
            prev = r
        else:
            runs.append((start, prev))
            start = prev = r
    if start is not None:
        runs.append((start, prev))
    body = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return (("rank " if len(ranks) == 1 else "ranks ") + body) if noun else body
