"""Reductions over the SP group for an objective that every rank of the group computes identically (the RL and
preference losses: every rank holds the same batch, generated once per group; only the forward is sharded).

A per-token value lives on the rank whose shard holds the token. ``gather_tokens`` makes the whole sequence's
values (``[b, sp * n]``: O(tokens) numbers, never ``[tokens, vocab]``) and ``sum_over_group`` adds each rank's partial
sums (per-sequence sums, token counts), always before any division. Both are differentiable for a loss computed the
same way on every rank: the gradient reaching the gathered (summed) value is then the same on every rank, so each
rank keeps its own part of it (not a reduce-scatter, which would count it SP times), times ``grad_scale``: the factor
DeepSpeed's gradient reduction needs to end at one replica's gradient (``dist.comm.sp_grad_scale``: SP under ZeRO-3's
reduce-scatter, which averages over the SP ranks too; 1 otherwise). Without a group (SP 1) each is the identity."""
from __future__ import annotations

import torch
import torch.distributed as dist


def _group_size(group) -> int:
    return 1 if group is None or not dist.is_initialized() else dist.get_world_size(group)


def _in_token_order(gathered: torch.Tensor, order):
    """The shards concatenated in SP-rank order put in token order (``order[i]``: the token of gathered column i;
    None: already in order, the contiguous cut)."""
    if order is None:
        return gathered
    return torch.empty_like(gathered).index_copy_(1, order.to(gathered.device), gathered)


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sp: int, rank: int, scale: float, order):
        ctx.rank, ctx.n, ctx.scale, ctx.order = rank, x.shape[1], scale, order
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(sp)]
        dist.all_gather(parts, x, group=group)
        return _in_token_order(torch.cat(parts, dim=1), order)

    @staticmethod
    def backward(ctx, g):
        if ctx.order is not None:  # back to SP-rank order: gathered column i is token order[i]
            g = g.index_select(1, ctx.order.to(g.device))
        own = g[:, ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n]
        return (own * ctx.scale).contiguous(), None, None, None, None, None


class _SumOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scale: float):
        ctx.scale = scale
        out = x.detach().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None, None


def gather_tokens(x: torch.Tensor, group=None, grad_scale: float = 1.0, order=None) -> torch.Tensor:
    """This rank's ``[b, n, ...]`` sequence shard -> the group's ``[b, sp * n, ...]`` in token order: the shards in
    SP-rank order (``shard_batch``'s contiguous cut), or put back by ``order`` (``dist.layout.gathered_order``: the
    zigzag shards of a ring). Bool tensors travel as bytes."""
    sp = _group_size(group)
    if sp == 1:
        return x
    if not x.requires_grad or not torch.is_grad_enabled():
        dtype = x.dtype
        y = x.detach().to(torch.uint8) if dtype == torch.bool else x.detach()
        parts = [torch.empty_like(y) for _ in range(sp)]
        dist.all_gather(parts, y.contiguous(), group=group)
        return _in_token_order(torch.cat(parts, dim=1), order).to(dtype)
    return _GatherTokens.apply(x, group, sp, dist.get_rank(group), float(grad_scale), order)


def sum_over_group(x: torch.Tensor, group=None, grad_scale: float = 1.0) -> torch.Tensor:
    """Elementwise sum over the group of each rank's ``x``."""
    if _group_size(group) == 1:
        return x
    if not x.requires_grad or not torch.is_grad_enabled():
        out = x.detach().clone()
        dist.all_reduce(out, group=group)
        return out
    return _SumOverGroup.apply(x, group, float(grad_scale))


__all__ = ["gather_tokens", "sum_over_group"]
