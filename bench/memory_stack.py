#!/usr/bin/env python
"""Memory-stack ablation on CPU: peak live bytes of one training step (forward + backward) for
none / +checkpointing / +offload / +tiled MLP / +tiled loss / +untied attention, each row adding to
the previous one, all in one run on the same model, weights and batch.

Peak live bytes come from ``ds_longctx.measure.live_bytes.LiveBytesTracker`` (every storage created and
still alive). Offloaded layer inputs are host memory: the CPU offload target copies them outside the
tracker (as pinned host buffers are outside the CUDA allocator) and they are reported separately.
The model goes through ``patch.patch_model``, i.e. exactly what ``ds_longctx.initialize`` installs.

    python bench/memory_stack.py [--seq 2048] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402

# the rows: nothing, then the planner's stack ladder (ds_longctx.planner.search.STACK_STEPS: one definition for
# the planner's --compare, this bench and bench/gpu_memory_stack.py) up to untied attention, at its defaults
# (shards "auto", heads_per_chunk 1)
LAST_ROW = "+untied attention"


# not cumulative: the tiled-loss row without the tiled MLP, to show the MLP's share once the logits
# no longer set the peak (in the cumulative order the loss peak masks it)
EXTRA = [("offload + tiled loss, no tiled MLP", {"activation_checkpointing": {"enabled": True, "offload": "cpu"},
                                                 "tiled_loss": {"enabled": True, "shards": "auto"}})]


def cumulative_rows():
    from ds_longctx.planner.search import stack_ladder

    return [("none", {})] + stack_ladder(upto=LAST_ROW) + EXTRA


def build(args):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(hidden_size=args.hidden, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      head_dim=args.hidden // args.heads, num_hidden_layers=args.layers, vocab_size=args.vocab,
                      intermediate_size=args.intermediate, max_position_embeddings=args.seq, rms_norm_eps=1e-6,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32, attn_implementation="sdpa")


def _tag_modules(model, tracker):
    """Charge storages to the module kind that created them (stacked: the innermost kind wins)."""
    kinds = []
    for name, m in model.named_modules():
        cls = type(m).__name__
        kind = ("norm" if cls.endswith("RMSNorm") else "attention" if cls.endswith("Attention") else
                "mlp" if cls.endswith("MLP") else "loss" if name.endswith("lm_head") else None)
        if kind is None:
            continue
        stack = []

        def pre(mod, a, k=kind, st=stack):
            cm = tracker.tag(k)
            cm.__enter__()
            st.append(cm)

        def post(mod, a, o, st=stack):
            if st:
                st.pop().__exit__(None, None, None)

        kinds.append(m.register_forward_pre_hook(pre))
        kinds.append(m.register_forward_hook(post))
    return kinds


def run_row(args, name, lc):
    from ds_longctx.config import parse
    from ds_longctx.patching.patch import patch_model
    from ds_longctx.patching.spec import build_spec
    from ds_longctx.measure.live_bytes import LiveBytesTracker

    model = build(args)
    model.train()
    cfg = parse({"long_context": lc})
    patch_model(model, build_spec(cfg, model.config))
    handle = getattr(model, "_ds_longctx_memory", None)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (1, args.seq), generator=g)
    tracker = LiveBytesTracker()
    hooks = _tag_modules(model, tracker)
    boundary = []
    layers = list(model.model.layers)
    for layer in layers:
        hooks.append(layer.register_forward_pre_hook(lambda m, a: boundary.append(tracker.live)))
    # model state is the same in every row: allocate the grads up front (backward accumulates in place),
    # so the peak below is activations, logits and transients only
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    from torch.utils.checkpoint import set_checkpoint_early_stop

    # early stop ends a recompute by raising inside the layer, which skips the tagging post-hooks and
    # would charge later storages to the wrong creator; the memory it saves is the tail of one layer
    with tracker, set_checkpoint_early_stop(False):
        # the tracker charges a parameter's storage when an op first returns a view of it
        # (and a grad's storage when backward's in-place accumulation returns it): charge both on a
        # short step first, so the measured step's numbers are activations, logits and transients
        model(input_ids=ids[:, :8], labels=ids[:, :8]).loss.backward()
        base, base_by_tag = tracker.live, dict(tracker.live_by_tag)
        if handle is not None and handle.offloader is not None:
            handle.offloader.reset_stats()
        boundary.clear()
        tracker.reset_peak()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        forward_end = tracker.live
        loss.backward()
        dt = time.perf_counter() - t0
        loss_value = loss.item()
        del loss
    for h in hooks:
        h.remove()
    layer_input = args.seq * args.hidden * 4
    stats = handle.stats() if handle is not None else {}
    return {
        "row": name, "long_context": lc, "loss": loss_value, "step_s": round(dt, 3),
        "peak_bytes": tracker.peak - base, "tracker_peak_abs": tracker.peak, "live_after_forward": forward_end - base,
        "peak_breakdown": {k: v - base_by_tag.get(k, 0) for k, v in tracker.peak_breakdown.items()
                           if v - base_by_tag.get(k, 0)},
        "boundary_live_minus_first": [b - boundary[0] for b in boundary[:len(layers)]],
        "layer_input_bytes": layer_input, "host_bytes_peak": stats.get("host_bytes_peak", 0),
        "offloaded_tensors": stats.get("offloaded_tensors", 0),
    }


def mib(n):
    return f"{n / 2**20:,.1f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

    results = []
    for name, lc in cumulative_rows():
        try:
            results.append(run_row(args, name, lc))
        except Exception as e:  # a missing piece (e.g. untied attention on this build) skips its row
            results.append({"row": name, "long_context": lc, "error": f"{type(e).__name__}: {e}"})
        print(json.dumps({k: v for k, v in results[-1].items() if k != "long_context"}), file=sys.stderr)

    print(f"model: Llama, hidden {args.hidden}, {args.heads} heads / {args.kv_heads} kv, {args.layers} layers, "
          f"intermediate {args.intermediate}, vocab {args.vocab}, fp32; batch 1 x {args.seq} tokens; "
          f"one layer input = {mib(args.seq * args.hidden * 4)} MiB, full fp32 logits = "
          f"{mib(args.seq * args.vocab * 4)} MiB\n")
    print("| configuration | peak live MiB | vs none | host MiB (offloaded) | live at layer boundaries, MiB above "
          "layer 0 | peak by creator (MiB) | loss | step s |")
    print("|---|---|---|---|---|---|---|---|")
    ref = results[0].get("peak_bytes")
    for r in results:
        if "error" in r:
            print(f"| {r['row']} | skipped: {r['error'][:120]} | | | | | | |")
            continue
        bd = ", ".join(f"{k} {mib(v)}" for k, v in sorted(r["peak_breakdown"].items(), key=lambda kv: -kv[1]))
        bl = " / ".join(mib(b) for b in r["boundary_live_minus_first"])
        print(f"| {r['row']} | {mib(r['peak_bytes'])} | {r['peak_bytes'] / ref:.2f}x | {mib(r['host_bytes_peak'])} "
              f"| {bl} | {bd} | {r['loss']:.6f} | {r['step_s']} |")
    print(f"\nmachine: {platform.node()} {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
