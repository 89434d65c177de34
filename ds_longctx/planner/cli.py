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
from .core import DEFAULT_RESERVE, RESERVE_WHAT, PlanResult, Planner, load_model_config
from .units import fmt_bytes, fmt_tokens

CATS = ("model_states", "attention", "mlp", "loss", "other")


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
    q.add_argument("--gpus-per-node", type=int, default=None, help="ranks sharing one host (default min(gpus, 8))")
    q.add_argument("--gpu-mem", default="auto", help="device memory per GPU: a size (80GiB), 'h100' (79.1GiB, "
                   "what an H100-80GB gives the allocator) or 'auto' (default: this machine's CUDA device, else h100)")
    q.add_argument("--host-mem", default=None, help="host memory per node, checked: a size (2TiB), 'machine' "
                   "(this machine's RAM) or 'none'. Default: a shipped config's stated node (ds_configs/targets.json), "
                   "else not checked")
    q.add_argument("--reserve", default=DEFAULT_RESERVE, help=f"device memory kept back for {RESERVE_WHAT}, which "
                   f"the simulation does not see (default {DEFAULT_RESERVE})")
    q.add_argument("--seq-len", type=int, default=None, help="global tokens per sample (default: "
                   "long_context.sequence_length)")
    q.add_argument("--max-context", action="store_true", help="find the longest sequence that fits")
    q.add_argument("--compare", action="store_true", help="the stack's configurations side by side")
    q.add_argument("--plot", default=None, help="PNG of stacked bars (needs matplotlib)")
    q.add_argument("--json", action="store_true", help="one JSON object on stdout")
    q.add_argument("--full-depth", action="store_true", help="simulate every layer (default: 2 and 3 layers, "
                   "extrapolated; --max-context re-checks at full depth)")
    q.add_argument("--target", default="h100", help="rates for the predicted step time and MFU: h100 (default; "
                   "measured GEMM/attention/HBM/PCIe rates) or h200 (planner/rates.py names each rate's source)")
    q.add_argument("--device", choices=("meta", "cpu"), default="meta", help=argparse.SUPPRESS)
    return p


def _row(r: PlanResult, max_seq=None) -> dict:
    d = r.to_dict()
    if max_seq is not None:
        d["max_sequence_length"] = max_seq
    return d


def _table(rows, title_col="config", show_max=False) -> str:
    head = [title_col, "seq", "fits", "peak"] + list(CATS) + ["host/rank", "step s", "MFU", "binds"]
    lines = []
    for label, r, mx in rows:
        seq = fmt_tokens(mx if show_max else r.sequence_length)
        cells = [label, seq, "yes" if r.fits else "NO", fmt_bytes(r.peak_device_bytes)]
        cells += [fmt_bytes(r.breakdown.get(c, 0)) for c in CATS] + [fmt_bytes(r.host_bytes)]
        cells += [f"{r.time['seconds']:.3g}", f"{100 * r.time['mfu']:.1f}%"] if r.time else ["-", "-"]
        cells.append(r.binding or "-")
        lines.append(cells)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
    fmt = "  ".join("{:<%d}" % w for w in widths)
    out = [fmt.format(*head), fmt.format(*["-" * w for w in widths])]
    out += [fmt.format(*cells) for cells in lines]
    return "\n".join(out)


def _detail(r: PlanResult) -> str:
    lines = [f"budget {fmt_bytes(r.device_budget_bytes)} per device ({r.budget_source}) less a reserve of "
             f"{fmt_bytes(r.reserve_bytes)} for {RESERVE_WHAT} (--reserve): the step may use "
             f"{fmt_bytes(r.device_budget_bytes - r.reserve_bytes)}",
             f"world {r.world_size}, SP {r.sequence_parallel_size}, {r.num_layers} layers "
             + (f"(extrapolated from {r.layers_simulated})" if r.extrapolated else "(full depth)")
             + f"; peaks: backward {fmt_bytes(r.activation_peak_bytes)}, optimizer step {fmt_bytes(r.step_peak_bytes)}"]
    lines.append("model states on device: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in r.model_states.items()))
    if r.host:
        lines.append("host per rank: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in r.host.items())
                     + f"; per node {fmt_bytes(r.host_bytes_per_node)}"
                     + (f" of {fmt_bytes(r.host_budget_bytes)}" if r.host_budget_bytes else "")
                     + f" (host budget: {r.host_budget_source})")
    if r.offload:
        from .host import describe

        lines += describe(r.offload)
    lines += _time_lines(r.time)
    lines.append(f"binding limit: {r.binding_detail}")
    lines += [f"note: {n}" for n in r.notes]
    return "\n".join(lines)


def _time_lines(t: dict) -> list:
    if not t:
        return []
    tf = sum(t["flops"].values()) / 1e12
    parts = ", ".join(f"{k} {v:.3g}s" for k, v in sorted(t["parts"].items(), key=lambda kv: -kv[1]))
    return [f"predicted step on {t['target']} (planner/rates.py): {t['seconds']:.3g} s, MFU {100 * t['mfu']:.1f}% "
            f"({t['model_flops'] / 1e12:.4g} model TFLOP per GPU), {t['tokens_per_s']:.4g} tokens/s per GPU; "
            f"{tf:.4g} TFLOP executed (recompute included)",
            f"  compute {t['compute_s']:.3g} s, overlapped transfers {t['overlapped_s']:.3g} s (offload, ZeRO), "
            f"serial transfers {t['serial_s']:.3g} s (all-to-all, optimizer offload): {parts}"]


_COLORS = {"model_states": "#4c4c4c", "attention": "#1f77b4", "mlp": "#ff7f0e", "loss": "#2ca02c", "other": "#9467bd"}


def _max_context_estimate(r: PlanResult) -> int:
    """Longest sequence by the linear rule (activations grow linearly in S, constants ignored, so at a
    short plotted length this errs low): (usable - model states) / activation bytes per token."""
    act = r.activation_peak_bytes - r.breakdown.get("model_states", 0)
    room = r.device_budget_bytes - r.reserve_bytes - max(r.breakdown.get("model_states", 0), r.step_peak_bytes)
    if act <= 0 or room <= 0:
        return 0
    return int(room / (act / r.sequence_length))


def plot(rows, path: str, show_max: bool):
    """Left: peak device memory per configuration, stacked by category, the axis capped just above the
    budget so that the configurations that fit stay legible; bars that do not fit are cut at the cap
    and labelled with what they would need. Right: each configuration's max context."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot", "matplotlib is not installed", "pip install matplotlib (or drop --plot)") from None
    gib = 2**30
    n = len(rows)
    first = rows[0][1]
    budget = first.device_budget_bytes / gib
    usable = (first.device_budget_bytes - first.reserve_bytes) / gib
    cap = budget * 1.3
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(6 + 1.25 * n, 6.2), gridspec_kw={"width_ratios": [1.6, 1]})
    xs = list(range(n))
    bottom = [0.0] * n
    for cat in CATS:
        vals = [r.breakdown.get(cat, 0) / gib for _, r, _ in rows]
        ax.bar(xs, vals, bottom=bottom, color=_COLORS[cat], width=0.7, label=cat.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, vals)]
    for x, (_, r, _) in zip(xs, rows):
        need = r.peak_device_bytes / gib
        if need > cap:  # cut: a hatched band marks the break, the label says what it would need
            ax.bar([x], [cap * 0.04], bottom=[cap * 0.955], color="white", width=0.74, hatch="////",
                   edgecolor="0.3", lw=0)
            ax.text(x, budget + (cap - budget) * 0.42, f"needs\n{fmt_bytes(r.peak_device_bytes)}", ha="center",
                    va="center", fontsize=8, color="firebrick", fontweight="bold",
                    bbox=dict(boxstyle="round,pad=0.2", fc="white", ec="firebrick", lw=0.8))
        elif need > usable * 0.9:  # at the budget lines (every bar of a --max-context ladder): inside the bar
            ax.text(x, need - cap * 0.01, f"{need:.1f}", ha="center", va="top", fontsize=8, color="white",
                    fontweight="bold")
        else:
            ax.text(x, need + cap * 0.01, f"{need:.1f}", ha="center", va="bottom", fontsize=8,
                    color="black" if r.fits else "firebrick")
    ax.axhline(budget, color="k", ls="--", lw=1)
    ax.axhline(usable, color="firebrick", ls=":", lw=1)
    # both line labels above the device line, clear of the bars and their value labels
    ax.text(n - 0.5, budget + cap * 0.005, f"device {budget:.1f} GiB (dashed), usable {usable:.1f} GiB "
            f"(dotted: reserve {first.reserve_bytes / gib:.1f})", va="bottom", ha="right", fontsize=8,
            bbox=dict(boxstyle="square,pad=0.1", fc="white", ec="none", alpha=0.85))
    ax.set_ylim(0, cap)
    ax.set_xlim(-0.6, n - 0.4)
    ax.set_xticks(xs)
    ax.set_xticklabels([label for label, _, _ in rows], rotation=30, ha="right", fontsize=9)
    ax.set_ylabel("peak device GiB per rank")
    seqs = {fmt_tokens(mx if show_max else r.sequence_length) for _, r, mx in rows}
    ax.set_title("peak memory " + ("at each max context" if show_max else f"at {', '.join(sorted(seqs))} tokens")
                 + f", {first.world_size} GPUs", fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=len(CATS), frameon=False)
    # max context panel
    if show_max:
        ctx = [(mx or 0) for _, _, mx in rows]
        how = "planner --max-context search"
    else:
        ctx = [_max_context_estimate(r) for _, r, _ in rows]
        how = "linear estimate from this length;\n--max-context searches it exactly"
    ys = list(range(n))[::-1]
    bx.barh(ys, [c / 1e6 for c in ctx], color="#1f77b4", height=0.6)
    top = max(ctx + [1]) / 1e6
    for y, c in zip(ys, ctx):
        bx.text(c / 1e6 + top * 0.01, y, fmt_tokens(c) if c else "none fits", va="center", fontsize=8)
    bx.set_yticks(ys)
    bx.set_yticklabels([label for label, _, _ in rows], fontsize=9)
    bx.set_xlim(0, top * 1.25)
    bx.set_xlabel(f"max context, million tokens\n({how})", fontsize=9)
    bx.set_title(f"max context within {usable:.1f} GiB", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_plan(a) -> int:
    import contextlib

    # DeepSpeed prints build/info lines on stdout; with --json, stdout carries the JSON alone
    out = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):
        return _run_plan(a, out)


def _run_plan(a, out) -> int:
    t0 = time.perf_counter()
    ds = load_ds_config(a.config)
    mc = load_model_config(a.model_config, a.model)
    if a.gpus < 1:
        raise ConfigError("--gpus", f"must be positive, got {a.gpus}", "pass the world size")
    configs = [("config", ds)]
    if a.compare:
        from .search import ladder

        configs = ladder(ds, mc, a.gpus)
    rows, params = [], None
    host_mem, host_source = _host_mem(a.host_mem, a.config)
    for label, cfg in configs:
        p = Planner(cfg, mc, a.gpus, a.gpu_mem, host_mem, a.reserve, a.gpus_per_node, a.device, a.full_depth,
                    params=params, target=a.target, host_budget_source=host_source)
        params = p.params
        if a.max_context:
            mx, r = p.max_context(label=label)
            rows.append((label, r, mx))
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
        print(json.dumps(obj, indent=1), file=out)
    else:
        print(_table(rows, show_max=a.max_context), file=out)
        print(_detail(rows[-1][1]), file=out)
        if a.max_context:
            for label, r, mx in rows:
                print(f"max context [{label}]: {mx} tokens ({fmt_tokens(mx)}); {r.binding_detail}", file=out)
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
        from .host import machine_ram_bytes

        ram = machine_ram_bytes()
        return ram, f"--host-mem {value}: this machine's RAM ({fmt_bytes(ram)})"
    return value, f"--host-mem {value}"


def main(argv=None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    a = _parser().parse_args(argv)
    try:
        if a.cmd == "plan":
            return run_plan(a)
    except ConfigError as e:
        print(f"ds-longctx {a.cmd}: {e}", file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
