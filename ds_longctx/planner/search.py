"""The stack ladder (--compare) and "auto" resolution, both by running the planner."""
from __future__ import annotations

import copy
import logging
from typing import List, Tuple

from ..config import SECTION
from ..models import attention_shape, text_config
from .units import fmt_bytes

logger = logging.getLogger("ds_longctx.planner")


def ladder(ds_config: dict, model_config, world_size: int) -> List[Tuple[str, dict]]:
    """The same model and GPUs under each step of the stack: (label, ds_config)."""
    base = copy.deepcopy(ds_config)
    sp = base.get("sequence_parallel_size", 1)
    if sp <= 1:
        sp = world_size
    lc_user = (base.get(SECTION) or {})
    hpc = (lc_user.get("attention") or {}).get("heads_per_chunk", 1)
    steps = [
        ("no SP", 1, {"attention": {"implementation": "none"}}),
        ("Ulysses", sp, {"attention": {"implementation": "ulysses"}}),
        ("+checkpointing", sp, {"attention": {"implementation": "ulysses"},
                                "activation_checkpointing": {"enabled": True}}),
        ("+offload", sp, {"attention": {"implementation": "ulysses"},
                          "activation_checkpointing": {"enabled": True, "offload": "cpu"}}),
        ("+tiled MLP and loss", sp, {"attention": {"implementation": "ulysses"},
                                     "activation_checkpointing": {"enabled": True, "offload": "cpu"},
                                     "tiled_mlp": {"enabled": True}, "tiled_loss": {"enabled": True}}),
        ("+untied attention", sp, {"attention": {"implementation": "untied_ulysses", "heads_per_chunk": hpc},
                                   "activation_checkpointing": {"enabled": True, "offload": "cpu"},
                                   "tiled_mlp": {"enabled": True}, "tiled_loss": {"enabled": True}}),
        ("+memory-efficient RMSNorm", sp, {"attention": {"implementation": "untied_ulysses", "heads_per_chunk": hpc},
                                           "activation_checkpointing": {"enabled": True, "offload": "cpu"},
                                           "tiled_mlp": {"enabled": True}, "tiled_loss": {"enabled": True},
                                           "rms_norm": {"enabled": True}}),
    ]
    out = []
    for label, s, section in steps:
        cfg = copy.deepcopy(base)
        cfg["sequence_parallel_size"] = s
        keep = {k: v for k, v in lc_user.items() if k in ("sequence_length", "profile")}
        for k in ("tiled_mlp", "tiled_loss"):
            if k in section and k in lc_user and "shards" in lc_user[k]:
                section[k]["shards"] = lc_user[k]["shards"]
        cfg[SECTION] = {**keep, **section}
        out.append((label, cfg))
    return out


def _local_heads(model_config, sp: int) -> int:
    return attention_shape(model_config).heads // max(1, sp)


def _shard_candidates(local_seq: int, hidden: int) -> List[int]:
    """Fewest shards first (fastest), up to DeepSpeed's rule ceil(local_seq / hidden)."""
    top = max(1, -(-local_seq // max(1, hidden)))
    c, n = [], 1
    while n < top:
        c.append(n)
        n *= 2
    c.append(top)
    return c


def resolve(planner_factory, ds_config: dict, model_config, world_size: int, seq_len: int, log=None) -> dict:
    """Replace "auto" heads_per_chunk / tiled shards by the fastest values whose step fits.

    Speed order: more heads per chunk means fewer all-to-all stages and larger kernels; fewer shards
    means fewer, larger matmuls. So start from the memory-safest setting (1 head per chunk, DeepSpeed's
    shard rule), then relax one knob at a time to its fastest value that still fits.
    """
    log = log or logger.info
    cfg = copy.deepcopy(ds_config)
    section = cfg.setdefault(SECTION, {}) or {}
    cfg[SECTION] = section
    sp = cfg.get("sequence_parallel_size", 1)
    att = section.setdefault("attention", {})
    auto_keys = []
    if att.get("heads_per_chunk") == "auto":
        auto_keys.append(("attention", "heads_per_chunk"))
    for name in ("tiled_mlp", "tiled_loss"):
        sec = section.get(name) or {}
        if sec.get("enabled") and sec.get("shards", "auto") == "auto":
            auto_keys.append((name, "shards"))
    if not auto_keys:
        return cfg
    hidden = text_config(model_config).hidden_size
    local_seq = seq_len // max(1, sp)
    cands = {}
    for sec, key in auto_keys:
        if key == "heads_per_chunk":
            local = _local_heads(model_config, sp)
            cands[(sec, key)] = sorted([d for d in range(1, local + 1) if local % d == 0], reverse=True)
            section[sec][key] = 1
        else:
            cands[(sec, key)] = _shard_candidates(local_seq, hidden)
            section[sec][key] = cands[(sec, key)][-1]
    planner = planner_factory(cfg)
    r = planner.run(seq_len)
    if not r.fits:
        log(f"ds_longctx auto: even the memory-safest settings do not fit at {seq_len} tokens "
            f"(peak {fmt_bytes(r.peak_device_bytes)} > budget {fmt_bytes(r.device_budget_bytes - r.reserve_bytes)}); "
            "keeping them: "
            + ", ".join(f"{s}.{k}={section[s][k]}" for s, k in auto_keys))
        return cfg
    for sec, key in auto_keys:
        chosen = section[sec][key]
        for value in cands[(sec, key)]:
            if value == chosen:
                break
            section[sec][key] = value
            trial = planner_factory(cfg).run(seq_len)
            if trial.fits:
                chosen = value
                break
        section[sec][key] = chosen
        log(f"ds_longctx auto: {SECTION}.{sec}.{key}={chosen}: the fastest value whose step fits "
            f"{seq_len} tokens on {world_size} ranks (candidates, fastest first: {cands[(sec, key)]})")
    return cfg
