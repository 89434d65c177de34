"""Sequence-parallel groups and SP loss aggregation (the seq<->head all-to-alls live with their
only user, attention/untied.py, and DeepSpeed's Ulysses).

Groups come from DeepSpeed's ``parallel_state_sp`` (contiguous rank blocks of size SP; the
sequence-data-parallel group is every rank), so ZeRO and DeepSpeed's Ulysses see the same groups.
"""
from __future__ import annotations

import contextlib
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist


def disable_cpu_shm_allreduce() -> None:
    """Keep DeepSpeed's CPU backend from building its shared-memory all-reduce op.

    On the CPU accelerator every rank creates a ~64 MiB /dev/shm segment per master port that is
    never unlinked (a long test session filled 22 GiB of /dev/shm and was OOM-killed), it is
    JIT-compiled on first use (two ranks compiling at once can abort), and only DeepSpeed's
    inference all-reduce uses it. Training collectives go through gloo either way.
    """
    import importlib

    from deepspeed.accelerator import get_accelerator

    # `import deepspeed.comm.torch as m` would bind torch itself (deepspeed.comm re-exports `torch`)
    ds_torch_comm = importlib.import_module("deepspeed.comm.torch")
    if get_accelerator().device_name() == "cpu":
        ds_torch_comm.build_shm_op = lambda: None


def initialize_groups(sp_size: int):
    """Create the SP groups (idempotent). Returns the mpu for ``deepspeed.initialize`` or None for SP=1."""
    if sp_size <= 1:
        return None
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as pss

    if pss._SEQUENCE_PARALLEL_GROUP is None:
        pss.initialize_sequence_parallel(sp_size)
    elif pss.get_sequence_parallel_world_size() != sp_size:
        raise RuntimeError(f"sequence parallel groups already built with size "
                           f"{pss.get_sequence_parallel_world_size()}, asked for {sp_size}; SP groups are "
                           "once per process")
    return pss


# Ulysses x ring (attention/ring.py): inside every SP group, the Ulysses groups (consecutive SP ranks, ``sp / ring`` of
# them: inside a node) and the ring groups (SP ranks u, u + U, u + 2U, ...: across nodes). This module is their one
# owner: built once per (SP, ring) layout per process (``dist.new_group`` is collective), the last one asked for is
# the process's current layout (what data.shard_batch cuts for by default).
_RINGS: dict = {}  # (sp, ring) -> {"ulysses_group", "ring_group"}
_CURRENT = [1, 1]  # sp, ring of the current layout


def initialize_ring_groups(sp_size: int, ring: int) -> None:
    """Make (sp_size, ``ring``) this process's current Ulysses x ring layout, building its groups the first time
    (every rank calls this at the same point with the same numbers). ring 1: plain Ulysses, no sub-groups."""
    _CURRENT[:] = [sp_size, ring]
    if ring <= 1 or (sp_size, ring) in _RINGS:
        return
    _RINGS[(sp_size, ring)] = build_ring_groups(sp_size, ring)


def build_ring_groups(sp_size: int, ring: int) -> dict:
    """The caller's {"ulysses_group", "ring_group"} of SP groups of ``sp_size`` consecutive ranks (every rank builds
    every group, in one order); registered nowhere (the planner's fake world builds its own)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ulysses = sp_size // ring
    mine = {}
    for base in range(0, world, sp_size):
        for r in range(ring):
            ranks = [base + r * ulysses + u for u in range(ulysses)]
            g = dist.new_group(ranks) if ulysses > 1 else None
            if rank in ranks:
                mine["ulysses_group"] = g
        for u in range(ulysses):
            ranks = [base + r * ulysses + u for r in range(ring)]
            g = dist.new_group(ranks)
            if rank in ranks:
                mine["ring_group"] = g
    return mine


def ring_degree() -> int:
    """The ring degree of this process's current layout (1: none, plain Ulysses)."""
    return _CURRENT[1]


def ulysses_group():
    """The caller's Ulysses group in the current layout: the SP group itself without a ring; None when it is one rank
    (a ring over every SP rank)."""
    return _RINGS[tuple(_CURRENT)]["ulysses_group"] if _CURRENT[1] > 1 else sp_group()


def ring_group():
    """The caller's ring group in the current layout (None without a ring)."""
    return _RINGS[tuple(_CURRENT)]["ring_group"] if _CURRENT[1] > 1 else None


def sp_group():
    """The caller's SP group, or None when SP is 1 / not initialized."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as pss

    return pss._SEQUENCE_PARALLEL_GROUP


def sp_world_size(group=None) -> int:
    group = group if group is not None else sp_group()
    return 1 if group is None else dist.get_world_size(group)


def sp_rank(group=None) -> int:
    group = group if group is not None else sp_group()
    return 0 if group is None else dist.get_rank(group)


# ---------------------------------------------------------------------------------------------
# control data: small integers the ranks agree on (shard counts, batch verdicts and shapes)
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def control_plane():
    """Host integers agreed over a group are control data, not part of the step's tensor program: they
    are made and read outside every active tensor mode. Under the planner's fake tensors
    (``FakeTensorMode`` and its accountant) they stay real, so the same collective runs on the planner's
    fake process group (which hands every rank rank 0's values) and its result can be read; a FLOP
    counter or profiler mode does not count them. Without modes (training) this changes nothing."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield


def control_device(group=None) -> torch.device:
    """Where the group's backend takes tensors: the current CUDA device for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_ints(values: Sequence[int], group=None) -> List[List[int]]:
    """Every rank's ``values`` (one list of the same length on every rank), in group rank order."""
    with control_plane():
        t = torch.tensor([int(v) for v in values], dtype=torch.long, device=control_device(group))
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t, group=group)
        return torch.stack(parts).cpu().tolist()


def max_int(local: int, group=None) -> int:
    """MAX of ``local`` over ``group`` (None: every rank); every rank must call it at the same point."""
    with control_plane():
        t = torch.tensor([int(local)], dtype=torch.int64, device=control_device(group))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return int(t.item())


# ---------------------------------------------------------------------------------------------
# SP loss aggregation
# ---------------------------------------------------------------------------------------------


def sp_grad_scale(zero_stage: int, reduce_scatter: bool, sp_size: int) -> float:
    """Factor that makes the backward of ``local_sum / N_global`` give the single-process gradient.

    The true gradient is the *sum* over SP peers of each peer's local gradient (then averaged over
    data-parallel replicas). DeepSpeed's reductions differ by path (measured, research §4.4):
    ZeRO-0/1/2 and ZeRO-3 with reduce_scatter=false divide by world/SP, i.e. sum over SP peers ->
    scale 1; ZeRO-3's default reduce-scatter divides by the whole world, i.e. averages over SP
    peers -> scale SP. The tests pin this with SGD parameter deltas for every stage.
    """
    if sp_size <= 1:
        return 1.0
    if zero_stage == 3 and reduce_scatter:
        return float(sp_size)
    return 1.0


class SPLoss:
    """Global token-mean loss over the SP group from per-rank CE sums.

    value: sum over SP ranks of CE sums / number of valid tokens over SP ranks (the single-process
    loss). gradient: that of ``scale * local_sum / N`` so that DeepSpeed's reduction yields the
    single-process gradient. A rank with no valid labels contributes 0 (never NaN); a sample with no
    valid labels anywhere gives loss 0 with zero gradient. ``sp``: the group's size when the caller knows it
    (patch_model passes the spec's); None: read from the group.
    """

    def __init__(self, group=None, grad_scale: float = 1.0, sp: Optional[int] = None):
        self.group = group
        self.grad_scale = grad_scale
        self.sp = sp if sp is not None else (1 if group is None else dist.get_world_size(group))

    def __call__(self, local_sum: torch.Tensor, local_count: torch.Tensor) -> torch.Tensor:
        local_sum = local_sum.float()
        stats = torch.stack([local_sum.detach(), local_count.detach().to(local_sum.dtype)])
        if self.group is not None and self.sp > 1:
            dist.all_reduce(stats, group=self.group)
        total, count = stats[0], stats[1]
        denom = torch.clamp(count, min=1.0)
        grad_part = local_sum * (self.grad_scale / denom)
        value = total / denom
        return grad_part + (value - grad_part).detach()
