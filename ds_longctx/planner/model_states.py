"""Model-state bytes per rank (params, grads, optimizer state, ZeRO buffers) by arithmetic from the
ds_config.

These are the tensors DeepSpeed allocates at initialize and reuses every step; their sizes depend
only on parameter counts and the config, so arithmetic is exact enough and costs nothing. The
activations (which depend on the code that runs) are simulated instead (simulate.py).

What is counted, per rank, for world size N (ZeRO partitions over every rank, since with SP the
ZeRO data-parallel group is the sequence-data-parallel group = the world), P parameters, lp = the
model dtype's bytes (2 for bf16/fp16, 4 for fp32), k optimizer states per parameter (Adam: 2):

- stage 3: lp params P/N; grad partitions P/N in grad_accum_dtype; the contiguous-gradients IPG
  bucket (reduce_bucket_size elements, lp); fp32 master P/N; fp32 optimizer states k*P/N; the fp32
  gradient buffer of the largest optimizer sub-group (min(sub_group_size, P/N)), at the step-time
  peak only (``step_transient_device``); the gathered-parameter working set (largest module's full
  params + one prefetch bucket) and persistent params (numel <= stage3_param_persistence_threshold,
  kept whole); the reduce-scatter transients of backward (a flat copy of one IPG bucket + the full-
  size grads of the largest decoder-layer block awaiting their bucket).
- stage 1/2: full lp params; stage 1 full lp grads; the IPG bucket buffer (reduce_bucket_size elements,
  two with overlap_comm); fp32 grad partition, fp32 master and states P/N.
- stage 0 with bf16 (DeepSpeed's BF16_Optimizer): full lp params, full fp32 grads, master and states
  partitioned P/N. Stage 0 in fp32: full params, grads and states.
- offload_optimizer.device=cpu moves master, states and the fp32 grad partitions to host;
  offload_param.device=cpu (stage 3) moves the lp param partition to host; "nvme" moves them off
  both (reported as nvme).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from ..errors import ConfigError

_DTYPE_BYTES = {"fp32": 4, "float32": 4, "fp16": 2, "float16": 2, "bf16": 2, "bfloat16": 2, "half": 2, "float": 4}

# optimizer type (lower case) -> fp32 states per parameter
_OPT_STATES = {"adam": 2, "adamw": 2, "fusedadam": 2, "cpuadam": 2, "deepspeedcpuadam": 2, "onebitadam": 2,
               "zerooneadam": 2, "lamb": 2, "onebitlamb": 2, "fusedlamb": 2, "adagrad": 1, "lion": 1,
               "fusedlion": 1, "cpulion": 1, "muon": 1, "sgd": 1}


@dataclass
class ParamInfo:
    total: int                    # parameters in the model
    largest_module: int           # largest sum of a module's own (direct) parameters: one ZeRO-3 fetch
    persistent: int = 0           # params small enough to stay gathered under ZeRO-3
    largest_layer_block: int = 0  # largest child of a decoder layer (attention or MLP), all its params


@dataclass
class ModelStates:
    device: Dict[str, int] = field(default_factory=dict)
    host: Dict[str, int] = field(default_factory=dict)
    nvme: Dict[str, int] = field(default_factory=dict)
    step_transient_device: int = 0   # extra device bytes alive only inside optimizer.step()
    notes: List[str] = field(default_factory=list)
    model_dtype: str = "bf16"
    zero_stage: int = 0

    @property
    def device_total(self) -> int:
        return sum(self.device.values())

    @property
    def host_total(self) -> int:
        return sum(self.host.values())


def model_dtype(ds_config: dict) -> str:
    if (ds_config.get("bf16") or ds_config.get("bfloat16") or {}).get("enabled", False):
        return "bf16"
    if (ds_config.get("fp16") or {}).get("enabled", False):
        return "fp16"
    return "fp32"


def _int(section: dict, key: str, default: int, path: str) -> int:
    v = section.get(key, default)
    if v == "auto":  # HF Trainer style; DeepSpeed itself rejects it, so the default is what would run
        return default
    try:
        return int(float(v))
    except (TypeError, ValueError):
        raise ConfigError(path + key, f"expected a number, got {v!r}", "give an integer") from None


def _offload_device(zero: dict, key: str) -> str:
    sec = zero.get(key) or {}
    dev = str(sec.get("device", "none")).lower()
    if dev not in ("none", "cpu", "nvme"):
        raise ConfigError(f"zero_optimization.{key}.device", f"{dev!r} is not allowed", "use none, cpu or nvme")
    return dev


def optimizer_states_per_param(ds_config: dict, notes: Optional[list] = None) -> int:
    opt = ds_config.get("optimizer")
    if not opt:
        if notes is not None:
            notes.append("no optimizer in ds_config: assumed AdamW (2 fp32 states per parameter)")
        return 2
    name = str(opt.get("type", "adamw")).lower().replace("_", "")
    if name == "sgd":
        return 1 if float((opt.get("params") or {}).get("momentum", 0) or 0) > 0 else 0
    if name not in _OPT_STATES:
        if notes is not None:
            notes.append(f"optimizer {opt.get('type')!r} unknown to the planner: assumed 2 fp32 states per parameter")
        return 2
    return _OPT_STATES[name]


def compute(ds_config: dict, params: ParamInfo, world_size: int) -> ModelStates:
    zero = ds_config.get("zero_optimization") or {}
    stage = _int(zero, "stage", 0, "zero_optimization.")
    if stage not in (0, 1, 2, 3):
        raise ConfigError("zero_optimization.stage", f"{stage} is not a ZeRO stage", "use 0, 1, 2 or 3")
    dt = model_dtype(ds_config)
    lp = _DTYPE_BYTES[dt]
    grad_dt = str((ds_config.get("data_types") or {}).get("grad_accum_dtype") or dt).lower()
    gacc = _DTYPE_BYTES.get(grad_dt, lp)
    out = ModelStates(model_dtype=dt, zero_stage=stage)
    k = optimizer_states_per_param(ds_config, out.notes)
    n = max(1, world_size)
    P = params.total
    part = -(-P // n)  # ceil: DeepSpeed pads partitions to equal size
    mixed = dt != "fp32"
    off_opt = _offload_device(zero, "offload_optimizer")
    off_par = _offload_device(zero, "offload_param") if stage == 3 else "none"
    if stage != 3 and (zero.get("offload_param") or {}).get("device", "none") != "none":
        out.notes.append("offload_param is ignored below ZeRO-3 (DeepSpeed only offloads params in stage 3)")

    def put(where: str, key: str, nbytes: int):
        target = {"device": out.device, "cpu": out.host, "nvme": out.nvme, "none": out.device}[where]
        if nbytes:
            target[key] = target.get(key, 0) + int(nbytes)

    opt_where = "device" if off_opt == "none" else off_opt
    if stage == 3:
        put("device" if off_par == "none" else off_par, "params", part * lp)
        put("device", "params", params.persistent * lp)
        # grad partitions live where the optimizer runs (stage3.py: self.device is cpu with offload)
        put("device" if off_opt == "none" else "cpu", "grads", part * gacc)
        if _bool(zero, "contiguous_gradients", True):
            put("device", "zero buffers", _int(zero, "reduce_bucket_size", int(5e8), "zero_optimization.") * lp)
        prefetch = _int(zero, "stage3_prefetch_bucket_size", _int(zero, "prefetch_bucket_size", int(5e7),
                                                                  "zero_optimization."), "zero_optimization.")
        put("device", "zero buffers", (params.largest_module + min(prefetch, params.largest_module)) * lp)
        if mixed:
            put(opt_where, "optimizer", part * 4)  # fp32 master
        put(opt_where, "optimizer", k * part * 4)
        sub = min(_int(zero, "sub_group_size", int(1e9), "zero_optimization."), part)
        if off_opt == "none":
            # the fp32 gradient of one optimizer sub-group exists only inside step()
            # (stage3.py _prepare_fp32_grad_for_sub_group), after the activations are freed: it adds to
            # the step-time peak, not to the activation peak
            if mixed:
                out.step_transient_device += sub * 4
        else:
            put(off_opt, "grads", part * 4)
        # reduce-scatter transients during backward: reduce_scatter_coalesced torch.cat's a flat copy of
        # a full IPG bucket, and the full-size param.grads of the module that filled it wait for their
        # copy into the next bucket (with overlap_comm both run on a side stream into the next layer's
        # recompute, so they coexist with the activations)
        bucket = _int(zero, "reduce_bucket_size", int(5e8), "zero_optimization.")
        put("device", "zero transients", (bucket + min(bucket, params.largest_layer_block)) * lp)
    elif stage in (1, 2):
        put("device", "params", P * lp)
        bucket = _int(zero, "reduce_bucket_size", int(5e8), "zero_optimization.")
        # DeepSpeed 0.19.8 stage_1_and_2.setup_buckets (first backward): with contiguous_gradients (default on)
        # one reduce_bucket_size buffer, two with overlap_comm (default off below stage 3: double buffering);
        # in the grad-accumulation dtype where that differs from the model's at stage 1 (use_grad_accum_attribute)
        overlap = _bool(zero, "overlap_comm", False)
        buf = gacc if (stage == 1 and gacc != lp) else lp
        if stage == 1:
            put("device", "grads", P * buf)  # every param's full gradient until the step (param.grad / grad_accum)
            if _bool(zero, "contiguous_gradients", True):
                put("device", "zero buffers", bucket * buf * (2 if overlap else 1))
        elif _bool(zero, "contiguous_gradients", True):
            put("device", "zero buffers", bucket * lp * (2 if overlap else 1))
        else:  # ZeRO-2 without the buffers: a bucket's full-size grads wait for their reduction (about the same)
            put("device", "zero buffers", bucket * lp)
        put(opt_where, "grads", part * 4)
        if mixed:
            put(opt_where, "optimizer", part * 4)
        put(opt_where, "optimizer", k * part * 4)
    else:
        put("device", "params", P * lp)
        if mixed:
            put("device", "grads", P * 4)
            put(opt_where, "optimizer", part * 4 + k * part * 4)
        else:
            put("device", "grads", P * 4)
            put(opt_where, "optimizer", k * P * 4)
    if stage == 0 and off_opt != "none":
        out.notes.append("offload_optimizer needs ZeRO>=1 in DeepSpeed; counted as offloaded anyway")
    return out


def _bool(section: dict, key: str, default: bool) -> bool:
    v = section.get(key, default)
    return default if v == "auto" else bool(v)
