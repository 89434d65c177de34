"""Step time from the simulated step's work: a small rates table per named target and a roofline.

The simulation counts (measure/flops.py) attention FLOPs by head_dim, GEMM FLOPs and bytes by arithmetic
intensity, the bytes every other op reads and writes, and the all-to-all bytes this rank sends; core.py
adds ZeRO-3 and offload traffic by arithmetic. Seconds:

    compute  = attention FLOPs / attention rate(head_dim)
             + sum over GEMM buckets of max(FLOPs / GEMM rate, bytes / HBM)       (roofline)
             + other ops' bytes / HBM                                              (memory-bound)
    overlapped = ZeRO-3 all-gather + reduce-scatter (overlap_comm: side streams, prefetched)
               + layer-input offload to host / NVMe and back (side streams, prefetched one layer ahead)
    host     = ops dispatched x op_overhead_us        (dispatcher, autograd, our Python around each op)
    serial   = Ulysses all-to-alls (issued on the compute stream, waited on: no overlap in this code)
               + all-to-all calls x collective_latency_us
               + ring P2P beyond the attention kernels' time + P2P sends x collective_latency_us (a ring's
                 block transfers run under the attention of the block before: attention/ring.py)
             + optimizer offload traffic (inside optimizer.step(), after backward)
    compute' = compute + host            (host_async False: a CPU target, the host runs the kernels itself)
               max(compute, host)        (host_async True: a GPU, the host issues kernels ahead of the device;
                                          host-bound only where kernels are shorter than their issue cost)
    step     = max(compute', overlapped) + serial

The op and all-to-all counts come from the simulation (every dispatched op with tensor data, each tile of
a tiled op counted: measure/flops.py, Accountant.work's third column), so a configuration that runs more,
smaller stages (heads_per_chunk 1 against 2, more tiles) pays its fixed costs per stage.
Not modelled: the CPU optimizer's own arithmetic (offload_optimizer), host syncs that stall the issue
queue (the host cost is hidden entirely under async launch), allocator stalls, the lower efficiency of
narrow kernels below the roofline. Each rate names its source; "measured" ones are in bench/results/.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict

from ..config import ConfigError


@dataclass(frozen=True)
class Rates:
    name: str
    peak_tflops: float                  # dense bf16 spec, the MFU denominator
    gemm_tflops: float                  # large bf16 GEMM, achieved
    attention_tflops: Dict[int, float]  # head_dim -> fused causal attention fwd+bwd, achieved (flop_counter convention)
    hbm_gbps: float                     # device memory, achieved (copy)
    a2a_intra_gbps: float               # all-to-all bytes sent per GPU per second inside a node (NVLink)
    a2a_inter_gbps: float               # same across nodes (per-GPU NIC)
    pcie_gbps: float                    # pinned host <-> device, per direction, per GPU
    nvme_gbps: float                    # per node, read or write
    sources: Dict[str, str] = field(default_factory=dict)
    op_overhead_us: float = 0.0         # host time per dispatched op (dispatch, autograd, Python), microseconds
    collective_latency_us: float = 0.0  # fixed cost per all-to-all call (latency, launch, sync), microseconds
    host_async: bool = True             # the host issues ahead of the device (GPU); False: they are one (CPU)

    def attention_rate(self, head_dim: int) -> float:
        known = sorted(self.attention_tflops)
        if head_dim in self.attention_tflops:
            return self.attention_tflops[head_dim]
        lo = max([d for d in known if d <= head_dim], default=known[0])
        hi = min([d for d in known if d >= head_dim], default=known[-1])
        if lo == hi:
            return self.attention_tflops[lo]
        w = (head_dim - lo) / (hi - lo)
        return self.attention_tflops[lo] * (1 - w) + self.attention_tflops[hi] * w


_H100_MEASURED = "bench/results/gpu_rates_h100.json (python bench/gpu_rates.py on the lent H100 80GB HBM3, 2026-11-26)"

H100 = Rates(
    name="h100", peak_tflops=989.0, gemm_tflops=766.0,
    # 3.5 x causal-halved 4*S^2*d*h over the measured fwd+bwd of SDPA (cuDNN) at 128K, 32 heads
    attention_tflops={64: 432.0, 128: 551.0},
    hbm_gbps=2930.0, a2a_intra_gbps=350.0, a2a_inter_gbps=45.0, pcie_gbps=54.0, nvme_gbps=12.0,
    sources={
        "peak_tflops": "H100 SXM dense bf16 datasheet (989 TFLOP/s; RESULTS.md's MFU denominator)",
        "gemm_tflops": f"8192^3 bf16 matmul 766 TFLOP/s, {_H100_MEASURED}; narrow GEMMs via the roofline "
                       "(131072x2048x64: measured 151, roofline 180)",
        "attention_tflops": f"causal SDPA fwd+bwd, 128K tokens x 32 heads: d=64 0.571 s, d=128 0.894 s, {_H100_MEASURED}",
        "hbm_gbps": f"1 GiB bf16 copy, read + write, {_H100_MEASURED}",
        "pcie_gbps": f"pinned 512 MiB copies: H2D 54.4, D2H 55.0 GB/s, {_H100_MEASURED}",
        "a2a_intra_gbps": "NOT measured here (one-GPU machine): NVLink4 450 GB/s per direction, ~350 GB/s "
                          "nccl-tests alltoall bus bandwidth class figure",
        "a2a_inter_gbps": "NOT measured: 400 Gb/s NIC per GPU (50 GB/s), ~90% achieved",
        "nvme_gbps": "NOT measured (the lent image has no libaio): ~4 Gen4 drives x 3 GB/s sustained per node",
        "op_overhead_us": "NOT measured on the GPU: ~10 us of host time per eager op with autograd (dispatcher + "
                          "autograd node + our Python; the 2-core CPU box measures 10-20 us per counted op with "
                          "bench/planner_time.py); hidden under async launch unless kernels are shorter",
        "collective_latency_us": "NOT measured (one-GPU machine): ~30 us per 8-GPU NVLink all-to-all of small "
                                 "messages (nccl-tests alltoall latency class figure)",
    }, op_overhead_us=10.0, collective_latency_us=30.0)

H200 = Rates(
    name="h200", peak_tflops=989.0, gemm_tflops=790.0, attention_tflops={64: 432.0, 128: 551.0},
    hbm_gbps=4200.0, a2a_intra_gbps=350.0, a2a_inter_gbps=45.0, pcie_gbps=54.0, nvme_gbps=12.0,
    sources={
        "peak_tflops": "H200 dense bf16 datasheet (same SMs as H100 SXM)",
        "gemm_tflops": "device README's 'about 790 TFLOP/s' bf16 matrix work on the lent H200 (not re-measured)",
        "attention_tflops": "H100's measured figures (same SMs; not re-measured on H200)",
        "hbm_gbps": "4.8 TB/s datasheet x the H100's measured copy efficiency (0.87); not measured",
        "a2a_intra_gbps": "as h100 (NOT measured)", "a2a_inter_gbps": "as h100 (NOT measured)",
        "pcie_gbps": "as h100's measured pinned copies", "nvme_gbps": "as h100 (NOT measured)",
        "op_overhead_us": "as h100 (NOT measured)", "collective_latency_us": "as h100 (NOT measured)",
    }, op_overhead_us=10.0, collective_latency_us=30.0)

TARGETS = {"h100": H100, "h200": H200}


def target_rates(name) -> Rates:
    """A named target's rates, or ``name`` itself when it is a :class:`Rates` (a measured machine, bench/)."""
    if isinstance(name, Rates):
        return name
    key = (name or "h100").strip().lower()
    if key not in TARGETS:
        raise ConfigError("--target", f"no rates for {name!r}", f"use one of {', '.join(TARGETS)}")
    return TARGETS[key]


@dataclass
class StepTime:
    seconds: float
    compute_s: float
    overlapped_s: float
    serial_s: float
    parts: Dict[str, float]        # seconds by part (attention_forward, gemm, a2a, ...)
    flops: Dict[str, float]        # counted FLOPs by kind/phase (hardware work, recompute included)
    model_flops: float             # StepProfiler's formula (no recompute): MFU's numerator, per GPU
    mfu: float
    tokens_per_s: float            # per GPU, as StepProfiler reports
    target: str
    bytes: Dict[str, float] = field(default_factory=dict)
    calls: Dict[str, int] = field(default_factory=dict)  # ops dispatched ("ops") and all-to-all calls ("a2a")

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return asdict(self)


def step_time(work: Dict[tuple, tuple], traffic: Dict[str, float], rates: Rates, model_flops: float,
              tokens_per_gpu: float, a2a_internode: bool, p2p_internode: bool = False) -> StepTime:
    """``work``: (kind, phase, key) -> (flops, bytes[, calls]) of one rank's step; ``traffic``: bytes per rank of
    zero3_gather, zero3_reduce (over a2a_inter if ``zero3_internode``), offload_host, offload_nvme (per
    rank's share of the node's drive), optimizer_offload; ``model_flops`` per GPU. Ring attention's point-to-point
    bytes (work kind ``p2p``, over a2a_inter if ``p2p_internode``) are sent while the attention kernels run (each
    block's transfer posted before the block before it computes): hidden up to the attention time, the rest and
    the per-send latency serial."""
    parts: Dict[str, float] = {}
    flops: Dict[str, float] = {}
    hbm = rates.hbm_gbps * 1e9

    def add(name, secs):
        parts[name] = parts.get(name, 0.0) + secs

    calls = {"ops": 0.0, "a2a": 0.0, "p2p": 0.0}
    for (kind, phase, key), v in work.items():
        f, b = v[0], v[1]
        calls[kind if kind in ("a2a", "p2p") else "ops"] += v[2] if len(v) > 2 else 0.0
        if kind == "attention":
            add(f"attention_{phase}", f / (rates.attention_rate(int(key)) * 1e12))
        elif kind == "gemm":
            add(f"gemm_{phase}", max(f / (rates.gemm_tflops * 1e12), b / hbm))
        elif kind == "other":
            add("other_memory_bound", b / hbm)
        elif kind == "a2a":
            add("all_to_all", b / ((rates.a2a_inter_gbps if a2a_internode else rates.a2a_intra_gbps) * 1e9))
        elif kind == "p2p":
            add("ring_p2p", b / ((rates.a2a_inter_gbps if p2p_internode else rates.a2a_intra_gbps) * 1e9))
        if f:
            flops[f"{kind}_{phase}"] = flops.get(f"{kind}_{phase}", 0.0) + f
    if not calls["p2p"]:
        del calls["p2p"]  # no ring
    kernels = sum(v for k, v in parts.items() if k not in ("all_to_all", "ring_p2p"))
    if parts.get("ring_p2p"):  # overlapped with the attention kernels (async P2P one block ahead): the rest waits
        attention = sum(v for k, v in parts.items() if k.startswith("attention_"))
        parts["ring_p2p_exposed"] = max(0.0, parts["ring_p2p"] - attention) + \
            calls.get("p2p", 0) * rates.collective_latency_us * 1e-6
    host = calls["ops"] * rates.op_overhead_us * 1e-6
    if host:
        parts["host_overhead"] = host
    compute = max(kernels, host) if rates.host_async else kernels + host
    if calls["a2a"] and rates.collective_latency_us:
        parts["all_to_all_latency"] = calls["a2a"] * rates.collective_latency_us * 1e-6
    zlink = (rates.a2a_inter_gbps if traffic.get("zero3_internode") else rates.a2a_intra_gbps) * 1e9
    over = {"zero3": (traffic.get("zero3_gather", 0) + traffic.get("zero3_reduce", 0)) / zlink,
            "offload_host": traffic.get("offload_host", 0) / (rates.pcie_gbps * 1e9),
            "offload_nvme": traffic.get("offload_nvme", 0) / (rates.nvme_gbps * 1e9)}
    # the host copies and ZeRO's collectives run on separate engines/streams: concurrent with each other
    overlapped = max(over.values())
    serial = (parts.get("all_to_all", 0.0) + parts.get("all_to_all_latency", 0.0) + parts.get("ring_p2p_exposed", 0.0)
              + traffic.get("optimizer_offload", 0) / (rates.pcie_gbps * 1e9))
    for k, v in over.items():
        if v:
            parts[k] = v
    if traffic.get("optimizer_offload"):
        parts["optimizer_offload"] = traffic["optimizer_offload"] / (rates.pcie_gbps * 1e9)
    secs = max(compute, overlapped) + serial
    mfu = model_flops / secs / (rates.peak_tflops * 1e12) if secs > 0 else 0.0
    return StepTime(seconds=secs, compute_s=compute, overlapped_s=overlapped, serial_s=serial,
                    parts={k: round(v, 6) for k, v in parts.items()}, flops=flops, model_flops=model_flops, mfu=mfu,
                    tokens_per_s=tokens_per_gpu / secs if secs > 0 else 0.0, target=rates.name,
                    bytes={k: float(v) for k, v in traffic.items() if not isinstance(v, bool)},
                    calls={k: round(v) for k, v in calls.items()})
