"""The stack ladder (--compare) and "auto" resolution, both by running the planner."""
from __future__ import annotations

import copy
import logging
from typing import Dict, List, Optional, Sequence, Tuple

from ..config import SECTION
from ..models import attention_shape, text_config

logger = logging.getLogger("ds_longctx.planner")


# The memory stack, one feature per step in the order each is added: the one ladder behind the planner's
# --compare rows (:func:`ladder`) and the CPU/GPU memory-stack benches (bench/memory_stack.py).
STACK_STEPS: Tuple[Tuple[str, dict], ...] = (
    ("+checkpointing", {"activation_checkpointing": {"enabled": True}}),
    ("+offload", {"activation_checkpointing": {"offload": "cpu"}}),
    ("+tiled MLP", {"tiled_mlp": {"enabled": True}}),
    ("+tiled loss", {"tiled_loss": {"enabled": True}}),
    ("+untied attention", {"attention": {"implementation": "untied_ulysses"}}),
    ("+memory-efficient RMSNorm", {"rms_norm": {"enabled": True}}),
)


def _merged(a: dict, b: dict) -> dict:
    out = copy.deepcopy(a)
    for k, v in b.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def stack_ladder(base: Optional[dict] = None, upto: Optional[str] = None, together: Sequence[Tuple[str, ...]] = (),
                 extra: Optional[Dict[str, dict]] = None) -> List[Tuple[str, dict]]:
    """Cumulative ``long_context`` sections, one per step of :data:`STACK_STEPS`: row i is ``base`` with steps
    0..i merged in. ``upto``: the last step's label; ``together``: groups of consecutive step labels shown as
    one row (the row takes the group's last label, e.g. ``("+tiled MLP", "+tiled loss", "+tiled MLP and loss")``:
    the last entry is the row's label); ``extra``: keys merged into a step (e.g. the user's heads_per_chunk)."""
    acc, out = copy.deepcopy(base or {}), []
    skip = {label: group[-1] for group in together for label in group[:-2]}
    for label, add in STACK_STEPS:
        acc = _merged(_merged(acc, add), (extra or {}).get(label, {}))
        if label not in skip:
            row = next((g[-1] for g in together if label == g[-2]), label)
            out.append((row, copy.deepcopy(acc)))
        if label == upto:
            break
    return out


def ladder(ds_config: dict, model_config, world_size: int) -> List[Tuple[str, dict]]:
    """The same model and GPUs under each step of the stack: (label, ds_config)."""
    base = copy.deepcopy(ds_config)
    sp = base.get("sequence_parallel_size", 1)
    if sp <= 1:
        sp = world_size
    lc_user = (base.get(SECTION) or {})
    hpc = (lc_user.get("attention") or {}).get("heads_per_chunk", 1)
    ulysses = {"attention": {"implementation": "ulysses"}}
    steps = [("no SP", 1, {"attention": {"implementation": "none"}}), ("Ulysses", sp, ulysses)] + [
        (label, sp, section) for label, section in stack_ladder(
            ulysses, together=[("+tiled MLP", "+tiled loss", "+tiled MLP and loss")],
            extra={"+untied attention": {"attention": {"heads_per_chunk": hpc}}})]
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


def _seconds(r) -> float:
    return r.time["seconds"] if r.time else float("inf")


# a candidate must be predicted this much faster to replace the speed order's choice (the time model's
# resolution is far coarser than 0.5%)
TIE = 0.005


def resolve(planner_factory, ds_config: dict, model_config, world_size: int, seq_len: int, log=None) -> dict:
    """Replace "auto" values by the fastest settings whose step fits, by the planner's predicted step time.

    Knobs: attention.heads_per_chunk and tiled_mlp/tiled_loss shards ("auto" or, for shards, absent);
    activation_checkpointing.keep_attention_output and keep_on_device when set to "auto" (reinvest memory
    into speed: each is turned on only where the device and the host budgets allow; NVMe capacity is not
    budgeted). Speed order: more heads per chunk means fewer all-to-all stages and larger kernels; fewer
    shards means fewer, larger matmuls. Start from the memory-safest setting (1 head per chunk,
    DeepSpeed's shard rule), relax each knob to the first value in speed order that fits, then walk on
    to the next fitting value while the predicted step time (PlanResult.time) is lower: ties between
    fitting settings go to the faster prediction, at one extra simulation per knob in the usual case.
    """
    log = log or logger.info
    cfg = copy.deepcopy(ds_config)
    section = cfg.setdefault(SECTION, {}) or {}
    cfg[SECTION] = section
    sp = cfg.get("sequence_parallel_size", 1)
    att = section.setdefault("attention", {})
    ac = section.get("activation_checkpointing") or {}
    auto_keys = []
    if att.get("heads_per_chunk") == "auto":
        auto_keys.append(("attention", "heads_per_chunk"))
    for name in ("tiled_mlp", "tiled_loss"):
        sec = section.get(name) or {}
        if sec.get("enabled") and sec.get("shards", "auto") == "auto":
            auto_keys.append((name, "shards"))
    reinvest = [k for k in ("keep_attention_output", "keep_on_device") if ac.get(k) == "auto"]
    for k in reinvest:  # memory-safest first
        ac[k] = False if k == "keep_attention_output" else 0
    if not auto_keys and not reinvest:
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
            f"({r.binding_detail}); keeping them: "
            + ", ".join([f"{s}.{k}={section[s][k]}" for s, k in auto_keys] + [f"{k}={ac[k]}" for k in reinvest]))
        return cfg
    best = r
    for sec, key in auto_keys:
        chosen, values = section[sec][key], cands[(sec, key)]
        first = None
        for i, value in enumerate(values):
            if value == chosen:
                break
            section[sec][key] = value
            trial = planner_factory(cfg).run(seq_len)
            if trial.fits:
                chosen, best, first = value, trial, i
                break
        section[sec][key] = chosen
        # ties: the next fitting values in speed order, while predicted faster
        why = "the first in speed order whose step fits"
        if first is not None:
            for value in values[first + 1:]:
                section[sec][key] = value
                trial = planner_factory(cfg).run(seq_len)
                if not (trial.fits and _seconds(trial) < _seconds(best) * (1 - TIE)):
                    break
                chosen, best = value, trial
                why = "predicted faster than the values before it in speed order"
            section[sec][key] = chosen
        log(f"ds_longctx auto: {SECTION}.{sec}.{key}={chosen}: {why} at {seq_len} tokens on {world_size} ranks "
            f"(predicted step {_seconds(best):.4g} s; candidates in speed order: {values})")
    if "keep_attention_output" in reinvest:
        best = _try_keep_attention_output(planner_factory, cfg, ac, best, seq_len, log)
    if "keep_on_device" in reinvest:
        _try_keep_on_device(planner_factory, cfg, ac, best, seq_len, log)
    return cfg


def _try_keep_attention_output(planner_factory, cfg, ac, best, seq_len, log):
    key = f"{SECTION}.activation_checkpointing.keep_attention_output"
    att = cfg[SECTION].get("attention") or {}
    if not ac.get("enabled") or att.get("implementation") != "untied_ulysses":
        log(f"ds_longctx auto: {key}=False: needs activation checkpointing and untied_ulysses attention")
        return best
    if ac.get("offload", "none") != "none" and best.host_budget_bytes is None:
        log(f"ds_longctx auto: {key}=False: the kept outputs go to host memory with the layer inputs and no host "
            "budget was given to check them against")
        return best
    ac["keep_attention_output"] = True
    trial = planner_factory(cfg).run(seq_len)
    if trial.fits and _seconds(trial) < _seconds(best) * (1 - TIE):
        log(f"ds_longctx auto: {key}=True: predicted step {_seconds(trial):.4g} s against {_seconds(best):.4g} s, "
            f"and it fits ({trial.binding_detail})")
        return trial
    ac["keep_attention_output"] = False
    log(f"ds_longctx auto: {key}=False: " + (f"on, it does not fit ({trial.binding_detail})" if not trial.fits else
                                            f"not predicted faster ({_seconds(trial):.4g} s against "
                                            f"{_seconds(best):.4g} s)"))
    return best


def _try_keep_on_device(planner_factory, cfg, ac, best, seq_len, log):
    """The most last layers whose inputs stay on the device (no transfer) that the planner's offload
    options (planner/host.py, arithmetic on the simulated step; "none" = every layer kept) say fit,
    checked by one more simulation."""
    key = f"{SECTION}.activation_checkpointing.keep_on_device"
    target = ac.get("offload", "none")
    opts = [o for o in (best.offload or {}).get("options", []) if o["target"] in (target, "none") and o["fits"]]
    k = max((o["keep_on_device"] for o in opts), default=0)
    if target == "none" or k == 0:
        log(f"ds_longctx auto: {key}=0: " + ("nothing is offloaded" if target == "none" else
                                             "no device headroom for a layer input"))
        return best
    ac["keep_on_device"] = k
    trial = planner_factory(cfg).run(seq_len)
    if trial.fits:
        log(f"ds_longctx auto: {key}={k}: the most layer inputs the device holds ({trial.binding_detail})")
        return trial
    ac["keep_on_device"] = 0
    log(f"ds_longctx auto: {key}=0: {k} did not fit when simulated ({trial.binding_detail})")
    return best
