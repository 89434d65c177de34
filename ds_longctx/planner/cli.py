"""``ds-longctx plan``: will this config fit, what is the longest sequence, how does the stack compare.

Exit codes: 0 fits, 1 does not fit, 2 bad input (message on stderr).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Optional

from ..config import ConfigError, load_ds_config
from ..errors import command_line
from .core import DEFAULT_RESERVE, RESERVE_WHAT, PlanResult, Planner, load_model_config
from .host import describe, machine_ram_bytes
from .search import ladder
from .units import fmt_bytes, fmt_seconds, fmt_tokens

CATS = ("model_states", "attention", "mlp", "loss", "other")

# --node: a real node the planner checks against (device, host RAM and local NVMe per node). DGX H100 / H200: NVIDIA's
# datasheets (8 GPUs, 2 TB of DDR5, data cache 8 x 3.84 TB NVMe U.2); the GPU figures are what the allocator gets
NODES = {
    "dgx-h100": {"gpu_mem": "h100", "host_mem": "2TiB", "nvme_mem": "30.72TB", "gpus_per_node": 8,
                 "what": "NVIDIA DGX H100: 8 x H100-80GB (79.1 GiB usable each), 2 TiB RAM, 8 x 3.84 TB local NVMe"},
    "dgx-h200": {"gpu_mem": "139GiB", "host_mem": "2TiB", "nvme_mem": "30.72TB", "gpus_per_node": 8,
                 "what": "NVIDIA DGX H200: 8 x H200-141GB (139 GiB usable each), 2 TiB RAM, 8 x 3.84 TB local NVMe"},
}


def _parser():
    p = argparse.ArgumentParser(prog="ds-longctx", description="ds_longctx tools")
    sub = p.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("plan", help="simulate one training step's memory (no GPU needed)")
    q.add_argument("--deepspeed_config", "--deepspeed-config", "--config", dest="config", required=True,
                   help="ds_config.json")
    g = q.add_mutually_exclusive_group()
    g.add_argument("--model-config", help="HF config.json")
    g.add_argument("--model", help="local model directory (its config.json is read; no weights)")
    q.add_argument("--gpus", type=int, default=8, help="world size to simulate (default 8)")
    q.add_argument("--node", choices=sorted(NODES), default=None, help="a real node: its GPU, host and NVMe memory "
                   "(" + "; ".join(f"{k}: {v['what']}" for k, v in NODES.items()) + "); the flags below override it")
    q.add_argument("--gpus-per-node", type=int, default=None, help="ranks sharing one host (default min(gpus, 8))")
    q.add_argument("--gpu-mem", default=None, help="device memory per GPU: a size (80GiB), 'h100' (79.1GiB, "
                   "what an H100-80GB gives the allocator) or 'auto' (default: this machine's CUDA device, else h100)")
    q.add_argument("--host-mem", default=None, help="host memory per node, checked: a size (2TiB), 'machine' "
                   "(this machine's RAM) or 'none'. Default: a shipped config's stated node (ds_configs/targets.json), "
                   "else not checked")
    q.add_argument("--nvme-mem", default=None, help="local NVMe per node, checked (a size: 30.72TB); with "
                   "--max-context and a host-bound answer under offload 'cpu', the answer with offload 'nvme' too")
    q.add_argument("--reserve", default=DEFAULT_RESERVE, help=f"device memory kept back for {RESERVE_WHAT}, which "
                   f"the simulation does not see (default {DEFAULT_RESERVE})")
    q.add_argument("--seq-len", type=int, default=None, help="global tokens per sample (default: "
                   "long_context.sequence_length)")
    q.add_argument("--max-context", action="store_true", help="find the longest sequence that fits")
    q.add_argument("--objective", choices=("sft", "grpo"), default="sft", help="the step planned: 'sft' (default) or "
                   "'grpo' (TRL + enable(): the SFT step plus the reference model and the per-token values, and the "
                   "rollout's generation on one rank as a separate limit: planner/objectives.py)")
    q.add_argument("--compare", action="store_true", help="the stack's configurations side by side")
    q.add_argument("--plot", default=None, help="PNG of stacked bars (needs matplotlib)")
    q.add_argument("--json", action="store_true", help="one JSON object on stdout")
    q.add_argument("--full-depth", action="store_true", help="simulate every layer (default: two shallow steps, "
                   "at 2 and 3 layers plus the keep_on_device layers, extrapolated to the model's depth; "
                   "--max-context re-checks its answer at full depth)")
    q.add_argument("--target", default="h100", help="rates for the predicted step time and MFU: h100 (default; "
                   "measured GEMM/attention/HBM/PCIe rates) or h200 (planner/rates.py names each rate's source)")
    q.add_argument("--allocator", choices=("expandable", "classic"), default=None, help="the CUDA caching "
                   "allocator's segments the reserved bytes are predicted for (the step's allocations replayed through "
                   "measure/allocator.py): expandable (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, what "
                   "launch/*.sh export) or classic (torch's default). Default: what PYTORCH_CUDA_ALLOC_CONF says here, "
                   "else expandable")
    q.add_argument("--device", choices=("meta", "cpu"), default="meta", help=argparse.SUPPRESS)
    return p


def _row(r: PlanResult, max_seq=None) -> dict:
    d = r.to_dict()
    if max_seq is not None:
        d["max_sequence_length"] = max_seq
    return d


def _gib(n) -> str:
    return f"{n / 2**30:,.2f}"


def _table(rows, title_col="config", show_max=False) -> str:
    """One row per plan; memory in GiB (per GPU; host: per rank), the step time as a person reads it. The last
    column: the limit a plan exceeds ("-" when it fits), or for --max-context the limit that bounds the answer."""
    head = [title_col, "seq", "fits", "peak GiB", "reserved"] + list(CATS) + ["host/rank", "step", "MFU",
                                                                 "bound by" if show_max else "over"]
    lines = []
    for label, r, mx in rows:
        seq = fmt_tokens(mx if show_max else r.sequence_length)
        cells = [label, seq, "yes" if r.fits else "NO", _gib(r.peak_device_bytes), _gib(r.reserved_device_bytes)]
        cells += [_gib(r.breakdown.get(c, 0)) for c in CATS] + [_gib(r.host_bytes)]
        cells += [fmt_seconds(r.time["seconds"]), f"{100 * r.time['mfu']:.1f}%"] if r.time else ["-", "-"]
        cells.append(r.binding if (show_max or not r.fits) and r.binding else "-")
        lines.append(cells)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
    fmt = "  ".join("{:<%d}" % w for w in widths)
    out = [fmt.format(*head), fmt.format(*["-" * w for w in widths])]
    out += [fmt.format(*cells) for cells in lines]
    return "\n".join(out)


def _detail(r: PlanResult, max_context: bool = False) -> str:
    lines = [f"budget {fmt_bytes(r.device_budget_bytes)} per device ({r.budget_source}) less a reserve of "
             f"{fmt_bytes(r.reserve_bytes)} for {RESERVE_WHAT} (--reserve): the step may use "
             f"{fmt_bytes(r.device_budget_bytes - r.reserve_bytes)}",
             f"world {r.world_size}, SP {r.sequence_parallel_size}, {r.num_layers} layers "
             + (f"(extrapolated from {r.layers_simulated})" if r.extrapolated else "(full depth)")
             + f"; peaks: backward {fmt_bytes(r.activation_peak_bytes)}, optimizer step {fmt_bytes(r.step_peak_bytes)}"]
    al = r.allocator or {}
    if al:
        modes = ", ".join(f"{m} {fmt_bytes(v)}" for m, v in al.get("reserved_by_mode", {}).items())
        lines.append(f"reserved (max_memory_reserved, predicted: the step's allocations replayed through the caching "
                     f"allocator, {al['mode']} segments): {fmt_bytes(r.reserved_device_bytes)} = allocated "
                     f"{fmt_bytes(r.peak_device_bytes)} x {r.reserved_device_bytes / max(1, r.peak_device_bytes):.3f}"
                     f" ({modes}); at least {fmt_bytes(al.get('floor_bytes', 0))} (what no out-of-memory retry of "
                     f"the allocator releases); \"fits\" uses {fmt_bytes(al.get('need_bytes', 0))} (" +
                     ("the floor: expandable segments give cached pages back" if al["mode"] == "expandable" else
                      "reserved: classic segments give back only wholly free ones") + ")")
        if al.get("stranded"):
            lines.append("  stranded by (request that mapped memory while free blocks were too small): " + ", ".join(
                f"{k} {fmt_bytes(v)}" for k, v in al["stranded"][:4]))
    lines.append("model states on device: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in r.model_states.items()))
    if r.host:
        lines.append("host per rank: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in r.host.items())
                     + f"; per node {fmt_bytes(r.host_bytes_per_node)}"
                     + (f" of {fmt_bytes(r.host_budget_bytes)}" if r.host_budget_bytes else "")
                     + f" (host budget: {r.host_budget_source})")
    if r.offload:
        lines += describe(r.offload)
    lines += _time_lines(r.time)
    if not max_context:  # a max-context answer's bound is on its own line (run_plan)
        lines.append(f"limits: {r.binding_detail}")
    lines += [f"note: {n}" for n in r.notes]
    return "\n".join(lines)


def _time_lines(t: dict) -> list:
    if not t:
        return []
    tf = sum(t["flops"].values()) / 1e12
    parts = ", ".join(f"{k} {fmt_seconds(v)}" for k, v in sorted(t["parts"].items(), key=lambda kv: -kv[1]))
    return [f"predicted step on {t['target']} (planner/rates.py): {fmt_seconds(t['seconds'])}, MFU "
            f"{100 * t['mfu']:.1f}% ({t['model_flops'] / 1e12:,.0f} model TFLOP per GPU), {t['tokens_per_s']:,.1f} "
            f"tokens/s per GPU; {tf:,.0f} TFLOP executed (recompute included)",
            f"  compute {fmt_seconds(t['compute_s'])}, overlapped transfers {fmt_seconds(t['overlapped_s'])} "
            f"(offload, ZeRO), serial transfers {fmt_seconds(t['serial_s'])} (all-to-all, optimizer offload): {parts}"
            + (f"; {t['calls'].get('ops', 0):,} ops and {t['calls'].get('a2a', 0):,} all-to-alls dispatched"
               if t.get("calls") else "")]


_COLORS = {"model_states": "#4c4c4c", "attention": "#1f77b4", "mlp": "#ff7f0e", "loss": "#2ca02c", "other": "#9467bd"}


# the limit a max context is bound by (none of them a category colour)
_BIND_COLORS = {"device": "#17becf", "host": "#d62728", "nvme": "#8c564b", "search limit": "0.5"}


def plot(rows, path: str, show_max: bool):
    """Each --compare rung at a glance. Fixed length: left, peak device memory stacked by category (bars
    over the budget are drawn to the axis top with each category's share of what they would need, hatched,
    and labelled with the total); right, the predicted step time and MFU. --max-context: left, the max
    context on a log axis, coloured by the limit that binds; middle, what fills the device at that peak, in GiB
    on one axis for every rung up to the budget (a rung at 55 GiB looks 55/77 full); right, the predicted step
    time at that length. Legends sit below the panels and the image is cut to its artists, so no label overlaps a
    bar or leaves the image. ``rows``: (label, PlanResult or an object with its fields, max tokens or None)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise ConfigError("--plot", "matplotlib is not installed", "pip install matplotlib (or drop --plot)") from None
    gib = 2**30
    n = len(rows)
    first = rows[0][1]
    budget = first.device_budget_bytes / gib
    usable = (first.device_budget_bytes - first.reserve_bytes) / gib
    labels = [label for label, _, _ in rows]
    ys = list(range(n))[::-1]
    cat_handles = [Patch(color=_COLORS[c], label=c.replace("_", " ")) for c in CATS]
    if show_max:
        fig, (ax, cx, tx) = plt.subplots(1, 3, figsize=(15, 1.2 + 0.62 * n), sharey=True,
                                         gridspec_kw={"width_ratios": [1.3, 1, 0.9]})
        ctx = [(mx or 0) for _, _, mx in rows]
        colors = [_BIND_COLORS.get(r.binding, "0.5") for _, r, _ in rows]
        ax.barh(ys, [max(c, 1) for c in ctx], color=colors, height=0.62)
        ax.set_xscale("log")
        lo = max(1000, min([c for c in ctx if c] + [1e6]) / 3)
        ax.set_xlim(lo, max(ctx + [1]) * 6)
        for y, c, (_, r, _) in zip(ys, ctx, rows):
            ax.text(max(c, lo) * 1.08, y, (f"{fmt_tokens(c)} ({c:,})" if c else "none fits"), va="center", fontsize=8)
        ax.set_xlabel("max context, tokens (log scale; colour: the limit that binds)", fontsize=9)
        binds = sorted({r.binding for _, r, _ in rows if r.binding})
        cat_handles = [Patch(color=_BIND_COLORS.get(b, "0.5"), label=f"max bound by {b}") for b in binds] + cat_handles
        ax.set_title(f"max context, {first.world_size} GPUs, {usable:.1f} GiB usable per GPU", fontsize=10)
        left = [0.0] * n
        for cat in CATS:  # GiB on one axis: every rung's bar against the same budget
            vals = [r.breakdown.get(cat, 0) / gib for _, r, _ in rows]
            cx.barh(ys, vals, left=left, color=_COLORS[cat], height=0.62)
            for y, v, l0 in zip(ys, vals, left):
                if v >= 0.09 * usable:
                    cx.text(l0 + v / 2, y, f"{v:.0f}", ha="center", va="center", fontsize=7, color="white")
            left = [a + b for a, b in zip(left, vals)]
        for y, (_, r, _) in zip(ys, rows):
            cx.text(max(r.peak_device_bytes / gib, 0) + usable * 0.02, y, f"{r.peak_device_bytes / gib:.1f}",
                    va="center", fontsize=7)
        cx.axvline(usable, color="firebrick", ls=":", lw=1)
        cx.set_xlim(0, usable * 1.22)
        cx.set_xlabel(f"GiB per GPU at that length, by category (dotted: {usable:.1f} GiB usable)", fontsize=9)
        cx.set_title("what fills the device at the max", fontsize=10)
        fig.legend(handles=cat_handles, fontsize=8, loc="lower center", ncol=len(cat_handles), frameon=False)
        _time_panel(tx, ys, rows, "at each max context")
        ax.set_yticks(ys)
        ax.set_yticklabels(labels, fontsize=9)
    else:
        fig, (ax, tx) = plt.subplots(1, 2, figsize=(7 + 1.3 * n, 6.4), gridspec_kw={"width_ratios": [1.7, 1]})
        cap = budget * 1.3
        top = cap * 0.86  # clipped bars are drawn up to here, in their own shares
        xs = list(range(n))
        for x, (_, r, _) in zip(xs, rows):
            need = r.peak_device_bytes / gib
            act = max(1, r.activation_peak_bytes) / gib
            clipped = need > cap
            scale = top / act if clipped else 1.0
            b0 = 0.0
            for cat in CATS:
                v = r.breakdown.get(cat, 0) / gib * scale
                ax.bar([x], [v], bottom=[b0], color=_COLORS[cat], width=0.7, hatch="//" if clipped else None,
                       edgecolor="white" if clipped else None, lw=0)
                share = r.breakdown.get(cat, 0) / gib / act
                if clipped and share >= 0.08:
                    ax.text(x, b0 + v / 2, f"{cat.replace('_', ' ').replace('model states', 'states')}\n"
                            f"{r.breakdown.get(cat, 0) / gib:,.0f}", ha="center", va="center", fontsize=7,
                            color="white", fontweight="bold")
                b0 += v
            if clipped:
                ax.text(x, top + cap * 0.015, f"needs\n{fmt_bytes(r.peak_device_bytes)}", ha="center", va="bottom",
                        fontsize=8, color="firebrick", fontweight="bold",
                        bbox=dict(boxstyle="round,pad=0.2", fc="white", ec="firebrick", lw=0.8))
            else:
                ax.text(x, need + cap * 0.01, f"{need:.1f}", ha="center", va="bottom", fontsize=8,
                        color="black" if r.fits else "firebrick")
        ax.axhline(budget, color="k", ls="--", lw=1)
        ax.axhline(usable, color="firebrick", ls=":", lw=1)
        from matplotlib.lines import Line2D

        cat_handles += [Line2D([], [], color="k", ls="--", lw=1, label=f"device {budget:.1f} GiB"),
                        Line2D([], [], color="firebrick", ls=":", lw=1, label=f"usable {usable:.1f} GiB")]
        ax.set_ylim(0, cap)
        ax.set_xlim(-0.6, n - 0.4)
        ax.set_xticks(xs)
        ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=9)
        ax.set_ylabel("peak device GiB per rank")
        seqs = sorted({fmt_tokens(r.sequence_length) for _, r, _ in rows})
        ax.set_title(f"peak memory at {', '.join(seqs)} tokens, {first.world_size} GPUs (hatched: over the budget, "
                     "drawn to scale within the bar, GiB labelled)", fontsize=9)
        fig.legend(handles=cat_handles, fontsize=8, loc="lower center", ncol=len(cat_handles), frameon=False)
        _time_panel(tx, ys, rows, f"at {', '.join(seqs)} tokens")
        tx.set_yticks(ys)
        tx.set_yticklabels(labels, fontsize=9)
    fig.tight_layout(rect=(0, 0.07, 1, 1))  # the bottom strip holds the legend, below every tick label
    _texts_inside(fig)
    fig.savefig(path, dpi=120, bbox_inches="tight")  # every label inside the image
    plt.close(fig)


def _texts_inside(fig, rounds: int = 4) -> None:
    """Widen each panel's x range until every label written after a bar ends inside the panel's frame (a label's
    width is known only once drawn: at a fixed headroom, a long one such as "1 h 07 min, MFU 41.0%" crossed the
    frame into the next panel). Only the upper x limit grows; the scale (linear or log) is kept."""
    import numpy as np

    for _ in range(rounds):
        renderer = fig.canvas.get_renderer()
        grew = False
        for ax in fig.axes:
            frame = ax.get_window_extent(renderer)
            scale = ax.xaxis.get_transform()
            lo, hi = ax.get_xlim()
            t_lo, t_hi = scale.transform(np.array([lo, hi], dtype=float))
            need = t_hi
            for t in ax.texts:
                if not t.get_visible() or not t.get_text() or t.get_transform() is not ax.transData:
                    continue
                box = t.get_window_extent(renderer)
                if box.x1 <= frame.x1 - 2:
                    continue
                frac = (box.x0 - frame.x0) / frame.width  # where the label starts, as a share of the panel
                room = frame.width - box.width - 4
                if room <= 0 or frac <= 0:
                    continue
                need = max(need, t_lo + frac * (t_hi - t_lo) * frame.width / room)
            if need > t_hi:
                ax.set_xlim(lo, float(scale.inverted().transform(np.array([need]))[0]))
                grew = True
        if not grew:
            return


def _time_panel(tx, ys, rows, where: str):
    """Predicted step seconds per rung (planner/rates.py), log axis, MFU in the label; rungs that do
    not fit are grey and say so."""
    secs = [(r.time or {}).get("seconds") for _, r, _ in rows]
    known = [s for s in secs if s]
    if not known:
        tx.text(0.5, 0.5, "no step-time prediction (--target)", ha="center", transform=tx.transAxes)
        return
    for y, s, (_, r, mx) in zip(ys, secs, rows):
        ok = (mx or 0) > 0 if mx is not None else r.fits
        if s:
            tx.barh([y], [s], color="#2ca02c" if ok else "0.75", height=0.62)
            tx.text(s * 1.1, y, f"{fmt_seconds(s)}, MFU {100 * r.time['mfu']:.1f}%" + ("" if ok else " (does not fit)"),
                    va="center", fontsize=8, color="black" if ok else "0.35")
    tx.set_xscale("log")
    tx.set_xlim(min(known) / 2, max(known) * 40)
    target = next((r.time.get("target") for _, r, _ in rows if r.time), "")
    tx.set_xlabel(f"predicted step time on {target}, log scale\n(a prediction: planner/rates.py)", fontsize=9)
    tx.set_title(f"predicted step time {where}", fontsize=10)


def run_plan(a) -> int:
    import contextlib

    # DeepSpeed prints build/info lines on stdout; with --json, stdout carries the JSON alone
    out = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):
        return _run_plan(a, out)


def _shipped_names(a, shipped: Optional[str]) -> None:
    """A --deepspeed_config or --model-config that is not a file but a shipped config's name (``llama3-8b-5m.json``;
    ``llama3-8b.json`` from ds_configs/models/), as train.py takes them: from a wheel, ds_configs/ is inside the
    package (``ds-longctx configs`` lists them). ``shipped``: that folder (ds_longctx.cli passes train.py's), or None."""
    if not shipped:
        return
    for attr, folder in (("config", shipped), ("model_config", os.path.join(shipped, "models"))):
        name = getattr(a, attr)
        if not name or os.path.exists(name) or os.sep in name:
            continue
        for cand in (name, name + ".json"):
            if os.path.isfile(os.path.join(folder, cand)):
                setattr(a, attr, os.path.join(folder, cand))
                break


def _check_plot(path) -> None:
    """--plot needs matplotlib (not a dependency: the test extra has it): refused before minutes of simulation."""
    import importlib.util

    if path and importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("--plot", "needs matplotlib, which is not installed", "pip install matplotlib (or "
                          "ds_longctx[test]), or drop --plot")


def _run_plan(a, out) -> int:
    t0 = time.perf_counter()
    _check_plot(a.plot)
    _shipped_names(a, getattr(a, "shipped_dir", None))
    ds = load_ds_config(a.config)
    mc = load_model_config(a.model_config, a.model)
    if a.gpus < 1:
        raise ConfigError("--gpus", f"must be positive, got {a.gpus}", "pass the world size")
    configs = [("config", ds)]
    if a.compare:
        configs = ladder(ds, mc, a.gpus)
    rows, params = [], None
    node = NODES.get(a.node) or {}
    gpu_mem = a.gpu_mem or node.get("gpu_mem") or "auto"
    nvme_mem = a.nvme_mem or node.get("nvme_mem")
    if a.host_mem is None and node:
        host_mem, host_source = node["host_mem"], f"--node {a.node}: {node['what']}"
    else:
        host_mem, host_source = _host_mem(a.host_mem, a.config)
    gpus_per_node = a.gpus_per_node or node.get("gpus_per_node")

    def planner(cfg):
        nonlocal params
        p = Planner(cfg, mc, a.gpus, gpu_mem, host_mem, a.reserve, gpus_per_node, a.device, a.full_depth,
                    params=params, target=a.target, host_budget_source=host_source, nvme_mem=nvme_mem,
                    objective=a.objective, allocator=a.allocator)
        params = p.params
        return p

    nvme_alt = None
    for label, cfg in configs:
        p = planner(cfg)
        if a.max_context:
            mx, r = p.max_context(label=label)
            rows.append((label, r, mx))
            ac = p.lc.activation_checkpointing
            if not a.compare and r.binding == "host" and ac.enabled and ac.offload == "cpu" and nvme_mem:
                # host memory binds: the same run with the layer inputs on the node's NVMe
                alt = json.loads(json.dumps(cfg))
                alt["long_context"]["activation_checkpointing"].update(offload="nvme", nvme_path="/local_nvme")
                nvme_alt = planner(alt).max_context(label="offload nvme")
        else:
            seq = a.seq_len if a.seq_len is not None else p.lc.sequence_length
            if seq is None:
                raise ConfigError("--seq-len", "no sequence length was given",
                                  "pass --seq-len N, set long_context.sequence_length, or use --max-context")
            rows.append((label, p.run(int(seq), label=label), None))
    wall = time.perf_counter() - t0
    if a.plot:
        plot(rows, a.plot, a.max_context)
    fits = all((mx or 0) > 0 if a.max_context else r.fits for _, r, mx in rows) if not a.compare else \
        ((rows[-1][2] or 0) > 0 if a.max_context else rows[-1][1].fits)
    if a.json:
        if a.compare:
            obj = {"fits": fits, "configs": [_row(r, mx) for _, r, mx in rows], "wall_seconds": round(wall, 2)}
        else:
            label, r, mx = rows[0]
            obj = {**_row(r, mx), "wall_seconds": round(wall, 2)}
            obj["fits"] = fits
            if nvme_alt is not None:
                obj["with_offload_nvme"] = _row(nvme_alt[1], nvme_alt[0])
        print(json.dumps(obj, indent=1), file=out)
    else:
        if node:
            print(f"node: {node['what']}", file=out)
        print(_table(rows, show_max=a.max_context), file=out)
        print(_detail(rows[-1][1], a.max_context), file=out)
        if a.max_context:
            for label, r, mx in rows:
                print(f"max context [{label}]: {mx:,} tokens ({fmt_tokens(mx)}), {r.binding_detail}", file=out)
            if nvme_alt is not None:
                mx, r = nvme_alt
                print(f"max context with the layer inputs on the node's NVMe (activation_checkpointing.offload "
                      f"'nvme'): {mx:,} tokens ({fmt_tokens(mx)}), {r.binding_detail}", file=out)
        print(f"planner wall time {wall:.1f}s", file=out)
    return 0 if fits else 1


def shipped_target(config_path) -> Optional[tuple]:
    """(name, target) when ``config_path`` is one of ds_configs/ (a link such as 5m.json resolved) and
    ds_configs/targets.json states its hardware; else None."""
    if not isinstance(config_path, str):
        return None
    real = os.path.realpath(config_path)
    folder = os.path.dirname(real)
    targets = os.path.join(folder, "targets.json")
    if not os.path.exists(targets) or os.path.basename(real) == "targets.json":
        return None
    try:
        with open(targets) as f:
            t = json.load(f).get(os.path.basename(real))
    except (OSError, ValueError):
        return None
    return (os.path.basename(real), t) if isinstance(t, dict) else None


def _host_mem(value, config_path=None):
    """--host-mem -> (budget or None, where it came from). Absent: a shipped config's stated node
    (ds_configs/targets.json), else not checked. 'machine': this machine's RAM; 'none': not checked."""
    if value is None:
        st = shipped_target(config_path)
        if st and st[1].get("host_mem"):
            return st[1]["host_mem"], f"ds_configs/targets.json: {st[0]}'s stated node ({st[1]['host_mem']})"
        return None, "not checked (not a shipped config with a stated node; pass --host-mem 2TiB or 'machine')"
    if str(value).lower() == "none":
        return None, "not checked (--host-mem none)"
    if str(value).lower() in ("machine", "auto"):
        ram = machine_ram_bytes()
        return ram, f"--host-mem {value}: this machine's RAM ({fmt_bytes(ram)})"
    return value, f"--host-mem {value}"


def main(argv=None, shipped_dir: Optional[str] = None) -> int:
    """``shipped_dir``: the shipped ds_configs/ folder, whose names --deepspeed_config and --model-config then take
    (``ds-longctx plan`` passes it)."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    a = _parser().parse_args(argv)
    a.shipped_dir = shipped_dir
    return command_line(f"ds-longctx {a.cmd}", lambda _: run_plan(a), None)


if __name__ == "__main__":
    sys.exit(main())
