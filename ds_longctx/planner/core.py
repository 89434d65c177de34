"""plan(): model states by arithmetic + one simulated step of activations -> peak device/host bytes.

Depth. A step's activation peak is affine in the layer count (every layer leaves the same saved
tensors or checkpoint; the layer working set and the loss do not depend on depth), so by default the
step is simulated at 2 and 3 layers and extrapolated per category to the model's depth. This is
checked against full-depth runs (tests/test_planner.py; ``--full-depth`` forces them), and
``max_context`` re-checks its answer at full depth.
"""
from __future__ import annotations

import copy
import logging
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

from ..config import SECTION, ConfigError, auto_keys, load_ds_config, parse
from ..dist.layout import Layout
from ..measure.formula import attention_layers, attention_width, flops_per_sample
from ..models import text_config
from ..models.loading import load_model_config
from ..patching.spec import build_spec
from . import host as host_plan
from . import model_states as ms
from .objectives import OBJECTIVES, grpo_extras
from .rates import step_time, target_rates
from .simulate import ALLOCATOR_MODES, CATEGORIES, build_model, simulate_step, with_layers
from .units import fmt_bytes, fmt_over, parse_bytes

logger = logging.getLogger("ds_longctx.planner")

EXTRAPOLATE_FROM = (2, 3)

# What an H100-80GB gives the CUDA caching allocator: cudaMemGetInfo's total is ~79.2 GiB (80 GB of HBM3
# less the driver's carve-outs), and the CUDA context takes some of it before the first allocation.
H100_USABLE = "79.1GiB"
# Device memory the step cannot use though the planner's simulation does not see it: CUDA context (outside
# the allocator on some drivers), NCCL communicator buffers (DeepSpeed creates several groups), cuBLAS
# workspaces, and the fragmentation of allocations the simulation does not trace (DeepSpeed's own streams beyond
# the model-state arithmetic). The fragmentation of the step's own allocations is predicted (reserved_device_bytes).
DEFAULT_RESERVE = "2GiB"
RESERVE_WHAT = "CUDA context, NCCL communicators, cuBLAS workspaces, untraced fragmentation"
_NAMED_DEVICES = {"h100": H100_USABLE}


def device_budget(gpu_mem=None):
    """(bytes, where the figure comes from) for ``--gpu-mem``: None/"auto" means this machine's CUDA device
    when one exists, else the usable memory of an H100-80GB; "h100" names that figure; anything else is a
    byte size ("80GiB")."""
    key = str(gpu_mem).strip().lower() if gpu_mem is not None else "auto"
    if key == "auto":
        try:
            import torch

            if torch.cuda.is_available():
                dev = torch.cuda.current_device()
                total = torch.cuda.mem_get_info(dev)[1]
                return int(total), f"this machine's cuda:{dev} ({torch.cuda.get_device_name(dev)}, cudaMemGetInfo total)"
        except Exception:  # no usable driver: fall through to the stated nominal figure
            pass
        key = "h100"
    if key in _NAMED_DEVICES:
        return parse_bytes(_NAMED_DEVICES[key]), (f"nominal H100-80GB: {_NAMED_DEVICES[key]} usable by the allocator "
                                                  "(pass --gpu-mem for another device)")
    return parse_bytes(gpu_mem), f"--gpu-mem {gpu_mem}"


@dataclass
class PlanResult:
    fits: bool
    sequence_length: int
    world_size: int
    sequence_parallel_size: int
    peak_device_bytes: int
    device_budget_bytes: int
    reserve_bytes: int
    host_bytes: int                 # per rank
    host_bytes_per_node: int
    host_budget_bytes: Optional[int]
    breakdown: Dict[str, int]       # model_states, attention, mlp, loss, other (device, at the activation peak)
    model_states: Dict[str, int]    # device model-state parts
    host: Dict[str, int]            # host parts: offloaded activations, optimizer, grads, params
    layers_simulated: List[int]
    num_layers: int
    extrapolated: bool
    sim_seconds: float
    notes: List[str] = field(default_factory=list)
    label: str = ""
    nvme_bytes_per_node: int = 0    # offloaded layer inputs (and ZeRO nvme states) on the node's drive
    offload: Dict = field(default_factory=dict)  # planner/host.py: configured target, options, recommendation
    activation_peak_bytes: int = 0  # sum(breakdown): model states + activations at the backward's peak
    step_peak_bytes: int = 0        # inside optimizer.step(): model states + step-only buffers, no activations
    budget_source: str = ""
    time: Dict = field(default_factory=dict)  # planner/rates.py StepTime on the target: seconds, mfu, parts, ...
    host_budget_source: str = ""    # where host_budget_bytes came from ("not checked" when None)
    # each limit: need and budget in bytes per device (device: the peak against the budget less the reserve) or per
    # node (host, nvme); budget None = not checked
    limits: Dict = field(default_factory=dict)
    # "device" | "host" | "nvme" | "search limit": over budget, the limit exceeded most; within, the tightest (a
    # max-context answer: the limit the next length exceeds); binding_detail says which it is, with the figures
    binding: str = ""
    binding_detail: str = ""
    # what max_memory_reserved will show with room to spare: peak_device_bytes plus the caching allocator's stranded
    # bytes (the step's device allocations replayed through measure/allocator.py in ``allocator["mode"]``).
    # allocator: {"mode", "activation_slack_bytes", "reserved_by_mode": {mode: bytes}, "floor_bytes" (what no
    # out-of-memory retry releases: the least the device must hold), "need_bytes" (what "fits" and the device limit
    # use: the floor with expandable segments, reserved with classic ones), "stranded": [[label, bytes], ...] (the
    # requests that mapped memory while free blocks were too small, in the deepest simulated step)}
    reserved_device_bytes: int = 0
    allocator: Dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------


def _count_params(model_config, n: int) -> tuple:
    """(total, largest module's own, persistent (<= 1e5 elements), largest decoder-layer child) of an ``n``-layer
    fake build (no allocation)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import torch

    model = build_model(with_layers(model_config, n), torch.bfloat16, "meta", FakeTensorMode(allow_non_fake_inputs=True))
    total = sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    small = sum(p.numel() for p in model.parameters() if p.numel() <= 100000)
    block = max((sum(p.numel() for p in child.parameters()) for layer in model.get_decoder().layers
                 for child in layer.children()), default=0)
    return total, largest, small, block


def param_info(model_config) -> ms.ParamInfo:
    """Parameter counts from fake 1- and 2-layer builds (no allocation), extended to full depth (per layer kind)."""

    def count(n):
        return _count_params(model_config, n)

    L = text_config(model_config).num_hidden_layers
    kinds = _layer_kinds(model_config)
    if kinds is None:
        t1, big, s1, block = count(1)
        t2, _, s2, _ = count(2)
        return ms.ParamInfo(total=t1 + (L - 1) * (t2 - t1), largest_module=big, persistent=s1 + (L - 1) * (s2 - s1),
                            largest_layer_block=block)
    # layers of several kinds (DeepSeek-V3's first 3 dense MLP layers, then MoE): one layer's parameters per kind,
    # times the kind's count (from 1 and 2 layers as the model starts, its dense layers alone, the experts were missing)
    total = persistent = big = block = 0
    base = None
    for kind in sorted(set(kinds)):
        mc = _all_of(model_config, kind)
        t1, b1, s1, k1 = _count_params(mc, 1)
        t2, _, s2, _ = _count_params(mc, 2)
        if base is None:
            base = (t1 - (t2 - t1), s1 - (s2 - s1))
        n = kinds.count(kind)
        total, persistent = total + n * (t2 - t1), persistent + n * (s2 - s1)
        big, block = max(big, b1), max(block, k1)
    return ms.ParamInfo(total=base[0] + total, largest_module=big, persistent=base[1] + persistent,
                        largest_layer_block=block)


def _persistent(ds_config: dict, info: ms.ParamInfo) -> ms.ParamInfo:
    zero = ds_config.get("zero_optimization") or {}
    thr = zero.get("stage3_param_persistence_threshold", zero.get("param_persistence_threshold", 100000))
    return info if thr == "auto" or int(float(thr)) >= 100000 else \
        ms.ParamInfo(info.total, info.largest_module, 0, info.largest_layer_block)


# ---------------------------------------------------------------------------------------------
# plan
# ---------------------------------------------------------------------------------------------


def _micro_batch(ds_config: dict) -> int:
    mb = ds_config.get("train_micro_batch_size_per_gpu", 1)
    return 1 if mb in (None, "auto") else int(mb)


def _steps(model_config, ds_config, lc, spec, world, seq, device, full_depth) -> tuple:
    """(device breakdown at the peak, host bytes per rank, layers simulated, extrapolated, seconds, work, allocator:
    {mode: {"slack": reserved beyond the activation peak, "stranded": [[label, bytes], ...]}}). ``lc``:
    the section simulated (planner/host.simulation_lc); ``spec``: the run's resolved counts (its keep_on_device and
    kept_attention_layers, for the model's full depth)."""
    L = spec.model.layers
    bs = _micro_batch(ds_config)
    # keep_on_device=k: the last k layers differ from the rest, so extrapolate from k+2 and k+3 layers
    shift = spec.keep_on_device
    lo, hi = EXTRAPOLATE_FROM[0] + shift, EXTRAPOLATE_FROM[1] + shift
    if full_depth or L <= hi + 1:
        r = simulate_step(model_config, ds_config, lc, world, seq, L, device=device, batch_size=bs)
        return r.breakdown, r.peak_host, [L], False, r.seconds, r.work, _slack([(1, None, r)], r)
    n = spec.kept_attention_layers
    off = L - shift  # the offloaded layers: the first ones
    if 0 < n < L:
        # the first n layers keep their attention output: not affine in depth from two shallow models. Blend per
        # layer between none keeping and, for n <= off, every offloaded layer keeping (at depth d the first d -
        # shift: the device-kept last layers do not), else every layer; the device peak is that second step's
        def keeping(value):
            return lambda d: host_plan.with_checkpointing(lc, keep_attention_output=value(d))

        none = _affine(model_config, ds_config, keeping(lambda d: False), world, seq, device, bs, lo, hi, L)
        most = L if n > off else off  # the layers whose recompute the "full" step skips
        full = _affine(model_config, ds_config, keeping(lambda d: d - shift if n <= off else True), world, seq,
                       device, bs, lo, hi, L)
        f = n / most
        work = {k: tuple(y + f * (x - y) for x, y in zip(full[5].get(k, (0.0,) * 3), none[5].get(k, (0.0,) * 3)))
                for k in sorted(set(full[5]) | set(none[5]))}  # (sorted: one summation order, any hash seed)
        host = none[1] + min(1.0, n / off) * (full[1] - none[1]) if off > 0 else none[1]
        return full[0], host, full[2], True, full[4] + none[4], work, full[6]
    return _affine(model_config, ds_config, lambda d: lc, world, seq, device, bs, lo, hi, L)


def _mixed_layer_types(model_config) -> Optional[list]:
    """The model's ``layer_types`` when they hold more than one kind (Qwen3.5: 3 Gated DeltaNet to 1 attention)."""
    types = getattr(text_config(model_config), "layer_types", None)
    return [str(t) for t in types] if isinstance(types, (list, tuple)) and len(set(map(str, types))) > 1 else None


def _dense_prefix(tc) -> Optional[int]:
    """DeepSeek-style MoE stacks' leading dense-MLP layers (``first_k_dense_replace``), when some but not all layers."""
    k = getattr(tc, "first_k_dense_replace", None)
    L = getattr(tc, "num_hidden_layers", 0)
    return k if isinstance(k, int) and 0 < k < L and getattr(tc, "n_routed_experts", None) else None


def _layer_kinds(model_config) -> Optional[List[str]]:
    """Each layer's kind when the model has more than one: its ``layer_types`` entry, with "/dense" or "/moe" where a
    DeepSeek-style stack starts with dense-MLP layers (:func:`_dense_prefix`); None for one kind."""
    tc = text_config(model_config)
    L = tc.num_hidden_layers
    types = _mixed_layer_types(model_config) or ["layer"] * L
    k = _dense_prefix(tc)
    kinds = [f"{t}/{'dense' if k is not None and i < k else 'moe'}" if k is not None else t
             for i, t in enumerate(types)]
    return kinds if len(set(kinds)) > 1 else None


def _all_of(model_config, kind: str):
    """The model with every layer of ``kind`` (:func:`_layer_kinds`), each with the attention shape of the model's
    first layer of that kind: where the config gives shapes per layer (transformers' heterogeneous configs: Gemma 4's
    global layers have their own head_dim and key/value heads), that layer's overrides on every layer (else its global
    layers grew with the sliding layers' head_dim); a DeepSeek-style stack's MLP kind on every layer."""
    cfg = copy.deepcopy(model_config)
    tc = text_config(cfg)
    kinds = _layer_kinds(model_config) or [kind] * tc.num_hidden_layers
    first = kinds.index(kind)
    kind, _, mlp = kind.partition("/")
    if mlp:
        tc.first_k_dense_replace = tc.num_hidden_layers + 1 if mlp == "dense" else 0
    if kind != "layer" and isinstance(getattr(tc, "layer_types", None), (list, tuple)):
        tc.layer_types = [kind] * len(tc.layer_types)
    spec = tc.__dict__.get("_heterogeneity_spec")
    if spec is not None:
        like = dict(spec.per_layer_overrides.get(first, {}))
        tc.per_layer_config = {i: dict(like) for i in range(tc.num_hidden_layers)} if like else None
    return cfg


def _affine(model_config, ds_config, lc_at, world, seq, device, bs, lo, hi, L) -> tuple:
    """The step at ``lo`` and ``hi`` layers (``lc_at(depth)``), extrapolated per category to ``L`` layers. Layers of
    several kinds (``layer_types``): the first ``lo`` as the model has them, then per kind the growth from ``lo`` to
    ``hi`` layers of that kind alone, times the kind's count among the rest (two shallow prefixes of Qwen3.5 hold
    only Gated DeltaNet layers: extrapolated from them, its 8 attention layers were missing)."""
    a = simulate_step(model_config, ds_config, lc_at(lo), world, seq, lo, device=device, batch_size=bs)
    types = _layer_kinds(model_config)
    if types is None:
        b = simulate_step(model_config, ds_config, lc_at(hi), world, seq, hi, device=device, batch_size=bs)
        growth, secs = [(L - lo, a, b)], a.seconds + b.seconds
    else:
        growth, secs = [], a.seconds
        for kind in sorted(set(types)):
            n = types[lo:].count(kind)
            if n:
                mk = _all_of(model_config, kind)
                x = simulate_step(mk, ds_config, lc_at(lo), world, seq, lo, device=device, batch_size=bs)
                y = simulate_step(mk, ds_config, lc_at(hi), world, seq, hi, device=device, batch_size=bs)
                growth.append((n, x, y))
                secs += x.seconds + y.seconds
    br = {c: max(0, a.breakdown[c] + sum(n * (y.breakdown[c] - x.breakdown[c]) for n, x, y in growth))
          for c in CATEGORIES}
    host = max(0, a.peak_host + sum(n * (y.peak_host - x.peak_host) for n, x, y in growth))
    # the step's work is affine in depth too (every layer of a kind does the same work)
    zero = (0.0, 0.0, 0.0)
    # sorted: the step's time sums the work in one order whatever PYTHONHASHSEED is (a set's order varied the last bit)
    keys = sorted(set(a.work).union(*(set(x.work) | set(y.work) for _, x, y in growth)))
    work = {key: tuple(max(0.0, v + sum(n * (wy[i] - wx[i]) for n, wx, wy in
                                        ((n, x.work.get(key, zero), y.work.get(key, zero)) for n, x, y in growth)))
                       for i, v in enumerate(a.work.get(key, zero)))
            for key in keys}
    return br, host, [lo, hi], True, secs, work, _slack(growth, a)


def _slack(growth, a) -> Dict[str, dict]:
    """Per allocator mode: the reserved bytes beyond the activation peak (simulate.StepMemory.reserved_slack) and the
    floor's, and the labels that stranded the most in the deepest step simulated. ``growth``: (layers, shallow, deeper)
    steps; ``a``: the step they grow from; one full-depth step: ``[(1, None, step)]``. The slack is not grown with
    depth: what strands is the per-layer working set above what the layers keep, which repeats layer after layer and
    reuses the same holes (the 8B layer shape at 64K / SP 8: classic slack 1.44 GB at 2 layers, 1.56 GB at 3, 4, 5 and 8;
    expandable 1.26 GB at each), so the largest of the simulated steps' is taken (an affine extrapolation
    over-counted 3.4% at 8 layers)."""
    steps = [a] + [s for _, x, y in growth for s in (x, y) if s is not None]
    deepest = growth[-1][2]
    out = {}
    for mode in ALLOCATOR_MODES:
        out[mode] = {"stranded": list(deepest.allocator.get(mode, {}).get("stranded", [])),
                     "slack": max(s.reserved_slack(mode) for s in steps),
                     "floor_slack": max(s.reserved_slack(mode, "floor") for s in steps)}
    return out


def allocator_mode(value=None) -> str:
    """"expandable" or "classic": ``value`` when given (--allocator), else what PYTORCH_CUDA_ALLOC_CONF says in this
    environment, else "expandable" (what launch/*.sh export for every run)."""
    import os

    if value is not None:
        key = str(value).strip().lower()
        if key not in ("expandable", "classic"):
            raise ConfigError("--allocator", f"{value!r} is not an allocator mode",
                              "use expandable (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) or classic")
        return key
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower()
    return "classic" if conf and "expandable_segments:true" not in conf else "expandable"


class Planner:
    """Holds what does not change across sequence lengths (configs, parameter counts, model states)."""

    def __init__(self, ds_config, model_config, world_size: int, gpu_mem=None, host_mem=None,
                 reserve=DEFAULT_RESERVE, gpus_per_node: Optional[int] = None, device: str = "meta",
                 full_depth: bool = False, params: Optional[ms.ParamInfo] = None, target: Optional[str] = "h100",
                 host_budget_source: Optional[str] = None, nvme_mem=None, objective: str = "sft",
                 allocator: Optional[str] = None):
        if objective not in OBJECTIVES:
            raise ConfigError("--objective", f"is {objective!r}", f"use one of {', '.join(OBJECTIVES)}")
        self.objective = objective  # "grpo": planner/objectives.py's reference model, token fields and generation
        self.ds_config = load_ds_config(ds_config) if not isinstance(ds_config, dict) else copy.deepcopy(ds_config)
        self.allocator = allocator_mode(allocator)
        self.model_config = model_config
        self.world = int(world_size)
        if self.world < 1:
            raise ConfigError("--gpus", f"must be a positive integer, got {world_size}", "pass the world size")
        try:
            self.budget, self.budget_source = device_budget(gpu_mem)
            self.reserve = parse_bytes(DEFAULT_RESERVE if reserve is None else reserve)
            self.host_budget = parse_bytes(host_mem) if host_mem is not None else None
            self.nvme_budget = parse_bytes(nvme_mem) if nvme_mem is not None else None
        except ValueError as e:
            raise ConfigError("--gpu-mem/--host-mem/--nvme-mem/--reserve", str(e), "write sizes like 80GiB") from None
        self.host_budget_source = host_budget_source or (
            "not checked (no host budget given)" if self.host_budget is None else f"--host-mem {host_mem}")
        if self.budget <= self.reserve:
            raise ConfigError("--gpu-mem", f"the budget {fmt_bytes(self.budget)} leaves nothing after the "
                              f"reserve {fmt_bytes(self.reserve)}", "give the device memory, e.g. 80GiB")
        self.gpus_per_node = gpus_per_node or min(self.world, 8)

        self.rates = target_rates(target) if target else None
        self.device = device
        self.full_depth = full_depth
        self.lc = parse(self.ds_config)
        for key in auto_keys(self.lc):
            raise ConfigError(f"{SECTION}.{key}", "'auto' is a choice the planner makes (ds_longctx.planner."
                              "resolve_auto, run by ds_longctx.initialize), not a setting one step can be planned with",
                              "plan with a value (true/false or a number of layers for keep_attention_output, a number "
                              "for keep_on_device and heads_per_chunk: the plan lists the offload options that fit), "
                              "or resolve first")
        # the run's resolved counts (keep_on_device, kept attention layers) at full depth; checks the section against
        # the model and the world (each simulated step's spec checks it again with its sequence length)
        self.spec = build_spec(self.lc, self.model_config, Layout(world=self.world, sp=self.lc.sequence_parallel_size))
        self.sim_lc = host_plan.simulation_lc(self.lc)  # every input to host; targets by arithmetic
        self.params = _persistent(self.ds_config, params or param_info(model_config))
        self.states = ms.compute(self.ds_config, self.params, self.world)
        host_plan.check_host_budget(self.states, self.host_budget, self.gpus_per_node)
        if max(self.states.device_total, self.step_peak) + self.reserve >= self.budget:
            raise ConfigError("--gpu-mem", f"the model states alone need {fmt_bytes(self.states.device_total)} per "
                              f"device (ZeRO-{self.states.zero_stage}, {self.world} ranks), over the budget "
                              f"{fmt_bytes(self.budget - self.reserve)}: no sequence length can fit",
                              "use more GPUs, ZeRO-3, or offload_optimizer/offload_param to cpu")

    @property
    def step_peak(self) -> int:
        return self.states.device_total + self.states.step_transient_device

    def run(self, seq_len: int, label: str = "", full_depth: Optional[bool] = None) -> PlanResult:
        sp = self.lc.sequence_parallel_size
        fd = self.full_depth if full_depth is None else full_depth
        br, host_act, layers, extrap, secs, work, alloc = _steps(self.model_config, self.ds_config, self.sim_lc,
                                                                 self.spec, self.world, seq_len, self.device, fd)
        breakdown = {"model_states": self.states.device_total, **br}
        rl = None
        if self.objective == "grpo":
            rl = grpo_extras(self.model_config, self.params.total, 4 if self.states.model_dtype == "fp32" else 2,
                             self.states.zero_stage, self.world, seq_len, _micro_batch(self.ds_config))
            breakdown.update(rl["breakdown"])
        act_peak = sum(breakdown.values())
        # the activations are gone before optimizer.step() allocates its step-only buffers
        peak = max(act_peak, self.step_peak)
        # what the caching allocator holds at the backward's peak: the live bytes plus the step's stranded slack (its
        # device allocations replayed through measure/allocator.py; model states are allocated once, or on their own
        # streams' pools by arithmetic, and add as they are); the optimizer step reuses the activations' cached blocks
        # (a simulated CPU run, device "cpu": no CUDA caching allocator, nothing added)
        slack = alloc[self.allocator]["slack"] if self.device == "meta" else 0
        floor_slack = alloc[self.allocator]["floor_slack"] if self.device == "meta" else 0
        act_reserved = act_peak + slack
        reserved = max(act_reserved, self.step_peak)
        floor = max(act_peak + floor_slack, self.step_peak)
        # what must fit: with expandable segments the allocator, when a mapping fails, unmaps every page no live block
        # touches and retries (CUDACachingAllocator release_cached_blocks -> unmap_block), so the floor must fit (the
        # H200's (c) ran with an unpressured reserved prediction over its 150 GB: it reserved 148.6 GB, 1.05x its
        # allocated); with classic segments only wholly free segments go back, so the reserved peak must
        need = floor if self.allocator == "expandable" else reserved
        act_need = act_peak + (floor_slack if self.allocator == "expandable" else slack)
        num_layers = self.spec.model.layers
        hs = host_plan.host_side(self.spec, self.states, int(host_act), host_plan.offloaded_bytes_per_layer(
            self.model_config, self.ds_config, self.spec, seq_len, _micro_batch(self.ds_config)), act_need,
            self.budget, self.reserve, self.host_budget, self.gpus_per_node, step_peak=self.step_peak)
        host = hs.host
        host_total = sum(host.values())
        host_node = host_total * self.gpus_per_node
        nvme_node = int(sum(hs.nvme.values()) * self.gpus_per_node)
        fits = need + self.reserve <= self.budget and (self.host_budget is None or host_node <= self.host_budget) \
            and (self.nvme_budget is None or nvme_node <= self.nvme_budget)
        notes = list(self.states.notes)
        if need < reserved and need + self.reserve <= self.budget < reserved + self.reserve:
            notes.append(f"reserved {fmt_bytes(reserved)} (predicted max_memory_reserved with room to spare) is over "
                         f"the budget; the allocator's floor {fmt_bytes(floor)} is not: with expandable segments the "
                         "step runs, the caching allocator releasing its cached pages when a mapping fails (a device "
                         "sync each time: slower)")
        if self.states.step_transient_device:
            notes.append(f"optimizer step: {fmt_bytes(self.step_peak)} (model states + "
                         f"{fmt_bytes(self.states.step_transient_device)} fp32 sub-group grad, no activations)"
                         + (" is the peak" if self.step_peak > act_peak else ""))
        if hs.nvme:
            notes.append("on NVMe per rank: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in hs.nvme.items()))
        if self.host_budget is not None and host_node > self.host_budget:
            rec = hs.offload.get("recommended")
            notes.append(f"host memory per node: {fmt_over(host_node, self.host_budget)} (--host-mem)"
                         + (f"; set activation_checkpointing {rec['keys']} (host {fmt_bytes(rec['host_bytes_per_node'])}"
                            f"/node)" if rec else "; no offload target fits"))
        timing = self._step_time(work, hs, seq_len) if self.rates is not None else None
        limits = {"device": {"need": int(need), "budget": int(self.budget - self.reserve), "per": "device",
                             "what": ("the allocator's floor (expandable segments)" if self.allocator == "expandable"
                                      else "the reserved peak (classic segments)") + f" against the "
                                     f"{fmt_bytes(self.budget)} budget less the {fmt_bytes(self.reserve)} reserve"},
                  "host": {"need": int(host_node), "budget": self.host_budget, "per": "node",
                           "source": self.host_budget_source},
                  "nvme": {"need": nvme_node, "budget": self.nvme_budget, "per": "node",
                           "source": "not checked (no --nvme-mem)" if self.nvme_budget is None else "--nvme-mem"}}
        if rl is not None:
            gen = rl["generation"]
            limits["generation"] = {"need": gen["bytes"], "budget": int(self.budget - self.reserve), "per": "device",
                                    "what": "the rollout's generation on one rank"}
            fits = fits and gen["bytes"] + self.reserve <= self.budget
            notes.append(f"GRPO: generation on one rank (TRL's transformers generate, whole sequences): "
                         f"{fmt_bytes(gen['bytes'])} (weights gathered {fmt_bytes(gen['weights'])}, KV cache of "
                         f"{gen['rows']} rollout row(s) {fmt_bytes(gen['kv_cache'])}); the training step adds the "
                         f"reference model {fmt_bytes(rl['breakdown']['rl_reference_model'])} and the per-token "
                         f"values {fmt_bytes(rl['breakdown']['rl_token_fields'])} (planner/objectives.py)")
        binding, detail = binding_limit(limits)
        return PlanResult(fits=fits, sequence_length=seq_len, world_size=self.world, sequence_parallel_size=sp,
                          peak_device_bytes=int(peak), device_budget_bytes=self.budget, reserve_bytes=self.reserve,
                          host_bytes=int(host_total), host_bytes_per_node=int(host_node),
                          host_budget_bytes=self.host_budget, breakdown={k: int(v) for k, v in breakdown.items()},
                          model_states=dict(self.states.device), host={k: int(v) for k, v in host.items()},
                          layers_simulated=layers, num_layers=num_layers,
                          extrapolated=extrap, sim_seconds=round(secs, 3), notes=notes, label=label,
                          nvme_bytes_per_node=int(sum(hs.nvme.values()) * self.gpus_per_node), offload=hs.offload,
                          activation_peak_bytes=int(act_peak), step_peak_bytes=int(self.step_peak),
                          budget_source=self.budget_source, time=timing.to_dict() if timing else {},
                          host_budget_source=self.host_budget_source, limits=limits, binding=binding,
                          binding_detail=detail, reserved_device_bytes=int(reserved),
                          allocator={"mode": self.allocator, "activation_slack_bytes": int(slack),
                                     "reserved_by_mode": {m: int(max(act_peak + v["slack"], self.step_peak))
                                                          for m, v in alloc.items()},
                                     "floor_bytes": int(floor), "need_bytes": int(need),
                                     "stranded": alloc[self.allocator]["stranded"]})

    def _step_time(self, work, hs, seq_len: int):
        """Predicted step seconds, MFU and tokens/s on ``self.rates`` (planner/rates.py)."""
        tc = text_config(self.model_config)
        lc, W, per_node = self.lc, self.world, self.gpus_per_node
        sp = lc.sequence_parallel_size
        bs = _micro_batch(self.ds_config)
        lp = 4 if self.states.model_dtype == "fp32" else 2
        P = self.params.total
        traffic: Dict[str, float] = {}
        if self.states.zero_stage == 3 and W > 1:
            share = P * lp * (W - 1) / W
            # forward, backward, and again for the checkpoint recompute (ZeRO-3 releases a module's params after
            # its forward)
            gathers = 3 if lc.activation_checkpointing.enabled else 2
            traffic.update(zero3_gather=gathers * share, zero3_reduce=share, zero3_internode=W > per_node)
        elif self.states.zero_stage in (1, 2) and W > 1:
            traffic.update(zero3_reduce=P * lp * (W - 1) / W, zero3_internode=W > per_node)
        off = hs.host.get("offloaded activations", 0)
        if off:
            traffic["offload_host"] = 2.0 * off  # out in forward, back in backward
        nvme = hs.nvme.get("offloaded activations", 0)
        if nvme:
            traffic["offload_nvme"] = 2.0 * nvme * per_node  # the node's drives serve every rank of the node
        zero = self.ds_config.get("zero_optimization") or {}
        if ((zero.get("offload_optimizer") or {}).get("device") or "none") != "none":
            traffic["optimizer_offload"] = P / W * (4 + lp)  # fp32 grad partition out, updated params back
        emb = tc.vocab_size * tc.hidden_size
        model = flops_per_sample(seq_len, P - emb, attention_layers(tc), attention_width(tc))["total"] * bs / sp
        # with a ring (attention.ring_degree) the all-to-alls span only the Ulysses group (consecutive ranks: inside
        # a node when it fits) and the ring's P2P crosses nodes once the SP group does
        ulysses = sp // self.spec.ring
        return step_time(work, traffic, self.rates, model, seq_len * bs / sp, a2a_internode=ulysses > per_node,
                         p2p_internode=sp > per_node)

    def max_context(self, granularity: Optional[int] = None, limit: int = 1 << 27, label: str = ""):
        """Largest S (a multiple of SP) whose step fits, and the PlanResult at it (None when none fits)."""
        unit = granularity or self.lc.sequence_parallel_size
        cache: Dict[int, PlanResult] = {}

        def at(k, full=None):
            if (k, full) not in cache:
                cache[(k, full)] = self.run(k * unit, label=label, full_depth=full)
            return cache[(k, full)]

        def root(a: PlanResult, b: PlanResult) -> int:
            """False position between a fitting ``a`` and a failing ``b``: the first crossing of any checked
            limit (device, host: each nearly affine in S) by linear interpolation of its headroom."""
            ka, kb, cross = a.sequence_length // unit, b.sequence_length // unit, []
            for name, vb in b.limits.items():
                va = a.limits[name]
                if vb["budget"] and vb["need"] > vb["budget"] and va["budget"]:
                    h_a, h_b = va["budget"] - va["need"], vb["budget"] - vb["need"]
                    if h_a >= 0 > h_b:
                        cross.append(ka + int((kb - ka) * h_a / (h_a - h_b)))
            return min(cross) if cross else (ka + kb) // 2

        lo = hi = max(1, 4096 // unit)
        while not at(lo).fits and lo > 1:
            hi, lo = lo, max(1, lo // 4)
        if not at(lo).fits:  # lo == 1: not even one unit fits
            return 0, _bound_by(at(1), at(1), 0)
        while at(hi).fits:  # gallop: memory grows at least linearly, so this brackets in few steps
            lo = hi
            hi = min(hi * 4, limit // unit)
            if hi == lo:
                best = at(lo)
                best.binding = "search limit"
                best.binding_detail = (f"search limit: the search stops at {limit:,} tokens; no memory limit binds "
                                       f"below it ({best.binding_detail})")
                return lo * unit, best
        halve = False
        while hi - lo > 1:
            # false position on the (nearly affine) headroom, every other step a bisection so that
            # steps in the curve (shard counts change with S) cannot stall it
            guess = (lo + hi) // 2 if halve else root(at(lo), at(hi))
            mid = min(max(guess, lo + 1), hi - 1)
            before = hi - lo
            if at(mid).fits:
                lo = mid
                if mid + 1 < hi and not at(mid + 1).fits:
                    hi = mid + 1
            else:
                hi = mid
                if mid - 1 > lo and at(mid - 1).fits:
                    lo = mid - 1
            halve = (hi - lo) * 2 > before
        best, stop = at(lo), at(hi)  # stop: the shortest length seen not to fit
        if best.extrapolated:
            # the answer is re-checked at full depth; walk down if extrapolation was optimistic
            full = at(lo, True)
            while not full.fits and lo > 1:
                stop = full
                lo = max(1, lo - max(1, lo // 200))
                full = at(lo, True)
            best = full if full.fits else at(lo)
        n = lo * unit if best.fits else 0
        return n, _bound_by(best, stop if best.fits else best, n)


_LIMIT_NAMES = {"device": "device memory", "host": "host memory", "nvme": "NVMe",
                "generation": "generation (device memory, one rank)"}


def _usable(v: dict) -> str:
    return " usable" if v["per"] == "device" else ""


def binding_limit(limits: Dict) -> tuple:
    """(key, words). Over budget: every exceeded limit with the digits that show by how much (the first named, and
    the key, is the largest overshoot). Within budget: "fits", then each checked limit's use, the tightest first
    (the key). Unchecked limits are named as such. "binds" is left to the max-context answer (_bound_by)."""
    def frac(v):
        return v["need"] / v["budget"]

    checked = {k: v for k, v in limits.items() if v["budget"]}
    unchecked = [f"{_LIMIT_NAMES[k]} not checked ({fmt_bytes(v['need'])}/{v['per']})"
                 for k, v in limits.items() if not v["budget"]]
    over = sorted((k for k, v in checked.items() if v["need"] > v["budget"]), key=lambda k: -frac(checked[k]))
    if over:
        key = over[0]
        words = "over " + "; ".join(f"{_LIMIT_NAMES[k]}: {fmt_over(checked[k]['need'], checked[k]['budget'])}"
                                    f"{_usable(checked[k])} per {checked[k]['per']}" for k in over)
    else:
        key = max(checked, key=lambda k: frac(checked[k]))
        words = "fits; tightest: " + "; ".join(
            f"{_LIMIT_NAMES[k]} {100 * frac(v):.0f}% used ({fmt_over(v['need'], v['budget'])}{_usable(v)} per "
            f"{v['per']})" for k, v in sorted(checked.items(), key=lambda kv: -frac(kv[1])))
    return key, words + ("; " + "; ".join(unchecked) if unchecked else "")


def _bound_by(best: "PlanResult", stop: "PlanResult", n: int) -> "PlanResult":
    """Mark ``best`` (the max-context answer) with the limit that ``stop`` (the shortest length that
    does not fit, or ``best`` itself when none fits) exceeds."""
    over = [k for k, v in stop.limits.items() if v["budget"] and v["need"] > v["budget"]]
    best.binding = over[0] if over else stop.binding
    v = stop.limits.get(best.binding)
    at = (f"{fmt_over(v['need'], v['budget'])}{_usable(v)} per {v['per']}" if v and v["budget"] else
          stop.binding_detail)
    best.binding_detail = (f"bound by {_LIMIT_NAMES.get(best.binding, best.binding)}: at {stop.sequence_length:,} "
                           f"tokens {at}")
    return best


def plan(ds_config, model_config=None, *, model: Optional[str] = None, world_size: int = 8, gpu_mem=None,
         host_mem=None, seq_len: Optional[int] = None, reserve=DEFAULT_RESERVE, gpus_per_node: Optional[int] = None,
         device: str = "meta", full_depth: bool = False, nvme_mem=None, allocator: Optional[str] = None) -> PlanResult:
    """Plan one training step (see module doc). ``seq_len`` defaults to long_context.sequence_length; ``host_mem``
    and ``nvme_mem``: per node, checked when given."""
    mc = load_model_config(model_config, model)
    p = Planner(ds_config, mc, world_size, gpu_mem, host_mem, reserve, gpus_per_node, device, full_depth,
                nvme_mem=nvme_mem, allocator=allocator)
    seq = seq_len if seq_len is not None else p.lc.sequence_length
    if seq is None:
        raise ConfigError("--seq-len", "no sequence length was given",
                          "pass --seq-len N, set long_context.sequence_length, or use --max-context")
    return p.run(int(seq))


def max_context(ds_config, model_config=None, *, model=None, world_size: int = 8, gpu_mem=None, host_mem=None,
                reserve=DEFAULT_RESERVE, gpus_per_node=None, device: str = "meta", nvme_mem=None,
                allocator: Optional[str] = None) -> tuple:
    mc = load_model_config(model_config, model)
    p = Planner(ds_config, mc, world_size, gpu_mem, host_mem, reserve, gpus_per_node, device, nvme_mem=nvme_mem,
                allocator=allocator)
    return p.max_context()
