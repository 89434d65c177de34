"""The memory planner: one rank's training step simulated on fake tensors, plus model-state arithmetic.

``plan(ds_config, model_config, world_size=8, gpu_mem="80GiB", seq_len=...)`` -> :class:`PlanResult`;
``max_context(...)``; ``resolve_auto(ds_config, model_config, world_size, gpu_mem_bytes)`` -> ds_config
with "auto" heads_per_chunk / tiled shards replaced. CLI: ``ds-longctx plan`` (cli.py).
"""
from __future__ import annotations

from typing import Optional

from .core import PlanResult, Planner, load_model_config, max_context, plan


def resolve_auto(ds_config, model_config, world_size: int, gpu_mem_bytes, seq_len: Optional[int] = None,
                 host_mem=None, reserve="0", log=None) -> dict:
    """A copy of ``ds_config`` with "auto" heads_per_chunk and tiled shard counts replaced by the fastest
    values whose simulated step fits ``gpu_mem_bytes``; each choice is logged with its reason.

    Pure (same answer on every rank). Inside a process that already runs a real process group the
    simulation runs in a child process (the fake group needs the default group to itself).
    """
    import copy

    from ..config import ConfigError, load_ds_config
    from .search import resolve
    from .simulate import NeedsOwnProcess

    cfg = copy.deepcopy(load_ds_config(ds_config))
    mc = load_model_config(model_config)
    seq = seq_len or (cfg.get("long_context") or {}).get("sequence_length")
    if seq is None:
        raise ConfigError("long_context.sequence_length", "'auto' values need a sequence length to plan for",
                          "set long_context.sequence_length or give integers instead of 'auto'")
    params = None

    def factory(c):
        nonlocal params
        p = Planner(c, mc, world_size, gpu_mem_bytes, host_mem, reserve, params=params)
        params = p.params
        return p

    try:
        return resolve(factory, cfg, mc, world_size, int(seq), log)
    except NeedsOwnProcess:
        return _resolve_in_child(cfg, mc, world_size, gpu_mem_bytes, int(seq), host_mem, reserve)


def _resolve_in_child(cfg, mc, world_size, gpu_mem_bytes, seq, host_mem, reserve):
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(_child, (cfg, mc.to_dict(), world_size, gpu_mem_bytes, seq, host_mem, reserve))


def _child(cfg, mc_dict, world_size, gpu_mem_bytes, seq, host_mem, reserve):
    import logging

    logging.basicConfig(level=logging.INFO)
    return resolve_auto(cfg, mc_dict, world_size, gpu_mem_bytes, seq, host_mem, reserve)


__all__ = ["plan", "max_context", "resolve_auto", "PlanResult", "Planner", "load_model_config"]
