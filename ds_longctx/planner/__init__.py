"""The memory planner: one rank's training step simulated on fake tensors, plus model-state arithmetic.

``plan(ds_config, model_config, world_size=8, gpu_mem="80GiB", seq_len=...)`` -> :class:`PlanResult`;
``max_context(...)``; ``resolve_auto(ds_config, model_config, world_size, gpu_mem_bytes)`` -> the values of the
"auto" keys (config.AUTO_KEYS, and tiled shards) the planner picks, which ``config.with_values`` applies to the
parsed section. CLI: ``ds-longctx plan`` (cli.py).
"""
from __future__ import annotations

import copy
import logging
import multiprocessing as mp
from typing import Optional

from ..config import ConfigError, load_ds_config
from .core import PlanResult, Planner, _micro_batch, load_model_config, max_context, plan
from .search import resolve
from .simulate import NeedsOwnProcess


def resolve_auto(ds_config, model_config, world_size: int, gpu_mem_bytes, seq_len: Optional[int] = None,
                 host_mem=None, reserve="0", log=None, gpus_per_node: Optional[int] = None, with_plan: bool = False):
    """The values for the "auto" settings of ``ds_config`` (``config.AUTO_KEYS``, and enabled tiled shard counts)
    as {key inside the section: value}, e.g. {"attention.heads_per_chunk": 4, "tiled_mlp.shards": 2}: the fastest
    whose simulated step fits ``gpu_mem_bytes`` per device and ``host_mem`` per node of ``gpus_per_node`` ranks
    (default min(world, 8)); each choice is logged with its reason (planner/search.resolve). ``config.with_values``
    applies them to the parsed section (what ds_longctx.initialize does). ``with_plan``: the pair (values, the
    PlanResult of the chosen configuration, None when nothing is "auto"): the run's predicted step.

    Pure (same answer on every rank). Inside a process that already runs a real process group the
    simulation runs in a child process (the fake group needs the default group to itself); its log lines
    come back and go through ``log`` here.
    """
    cfg = copy.deepcopy(load_ds_config(ds_config))
    mc = load_model_config(model_config)
    seq = seq_len or (cfg.get("long_context") or {}).get("sequence_length")
    if seq is None:
        raise ConfigError("long_context.sequence_length", "'auto' values need a sequence length to plan for",
                          "set long_context.sequence_length or give integers instead of 'auto'")
    params = None

    def factory(c):
        nonlocal params
        p = Planner(c, mc, world_size, gpu_mem_bytes, host_mem, reserve, gpus_per_node=gpus_per_node, params=params)
        params = p.params
        return p

    try:
        return resolve(factory, cfg, mc, world_size, int(seq), log, with_plan=with_plan)
    except NeedsOwnProcess:
        (out, plan_dict), lines = _resolve_in_child(cfg, mc, world_size, gpu_mem_bytes, int(seq), host_mem, reserve,
                                                    gpus_per_node)
        for line in lines:
            (log or logging.getLogger("ds_longctx.planner").info)(line)
        return (out, plan_dict and PlanResult(**plan_dict)) if with_plan else out


def planned_work(ds_config, model_config, world_size: int, seq_len: int) -> dict:
    """The planner's counts of one rank's step of one micro batch ({"flops": {kind_phase: FLOPs}, "calls": {...}}:
    StepTime's, and "micro_batch"),
    for the profiler's measured-vs-planned table. No budget applies (only the work is wanted). In a process
    with a real process group the simulation runs in a child process."""
    mc = load_model_config(model_config)
    try:
        p = Planner(ds_config, mc, world_size, gpu_mem=1 << 60, reserve="0")
        t = p.run(int(seq_len)).time
        return {"flops": t["flops"], "calls": t["calls"], "micro_batch": _micro_batch(p.ds_config)}
    except NeedsOwnProcess:
        with mp.get_context("spawn").Pool(1) as pool:
            return pool.apply(planned_work, (ds_config, mc.to_dict(), world_size, seq_len))


def plan_resolved(ds_config, model_config, world_size: int, gpu_mem_bytes, seq_len: int, host_mem=None,
                  reserve="0", gpus_per_node: Optional[int] = None) -> PlanResult:
    """The planner's :class:`PlanResult` of one rank's step of a resolved ds_config (no "auto" left:
    ``config.resolved_ds_config``) at ``seq_len``, against the budgets ``resolve_auto`` plans with: the same
    simulation "auto" ran (its fastest fitting choice), stated to the user (train.py's stage line: the new peak
    before step 1). In a process with a real process group the simulation runs in a child process."""
    try:
        return Planner(ds_config, load_model_config(model_config), world_size, gpu_mem_bytes, host_mem, reserve,
                       gpus_per_node=gpus_per_node).run(int(seq_len))
    except NeedsOwnProcess:
        mc = load_model_config(model_config).to_dict()
        with mp.get_context("spawn").Pool(1) as pool:
            d = pool.apply(_plan_dict, (ds_config, mc, world_size, gpu_mem_bytes, seq_len, host_mem, reserve,
                                        gpus_per_node))
        return PlanResult(**d)


def plan_resolved_soon(ds_config, model_config, world_size: int, gpu_mem_bytes, seq_len: int, host_mem=None,
                       reserve="0", gpus_per_node: Optional[int] = None):
    """:func:`plan_resolved` started now and read later: a function returning the PlanResult. In a process with a
    real process group the simulation runs in a child process meanwhile (the caller builds its model and engine
    during the seconds it takes); otherwise it runs here, now."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        r = plan_resolved(ds_config, model_config, world_size, gpu_mem_bytes, seq_len, host_mem, reserve,
                          gpus_per_node)
        return lambda: r
    mc = load_model_config(model_config).to_dict()
    pool = mp.get_context("spawn").Pool(1)
    pending = pool.apply_async(_plan_dict, (ds_config, mc, world_size, gpu_mem_bytes, seq_len, host_mem, reserve,
                                            gpus_per_node))
    pool.close()

    def result() -> PlanResult:
        try:
            return PlanResult(**pending.get())
        finally:
            pool.join()
    return result


def _plan_dict(*args):
    return plan_resolved(*args).to_dict()


def _resolve_in_child(cfg, mc, world_size, gpu_mem_bytes, seq, host_mem, reserve, gpus_per_node=None):
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(_child, (cfg, mc.to_dict(), world_size, gpu_mem_bytes, seq, host_mem, reserve,
                                   gpus_per_node))


def _child(cfg, mc_dict, world_size, gpu_mem_bytes, seq, host_mem, reserve, gpus_per_node=None):
    lines = []
    out, plan_result = resolve_auto(cfg, mc_dict, world_size, gpu_mem_bytes, seq, host_mem, reserve, lines.append,
                                    gpus_per_node, with_plan=True)
    return (out, plan_result and plan_result.to_dict()), lines


__all__ = ["plan", "max_context", "planned_work", "plan_resolved", "plan_resolved_soon", "resolve_auto", "PlanResult",
           "Planner", "load_model_config"]
