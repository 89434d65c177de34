"""``ds-longctx plan``: will this config fit, what is the longest sequence, how does the stack compare.

Exit codes: 0 fits, 1 does not fit, 2 bad input (message on stderr).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from ..config import ConfigError, load_ds_config
from .core import PlanResult, Planner, load_model_config
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
    q.add_argument("--gpu-mem", default="80GiB", help="device memory per GPU (default 80GiB)")
    q.add_argument("--host-mem", default="auto", help="host memory per node, checked (default: this machine's "
                   "RAM; 'none' to skip the check)")
    q.add_argument("--reserve", default="0", help="device memory kept back for CUDA context/NCCL (default 0)")
    q.add_argument("--seq-len", type=int, default=None, help="global tokens per sample (default: "
                   "long_context.sequence_length)")
    q.add_argument("--max-context", action="store_true", help="find the longest sequence that fits")
    q.add_argument("--compare", action="store_true", help="the stack's configurations side by side")
    q.add_argument("--plot", default=None, help="PNG of stacked bars (needs matplotlib)")
    q.add_argument("--json", action="store_true", help="one JSON object on stdout")
    q.add_argument("--full-depth", action="store_true", help="simulate every layer (default: 2 and 3 layers, "
                   "extrapolated; --max-context re-checks at full depth)")
    q.add_argument("--device", choices=("meta", "cpu"), default="meta", help=argparse.SUPPRESS)
    return p


def _row(r: PlanResult, max_seq=None) -> dict:
    d = r.to_dict()
    if max_seq is not None:
        d["max_sequence_length"] = max_seq
    return d


def _table(rows, title_col="config", show_max=False) -> str:
    head = [title_col, "seq", "fits", "peak"] + list(CATS) + ["host/rank"]
    lines = []
    for label, r, mx in rows:
        seq = fmt_tokens(mx if show_max else r.sequence_length)
        cells = [label, seq, "yes" if r.fits else "NO", fmt_bytes(r.peak_device_bytes)]
        cells += [fmt_bytes(r.breakdown.get(c, 0)) for c in CATS] + [fmt_bytes(r.host_bytes)]
        lines.append(cells)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
    fmt = "  ".join("{:<%d}" % w for w in widths)
    out = [fmt.format(*head), fmt.format(*["-" * w for w in widths])]
    out += [fmt.format(*cells) for cells in lines]
    return "\n".join(out)


def _detail(r: PlanResult) -> str:
    lines = [f"budget {fmt_bytes(r.device_budget_bytes)} per device (reserve {fmt_bytes(r.reserve_bytes)}), "
             f"world {r.world_size}, SP {r.sequence_parallel_size}, {r.num_layers} layers "
             + (f"(extrapolated from {r.layers_simulated})" if r.extrapolated else "(full depth)")]
    lines.append("model states on device: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in r.model_states.items()))
    if r.host:
        lines.append("host per rank: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in r.host.items())
                     + f"; per node {fmt_bytes(r.host_bytes_per_node)}"
                     + (f" of {fmt_bytes(r.host_budget_bytes)}" if r.host_budget_bytes else ""))
    if r.offload:
        from .host import describe

        lines += describe(r.offload)
    lines += [f"note: {n}" for n in r.notes]
    return "\n".join(lines)


def plot(rows, path: str, show_max: bool):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot", "matplotlib is not installed", "pip install matplotlib (or drop --plot)") from None
    labels = [f"{label}\n{fmt_tokens(mx if show_max else r.sequence_length)}" for label, r, mx in rows]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows)), 5))
    bottom = [0.0] * len(rows)
    for cat in CATS:
        vals = [r.breakdown.get(cat, 0) / 2**30 for _, r, _ in rows]
        ax.bar(labels, vals, bottom=bottom, label=cat)
        bottom = [b + v for b, v in zip(bottom, vals)]
    budget = rows[0][1].device_budget_bytes / 2**30
    ax.axhline(budget, color="k", ls="--", lw=1, label="budget")
    ax.set_ylabel("peak device GiB per rank")
    ax.set_title("ds_longctx plan" + (" at max context" if show_max else ""))
    ax.legend(fontsize=8)
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
    a.host_mem = _host_mem(a.host_mem)
    for label, cfg in configs:
        p = Planner(cfg, mc, a.gpus, a.gpu_mem, a.host_mem, a.reserve, a.gpus_per_node, a.device, a.full_depth,
                    params=params)
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
                print(f"max context [{label}]: {mx} tokens ({fmt_tokens(mx)})", file=out)
        print(f"planner wall time {wall:.1f}s", file=out)
    return 0 if fits else 1


def _host_mem(value):
    """--host-mem: 'auto' is this machine's RAM, 'none' skips the host check."""
    if value is None or str(value).lower() == "none":
        return None
    if str(value).lower() == "auto":
        from .host import machine_ram_bytes

        return machine_ram_bytes()
    return value


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
