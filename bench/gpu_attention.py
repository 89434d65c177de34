"""Untied (headwise-chunked) vs tied attention on one CUDA GPU, plus a check of every CUDA kernel backend.

SP=1: untied is head chunking alone (no all-to-all). The stage compared is q/k/v projection + RoPE +
attention, forward and backward, Llama3-8B attention shapes (hidden 4096, 32 heads, 8 kv heads,
head_dim 128), bf16, batch 1. o_proj is the same for both and left out.

tied:   HF's path on CUDA: project all heads, RoPE, torch SDPA (enable_gqa, causal) with autograd.
untied: ds_longctx.attention.untied.untied_attention_fused, every heads_per_chunk, kernel 'auto'
        (FA3 > FA2 > torch flash), plus heads_per_chunk=1 with each other available kernel.

Memory: torch.cuda.max_memory_allocated() during the step minus what was allocated before it
(inputs, weights and their grads exist before). Time: CUDA events, median of --steps after a warm-up.
Kernel check: each available CUDA backend vs an fp32 math reference on the same (bf16-rounded)
inputs: out, lse, dq, dk, dv, MHA/GQA/MQA, causal and not.

Prints one JSON document (and a markdown table on stderr). Needs only torch (+ pydantic for the
ds_longctx package); deepspeed and transformers are not used.

    python bench/gpu_attention.py                      # seq 32768 and 131072
    python bench/gpu_attention.py --seq 8192 --steps 2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 4096, 32, 8, 128


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-12)).item()


def check_kernels(dev):
    """Every available CUDA backend vs an fp32 math reference."""
    from ds_longctx.attention.kernels import BACKENDS, reference_attention

    out = {}
    for name, cls in BACKENDS.items():
        if cls.device_type != "cuda":
            continue
        if not cls.available():
            out[name] = {"available": False}
            continue
        res = {"available": True, "cases": {}}
        backend = cls()
        for hq, hk in [(8, 8), (8, 2), (8, 1)]:
            for causal in (True, False):
                key = f"h{hq}kv{hk}-{'causal' if causal else 'full'}"
                try:
                    g = torch.Generator(device=dev).manual_seed(0)
                    b, s, d, scale = 2, 1000, HEAD_DIM, HEAD_DIM ** -0.5
                    q, k, v = (torch.randn(b, s, h, d, generator=g, device=dev, dtype=torch.bfloat16)
                               for h in (hq, hk, hk))
                    do = torch.randn(b, s, hq, d, generator=g, device=dev, dtype=torch.bfloat16)
                    ref_in = [t.float().requires_grad_(True) for t in (q, k, v)]
                    ro, rl = reference_attention(*ref_in, causal, scale)
                    ro.backward(do.float())
                    o, lse = backend.forward(q, k, v, causal, scale)
                    dq, dk, dv = backend.backward(do, q, k, v, o, lse, causal, scale)
                    torch.cuda.synchronize()
                    errs = {"out": _rel(o, ro), "lse": _rel(lse, rl), "dq": _rel(dq, ref_in[0].grad),
                            "dk": _rel(dk, ref_in[1].grad), "dv": _rel(dv, ref_in[2].grad)}
                    ok = all(e < 3e-2 for e in errs.values()) and dk.shape == k.shape
                    res["cases"][key] = {"ok": ok, **{n: round(e, 6) for n, e in errs.items()}}
                except Exception as e:  # report, keep going
                    res["cases"][key] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:400]}
        res["ok"] = all(c.get("ok") for c in res["cases"].values())
        out[name] = res
    return out


def _inputs(seq, dev, dtype, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    x = (torch.randn(1, seq, HIDDEN, generator=g, device=dev) * 0.5).to(dtype).requires_grad_(True)
    w = {n: (torch.randn(r * HEAD_DIM, HIDDEN, generator=g, device=dev) * HIDDEN ** -0.5).to(dtype)
         .requires_grad_(True) for n, r in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS))}
    pos = torch.arange(seq, device=dev, dtype=torch.float32)
    inv = 1.0 / (500000.0 ** (torch.arange(0, HEAD_DIM, 2, device=dev, dtype=torch.float32) / HEAD_DIM))
    ang = torch.cat([pos[:, None] * inv] * 2, -1)[None]
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    dout = (torch.randn(1, seq, HEADS * HEAD_DIM, generator=g, device=dev) * 0.1).to(dtype)
    return x, w, cos, sin, dout


def stage_tied(x, w, cos, sin, dout, only=None):
    from ds_longctx.models import rope_bshd

    if only is not None:  # pin SDPA to one backend, to tell kernel speed from chunking cost
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(getattr(SDPBackend, only)):
            return stage_tied(x, w, cos, sin, dout)

    b, s, _ = x.shape
    q = rope_bshd(torch.nn.functional.linear(x, w["q"]).view(b, s, HEADS, HEAD_DIM), cos, sin)
    k = rope_bshd(torch.nn.functional.linear(x, w["k"]).view(b, s, KV_HEADS, HEAD_DIM), cos, sin)
    v = torch.nn.functional.linear(x, w["v"]).view(b, s, KV_HEADS, HEAD_DIM)
    o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         is_causal=True, scale=HEAD_DIM ** -0.5, enable_gqa=True)
    o = o.transpose(1, 2).reshape(b, s, HEADS * HEAD_DIM)
    o.backward(dout)
    return o


def stage_untied(x, w, cos, sin, dout, hpc, kernel):
    from ds_longctx.attention.kernels import get_backend
    from ds_longctx.attention.untied import ProjectionSpec, untied_attention_fused
    from ds_longctx.models import rope_bshd

    b, s, _ = x.shape
    o, _ = untied_attention_fused(x, cos, sin, w["q"], w["k"], w["v"], heads=HEADS, kv_heads=KV_HEADS,
                                  spec=ProjectionSpec(HEAD_DIM, rope_bshd), heads_per_chunk=hpc,
                                  backend=get_backend(kernel, x.device), causal=True, scale=HEAD_DIM ** -0.5)
    o = o.reshape(b, s, HEADS * HEAD_DIM)
    o.backward(dout)
    return o


def measure(fn, tensors, steps):
    times, peaks = [], []
    for i in range(steps + 1):
        for t in tensors:
            if t.grad is not None:
                t.grad.zero_()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del out
        if i:  # the first step allocates the .grad buffers and warms the kernels up
            times.append(start.elapsed_time(end) / 1e3)
            peaks.append(peak)
    return statistics.median(times), max(peaks)


def compare(seq, steps, dev, hpcs, kernels):
    from ds_longctx.attention.kernels import get_backend

    dtype = torch.bfloat16
    x, w, cos, sin, dout = _inputs(seq, dev, dtype)
    tensors = [x] + list(w.values())
    rows = []
    ref = None
    auto = get_backend("auto", dev).name
    modes = [("tied (torch SDPA)", None, None), ("tied (SDPA pinned to flash)", None, "FLASH_ATTENTION"),
             ("tied (SDPA pinned to cuDNN)", None, "CUDNN_ATTENTION")]
    modes += [(f"untied u={u} [{auto}]", u, "auto") for u in hpcs]
    modes += [(f"untied u=1 [{k}]", 1, k) for k in kernels if k != auto]
    for name, hpc, kernel in modes:
        try:
            if hpc is None:
                fn = lambda kernel=kernel: stage_tied(x, w, cos, sin, dout, kernel)  # noqa: E731
            else:
                fn = lambda hpc=hpc, kernel=kernel: stage_untied(x, w, cos, sin, dout, hpc, kernel)  # noqa: E731
            t, peak = measure(fn, tensors, steps)
            out = fn()
            grads = [out.detach()] + [t_.grad.clone() for t_ in tensors]
            if ref is None:
                ref = grads
            diff = max(_rel(a, b) for a, b in zip(grads, ref))
            del out, grads
            rows.append({"mode": name, "heads_per_chunk": hpc, "kernel": kernel, "step_s": t,
                         "peak_bytes": peak, "max_rel_diff_vs_tied": diff})
        except Exception as e:
            rows.append({"mode": name, "error": f"{type(e).__name__}: {e}"[:400]})
        torch.cuda.empty_cache()
    return rows


def correctness_small(dev):
    """Untied vs tied at a small size, each CUDA kernel, heads_per_chunk 1 and 4 (fp32 grads compared)."""
    from ds_longctx.attention.kernels import BACKENDS

    out = {}
    x, w, cos, sin, dout = _inputs(2048, dev, torch.bfloat16, seed=1)
    tensors = [x] + list(w.values())
    ref = stage_tied(x, w, cos, sin, dout)
    ref = [ref.detach()] + [t.grad.clone() for t in tensors]
    for name, cls in BACKENDS.items():
        if cls.device_type != "cuda" or not cls.available():
            continue
        for hpc in (1, 4):
            for t in tensors:
                t.grad = None
            try:
                o = stage_untied(x, w, cos, sin, dout, hpc, name)
                got = [o.detach()] + [t.grad for t in tensors]
                errs = [_rel(a, b) for a, b in zip(got, ref)]
                out[f"{name}-u{hpc}"] = {"ok": max(errs) < 3e-2, "rel_err_out_dx_dwq_dwk_dwv": [round(e, 5)
                                                                                           for e in errs]}
            except Exception as e:
                out[f"{name}-u{hpc}"] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:400]}
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--hpc", type=int, nargs="*", default=[1, 2, 4, 8, 32])
    p.add_argument("--json", help="also write the result here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    dev = torch.device("cuda")
    from ds_longctx.attention.kernels import available_backends

    t0 = time.time()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "kernels_available": available_backends(), "date": time.strftime("%Y-%m-%d"),
              "command": " ".join(["python", "bench/gpu_attention.py"] + (argv if argv is not None else sys.argv[1:]))}
    for part, fn in [("kernel_check", lambda: check_kernels(dev)), ("untied_vs_tied_small", lambda: correctness_small(dev))]:
        try:
            result[part] = fn()
        except Exception:
            result[part] = {"error": traceback.format_exc()[-1500:]}
    cuda_kernels = [k for k in available_backends() if k != "sdpa_cpu_flash"]
    result["compare"] = {}
    for seq in args.seq:
        try:
            result["compare"][seq] = compare(seq, args.steps, dev, args.hpc, cuda_kernels)
        except Exception:
            result["compare"][seq] = {"error": traceback.format_exc()[-1500:]}
    result["wall_s"] = round(time.time() - t0, 1)
    print(json.dumps(result, indent=1))
    for seq, rows in result["compare"].items():
        if not isinstance(rows, list):
            continue
        tied = next((r for r in rows if r["mode"].startswith("tied") and "error" not in r), None)
        print(f"\nseq {seq}, bf16, SP=1, {result['device']}\n", file=sys.stderr)
        print("| mode | step s | speed vs tied | peak GiB | peak vs tied | max rel diff vs tied |", file=sys.stderr)
        print("|---|---|---|---|---|---|", file=sys.stderr)
        for r in rows:
            if "error" in r:
                print(f"| {r['mode']} | error: {r['error'][:80]} | | | | |", file=sys.stderr)
                continue
            sp = f"{tied['step_s'] / r['step_s']:.2f}x" if tied else "-"
            pk = f"{r['peak_bytes'] / tied['peak_bytes']:.2f}x" if tied else "-"
            print(f"| {r['mode']} | {r['step_s']:.3f} | {sp} | {r['peak_bytes'] / 2**30:.2f} | {pk} | "
                  f"{r['max_rel_diff_vs_tied']:.1e} |", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
