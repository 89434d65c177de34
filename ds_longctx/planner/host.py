"""The host side of a plan: where checkpointed layer inputs go (host arena, NVMe, or kept on the
device), the host and NVMe bytes per node for each choice, and the check against the node's RAM.

The step is simulated with the configured ``keep_on_device`` and the offloaded inputs going to host
memory (``offload="nvme"`` is simulated as ``"cpu"``: the planner touches no files). The runtime's
targets are exact-size, so each target's bytes follow from the simulated ones by arithmetic:

- ``cpu``: the host arena holds one exact-size block per offloaded layer input (memory/arena.py);
- ``nvme``: host memory holds the staging ring (``nvme_buffer_count`` chunks of at most
  ``memory.nvme.CHUNK_BYTES``, 4 KiB-aligned), the drive one aligned slot per offloaded layer input
  (memory/nvme.py).

Alternatives with a different ``keep_on_device`` are estimates (their device peak is the simulated
one plus the extra kept inputs, an upper bound); put the recommended keys in the config and plan it
again for the simulated figure.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional

from ..errors import ConfigError
from ..memory.nvme import CHUNK_BYTES
from ..models import attention_dims, text_config
from .model_states import _DTYPE_BYTES, model_dtype
from .units import fmt_bytes

ALIGN = 4096  # memory/nvme.py: O_DIRECT slots and staging buffers
KEY = "long_context.activation_checkpointing"


def machine_ram_bytes() -> int:
    """This machine's physical RAM: the default --host-mem."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def simulation_lc(lc):
    """The config the step is simulated with: offloaded inputs to host memory (no files are touched by
    the planner; the NVMe figures are derived from it), ``keep_on_device`` as configured."""
    if lc.activation_checkpointing.offload != "nvme":
        return lc
    return with_checkpointing(lc, nvme_path=None, offload="cpu")


def with_checkpointing(lc, **values):
    """A copy of ``lc`` with these activation_checkpointing values (``sequence_parallel_size`` kept: it is set
    on the parsed config, not a field)."""
    out = lc.model_copy(deep=True)
    for key, value in values.items():
        setattr(out.activation_checkpointing, key, value)
    out.sequence_parallel_size = lc.sequence_parallel_size
    return out


def layer_input_bytes(model_config, ds_config: dict, lc, seq_len: int, micro_batch: int) -> int:
    """One decoder layer's input on one rank: micro_batch x (seq / SP) x hidden, in the model dtype."""
    hidden = text_config(model_config).hidden_size
    return micro_batch * (seq_len // lc.sequence_parallel_size) * hidden * _DTYPE_BYTES[model_dtype(ds_config)]


def kept_attention_bytes(model_config, lc, seq_len: int, micro_batch: int, dtype_bytes: int,
                         first: Optional[int] = None) -> int:
    """keep_attention_output (memory/keep.py): what a keeping layer keeps besides its input, where the input goes:
    the attention output [micro_batch, seq / SP, heads x head_dim] in the model dtype and the fp32 LSE
    [micro_batch, heads / SP, seq], per layer from its own heads and head dims (models.attention_dims: Gemma 4's
    global layers have their own; latent attention's output is its values zero-padded to the query/key head dim in
    untied's stage buffers). ``first``: the sum over the first ``first`` layers (the layers that keep); None: the
    largest layer's (one slot that any layer's fits)."""
    sp = lc.sequence_parallel_size

    def one(d) -> int:
        return (micro_batch * (seq_len // sp) * d.heads * max(d.qk_dim, d.v_dim) * dtype_bytes
                + micro_batch * (d.heads // sp) * seq_len * 4)

    dims = attention_dims(model_config)
    if first is None:
        return max(one(d) for d in set(dims))
    return sum(one(d) for d in dims[:first])


def offloaded_bytes_per_layer(model_config, ds_config: dict, spec, seq_len: int, micro_batch: int) -> int:
    """What one checkpointed layer sends to its offload target: its input, plus its attention output and LSE
    for the spec's ``kept_attention_layers`` (their share, averaged over the layers)."""
    L, n, lc = spec.model.layers, spec.kept_attention_layers, spec.config
    kept = kept_attention_bytes(model_config, lc, seq_len, micro_batch, _DTYPE_BYTES[model_dtype(ds_config)],
                                first=n) if n else 0
    return layer_input_bytes(model_config, ds_config, lc, seq_len, micro_batch) + kept // max(1, L)


@dataclass
class OffloadOption:
    target: str            # "cpu" | "nvme" | "none" (nothing offloaded: every input fits on the device)
    keep_on_device: int
    host_bytes_per_node: int
    nvme_bytes_per_node: int
    peak_device_bytes: int
    fits: bool

    def keys(self) -> dict:
        """The activation_checkpointing keys that select this option."""
        if self.target == "none":
            return {"offload": "none"}
        d = {"offload": self.target}
        if self.keep_on_device:
            d["keep_on_device"] = self.keep_on_device
        if self.target == "nvme":
            d["nvme_path"] = "/local_nvme"
        return d


@dataclass
class HostSide:
    host: Dict[str, int]             # per rank, by part (configured target)
    nvme: Dict[str, int]             # per rank, by part (configured target)
    peak_device_extra: int           # device bytes the configured keep_on_device adds to the simulated peak
    offload: dict                    # configured target, options per target, the recommended one


def host_side(spec, states, offloaded_host_per_rank: int, layer_bytes: int, peak_device: int,
              budget: int, reserve: int, host_budget: Optional[int], gpus_per_node: int,
              step_peak: int = 0) -> HostSide:
    """Host/NVMe bytes of the configured target (from the simulated bytes of its offloaded layer inputs,
    ``offloaded_host_per_rank``) and of the alternatives. ``spec``: the run's (its switches and resolved counts at
    full depth); ``peak_device``: the activation peak (kept inputs add to it); ``step_peak``: the optimizer step's
    peak (no activations, so kept inputs do not)."""
    ac = spec.config.activation_checkpointing
    num_layers = spec.model.layers
    offloading = ac.enabled and ac.offload != "none"
    keep = spec.keep_on_device
    n_off = spec.offloaded_layers
    per_layer = layer_bytes
    ring = ac.nvme_buffer_count

    def option(target: str, k: int):
        left = num_layers - k
        host, nvme = dict(states.host), dict(states.nvme)
        if target == "cpu" and left:
            # the configured target: the simulated bytes themselves (equal to left x layer, checked in tests)
            host["offloaded activations"] = (offloaded_host_per_rank if k == keep and offloading
                                             else left * per_layer)
        elif target == "nvme" and left:
            host["nvme staging ring"] = ring * min(CHUNK_BYTES, _aligned(per_layer))
            nvme["offloaded activations"] = left * _aligned(per_layer)
        h, v = sum(host.values()) * gpus_per_node, sum(nvme.values()) * gpus_per_node
        # more kept than simulated: + the extra inputs (an upper bound); fewer: the simulated peak (the
        # kept inputs may not be alive at the peak, so subtracting them could under-count)
        peak = max(peak_device + max(0, k - keep) * per_layer, step_peak)
        fits = peak + reserve <= budget and (host_budget is None or h <= host_budget)
        name = target if left else "none"
        return OffloadOption(name, k if left else num_layers, h, v, peak, fits), host, nvme

    configured = ac.offload if offloading else "none"
    conf_opt, conf_host, conf_nvme = option(configured if configured != "none" else "cpu",
                                            keep if offloading else num_layers)
    if not offloading:  # no offload configured: host holds the model states only
        conf_host, conf_nvme = dict(states.host), dict(states.nvme)
    options: List[OffloadOption] = []
    if offloading and per_layer:
        headroom = budget - reserve - peak_device
        k_max = max(0, min(num_layers, keep + headroom // per_layer))
        for target in ("cpu", "nvme"):
            for k in sorted({keep, k_max, 0}):
                if k <= k_max:
                    options.append(option(target, k)[0])
    # fastest first: everything on the device, then host with the most kept, then NVMe
    order = {"none": 0, "cpu": 1, "nvme": 2}
    seen, ranked = set(), []
    for o in sorted(options, key=lambda o: (order[o.target], -o.keep_on_device)):
        if (o.target, o.keep_on_device) not in seen:
            seen.add((o.target, o.keep_on_device))
            ranked.append(o)
    best = next((o for o in ranked if o.fits), None)
    offload = {"target": configured, "keep_on_device": keep,
               "host_bytes_per_node": sum(conf_host.values()) * gpus_per_node,
               "nvme_bytes_per_node": sum(conf_nvme.values()) * gpus_per_node,
               "layer_input_bytes": per_layer, "offloaded_layers": n_off,
               "kept_attention_output": spec.kept_attention_layers,
               "options": [asdict(o) for o in ranked],
               "recommended": None if best is None else dict(asdict(best), keys=best.keys())}
    return HostSide(conf_host, conf_nvme, 0, offload)


def check_host_budget(states, host_budget: Optional[int], gpus_per_node: int) -> None:
    """Too small a --host-mem: the model states alone (CPU-offloaded optimizer, params) do not fit."""
    if host_budget is None:
        return
    need = states.host_total * gpus_per_node
    if need > host_budget:
        raise ConfigError("--host-mem", f"the model states alone need {fmt_bytes(need)} of host memory per node "
                          f"({gpus_per_node} ranks x {fmt_bytes(states.host_total)}), over --host-mem "
                          f"{fmt_bytes(host_budget)}: no offload target can fit",
                          "give the node's RAM (e.g. --host-mem 2TiB), offload the optimizer to nvme, or use "
                          "more nodes")


def describe(offload: dict) -> List[str]:
    """Lines for the plan's text report."""
    n = offload.get("kept_attention_output") or 0
    kept = "" if not n else (" (each with its kept attention output and LSE)" if n >= offload.get("offloaded_layers", 0)
                             + offload.get("keep_on_device", 0) else f" (the first {n} with their kept attention "
                             "output and LSE: the per-layer figure is the average)")
    lines = [f"layer inputs{kept}: {offload['offloaded_layers']} x {fmt_bytes(offload['layer_input_bytes'])} per rank "
             f"offloaded to {offload['target']}" + (f", last {offload['keep_on_device']} kept on the device"
                                                    if offload['keep_on_device'] else "")]
    for o in offload["options"]:
        lines.append(f"  option {o['target']:<4} keep_on_device={o['keep_on_device']:<2} host/node "
                     f"{fmt_bytes(o['host_bytes_per_node'])}  nvme/node {fmt_bytes(o['nvme_bytes_per_node'])}  "
                     f"peak/GPU {fmt_bytes(o['peak_device_bytes'])}  {'fits' if o['fits'] else 'does not fit'}")
    rec = offload.get("recommended")
    lines.append("recommended: " + (f"activation_checkpointing {rec['keys']}" if rec else
                                    "nothing fits the host and device budgets"))
    return lines
