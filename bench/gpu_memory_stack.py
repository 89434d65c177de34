#!/usr/bin/env python
"""Memory-stack ablation on one CUDA GPU: peak device memory (torch.cuda.max_memory_allocated) and
step time of one training step for none / +checkpointing / +offload / +tiled MLP / +tiled loss /
+untied attention, each row adding to the previous one. Same rows as bench/memory_stack.py (CPU).

Single process, no DeepSpeed engine: ``install`` is ``ds_longctx.patching.patch.patch_model`` for SP=1,
which imports no DeepSpeed there (absent on the GPU image). bf16 weights, no optimizer; grads are
allocated before measuring (model state is the same in every row), so peaks are activations,
logits and transients. A row that fails (OOM, missing kernel) is recorded and the run goes on.

    python bench/gpu_memory_stack.py [--seq 32768] [--out results.json]     # < 2 min on one H100
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# the same rows as the CPU bench (one definition of the stack ladder for both)
from memory_stack import cumulative_rows  # noqa: E402  (bench/ is on sys.path when run as a script)


def build(args):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(hidden_size=args.hidden, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      head_dim=args.hidden // args.heads, num_hidden_layers=args.layers, vocab_size=args.vocab,
                      intermediate_size=args.intermediate, max_position_embeddings=args.seq, rms_norm_eps=1e-6,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    return model


def install(model, lc: dict):
    """``ds_longctx.patching.patch.patch_model`` at SP=1 (no process group): exactly what training installs. It
    imports no DeepSpeed at SP=1, which is absent on the GPU image."""
    from ds_longctx.config import parse
    from ds_longctx.patching.patch import patch_model
    from ds_longctx.patching.spec import build_spec

    return patch_model(model, build_spec(parse({"long_context": lc}), model.config))


def run_row(args, name, lc):
    model = build(args)
    model.train()
    handle = install(model, lc).memory
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (1, args.seq), generator=g).cuda()
    torch.cuda.synchronize()
    state_bytes = torch.cuda.memory_allocated()
    times, peaks, losses, host = [], [], [], 0
    for step in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        if handle is not None and handle.offloader is not None:
            handle.offloader.reset_stats()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if step >= args.warmup:
            times.append(dt)
            peaks.append(torch.cuda.max_memory_allocated() - state_bytes)
            losses.append(loss.item())
            if handle is not None:
                host = max(host, handle.host_bytes_peak())
        del loss
    out = {"row": name, "long_context": lc, "peak_bytes": max(peaks), "peak_gib": round(max(peaks) / 2**30, 3),
           "model_state_bytes": state_bytes, "step_s": round(statistics.median(times), 4),
           "loss": losses[-1], "host_bytes_peak": host}
    if handle is not None:
        out["memory_stack"] = handle.stats()
    del model, handle
    gc.collect()  # the patched forwards and hooks form reference cycles with the model
    torch.cuda.empty_cache()
    return out


def offload_check(target: str = "cpu", nvme_path: str = None, steps: int = 1, device: str = "cuda"):
    """On CUDA, through the pinned side-stream target (``target`` "cpu") or the NVMe file target ("nvme",
    files under ``nvme_path``): checkpoint+offload gives bit-identical loss and gradients to checkpointing
    alone at every one of ``steps`` steps, moves every layer input once each way, frees the host copies."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(hidden_size=256, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                      num_hidden_layers=4, vocab_size=1024, intermediate_size=512, tie_word_embeddings=False)
    ids = torch.randint(0, 1024, (2, 2048), generator=torch.Generator().manual_seed(3)).to(device)
    out = {}
    for reentrant in (False, True):
        res = {}
        for offload in ("none", target):
            torch.manual_seed(0)
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32, attn_implementation="sdpa")
            model.train()
            ac = {"enabled": True, "offload": offload, "use_reentrant": reentrant}
            if offload == "nvme":
                ac["nvme_path"] = nvme_path
            lc = {"activation_checkpointing": ac,
                  "tiled_mlp": {"enabled": True, "shards": 3}, "tiled_loss": {"enabled": True, "shards": 5}}
            install(model, lc)
            losses, grads = [], []
            for _ in range(steps):  # later steps reuse the first step's host blocks / file slots
                model.zero_grad(set_to_none=True)
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                if device == "cuda":
                    torch.cuda.synchronize()
                losses.append(loss.detach())
                grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
            res[offload] = (losses, grads, model._ds_longctx_memory.stats())
        (l0s, g0s, _), (l1s, g1s, st) = res["none"], res[target]
        l0, g0, l1, g1 = l0s[-1], g0s[-1], l1s[-1], g1s[-1]
        every_step = all(torch.equal(a, b) for a, b in zip(l0s, l1s)) and all(
            torch.equal(a[n], b[n]) for a, b in zip(g0s, g1s) for n in a)
        layer_bytes = ids.numel() * cfg.hidden_size * 4
        out[f"reentrant={reentrant}"] = {
            "loss_equal": bool(torch.equal(l0, l1)),
            "grads_equal": all(torch.equal(g0[n], g1[n]) for n in g0),
            "max_grad_diff": max(float((g0[n] - g1[n]).abs().max()) for n in g0),
            "offloaded_ok": st["offloaded_tensors"] == cfg.num_hidden_layers * steps
            and st["offloaded_bytes"] == cfg.num_hidden_layers * layer_bytes * steps
            and st["restored_tensors"] == cfg.num_hidden_layers * steps,
            "host_freed": st["host_bytes"] == 0, "steps": steps, "bit_equal_every_step": every_step, "stats": st,
        }
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--rows", default=None, help="comma-separated row indices to run (default: all)")
    ap.add_argument("--no-check", action="store_true", help="skip the CUDA offload correctness check")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device"}))
        sys.exit(2)

    try:
        check = None if args.no_check else offload_check()
    except Exception as e:
        check = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-1500:]}
    print(json.dumps({"offload_check": check}), file=sys.stderr, flush=True)
    results = []
    keep = None if args.rows is None else {int(i) for i in args.rows.split(",")}
    for i, (name, lc) in enumerate(cumulative_rows()):
        if keep is not None and i not in keep:
            continue
        try:
            results.append(run_row(args, name, lc))
        except Exception as e:  # OOM or a missing kernel: record it, free, go on with the next row
            results.append({"row": name, "long_context": lc, "error": f"{type(e).__name__}: {str(e)[:300]}",
                            "trace": traceback.format_exc()[-1500:]})
            gc.collect()
            torch.cuda.empty_cache()
        print(json.dumps({k: v for k, v in results[-1].items() if k not in ("long_context", "trace")}),
              file=sys.stderr, flush=True)
    report = {
        "bench": "gpu_memory_stack", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "device": torch.cuda.get_device_name(), "host": platform.node(), "torch": torch.__version__,
        "model": {k: getattr(args, k) for k in ("seq", "hidden", "heads", "kv_heads", "layers", "intermediate",
                                                "vocab")},
        "dtype": "bfloat16", "layer_input_bytes": args.seq * args.hidden * 2,
        "full_fp32_logits_bytes": args.seq * args.vocab * 4, "offload_check": check, "rows": results,
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
