"""The tile loops' one simulation seam (memory/tiles.py): training runs every tile; inside
``representative()`` (the planner's step) a loop runs its first tile, its work counted for all tiles."""
import pytest
import torch

from ds_longctx.measure.flops import current_scale
from ds_longctx.memory.tiles import each_tile, representative, row_starts
from ds_longctx.memory.tiling import TiledRowsFunction, _class_forward


def test_every_tile_runs_outside_the_planner():
    assert list(row_starts(10, 4)) == [0, 4, 8]
    assert [current_scale() for _ in each_tile([1, 2, 3], 9, 3)] == [1.0, 1.0, 1.0]


def test_representative_runs_the_first_tile_for_all_and_is_undone():
    with representative():
        seen = [(lo, current_scale()) for lo in row_starts(10, 4)]
        assert list(each_tile(["only"], 5, 5)) == ["only"]  # one tile: nothing to stand for
        assert list(row_starts(0, 4)) == []
    assert seen == [(0, 2.5)]
    assert current_scale() == 1.0
    with pytest.raises(RuntimeError):
        with representative():
            raise RuntimeError("boom")
    assert list(row_starts(10, 4)) == [0, 4, 8]


def test_tiled_rows_function_is_exact_in_training():
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    x = torch.randn(2, 11, 8, requires_grad=True)
    ref = mlp(x)
    ref.sum().backward()
    gx, gw = x.grad.clone(), mlp[0].weight.grad.clone()
    x.grad = None
    mlp.zero_grad()
    y = TiledRowsFunction.apply(x, _class_forward, mlp, 5, list(mlp.parameters()))
    torch.testing.assert_close(y, ref)
    y.sum().backward()
    torch.testing.assert_close(x.grad, gx)
    torch.testing.assert_close(mlp[0].weight.grad, gw)
