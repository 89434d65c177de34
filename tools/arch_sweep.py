"""Every causal-LM architecture the installed transformers ships, through ds_longctx at SP=1: exact or a clear error.

For each model type in transformers' causal-LM mapping whose config can be built tiny from its own config class
(hidden 64, 4 heads, 2 layers, vocab 256, small MoE), in fp32 with dropout and router jitter off:

* the reference: HF's own forward loss and gradients (one process, no ds_longctx);
* ds_longctx ``patch_model`` at SP=1, attention implementation "none", the full memory stack (checkpointing with
  CPU offload, tiled MLP, tiled loss, memory-efficient RMSNorm); a refusal whose fix switches a memory feature
  off (most MLP classes are not in ds_longctx's tiled-MLP registry) is applied and the run repeated, so the fix
  is checked and the loss path (the model's logit transform) and the rest of the stack still are.

Each run is one of: ``exact`` (the loss and every gradient element within EXACT_RTOL relative + EXACT_ATOL
absolute of HF's, torch.testing.assert_close's rule: the one "exact" of the SP equivalence tests; only the summation
order differs), ``refused`` (a ds_longctx ConfigError: one clear message naming the fix), ``raw``
(any other exception: a defect) or ``WRONG`` (a silent difference: a defect). Types whose tiny config or model
transformers itself cannot build or run are counted apart (``skipped``, with the reason).

    python tools/arch_sweep.py [--only llama,gemma2] [--out bench/results/arch_sweep.json] [--time-limit 600]
    python tools/arch_sweep.py --sp 2 --attention ulysses --only qwen3_5,lfm2 --merge \
        --out bench/results/arch_sweep_sp2_ulysses.json     # rerun these types, the file's other rows kept
"""
from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import signal
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

VOCAB = 256
SEQ = 16
SIZES = {  # canonical name -> tiny value (set under whatever name the config class's __init__ takes)
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 128, "vocab_size": VOCAB, "max_position_embeddings": 256, "head_dim": 16,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "ffn_hidden_size": 128,
    "n_inner": 128, "d_ff": 128, "ffn_dim": 128, "decoder_ffn_dim": 128, "encoder_ffn_dim": 128,
    "num_decoder_layers": 2, "num_layers": 2, "decoder_layers": 2, "encoder_layers": 2,
    "decoder_attention_heads": 4, "encoder_attention_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 16,
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "first_k_dense_replace": 1,
    "sliding_window": 64, "attention_chunk_size": 64, "n_shared_experts": 1, "num_shared_experts": 1,
    "rotary_dim": 8, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}
ZERO = ("drop", "jitter")  # float config fields containing these are set to 0 (dropout, pdrop, drop_path)
STACK = {"activation_checkpointing": {"enabled": True, "offload": "cpu", "pin_memory": False},
         "tiled_mlp": {"enabled": True, "shards": 2}, "tiled_loss": {"enabled": True, "shards": 2},
         "rms_norm": {"enabled": True}}
MAX_PARAMS = 5_000_000


class Timeout(Exception):
    pass


def _alarm(*_):
    raise Timeout()


def tiny_config(model_type: str):
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    params = inspect.signature(cls.__init__).parameters
    amap = getattr(cls, "attribute_map", {}) or {}
    kw = {}
    for name, value in SIZES.items():
        for cand in (name, amap.get(name)):
            if cand and cand in params:
                kw[cand] = value
                break
    if "qk_rope_head_dim" in kw and "head_dim" in kw:  # MLA (DeepSeek-V2/3, ...): RoPE runs on qk_rope_head_dim
        kw["head_dim"] = kw["qk_rope_head_dim"]
    if "kv_lora_rank" in kw and "num_key_value_heads" in kw:  # MLA: as many key/value heads as query heads
        kw["num_key_value_heads"] = kw.get("num_attention_heads", 4)
    for name, p in params.items():
        if any(z in name for z in ZERO) and isinstance(p.default, float):
            kw[name] = 0.0
    cfg = cls(**kw)
    for sub in {id(c): c for c in (cfg, cfg.get_text_config())}.values():  # composite configs: the text part too
        for name, value in SIZES.items():
            if sub is not cfg and hasattr(sub, name) and name not in ("pad_token_id", "bos_token_id", "eos_token_id"):
                try:
                    setattr(sub, name, value)
                except Exception:
                    pass
        for name in list(vars(sub)):
            if any(z in name for z in ZERO) and isinstance(getattr(sub, name), float):
                setattr(sub, name, 0.0)
    return cfg


def _batch(seed=0):
    ids = torch.randint(3, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[:, :3] = -100
    return {"input_ids": ids, "labels": labels}


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch, use_cache=False)  # training: no KV cache (hybrid linear-attention caches refuse it)
    loss = out.loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


# "exact" (fp32, the same ops in another summation order): every element within EXACT_ATOL + EXACT_RTOL x |reference|,
# torch.testing.assert_close's rule with the SP equivalence tests' tolerances (tests/test_sp_equivalence.py); a
# gradient that vanishes in exact arithmetic (a key bias: softmax ignores a per-query constant) is rounding noise far
# below EXACT_ATOL in both runs
EXACT_RTOL, EXACT_ATOL = 1e-5, 1e-6


def exceeds(got: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest |got - ref| / (EXACT_ATOL + EXACT_RTOL |ref|) over the elements: exact while <= 1."""
    got, ref = got.detach().double(), ref.detach().double()
    return float(((got - ref).abs() / (EXACT_ATOL + EXACT_RTOL * ref.abs())).max()) if ref.numel() else 0.0


def _compare(ref, got):
    """(loss's relative error, worst gradient's relative Frobenius error, its name, params missing on one side,
    the worst :func:`exceeds` over the loss and every gradient)."""
    (rl, rg), (gl, gg) = ref, got
    loss_rel = abs(float(gl) - float(rl)) / max(abs(float(rl)), 1e-12)
    worst, where, within = 0.0, None, exceeds(gl, rl)
    missing = sorted(set(rg) ^ set(gg))
    for n in rg:
        if n not in gg:
            continue
        err = float((gg[n] - rg[n]).norm() / rg[n].norm().clamp(min=1e-12))
        within = max(within, exceeds(gg[n], rg[n]))
        if err > worst:
            worst, where = err, n
    return loss_rel, worst, where, missing, within


ATTENTION = {"none": {"implementation": "none"}, "ulysses": {"implementation": "ulysses"},
             # ds_longctx's own attention with no other key: fuse_projections 'auto' (fused for the architectures of
             # ds_longctx.models, function level for any other model on transformers' attention interface)
             "untied": {"implementation": "untied_ulysses", "heads_per_chunk": 1}}


def run_one(model_type: str, stack: dict, attention: str = "none", group=None):
    """(status, detail) for one architecture with one long_context section; with an SP ``group`` (``--sp``) each
    rank runs its sequence shard (data.shard_batch) and the gradients are summed over the group, against the
    one-process reference every rank computes on the full sample."""
    from transformers import AutoModelForCausalLM

    from ds_longctx.config import parse
    from ds_longctx.errors import ConfigError
    from ds_longctx.dist.layout import Layout
    from ds_longctx.patching.patch import patch_model
    from ds_longctx.patching.spec import build_spec

    try:
        cfg = tiny_config(model_type)
        with torch.device("meta"):  # count first: a config whose other defaults stay large is not built
            n = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").parameters())
        if n > MAX_PARAMS:
            return "skipped", f"tiny config still has {n / 1e6:.0f}M parameters"
        torch.manual_seed(0)
        ref_model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    except Timeout:
        raise
    except Exception as e:
        return "skipped", f"transformers cannot build it tiny: {type(e).__name__}: {str(e)[:200]}"
    ref_model.train()
    model = copy.deepcopy(ref_model)
    if attention != "none":  # ours runs through transformers' attention interface (the reference stays eager)
        try:
            model.set_attn_implementation("sdpa")
        except Exception as e:
            return "skipped", f"transformers has no sdpa path for it: {type(e).__name__}: {str(e)[:160]}"
    batch = _batch()
    try:
        ref = _loss_and_grads(ref_model, batch)
        if not torch.isfinite(ref[0]):
            return "skipped", f"HF's own loss is {float(ref[0])}"
    except Timeout:
        raise
    except Exception as e:
        return "skipped", f"HF's own forward fails: {type(e).__name__}: {str(e)[:200]}"
    sp = 1 if group is None else torch.distributed.get_world_size(group)
    lc = parse({"sequence_parallel_size": sp, "long_context": {"attention": ATTENTION[attention], **stack}})
    try:
        # what ds_longctx.initialize builds and checks before it patches
        spec = build_spec(lc, model.config, Layout(world=sp, sp=sp, rank=0 if group is None else
                                                   torch.distributed.get_rank(group)), group)
        handle = patch_model(model, spec)
        if group is None:
            got = _loss_and_grads(model, batch)
        else:
            from ds_longctx.data import shard_batch

            loss, grads = _loss_and_grads(model, shard_batch(batch, torch.distributed.get_rank(group), sp))
            for g in grads.values():  # each rank holds its shard's part of every gradient
                torch.distributed.all_reduce(g, group=group)
            got = (loss, grads)
        handle.remove()
    except Timeout:
        raise
    except ConfigError as e:
        return "refused", str(e)  # whole: _fix_of reads the fix at its end
    except Exception as e:
        tb = traceback.format_exc().strip().splitlines()
        return "raw", f"{type(e).__name__}: {str(e)[:300]} | {' / '.join(tb[-4:])[:600]}"
    loss_rel, grad_rel, where, missing, within = _compare(ref, got)
    detail = {"loss_ref": float(ref[0]), "loss": float(got[0]), "loss_rel": loss_rel, "grad_rel": grad_rel,
              "worst_grad": where, "of_tolerance": within}
    if missing:
        return "WRONG", dict(detail, missing_grads=missing[:8])
    if within <= 1.0:
        return "exact", detail
    return "WRONG", detail


# refusal key -> the memory feature its fix switches off
_FIXES = {"long_context.tiled_mlp.enabled": "tiled_mlp", "long_context.activation_checkpointing.enabled":
          "activation_checkpointing", "long_context.rms_norm.enabled": "rms_norm",
          "long_context.tiled_loss.enabled": "tiled_loss"}


def _fix_of(message: str):
    key = message.split(":")[0]
    return _FIXES.get(key) if "enabled=false" in message or "set enabled=false" in message else None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated model types")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "arch_sweep.json"))
    ap.add_argument("--time-limit", type=float, default=600.0, help="stop starting new types after this many s")
    ap.add_argument("--per-type", type=int, default=60, help="seconds allowed per type")
    ap.add_argument("--attention", choices=sorted(ATTENTION), default="none",
                    help="'none': transformers' attention; 'untied': ds_longctx's own (untied, fuse_projections 'auto'); "
                    "'ulysses': DeepSpeed's Ulysses (needs --sp 2 or more)")
    ap.add_argument("--sp", type=int, default=1, help="sequence-parallel degree: that many processes (gloo)")
    ap.add_argument("--merge", action="store_true", help="with --only: replace those types' rows in the existing "
                    "--out file (the others kept, the summary recounted, the run listed under 'updates')")
    a = ap.parse_args(argv)
    if a.sp > 1 and not torch.distributed.is_initialized():
        return _spawn(a, argv)
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    torch.set_num_threads(1)
    types = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if a.only:
        types = [t for t in a.only.split(",") if t]
    results, start = {}, time.time()
    signal.signal(signal.SIGALRM, _alarm)
    for t in types:
        if time.time() - start > a.time_limit:
            results[t] = {"full_stack": ["not run", "time limit"]}
            continue
        row = {}
        t0 = time.time()
        try:
            signal.alarm(a.per_type)
            row["full_stack"] = run_one(t, STACK, a.attention, _GROUP[0])
            # a refusal whose fix is to switch a memory feature off: apply the fix and run again (it must lead to
            # exact training or to another clear error)
            stack, last = dict(STACK), row["full_stack"]
            while last[0] == "refused" and _fix_of(last[1]) in stack:
                off = _fix_of(last[1])
                stack.pop(off)
                last = run_one(t, stack, a.attention, _GROUP[0])
                row.setdefault("after_fixes", []).append([f"{off} off"] + list(last))
        except Timeout:
            row.setdefault("full_stack", ["skipped", f"over {a.per_type} s"])
        finally:
            signal.alarm(0)
        if _GROUP[0] is not None:  # the ranks must agree on every type (a divergence would desynchronise them)
            verdicts = [None] * a.sp
            torch.distributed.all_gather_object(verdicts, (t, row["full_stack"][0]), group=_GROUP[0])
            if len(set(verdicts)) > 1:
                raise RuntimeError(f"the SP ranks disagree on {t}: {verdicts}")
        row["final"] = row["after_fixes"][-1][1] if row.get("after_fixes") else row["full_stack"][0]
        row["seconds"] = round(time.time() - t0, 2)
        results[t] = row
        fixes = "+".join(f[0].split(" ")[0] for f in row.get("after_fixes", []))
        last = row["after_fixes"][-1][1:] if row.get("after_fixes") else row["full_stack"]
        if _GROUP[0] is not None and torch.distributed.get_rank() != 0:
            continue
        print(f"{t:28s} {row['full_stack'][0]:8s} {row['final']:8s} {fixes:36s} {row['seconds']:6.1f}s  "
              f"{str(last[1])[:120]}", flush=True)

    def count(key):
        out = {}
        for r in results.values():
            v = r[key] if isinstance(r[key], str) else r[key][0]
            out[v] = out.get(v, 0) + 1
        return out

    if _GROUP[0] is not None and torch.distributed.get_rank() != 0:
        return results
    record, ran = None, dict(results)
    if a.merge and a.out and os.path.exists(a.out):  # this run's types replace theirs; every other row is kept
        with open(a.out) as f:
            record = json.load(f)
        results = dict(record["results"], **results)
        types = sorted(results)
    summary = {"transformers": transformers.__version__, "torch": torch.__version__, "types": len(types),
               "attention": a.attention, "sequence_parallel_size": a.sp,
               "full_stack": count("full_stack"), "final (after applying each refusal's memory-feature fix)":
               count("final"), "seconds": round(time.time() - start, 1)}
    print(json.dumps(summary, indent=1))
    if a.out:
        os.makedirs(os.path.dirname(a.out), exist_ok=True)
        command = "python " + " ".join(sys.argv)
        if record is not None:
            summary["seconds"] = record["summary"].get("seconds")  # the full run's; this update's is under updates
            record.setdefault("updates", []).append({"command": command, "date": time.strftime("%Y-%m-%d"),
                                                     "types": sorted(ran), "seconds": round(time.time() - start, 1)})
            record.update(summary=summary, results=results)
        else:
            record = {"what": f"tools/arch_sweep.py: every transformers causal-LM type through ds_longctx at "
                              f"SP={a.sp} (attention {a.attention}, full memory stack) vs HF's own loss and "
                              "gradients (one process)", "command": command,
                      "machine": "2-core x86_64 CPU VM", "date": time.strftime("%Y-%m-%d"),
                      "summary": summary, "results": results}
        with open(a.out, "w") as f:
            json.dump(record, f, indent=1, default=str)
    return results


_GROUP = [None]  # the SP group inside a --sp worker


def _worker(rank, a, argv, port):
    import datetime

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(a.sp))
    from ds_longctx.dist.comm import disable_cpu_shm_allreduce

    disable_cpu_shm_allreduce()
    import deepspeed

    os.environ.update(LOCAL_RANK=str(rank), LOCAL_SIZE=str(a.sp))
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, timeout=datetime.timedelta(seconds=120))
    _GROUP[0] = torch.distributed.new_group(list(range(a.sp)))
    import ds_longctx

    code = 1
    try:
        main(argv)
        code = 0
    finally:
        ds_longctx.shutdown(code)  # no interpreter finalization: gloo's threads abort it (see ds_longctx.dist.runtime)


def _spawn(a, argv):
    import socket

    import torch.multiprocessing as mp

    import tempfile

    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        port = so.getsockname()[1]
    argv = list(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = a.out or os.path.join(tmp, "results.json")  # rank 0 writes it; the caller gets the results back
        mp.start_processes(_worker, args=(a, argv + ["--out", out], port), nprocs=a.sp, start_method="spawn")
        with open(out) as f:
            return json.load(f)["results"]


if __name__ == "__main__":
    main()
