"""The attention block's backward: one pass over the re-derived normed-input tiles per projection (shared)
against the schedule before it, one pass per GEMM with the fp32 copy of x (per-GEMM). CPU, one process.

Both variants run the same Function (attention/block.py) on the same inputs; "per-GEMM" swaps in a
subclass of its projection source that runs every GEMM in a pass of its own and re-derives each tile as
``weight * (x.float() * r).to(x.dtype)``, which is what the code did before. They alternate (per-GEMM,
shared, per-GEMM, ...) so load on the shared box hits both alike. Reported per length: the median forward +
backward time of each, the ratio, the re-derivation passes per backward, and measure/flops.WorkCounter's
memory-bound bytes and dispatched ops of one untimed step of each (gradients are bit-equal: checked).

    python bench/block_passes.py --seq 4096 8192 --rounds 5 [--dtype bf16] [--json out.json]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ds_longctx.attention import block as block_mod  # noqa: E402
from ds_longctx.attention.block import untied_attention_block  # noqa: E402
from ds_longctx.attention.kernels import get_backend  # noqa: E402
from ds_longctx.attention.untied import ProjectionSpec, Schedule  # noqa: E402
from ds_longctx.measure.flops import WorkCounter, by_category  # noqa: E402
from ds_longctx.memory.norm import tile_starts  # noqa: E402
from ds_longctx.models import rope_bshd  # noqa: E402

SHARED = block_mod._NormedProjSource


class Counted(SHARED):
    passes = 0

    def _pass(self, mms):
        Counted.passes += 1
        super()._pass(mms)


class PerGemm(Counted):
    """The schedule before the passes were shared: every GEMM in a pass of its own, fp32 copy of x."""

    def _pass(self, mms):
        Counted.passes += 1
        waiting, self._waiting = self._waiting, []
        n = self.x2.shape[0]
        for lo in tile_starts(n, self.step):
            hi = min(lo + self.step, n)
            xn = self.norm_w * (self.x2[lo:hi].to(torch.float32) * self.r2[lo:hi]).to(self.x2.dtype)
            for g, gw_rows in waiting:
                block_mod._add_gt_x(gw_rows, g[lo:hi], xn)
            for w_rows, out in mms:
                torch.mm(xn, w_rows.t(), out=out[lo:hi])

    def _x_mm(self, pairs):
        for pair in pairs:
            self._pass([pair])

    def _x_grad_w(self, pairs):
        for pair in pairs:
            self._waiting.append(pair)
            self._pass([])


def _inputs(shape, s, dtype, device):
    g = torch.Generator().manual_seed(0)
    D, H, G, d = shape["hidden"], shape["heads"], shape["kv_heads"], shape["head_dim"]

    def rnd(*size, scale=0.02):
        return (torch.randn(*size, generator=g) * scale).to(device=device, dtype=dtype)

    p = {"x": rnd(1, s, D, scale=1.0), "nw": 1 + rnd(D), "wq": rnd(H * d, D), "wk": rnd(G * d, D),
         "wv": rnd(G * d, D), "wo": rnd(D, H * d)}
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = torch.cat([torch.arange(s, dtype=torch.float32)[:, None] * inv] * 2, -1)
    cos, sin = ang.cos()[None].to(device, dtype), ang.sin()[None].to(device, dtype)
    return p, cos, sin, rnd(1, s, D, scale=1.0)


def _step(shape, hpc, backend, p, cos, sin, gy):
    p = {k: v.detach().requires_grad_(True) for k, v in p.items()}
    spec = ProjectionSpec(head_dim=shape["head_dim"], rope=rope_bshd)
    y = untied_attention_block(p["x"], cos, sin, p["wq"], p["wk"], p["wv"], p["wo"], norm_weight=p["nw"],
                               norm_eps=1e-5, schedule=Schedule(shape["heads"], shape["kv_heads"], 1, hpc), spec=spec,
                               backend=backend, causal=True)
    y.backward(gy)
    return {k: v.grad for k, v in p.items()}


def compare(s, shape, hpc=1, rounds=3, dtype=torch.float32, device="cpu"):
    """One row: both variants at ``s`` tokens (counted step each, then ``rounds`` alternated timed steps)."""
    device = torch.device(device)
    cuda = device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    p, cos, sin, gy = _inputs(shape, s, dtype, device)
    backend = get_backend("auto", device.type)
    variants = {"per_gemm": PerGemm, "shared": Counted}
    row = dict(shape, seq=s, dtype=str(dtype)[6:], heads_per_chunk=hpc, device=str(device))
    grads = {}
    try:
        for name, cls in variants.items():  # one untimed, counted step each (also the warm-up)
            block_mod._NormedProjSource = cls
            Counted.passes = 0
            with WorkCounter() as wc:
                grads[name] = _step(shape, hpc, backend, p, cos, sin, gy)
            cat = by_category(wc.work)
            row[name] = {"passes_per_backward": Counted.passes,
                         "memory_bound_bytes": sum(v for k, v in cat["bytes"].items() if k.startswith("other")),
                         "ops": int(sum(cat["calls"].values())), "times_s": []}
        row["grads_bit_equal"] = all(torch.equal(grads["shared"][k], grads["per_gemm"][k]) for k in grads["shared"])
        g1, g2 = grads["shared"], grads["per_gemm"]
        row["grads_max_rel_l2"] = max(float((g1[k].float() - g2[k].float()).norm() /
                                            g2[k].float().norm().clamp_min(1e-30)) for k in g1)
        del grads
        for _ in range(rounds):  # alternated: load hits both alike
            for name, cls in variants.items():
                block_mod._NormedProjSource = cls
                sync()
                t0 = time.perf_counter()
                _step(shape, hpc, backend, p, cos, sin, gy)
                sync()
                row[name]["times_s"].append(time.perf_counter() - t0)
    finally:
        block_mod._NormedProjSource = SHARED
    for name in variants:
        row[name]["median_s"] = statistics.median(row[name]["times_s"])
    row["speedup"] = row["per_gemm"]["median_s"] / row["shared"]["median_s"]
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[4096])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--hpc", type=int, default=1, help="heads_per_chunk")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    shape = {"hidden": args.hidden, "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim}
    rows = []
    for s in args.seq:
        row = compare(s, shape, args.hpc, args.rounds, dtype)
        rows.append(row)
        a, b = row["per_gemm"], row["shared"]
        print(f"seq {s} {args.dtype}: per-GEMM {a['median_s']:.3f} s ({a['passes_per_backward']} passes, "
              f"{a['memory_bound_bytes'] / 2**30:.2f} GiB memory-bound), shared {b['median_s']:.3f} s "
              f"({b['passes_per_backward']} passes, {b['memory_bound_bytes'] / 2**30:.2f} GiB): "
              f"{row['speedup']:.3f}x; grads bit-equal {row['grads_bit_equal']}", flush=True)
    if args.json:
        from _results import write_rows

        write_rows(args.json, rows)


if __name__ == "__main__":
    main()
