"""The stack ladder (--compare) and "auto" resolution, both by running the planner."""
from __future__ import annotations

import copy
import math
import logging
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ..config import SECTION, auto_keys, parse
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
    """The query heads per rank every layer's heads_per_chunk must divide: the greatest common divisor of each layer
    shape's (Gemma 4: sliding and global layers may differ)."""
    return math.gcd(*(s.heads // max(1, sp) for s in attention_shape(model_config).distinct()))


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


@dataclass(frozen=True)
class Knob:
    """One "auto" value of the ``long_context`` section: ``key`` (its path inside the section, e.g.
    "attention.heads_per_chunk") and its candidates in speed order (fastest first; the last is the
    memory-safest)."""
    key: str
    values: Tuple = ()


def ds_config_with(ds_config: dict, values: Mapping[str, object]) -> dict:
    """A new ds_config: ``ds_config`` with the ``long_context`` values ``values`` ({"attention.heads_per_chunk":
    4, "tiled_mlp.shards": 2, ...}) set, as one new section; ``ds_config`` is not modified."""
    patch: Dict[str, dict] = {}
    for key, value in values.items():
        sub, name = key.split(".")
        patch.setdefault(sub, {})[name] = value
    out = copy.deepcopy(ds_config)
    out[SECTION] = _merged(out.get(SECTION) or {}, patch)
    return out


def auto_knobs(section: dict, model_config, sp: int, seq_len: int, auto: Sequence[str] = ()) -> List[Knob]:
    """The speed knobs the section leaves to "auto", with their candidates: attention.heads_per_chunk (the
    divisors of the local query heads, most first) when ``auto`` (config.auto_keys of the section) has it, and the
    shards of an enabled tiled_mlp / tiled_loss ("auto" or absent: one up to DeepSpeed's rule, fewest first)."""
    knobs = []
    if "attention.heads_per_chunk" in auto:
        local = _local_heads(model_config, sp)
        knobs.append(Knob("attention.heads_per_chunk",
                          tuple(sorted([d for d in range(1, local + 1) if local % d == 0], reverse=True))))
    hidden, local_seq = None, seq_len // max(1, sp)
    for name in ("tiled_mlp", "tiled_loss"):
        sec = section.get(name) or {}
        if sec.get("enabled") and sec.get("shards", "auto") == "auto":
            hidden = hidden or text_config(model_config).hidden_size
            knobs.append(Knob(f"{name}.shards", tuple(_shard_candidates(local_seq, hidden))))
    return knobs


def resolve(planner_factory, ds_config: dict, model_config, world_size: int, seq_len: int, log=None,
            with_plan: bool = False):
    """The values for the "auto" settings of ``ds_config``: the fastest whose step fits, by the planner's predicted
    step time, as {key inside the section: value} (e.g. {"attention.heads_per_chunk": 4, "tiled_mlp.shards": 2};
    config.with_values applies them to the parsed section).

    Knobs: attention.heads_per_chunk and tiled_mlp/tiled_loss shards ("auto" or, for shards, absent);
    activation_checkpointing.keep_attention_output and keep_on_device when set to "auto" (reinvest memory
    into speed: each is turned on only where the device and the host budgets allow; NVMe capacity is not
    budgeted). Speed order: more heads per chunk means fewer all-to-all stages and larger kernels; fewer
    shards means fewer, larger matmuls. Start from the memory-safest setting (1 head per chunk,
    DeepSpeed's shard rule), relax each knob to the first value in speed order that fits, then walk on
    to the next fitting value while the predicted step time (PlanResult.time) is lower: ties between
    fitting settings go to the faster prediction, at one extra simulation per knob in the usual case.

    The choices are a flat mapping of values (``chosen``, the return value; with ``with_plan`` the pair (chosen,
    the PlanResult of the chosen configuration, None when nothing is "auto")); every simulated configuration is a
    new ds_config built from ``ds_config`` and them (:func:`ds_config_with`). ``ds_config`` is not modified.
    """
    chosen, best = _resolve(planner_factory, ds_config, model_config, world_size, seq_len, log or logger.info)
    return (chosen, best) if with_plan else chosen


def _resolve(planner_factory, ds_config: dict, model_config, world_size: int, seq_len: int, log):
    base = copy.deepcopy(ds_config)
    section = dict(base.get(SECTION) or {})
    section.setdefault("attention", {})
    base[SECTION] = section
    sp = base.get("sequence_parallel_size", 1)
    ac = section.get("activation_checkpointing") or {}
    auto = auto_keys(parse(base))  # config.AUTO_KEYS: the one list of the keys resolved here
    knobs = auto_knobs(section, model_config, sp, seq_len, auto)
    reinvest = [k.split(".")[1] for k in auto if k.startswith("activation_checkpointing.")]
    # memory-safest first: the last candidate of each knob, nothing reinvested
    chosen: Dict[str, object] = {k.key: k.values[-1] for k in knobs}
    chosen.update({f"activation_checkpointing.{k}": False if k == "keep_attention_output" else 0 for k in reinvest})
    if not knobs and not reinvest:
        return {}, None

    def run(values: Mapping[str, object]):
        return planner_factory(ds_config_with(base, values)).run(seq_len)

    r = run(chosen)
    if not r.fits:
        log(f"ds_longctx auto: even the memory-safest settings do not fit at {seq_len} tokens "
            f"({r.binding_detail}); keeping them: "
            + ", ".join([f"{k.key}={chosen[k.key]}" for k in knobs]
                        + [f"{k}={chosen[f'activation_checkpointing.{k}']}" for k in reinvest]))
        return chosen, r
    best = r
    for knob in knobs:
        value, best, why = _choose(knob, chosen, best, run)
        chosen = {**chosen, knob.key: value}
        log(f"ds_longctx auto: {SECTION}.{knob.key}={value}: {why} at {seq_len} tokens on {world_size} ranks "
            f"(predicted step {_seconds(best):.4g} s; candidates in speed order: {list(knob.values)})")
    if "keep_attention_output" in reinvest:
        value, best = _keep_attention_output(run, section, ac, chosen, best, log,
                                             text_config(model_config).num_hidden_layers)
        chosen = {**chosen, "activation_checkpointing.keep_attention_output": value}
    if "keep_on_device" in reinvest:
        value, best = _keep_on_device(run, ac, chosen, best, log)
        chosen = {**chosen, "activation_checkpointing.keep_on_device": value}
    return chosen, best


def _choose(knob: Knob, chosen: Mapping[str, object], best, run):
    """(value, its PlanResult, why) for one knob, the others as ``chosen``: the first value in speed order
    whose step fits (the memory-safest ``chosen[knob.key]`` is known to), then the next ones while each is
    predicted faster by more than :data:`TIE`."""
    pick, values, first = chosen[knob.key], knob.values, None
    for i, value in enumerate(values):
        if value == pick:
            break
        trial = run({**chosen, knob.key: value})
        if trial.fits:
            pick, best, first = value, trial, i
            break
    why = "the first in speed order whose step fits"
    if first is not None:
        # ties: the next fitting values in speed order, while predicted faster
        for value in values[first + 1:]:
            trial = run({**chosen, knob.key: value})
            if not (trial.fits and _seconds(trial) < _seconds(best) * (1 - TIE)):
                break
            pick, best = value, trial
            why = "predicted faster than the values before it in speed order"
    return pick, best, why


def _keep_attention_output(run, section, ac, chosen, best, log, num_layers: int):
    """(keep_attention_output, the PlanResult to beat next): True where it fits and is predicted faster; where
    only part fits the host budget, the most first layers that do (a count), checked by one more simulation."""
    key = f"{SECTION}.activation_checkpointing.keep_attention_output"
    att = section.get("attention") or {}
    if not ac.get("enabled") or att.get("implementation") != "untied_ulysses":
        log(f"ds_longctx auto: {key}=False: needs activation checkpointing and untied_ulysses attention")
        return False, best
    if ac.get("offload", "none") != "none" and best.host_budget_bytes is None:
        log(f"ds_longctx auto: {key}=False: the kept outputs go to host memory with the layer inputs and no host "
            "budget was given to check them against")
        return False, best
    trial = run({**chosen, "activation_checkpointing.keep_attention_output": True})
    if trial.fits and _seconds(trial) < _seconds(best) * (1 - TIE):
        log(f"ds_longctx auto: {key}=True: predicted step {_seconds(trial):.4g} s against {_seconds(best):.4g} s, "
            f"and it fits ({trial.binding_detail})")
        return True, trial
    why = (f"on, it does not fit ({trial.binding_detail})" if not trial.fits else
           f"not predicted faster ({_seconds(trial):.4g} s against {_seconds(best):.4g} s)")
    n = _kept_layers_that_fit(ac, chosen, best, trial, num_layers) if not trial.fits else 0
    if n > 0:
        part = run({**chosen, "activation_checkpointing.keep_attention_output": n})
        if part.fits and _seconds(part) < _seconds(best) * (1 - TIE):
            log(f"ds_longctx auto: {key}={n}: every layer {why}; the first {n} of {num_layers}: predicted step "
                f"{_seconds(part):.4g} s against {_seconds(best):.4g} s, and it fits ({part.binding_detail})")
            return n, part
        why += f"; the first {n} layers: " + (f"do not fit ({part.binding_detail})" if not part.fits else
                                               "not predicted faster")
    log(f"ds_longctx auto: {key}=False: {why}")
    return False, best


def _kept_layers_that_fit(ac, chosen, none, every, num_layers: int) -> int:
    """The most first layers whose kept outputs fit the host budget, by the per-layer host bytes between the
    plans with none and with every layer keeping (only the offloaded layers' outputs go to host)."""
    budget = none.host_budget_bytes
    if budget is None or ac.get("offload", "none") == "none":
        return 0
    kod = chosen.get("activation_checkpointing.keep_on_device", ac.get("keep_on_device", 0))
    off = num_layers - (kod if isinstance(kod, int) else 0)
    per_layer = (every.host_bytes_per_node - none.host_bytes_per_node) / max(1, off)
    if per_layer <= 0 or off <= 1:
        return 0
    return max(0, min(off, num_layers - 1, int((budget - none.host_bytes_per_node) // per_layer)))


def _keep_on_device(run, ac, chosen, best, log):
    """(keep_on_device, the PlanResult): the most last layers whose inputs stay on the device (no transfer)
    that the planner's offload options (planner/host.py, arithmetic on the simulated step; "none" = every layer
    kept) say fit, checked by one more simulation."""
    key = f"{SECTION}.activation_checkpointing.keep_on_device"
    target = ac.get("offload", "none")
    opts = [o for o in (best.offload or {}).get("options", []) if o["target"] in (target, "none") and o["fits"]]
    k = max((o["keep_on_device"] for o in opts), default=0)
    if target == "none" or k == 0:
        log(f"ds_longctx auto: {key}=0: " + ("nothing is offloaded" if target == "none" else
                                             "no device headroom for a layer input"))
        return 0, best
    trial = run({**chosen, "activation_checkpointing.keep_on_device": k})
    if trial.fits:
        log(f"ds_longctx auto: {key}={k}: the most layer inputs the device holds ({trial.binding_detail})")
        return k, trial
    log(f"ds_longctx auto: {key}=0: {k} did not fit when simulated ({trial.binding_detail})")
    return 0, best
