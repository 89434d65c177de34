import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed

pytestmark = pytest.mark.distributed  # every test here spawns processes


def _allreduce(rank, world):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _boom(rank, world):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def test_spawn_collects_results():
    assert run_distributed(_allreduce, 2) == [3.0, 3.0]


def test_spawn_reports_errors():
    with pytest.raises(RuntimeError, match="boom on rank 1"):
        run_distributed(_boom, 2)
