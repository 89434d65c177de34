"""Host memory before it is touched: the planner's host bytes for this node against the node's RAM.

The host arena of CPU offload grows during step 1 (memory/arena.py: a block per offloaded layer input, pinned on
CUDA), DeepSpeed's optimizer offload allocates at ``deepspeed.initialize``: a plan over the node's RAM used to
start allocating without a word and end in the OOM killer (issue 30: RSS 7.3 GiB per rank and climbing toward a
64 GiB arena on a 23.5 GiB node) while ``ds-longctx plan`` on the same config said "over host memory".
``initialize`` calls :func:`check_host_memory` before ``patch_model`` builds the offload target and before
``deepspeed.initialize``: the same arithmetic as the planner (planner/model_states.compute for the model states
DeepSpeed puts on the host, planner/host.host_side for the arena or the NVMe staging ring; the arena bytes are
exact: the offloaded layers' inputs plus their kept attention outputs and LSEs), times the ranks on this node,
against ``DS_LONGCTX_HOST_MEM`` or this machine's RAM. Over it: one ConfigError on every rank (the verdicts are
all-gathered, as nodes may differ) naming the bytes by part and the fixes. The layer-input part needs the
sequence length (``long_context.sequence_length``); without it only the model states are checked.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

from ..dist.verdicts import all_gather_blobs
from .agreement import roster
from ..errors import ConfigError
from ..planner import host as host_plan
from ..planner import model_states as ms
from ..planner.core import _micro_batch
from ..planner.units import fmt_bytes

# the key to name for the largest part of the need
_PART_KEYS = {"offloaded activations": "long_context.activation_checkpointing.offload",
              "nvme staging ring": "long_context.activation_checkpointing.nvme_buffer_count",
              "optimizer": "zero_optimization.offload_optimizer.device",
              "grads": "zero_optimization.offload_optimizer.device",
              "params": "zero_optimization.offload_param.device"}


@dataclass
class HostNeed:
    per_rank: Dict[str, int] = field(default_factory=dict)  # bytes by part (planner/host's names)
    local_ranks: int = 1
    budget: int = 0
    source: str = ""
    seq_len: Optional[int] = None
    offloaded_layers: int = 0

    @property
    def per_node(self) -> int:
        return sum(self.per_rank.values()) * self.local_ranks

    @property
    def fits(self) -> bool:
        return self.per_node <= self.budget


# the part a run without an accelerator adds: what the planner puts "on the device" lives in host RAM there
DEVICE_AS_HOST = "device side (host RAM: no CUDA device)"


def _no_accelerator() -> bool:
    import torch

    return not torch.cuda.is_available()


def resident_on_cpu(ds_config: dict, total_params: int) -> dict:
    """``ds_config`` as the device side of a CPU run holds it in host RAM: ZeRO's reduce bucket (DeepSpeed's default
    5e8 elements: 2 GB in fp32) is a ``torch.empty`` that only the gradients written into it make resident, and at
    most the model's parameter count are; so the bucket counts at min(reduce_bucket_size, parameters). On a GPU the
    whole bucket is allocated device memory (the planner's figure, unchanged)."""
    zero = dict(ds_config.get("zero_optimization") or {})
    bucket = ms._int(zero, "reduce_bucket_size", int(5e8), "zero_optimization.")
    zero["reduce_bucket_size"] = max(1, min(bucket, int(total_params)))
    return dict(ds_config, zero_optimization=zero)


def host_need(ds_config: dict, spec, model, world: int, budget: Tuple[int, str], local: int,
              device_is_host: Optional[bool] = None) -> HostNeed:
    """The planner's host bytes per rank for this run (by part); ``budget``: (the node's host bytes, where the
    figure comes from: initialize._host_budget), ``local``: the ranks on this node (initialize._local_ranks).
    ``device_is_host`` (default: no CUDA device): the device side counts as host bytes too (part
    :data:`DEVICE_AS_HOST`): the model states ZeRO keeps on the device and the checkpointed layer inputs not
    offloaded (a lower bound: a layer's working activations come on top)."""
    lc = spec.config
    total = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    states = ms.compute(ds_config, ms.ParamInfo(total=int(total), largest_module=0), world)
    budget, source = budget
    seq = lc.sequence_length
    ac = lc.activation_checkpointing
    offloading = ac.enabled and ac.offload != "none"
    device_is_host = _no_accelerator() if device_is_host is None else device_is_host
    mc = getattr(model, "config", None)
    micro = _micro_batch(ds_config)
    inputs = host_plan.layer_input_bytes(mc, ds_config, lc, seq, micro) if seq is not None and ac.enabled else 0
    if device_is_host:  # what a CPU run makes resident of the device side (see resident_on_cpu)
        on_cpu = ms.compute(resident_on_cpu(ds_config, total), ms.ParamInfo(total=int(total), largest_module=0), world)
        device = on_cpu.device_total + on_cpu.step_transient_device
    else:
        device = states.device_total + states.step_transient_device
    if ac.enabled and inputs:
        device += (spec.model.layers - (spec.offloaded_layers if offloading else 0)) * inputs
    extra = {DEVICE_AS_HOST: device} if device_is_host and device else {}
    if seq is None or not offloading:
        return HostNeed(dict(states.host, **extra), local, budget, source, seq, 0)
    dtype = ms._DTYPE_BYTES[ms.model_dtype(ds_config)]
    kept = host_plan.kept_attention_bytes(mc, lc, seq, micro, dtype) if spec.kept_attention_layers else 0
    # exact: what the arena will hold (one block per offloaded input, and per kept output and LSE)
    offloaded = spec.offloaded_layers * inputs + spec.offloaded_kept_attention_layers * kept
    per_layer = host_plan.offloaded_bytes_per_layer(mc, ds_config, spec, seq, micro)
    hs = host_plan.host_side(spec, states, offloaded, per_layer, 0, 1 << 62, 0, None, local)
    return HostNeed(dict(hs.host, **extra), local, budget, source, seq, spec.offloaded_layers)


def _problem(need: HostNeed) -> Optional[ConfigError]:
    if need.fits:
        return None
    parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in sorted(need.per_rank.items(), key=lambda kv: -kv[1]) if v)
    # the key to name: the largest part a config key moves (the device side of a CPU run is said in the fixes)
    named = [k for k in need.per_rank if k != DEVICE_AS_HOST and need.per_rank[k]] or list(need.per_rank)
    largest = max(named, key=lambda k: need.per_rank[k])
    fixes = []
    if "offloaded activations" in need.per_rank:
        fixes.append("offload the layer inputs to NVMe (activation_checkpointing.offload 'nvme' with nvme_path on a "
                     "local drive), keep more of the last layers on the device (activation_checkpointing."
                     "keep_on_device: a number, or 'auto')")
    if any(k in need.per_rank for k in ("optimizer", "grads", "params")):
        fixes.append("offload the optimizer / parameters to NVMe instead of the CPU (zero_optimization."
                     "offload_optimizer / offload_param device 'nvme'), or not at all")
    if DEVICE_AS_HOST in need.per_rank:
        fixes.append("on a machine without CUDA the device side is host RAM too: shorten sequence_length or "
                     "micro batch for a CPU run")
    fixes.append("run fewer ranks on this node (or more nodes)")
    fixes.append("set DS_LONGCTX_HOST_MEM to the node's real budget if the figure is wrong (containers)")
    seq = f" at sequence_length {need.seq_len}" if need.seq_len else ""
    return ConfigError(_PART_KEYS.get(largest, "host memory"),
                       f"this node's ranks need {fmt_bytes(need.per_node)} of host memory{seq} ({need.local_ranks} "
                       f"local rank(s) x {fmt_bytes(sum(need.per_rank.values()))}: {parts}), over the node's "
                       f"{fmt_bytes(need.budget)} ({need.source}); refused before anything is allocated "
                       "(`ds-longctx plan` lists the options that fit)", "; ".join(fixes))


def check_host_memory(ds_config: dict, spec, model, world: int, budget: Tuple[int, str], local: int) -> HostNeed:
    """Refuse, on every rank, a run whose host bytes on some node exceed that node's budget; returns this rank's
    need. One all-gather of the verdicts (nodes may differ: RAM, local ranks)."""
    import torch.distributed as dist

    need = host_need(ds_config, spec, model, world, budget, local)
    err = _problem(need)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        mine = b"" if err is None else json.dumps([err.key, err.problem, err.fix]).encode()
        found = [(r, json.loads(b)) for r, b in enumerate(all_gather_blobs(mine)) if b]
        if found:
            r, (key, problem, fix) = found[0]
            members = roster()
            host = f" on host {members[r].host}" if members and r < len(members) else ""
            ranks = [x for x, _ in found]
            where = f"rank {r}{host}" + (f" (and {len(ranks) - 1} more rank(s))" if len(ranks) > 1 else "")
            raise ConfigError(key, f"{where}: {problem}", fix)
    elif err is not None:
        raise err
    return need


__all__ = ["check_host_memory", "host_need", "HostNeed"]
