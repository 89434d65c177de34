"""Where this rank sits: world = SP x DP, computed once from the config and the process group."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

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


__all__ = ["Layout", "zero_stage", "reduce_scatter"]
