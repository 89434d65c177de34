"""Where this rank sits: world = SP x DP, computed once from the config and the process group."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from .comm import sp_grad_scale


def zero_stage(ds_config: dict) -> int:
    return int((ds_config.get("zero_optimization") or {}).get("stage", 0))


def reduce_scatter(ds_config: dict) -> bool:
    return bool((ds_config.get("zero_optimization") or {}).get("reduce_scatter", True))


@dataclass(frozen=True)
class Layout:
    """SP groups are blocks of ``sp`` consecutive ranks (DeepSpeed's ``parallel_state_sp``), so rank r
    is SP rank ``r % sp`` of data-parallel replica ``r // sp``. ``grad_scale``: see comm.sp_grad_scale."""
    world: int
    sp: int
    rank: int = 0
    zero_stage: int = 0
    grad_scale: float = 1.0

    @property
    def dp(self) -> int:
        return self.world // self.sp

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.sp

    @classmethod
    def build(cls, ds_config: dict, sp: int, world: Optional[int] = None, rank: Optional[int] = None) -> "Layout":
        """From the ds_config and the default process group (world 1, rank 0 when there is none)."""
        live = dist.is_available() and dist.is_initialized()
        world = world if world is not None else (dist.get_world_size() if live else 1)
        rank = rank if rank is not None else (dist.get_rank() if live else 0)
        stage = zero_stage(ds_config)
        return cls(world=world, sp=sp, rank=rank, zero_stage=stage,
                   grad_scale=sp_grad_scale(stage, reduce_scatter(ds_config), sp))

    def describe(self) -> str:
        return f"world={self.world} sp={self.sp} dp={self.dp} zero_stage={self.zero_stage}"



# ---------------------------------------------------------------------------------------------
# Ulysses x ring: which tokens a rank holds (plain numbers; attention/ring.py and data's shard_batch read them)
# ---------------------------------------------------------------------------------------------


def ring_segments(seq: int, ring: int, ring_rank: int) -> List[Tuple[int, int, int]]:
    """Ring rank ``ring_rank``'s tokens as (start in its ring-local sequence, global start, length) segments.

    ring 1: the whole sequence. ring R > 1 (zigzag, the causal load balance): the sequence is cut in 2R chunks of
    S / 2R tokens and ring rank r holds chunks r and 2R-1-r, in that order: every ring rank then has one early and
    one late chunk, so each attends over the same number of key blocks."""
    if ring <= 1:
        return [(0, 0, seq)]
    c = seq // (2 * ring)
    return [(0, ring_rank * c, c), (c, (2 * ring - 1 - ring_rank) * c, c)]


def ring_length_multiple(sp: int, ring: int) -> int:
    """What the global sequence length must be a multiple of: SP (equal shards), and with a ring 2R chunks that each
    ring rank's Ulysses ranks cut into equal shards: R * lcm(2, U)."""
    if ring <= 1:
        return sp
    ulysses = sp // ring
    return ring * (ulysses if ulysses % 2 == 0 else 2 * ulysses)


def shard_spans(seq: int, sp: int, ring: int, sp_rank: int) -> List[Tuple[int, int]]:
    """SP rank ``sp_rank``'s tokens as global [start, end) spans, in its shard's order: SP rank = ring rank x U +
    Ulysses rank (U = sp / ring, the Ulysses groups are consecutive SP ranks); ring rank r's ring-local sequence
    (:func:`ring_segments`) is cut into U equal contiguous shards. ring 1: the contiguous shard ``sp_rank``."""
    ulysses = sp // ring
    r, u = divmod(sp_rank, ulysses)
    n = seq // sp
    lo, hi = u * n, (u + 1) * n  # ring-local
    out = []
    for local, glob, length in ring_segments(seq, ring, r):
        a, e = max(lo, local), min(hi, local + length)
        if a < e:
            out.append((glob + a - local, glob + e - local))
    return out


def shard_index(seq: int, sp: int, ring: int, sp_rank: int) -> List[int]:
    """The global token indices SP rank ``sp_rank`` holds, in its shard's order (:func:`shard_spans`)."""
    return [i for a, e in shard_spans(seq, sp, ring, sp_rank) for i in range(a, e)]


def gathered_order(seq: int, sp: int, ring: int):
    """[seq] long tensor: the global index of every token of the SP group's shards concatenated in SP-rank order (what
    an all-to-all over the whole SP group gathers); ``arange(seq)`` for ring 1."""
    return torch.cat([torch.arange(a, e) for rank in range(sp) for a, e in shard_spans(seq, sp, ring, rank)])

__all__ = ["Layout", "gathered_order", "reduce_scatter", "ring_length_multiple", "ring_segments", "shard_index",
           "shard_spans", "zero_stage"]
