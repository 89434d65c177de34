"""The GPU checks of one lent device call (bench/device/run_all.sh runs the parts under time limits).

Parts (``--part a,b,...``), each written into the JSON of ``--out`` as soon as it finishes, so a part
killed by its limit loses only itself:

  kernels    every CUDA kernel backend vs an fp32 reference (out, lse, dq, dk, dv; MHA/GQA/MQA, causal or
             not), and whether each aten op takes fewer kv heads natively (no repeat_interleave); under
             "windows": every backend that applies sliding windows / soft-capping (flash's native
             window_size / softcap, the banded kernel) on windows ``--windows`` over ``--window-seq`` tokens,
             GQA, causal, dense and packed documents (the varlen calls), a soft-capped case where a kernel
             takes softcap, vs the fp64 reference and vs the banded kernel; "auto"'s choice per pattern
  attention  untied (head-chunked) vs tied attention, q/k/v projection + RoPE + attention, forward and
             backward, Llama-3-8B attention shapes, bf16, SP=1: speed (modes alternated round by round)
             and peak (max_memory_allocated and max_memory_reserved); "auto"'s measured choice
  varlen     packed documents (``--docs`` per sample) on the untied path: one varlen call per stage vs the
             per-document loop (equality and speed) and vs a dense sample of the same length
  block      the untied attention block Function (norm + attention + o_proj, patch_model at SP=1) vs HF's
             own layers, bf16, both against an fp32 HF reference: loss and gradients
  arena      activation checkpointing with layer inputs offloaded through the pinned exact-size arena vs
             no offload (fp32: bit-equal loss and gradients), bench/gpu_memory_stack.offload_check
  keep       activation_checkpointing.keep_attention_output on vs off (issue 20): a 2-layer model of
             Llama-3-8B's layer shapes, untied fused attention + the memory stack, SP=1, bf16, forward +
             backward alternated round by round at ``--keep-seq``: step time, peaks, loss/grads equality
  passes     the attention block's backward with its re-derived normed-input tiles shared by every GEMM that
             can wait (one pass per projection) vs one pass per GEMM (the schedule before), bench/block_passes.py:
             Llama-3.2-1B's attention shapes, u=1, bf16, alternated, at ``--passes-seq``; grads bit-equal

``--dry-run``: the same code on CPU at tiny sizes (no CUDA needed), to catch argument, import and shape
errors before device time is spent.

    python bench/gpu_checks.py --part kernels,attention --seq 32768 131072 --out attention.json
    python bench/gpu_checks.py --dry-run --part kernels,attention,varlen,block,arena --out /tmp/dry.json
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

# Llama-3-8B attention (the dry run shrinks them)
SHAPES = {"hidden": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128}


def _rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def _maxrel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


class Clock:
    """Seconds of fn(): CUDA events on a GPU, perf_counter on CPU (the dry run)."""

    def __init__(self, dev):
        self.cuda = dev.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def __call__(self, fn):
        if not self.cuda:
            t = time.perf_counter()
            out = fn()
            return time.perf_counter() - t, out
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3, out

    def reset_peak(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return torch.cuda.memory_allocated()
        return 0

    def peak(self, base):
        if self.cuda:
            return {"allocated": torch.cuda.max_memory_allocated() - base,
                    "reserved": torch.cuda.max_memory_reserved()}
        return {}


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------

def part_kernels(dev, dtype, args):
    from ds_longctx.attention.kernels import BACKENDS, reference_attention

    out = {}
    d = SHAPES["head_dim"]
    for name, cls in BACKENDS.items():
        if cls.device_type != dev.type:
            continue
        if not cls.available():
            out[name] = {"available": False}
            continue
        res = {"available": True, "cases": {}, "native_gqa_probe": {}}
        backend = cls()
        for hq, hk in [(8, 8), (8, 2), (8, 1)]:
            for causal in (True, False):
                key = f"h{hq}kv{hk}-{'causal' if causal else 'full'}"
                try:
                    g = torch.Generator(device=dev).manual_seed(0)
                    b, s, scale = 2, args.kernel_seq, d ** -0.5
                    q, k, v = (torch.randn(b, s, h, d, generator=g, device=dev, dtype=dtype) for h in (hq, hk, hk))
                    do = torch.randn(b, s, hq, d, generator=g, device=dev, dtype=dtype)
                    ref_in = [t.double().requires_grad_(True) for t in (q, k, v)]
                    ro, rl = reference_attention(*ref_in, causal, scale)
                    ro.backward(do.double())
                    o, lse = backend.forward(q, k, v, causal, scale)
                    dq, dk, dv = backend.backward(do, q, k, v, o, lse, causal, scale)
                    errs = {"out": _rel(o, ro), "lse": _rel(lse, rl), "dq": _rel(dq, ref_in[0].grad),
                            "dk": _rel(dk, ref_in[1].grad), "dv": _rel(dv, ref_in[2].grad)}
                    ok = all(e < 2e-2 for e in errs.values()) and dk.shape == k.shape
                    res["cases"][key] = {"ok": ok, **{n: round(e, 6) for n, e in errs.items()}}
                    if hk < hq:  # the private _fwd/_bwd with fewer kv heads: does the op do GQA itself?
                        try:
                            o2, l2 = backend._fwd(q, k, v, causal, scale)
                            g2 = backend._bwd(do, q, k, v, o2, l2, causal, scale)
                            res["native_gqa_probe"][key] = {
                                "ran": True, "out": round(_rel(o2, ro), 6), "dk": round(_rel(g2[1], ref_in[1].grad), 6),
                                "dk_shape_ok": tuple(g2[1].shape) == tuple(k.shape)}
                        except Exception as e:  # noqa: BLE001 - recorded: the op needs expanded heads
                            res["native_gqa_probe"][key] = {"ran": False, "error": f"{type(e).__name__}: {e}"[:200]}
                except Exception as e:  # noqa: BLE001
                    res["cases"][key] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:300]}
        res["ok"] = all(c.get("ok") for c in res["cases"].values())
        out[name] = res
    try:
        out["windows"] = _kernel_windows(dev, dtype, args)
    except Exception:  # noqa: BLE001 - recorded, the other results stay
        out["windows"] = {"ok": False, "error": traceback.format_exc()[-2000:]}
    return out


def _rel_floor(a, b):
    """Relative error with a floor on the reference's norm (1e-2 per element, rms): with a window of 1 token
    dq and dk are exactly 0 and only an absolute error means anything."""
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp(min=1e-2 * b.numel() ** 0.5)).item()


def _grads_errs(got, want, prefix=""):
    return {prefix + n: round(_rel_floor(a, b), 6) for n, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want)}


def _kernel_windows(dev, dtype, args):
    """Sliding windows / soft-capping on every kernel that applies them (issue 19): the fp64 dense reference
    (reference_attention) and the banded kernel side by side, dense and packed documents (DocumentBackend:
    torch's / flash-attn's varlen call with the window, or the per-document loop), then what "auto" picks."""
    from ds_longctx.attention.documents import DocumentBackend, Documents
    from ds_longctx.attention.kernels import BACKENDS, KernelChoice, Windowed, reference_attention

    hq, hk, d = 8, 2, SHAPES["head_dim"]
    b, s, scale, cap = 1, args.window_seq, SHAPES["head_dim"] ** -0.5, 2.0  # cap 2: the tanh bends the scores
    banded_name = "torch_banded_cuda" if dev.type == "cuda" else "torch_banded"
    kernels = {n: cls() for n, cls in BACKENDS.items() if cls.device_type == dev.type and cls.available()
               and (cls.supports_window or cls.supports_softcap)}
    out = {"seq": s, "heads": [hq, hk], "kernels": sorted(kernels), "cases": {}}
    g = torch.Generator(device=dev).manual_seed(5)
    q, k, v = (torch.randn(b, s, h, d, generator=g, device=dev, dtype=dtype) for h in (hq, hk, hk))
    do = torch.randn(b, s, hq, d, generator=g, device=dev, dtype=dtype)
    docs = Documents(_doc_bounds(s, max(2, s // 512), seed=3))
    bounds = docs.bounds[0]

    def reference(window, softcap, packed):
        ref_in = [t.double().requires_grad_(True) for t in (q, k, v)]
        spans = bounds if packed else [(0, s)]
        outs, lses = [], []
        for a, e in spans:
            o, lse = reference_attention(*(t[:, a:e] for t in ref_in), True, scale, window or None, softcap or None)
            outs.append(o)
            lses.append(lse)
        o, lse = torch.cat(outs, 1), torch.cat(lses, 2)
        o.backward(do.double())
        return [o.detach(), lse.detach()] + [t.grad for t in ref_in]

    cases = [(w, 0.0, packed) for w in args.windows for packed in (False, True)]
    cases += [(0, cap, False), (args.windows[-1], cap, False), (args.windows[-1], cap, True)]
    for window, softcap, packed in cases:
        key = f"window{window}-softcap{softcap:g}-{'packed' if packed else 'dense'}"
        runs = [n for n, kb in kernels.items() if (not window or kb.supports_window)
                and (not softcap or kb.supports_softcap)]
        if not runs:
            continue
        want = reference(window, softcap, packed)
        case = {}
        got_banded = None
        for name in sorted(runs, key=lambda n: n != banded_name):  # the banded kernel first: the others vs it
            try:
                be = Windowed(kernels[name], window, softcap)
                route = "dense"
                if packed:  # the banded kernel per document (the reference loop); the others as training runs
                    be = DocumentBackend(be, docs, varlen=name != banded_name)
                    route = be._route(q, k, v, True, scale)[0]
                o, lse = be.forward(q, k, v, True, scale)
                dq, dk, dv = be.backward(do, q, k, v, o, lse, True, scale)
                got = [o, lse, dq, dk, dv]
                errs = _grads_errs(got, want)
                row = {"route": route, "ok": all(e < 2e-2 for e in errs.values()) and dk.shape == k.shape, **errs}
                if name == banded_name:
                    got_banded = got
                elif got_banded is not None:
                    row.update(_grads_errs(got, got_banded, "vs_banded_"))
                case[name] = row
            except Exception as e:  # noqa: BLE001
                case[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:300]}
        out["cases"][key] = case
        del want
    # "auto" per pattern: a windowed layer and a full one are measured apart (MeasuredChoice signature)
    choice = KernelChoice("auto")
    picked = {}
    for window, softcap in [(0, 0.0), (args.windows[-1], 0.0), (args.windows[-1], cap)]:
        try:
            be = choice.for_layer(dev, window or None, softcap or None)
            o, lse = be.forward(q, k, v, True, scale)
            be.backward(do, q, k, v, o, lse, True, scale)
            measured = choice.on(dev)
            chosen = getattr(measured, "choices", {})
            picked[f"window{window}-softcap{softcap:g}"] = {
                "backend": be.name, "choices": {str(k_): c_ for k_, c_ in chosen.items()}}
        except Exception as e:  # noqa: BLE001
            picked[f"window{window}-softcap{softcap:g}"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    out["auto"] = picked
    out["ok"] = all(r.get("ok") for c in out["cases"].values() for r in c.values()) and \
        not any("error" in r for r in picked.values())
    return out


# ---------------------------------------------------------------------------------------------
# attention: untied vs tied
# ---------------------------------------------------------------------------------------------

def _inputs(seq, dev, dtype, seed=0):
    H, G, d, D = SHAPES["heads"], SHAPES["kv_heads"], SHAPES["head_dim"], SHAPES["hidden"]
    g = torch.Generator(device=dev).manual_seed(seed)
    x = (torch.randn(1, seq, D, generator=g, device=dev) * 0.5).to(dtype).requires_grad_(True)
    w = {n: (torch.randn(r * d, D, generator=g, device=dev) * D ** -0.5).to(dtype).requires_grad_(True)
         for n, r in (("q", H), ("k", G), ("v", G))}
    pos = torch.arange(seq, device=dev, dtype=torch.float32)
    inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d))
    ang = torch.cat([pos[:, None] * inv] * 2, -1)[None]
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    dout = (torch.randn(1, seq, H * d, generator=g, device=dev) * 0.1).to(dtype)
    return x, w, cos, sin, dout


def stage_tied(x, w, cos, sin, dout, pin=None):
    from ds_longctx.models import rope_bshd

    if pin is not None:  # SDPA pinned to one backend, to tell kernel speed from chunking cost
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(getattr(SDPBackend, pin)):
            return stage_tied(x, w, cos, sin, dout)
    H, G, d = SHAPES["heads"], SHAPES["kv_heads"], SHAPES["head_dim"]
    b, s, _ = x.shape
    q = rope_bshd(torch.nn.functional.linear(x, w["q"]).view(b, s, H, d), cos, sin)
    k = rope_bshd(torch.nn.functional.linear(x, w["k"]).view(b, s, G, d), cos, sin)
    v = torch.nn.functional.linear(x, w["v"]).view(b, s, G, d)
    o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         is_causal=True, scale=d ** -0.5, enable_gqa=True)
    o = o.transpose(1, 2).reshape(b, s, H * d)
    o.backward(dout)
    return o


def stage_untied(x, w, cos, sin, dout, hpc, backend, docs=None):
    from ds_longctx.attention.untied import ProjectionSpec, Schedule, untied_attention_fused
    from ds_longctx.models import rope_bshd

    H, G, d = SHAPES["heads"], SHAPES["kv_heads"], SHAPES["head_dim"]
    b, s, _ = x.shape
    o, _ = untied_attention_fused(x, cos, sin, w["q"], w["k"], w["v"], schedule=Schedule(H, G, 1, hpc),
                                  spec=ProjectionSpec(d, rope_bshd), backend=backend,
                                  causal=True, scale=d ** -0.5, docs=docs)
    o = o.reshape(b, s, H * d)
    o.backward(dout)
    return o


def _alternated(modes, tensors, steps, clock):
    """modes: [(name, fn)]. A warm-up pass per mode (peak memory, outputs and grads kept for the diffs),
    then ``steps`` rounds that time every mode once each, in turn: noise hits all modes alike."""
    rows, ref = {}, None
    for name, fn in modes:
        try:
            for t in tensors:
                t.grad = None
            base = clock.reset_peak()
            sec, out = clock(fn)
            peak = clock.peak(base)
            got = [out.detach().float()] + [t.grad.float() for t in tensors]
            if ref is None:
                ref = got
            rows[name] = {"warmup_s": sec, "peak": peak, "max_rel_diff_vs_first": max(_rel(a, b) for a, b in
                                                                                     zip(got, ref)), "times": []}
            del out, got
        except Exception as e:  # noqa: BLE001 - a mode that fails (OOM, missing kernel) is recorded
            rows[name] = {"error": f"{type(e).__name__}: {e}"[:400]}
        gc.collect()
        if clock.cuda:
            torch.cuda.empty_cache()
    for _ in range(steps):
        for name, fn in modes:
            if "error" in rows[name]:
                continue
            for t in tensors:
                if t.grad is not None:
                    t.grad.zero_()
            rows[name]["times"].append(clock(fn)[0])
    for r in rows.values():
        if r.get("times"):
            r["step_s"] = statistics.median(r["times"])
    return rows


def part_attention(dev, dtype, args):
    from ds_longctx.attention.kernels import available_backends, get_backend

    clock = Clock(dev)
    out = {}
    for seq in args.seq:
        x, w, cos, sin, dout = _inputs(seq, dev, dtype)
        tensors = [x] + list(w.values())
        auto = get_backend("auto", dev)
        modes = [("tied (SDPA default)", lambda: stage_tied(x, w, cos, sin, dout))]
        if clock.cuda and not args.minimal:
            modes += [("tied (SDPA cuDNN)", lambda: stage_tied(x, w, cos, sin, dout, "CUDNN_ATTENTION")),
                      ("tied (SDPA flash)", lambda: stage_tied(x, w, cos, sin, dout, "FLASH_ATTENTION"))]
        modes += [(f"untied u={u} [auto]", lambda u=u: stage_untied(x, w, cos, sin, dout, u, auto))
                  for u in args.hpc]
        for k in ([] if args.minimal else available_backends()):
            if k.startswith("sdpa_cpu") and clock.cuda:
                continue
            modes.append((f"untied u=1 [{k}]", lambda k=k: stage_untied(x, w, cos, sin, dout, 1, get_backend(k, dev))))
        rows = _alternated(modes, tensors, args.steps, clock)
        tied = rows.get("tied (SDPA default)", {})
        for r in rows.values():
            if "step_s" in r and "step_s" in tied:
                r["speed_vs_tied"] = tied["step_s"] / r["step_s"]
        out[str(seq)] = {"rows": rows, "auto_choices": {str(k): v for k, v in getattr(auto, "choices", {}).items()}}
        del x, w, cos, sin, dout, tensors
        gc.collect()
        if clock.cuda:
            torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------------------------------------
# varlen: packed documents in one call per stage
# ---------------------------------------------------------------------------------------------

def _doc_bounds(seq, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randperm(seq - 1, generator=g)[:n - 1].add(1).tolist())
    return torch.tensor([[0] + cuts + [seq]])


def part_varlen(dev, dtype, args):
    from ds_longctx.attention.documents import DocumentBackend, Documents
    from ds_longctx.attention.kernels import get_backend

    clock = Clock(dev)
    out = {}
    for seq in args.varlen_seq:
        docs = Documents(_doc_bounds(seq, args.docs))
        x, w, cos, sin, dout = _inputs(seq, dev, dtype, seed=2)
        tensors = [x] + list(w.values())
        auto = get_backend("auto", dev)
        loop_kernel = get_backend("sdpa", dev)  # the same kernel family as the varlen call: comparable numbers
        modes = [("dense (1 document)", lambda: stage_untied(x, w, cos, sin, dout, 1, auto)),
                 (f"packed {args.docs} docs, varlen", lambda: stage_untied(x, w, cos, sin, dout, 1, auto, docs)),
                 (f"packed {args.docs} docs, per-document loop [{loop_kernel.name}]",
                  lambda: stage_untied(x, w, cos, sin, dout, 1, DocumentBackend(loop_kernel, docs, varlen=False))),
                 (f"packed {args.docs} docs, per-document loop [auto]",
                  lambda: stage_untied(x, w, cos, sin, dout, 1, DocumentBackend(auto, docs, varlen=False)))]
        rows = _alternated(modes, tensors, args.steps, clock)
        # equality: varlen vs the loop on the same kernel family (outputs and every gradient)
        names = [m[0] for m in modes]
        res = {"rows": rows, "docs": args.docs}
        try:
            got = {}
            for name in names[1:3]:
                for t in tensors:
                    t.grad = None
                o = dict(modes)[name]()
                got[name] = [o.detach()] + [t.grad.clone() for t in tensors]
            a, b = got[names[1]], got[names[2]]
            res["varlen_vs_loop_rel_diff"] = {n: _rel(p, q) for n, p, q in zip(("out", "dx", "dwq", "dwk", "dwv"), a, b)}
            res["varlen_vs_loop_max_rel_diff"] = {n: _maxrel(p, q) for n, p, q in
                                                  zip(("out", "dx", "dwq", "dwk", "dwv"), a, b)}
        except Exception as e:  # noqa: BLE001
            res["equality_error"] = f"{type(e).__name__}: {e}"[:400]
        out[str(seq)] = res
        del x, w, cos, sin, dout, tensors
        gc.collect()
        if clock.cuda:
            torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------------------------------------
# block Function vs HF layers
# ---------------------------------------------------------------------------------------------

def part_block(dev, dtype, args):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from ds_longctx.config import parse
    from ds_longctx.patching.patch import patch_model
    from ds_longctx.patching.spec import build_spec

    cfg = LlamaConfig(hidden_size=args.block_hidden, num_attention_heads=8, num_key_value_heads=4,
                      head_dim=args.block_hidden // 8, num_hidden_layers=2, vocab_size=4096,
                      intermediate_size=2 * args.block_hidden, tie_word_embeddings=False, rms_norm_eps=1e-5)
    ids = torch.randint(0, 4096, (1, args.block_seq), generator=torch.Generator().manual_seed(5)).to(dev)

    def run(dt, lc):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
        model = model.to(device=dev, dtype=dt).train()
        handle = patch_model(model, build_spec(parse({"long_context": lc}), model.config)) if lc else None
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {n: p.grad.detach().double() for n, p in model.named_parameters()}
        if handle is not None:
            handle.remove()
        return float(loss), grads

    stack = {"attention": {"implementation": "untied_ulysses", "heads_per_chunk": 1, "fuse_projections": True},
             "activation_checkpointing": {"enabled": True}, "rms_norm": {"enabled": True}}
    ref_loss, ref = run(torch.float32, None)  # fp32 HF on the same device (tf32 off by default)
    out = {"model": {"hidden": args.block_hidden, "layers": 2, "seq": args.block_seq}, "fp32_hf_loss": ref_loss}
    for name, lc in (("hf_" + str(dtype).split(".")[-1], None), ("block_" + str(dtype).split(".")[-1], stack)):
        loss, g = run(dtype, lc)
        errs = {n: _rel(g[n], ref[n]) for n in ref}
        out[name] = {"loss": loss, "loss_rel_err_vs_fp32": abs(loss - ref_loss) / abs(ref_loss),
                     "grad_rel_err_vs_fp32_max": max(errs.values()),
                     "grad_rel_err_vs_fp32_median": statistics.median(errs.values())}
    h, b = out[f"hf_{str(dtype).split('.')[-1]}"], out[f"block_{str(dtype).split('.')[-1]}"]
    # the block is as exact as HF's own bf16 path when its error vs fp32 is of the same size
    out["block_error_over_hf_error"] = {"loss": b["loss_rel_err_vs_fp32"] / max(h["loss_rel_err_vs_fp32"], 1e-12),
                                        "grads_max": b["grad_rel_err_vs_fp32_max"] / max(h["grad_rel_err_vs_fp32_max"],
                                                                                        1e-12)}
    return out


def part_arena(dev, dtype, args):
    if dev.type != "cuda":
        return {"skipped": "the pinned arena needs CUDA (dry run)"}
    from gpu_memory_stack import offload_check

    return offload_check()


def part_keep(dev, dtype, args):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from ds_longctx.config import parse
    from ds_longctx.patching.patch import patch_model
    from ds_longctx.patching.spec import build_spec

    h = SHAPES["hidden"]
    cfg = LlamaConfig(hidden_size=h, num_attention_heads=SHAPES["heads"], num_key_value_heads=SHAPES["kv_heads"],
                      head_dim=SHAPES["head_dim"], num_hidden_layers=2, vocab_size=4096,
                      intermediate_size=args.keep_intermediate, tie_word_embeddings=False, rms_norm_eps=1e-5)
    clock = Clock(dev)
    out = {"model": {"hidden": h, "layers": 2, "intermediate": args.keep_intermediate}}
    for seq in args.keep_seq:
        ids = torch.randint(0, 4096, (1, seq), generator=torch.Generator().manual_seed(7)).to(dev)
        models = {}
        for keep in (False, True):
            torch.manual_seed(0)
            with torch.device(dev):
                m = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
            m.train()
            lc = {"attention": {"implementation": "untied_ulysses", "heads_per_chunk": args.keep_hpc,
                                "fuse_projections": True},
                  "activation_checkpointing": {"enabled": True, "keep_attention_output": keep},
                  "tiled_mlp": {"enabled": True}, "tiled_loss": {"enabled": True}, "rms_norm": {"enabled": True}}
            patch_model(m, build_spec(parse({"long_context": lc}), m.config))
            models["keep" if keep else "recompute"] = m

        def step(m):
            m.zero_grad(set_to_none=True)
            m(input_ids=ids, labels=ids).loss.backward()

        rows = {}
        for name, m in models.items():  # warm-up: peaks, loss and grads
            base = clock.reset_peak()
            m.zero_grad(set_to_none=True)
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            clock.sync()
            rows[name] = {"loss": loss.item(), "peak": clock.peak(base), "times": []}
        a, b = models["recompute"], models["keep"]
        rows["keep"]["loss_equal"] = rows["keep"]["loss"] == rows["recompute"]["loss"]
        rows["keep"]["grads_equal"] = all(torch.equal(pa.grad, pb.grad) for pa, pb in zip(a.parameters(),
                                                                                           b.parameters()))
        # on CUDA they were not bit-equal (H200, 2026-11-28): how far apart, relative L2 per tensor, the largest
        rows["keep"]["grads_max_rel_l2"] = max(float((pa.grad.float() - pb.grad.float()).norm() /
                                                     pa.grad.float().norm().clamp_min(1e-30))
                                               for pa, pb in zip(a.parameters(), b.parameters()))
        for _ in range(args.steps):  # alternated: noise hits both alike
            for name, m in models.items():
                rows[name]["times"].append(clock(lambda: step(m))[0])
        for r in rows.values():
            r["step_s"] = statistics.median(r["times"])
        rows["keep_over_recompute_time"] = rows["keep"]["step_s"] / rows["recompute"]["step_s"]
        out[str(seq)] = rows
        del models, a, b, ids
        gc.collect()
        if clock.cuda:
            torch.cuda.empty_cache()
    return out


def part_nvme(dev, dtype, args):
    """The NVMe file target (DeepSpeed's async_io op) on this machine's disk, bit-exact vs no offload over
    3 steps, then no file left behind. Needs the op built (libaio: run_all.sh carries and unpacks it)."""
    import shutil
    import tempfile

    from deepspeed.ops.op_builder import AsyncIOBuilder

    b = AsyncIOBuilder()
    if not b.is_compatible():
        return {"skipped": "DeepSpeed's async_io op is not compatible here (libaio not found)"}
    t0 = time.time()
    b.load()
    built_s = time.time() - t0
    from gpu_memory_stack import offload_check

    path = tempfile.mkdtemp(prefix="ds_longctx_nvme_", dir=args.nvme_dir)
    try:
        res = offload_check("nvme", nvme_path=path, steps=3 if dev.type == "cuda" else 2, device=dev.type)
        res["left_behind"] = sorted(os.listdir(path))
    finally:
        shutil.rmtree(path, ignore_errors=True)
    res["aio_build_or_load_s"] = round(built_s, 1)
    return res


def part_passes(dev, dtype, args):
    from block_passes import compare

    shape = {"hidden": 2048, "heads": 32, "kv_heads": 8, "head_dim": 64} if dev.type == "cuda" else dict(SHAPES)
    return [compare(s, shape, 1, args.steps, dtype, dev) for s in args.passes_seq]


PARTS = {"kernels": part_kernels, "attention": part_attention, "varlen": part_varlen, "block": part_block,
         "arena": part_arena, "nvme": part_nvme, "keep": part_keep, "passes": part_passes}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", required=True, help=f"comma-separated parts of {sorted(PARTS)}")
    p.add_argument("--out", required=True, help="JSON written after each part")
    p.add_argument("--seq", type=int, nargs="+", default=[32768, 131072], help="attention: sequence lengths")
    p.add_argument("--hpc", type=int, nargs="+", default=[1, 8], help="attention: heads_per_chunk values")
    p.add_argument("--steps", type=int, default=3, help="timed rounds (modes alternate within a round)")
    p.add_argument("--varlen-seq", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--docs", type=int, default=64, help="varlen: documents per sample")
    p.add_argument("--kernel-seq", type=int, default=1000)
    p.add_argument("--window-seq", type=int, default=4096, help="kernels: tokens of the sliding-window cases")
    p.add_argument("--windows", type=int, nargs="+", default=[1, 7, 256], help="kernels: sliding windows")
    p.add_argument("--nvme-dir", default="/tmp", help="nvme: where the activation files go")
    p.add_argument("--block-hidden", type=int, default=1024)
    p.add_argument("--block-seq", type=int, default=4096)
    p.add_argument("--keep-seq", type=int, nargs="+", default=[131072], help="keep: sequence lengths")
    p.add_argument("--keep-hpc", type=int, default=8, help="keep: heads_per_chunk")
    p.add_argument("--keep-intermediate", type=int, default=14336, help="keep: MLP width (Llama-3-8B: 14336)")
    p.add_argument("--passes-seq", type=int, nargs="+", default=[131072], help="passes: sequence lengths")
    p.add_argument("--minimal", action="store_true", help="attention: tied (SDPA default) and untied [auto] only")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: check the script, not the GPU")
    args = p.parse_args(argv)
    parts = [x for x in args.part.split(",") if x]
    bad = [x for x in parts if x not in PARTS]
    if bad:
        p.error(f"unknown part(s) {bad}; choose from {sorted(PARTS)}")
    if args.dry_run:
        SHAPES.update(hidden=64, heads=4, kv_heads=2, head_dim=16)
        args.seq, args.varlen_seq, args.hpc, args.steps = [128], [128], [1, 2], 1
        args.docs, args.kernel_seq, args.block_hidden, args.block_seq = 8, 32, 64, 64
        args.window_seq, args.windows = 96, [1, 7, 24]
        args.keep_seq, args.keep_hpc, args.keep_intermediate = [128], 2, 128
        args.passes_seq = [96]
        dev, dtype = torch.device("cpu"), torch.float32
    else:
        if not torch.cuda.is_available():
            p.error("no CUDA device (use --dry-run on CPU)")
        dev, dtype = torch.device("cuda"), torch.bfloat16
    import logging

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    result = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (dry run)",
              "torch": torch.__version__, "cuda": torch.version.cuda,
              "cudnn": torch.backends.cudnn.version() if dev.type == "cuda" else None,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "command": " ".join(["python", "bench/gpu_checks.py"] + (argv if argv is not None else sys.argv[1:])),
              "shapes": dict(SHAPES), "dtype": str(dtype)}
    for part in parts:
        t0 = time.time()
        print(f"== {part} ({time.strftime('%H:%M:%S')})", file=sys.stderr, flush=True)
        try:
            result[part] = PARTS[part](dev, dtype, args)
        except Exception:  # noqa: BLE001 - the next part still runs
            result[part] = {"error": traceback.format_exc()[-2000:]}
        result[part + "_wall_s"] = round(time.time() - t0, 1)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
        print(json.dumps({part: result[part]}, default=str)[:3000], file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
