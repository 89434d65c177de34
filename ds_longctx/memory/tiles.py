"""Row-tile loops (tiled MLP, memory-efficient RMSNorm, the fused attention's normed projection tiles) and
their one simulation seam.

Training runs every tile. A tile keeps nothing once done (results go into preallocated rows, weight
gradients are accumulated or dropped), so the first (largest: ``tensor_split`` and ``range`` tiles are
largest first) tile alone reaches the loop's memory peak and the rest only repeat its work. The planner's
simulation (planner/simulate.py) therefore enters :func:`representative` around its fake step: each loop
then runs its first tile only, inside ``measure.flops.representing`` so that its FLOPs and bytes stand for
all tiles'. The loops themselves do not look at their tensors (fake or real); the planner owns the switch,
scoped to its step and undone after.

Why not custom ops with ``register_fake`` (as the attention kernels are): a tile runs the module's own
forward (ZeRO-3 gathers the weights per tile through its hooks, MoE blocks route per tile) and the
backward accumulates parameter gradients and marks them ready for ZeRO as side effects, none of which
a custom op's schema can express; a fake impl would also run outside the planner's accountant, which
would then not see the tile's transient memory. Running every tile on fake tensors gives the same
numbers (measured: 0 bytes and 0 predicted seconds apart on every shipped config) at 4-23x the
simulation time.
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, Sequence, TypeVar

from ..measure.flops import representing

T = TypeVar("T")

_REPRESENTATIVE = [False]  # the seam's one state; set only by representative()


@contextlib.contextmanager
def representative():
    """Inside: every tile loop runs its first tile only, standing for all of them (the planner's step)."""
    before = _REPRESENTATIVE[0]
    _REPRESENTATIVE[0] = True
    try:
        yield
    finally:
        _REPRESENTATIVE[0] = before


def each_tile(tiles: Sequence[T], total_rows: int, first_rows: int) -> Iterator[T]:
    """The tiles to run, in order: all of them, or under :func:`representative` the first one, its work
    counted ``total_rows / first_rows`` times."""
    if not _REPRESENTATIVE[0] or len(tiles) <= 1:
        yield from tiles
        return

    with representing(total_rows / max(1, first_rows)):
        yield tiles[0]


def row_starts(rows: int, step: int) -> Iterable[int]:
    """First rows of the ``step``-row tiles of ``rows`` rows (see :func:`each_tile`)."""
    return each_tile(range(0, rows, step), rows, min(rows, step))


__all__ = ["each_tile", "representative", "row_starts"]
