"""Issue 32 on one GPU: ds_longctx next to DeepSpeed's ALST (the recipe users would pick instead), same model,
same length, same batches, alternating; plus the reserved bytes, SP=2 on one device and the 8B per-layer peak.

    python bench/alst_compare.py --part 1 --out issue32.json           # one H100 (bench/device/run_all.sh)
    python bench/alst_compare.py --part 1,2,3,4 --dry-run --out /tmp/issue32.json   # CPU, tiny model, gloo

Parts (--part, in order; each has its own wall-clock cap, --cap1..--cap4; results merge into --out as they come):

1. Side by side, one process per variant per round (ALST's registration and its MLP patch are process-global),
   rounds a b c a b c ... while the cap allows (--rounds at most), --steps each:
   (a) ``alst``: DeepSpeed's ALST as its authors publish it (docs/_tutorials/ulysses-alst-sequence-parallelism.md
       and ArcticTraining's sft_trainer.loss), run by this file's worker (``--worker alst``): the tutorial's
       ``UlyssesSPAttentionHF.register_with_transformers`` (it returns None at SP=1: DeepSpeed 0.19.8 ulysses_sp.py
       ``if sequence_parallel_size == 1: return None``, so HF's own SDPA attention runs, on cuDNN via
       torch.nn.attention.sdpa_kernel on CUDA), the tutorial's TiledMLP patch of LlamaMLP.forward
       (ceil(seq/hidden) shards, MAX-agreed), ArcticTraining's TiledFusedLogitsLoss (~1 GiB fp32 logit shards,
       sum / valid tokens), HF gradient checkpointing (non-reentrant, transformers' default) inside
       ``get_checkpoint_hidden_states_offloading_ctx_manager()`` (the tutorial's offload for non-reentrant
       checkpointing), plain ``deepspeed.initialize``; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True for every
       variant (the tutorial's last trick; run_all.sh exports it);
   (b) ``ds_longctx_shipped``: train.py with ds_configs/llama3.2-1b-1gpu.json (the memory-max config);
   (c) ``ds_longctx_planned``: the same with heads_per_chunk, keep_on_device and keep_attention_output "auto"
       (the planner resolves them for this device in ds_longctx.initialize; the picks are recorded).
   Every variant: the model from --model-config, bf16, ZeRO-3 with the shipped config's optimizer and ZeRO keys,
   random init from ds_longctx.models.weights.deterministic_init(seed) (the same weights in every process), the copy
   task's samples through ds_longctx.data.SampleStream (the same token batches), tokens/s, TFLOP/s and MFU by
   ds_longctx.measure.formula's one formula, max_memory_allocated and max_memory_reserved per step (CUDA; on CPU
   the process's peak RSS, reserved None), step-1 loss.
2. Reserved bytes: a one-step run of (c)'s resolved config with long_context.profile.allocator_check (the
   caching-allocator model vs max_memory_reserved; CUDA only: skipped on CPU, said so), and the planner
   (``ds-longctx plan``) for the same config and length: predicted step time vs (c)'s measured, predicted
   allocated peak vs measured.
3. SP=2 on one device: two ranks, both on device 0, over gloo (ProcessGroupGloo::alltoall_base takes CUDA tensors
   through pinned host copies: torch/csrc/distributed/c10d/ProcessGroupGloo.cpp, AsyncAlltoallCUDAWork; NCCL
   refuses two ranks on one device), against the same config at SP=1: losses per step. A failure records the
   exact error.
4. Llama-3-8B shape at reduced depth (--depth4 layers) with ds_configs/llama3-8b-1gpu-512k.json: lengths in
   --seq4 ascending while the last step's time says the next fits the cap; measured peak vs the planner's at the
   same depth and length; the planner's full-depth one-GPU maximum next to ALST's published 500K on one H100.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SHIPPED = os.path.join(ROOT, "ds_configs", "llama3.2-1b-1gpu.json")
MODEL_1B = os.path.join(ROOT, "ds_configs", "models", "llama3.2-1b.json")
CFG_8B = os.path.join(ROOT, "ds_configs", "llama3-8b-1gpu-512k.json")
MODEL_8B = os.path.join(ROOT, "ds_configs", "models", "llama3-8b.json")
TINY = os.path.join(ROOT, "ds_configs", "models", "tiny-llama.json")


# ---------------------------------------------------------------------------------------------------------------
# (a): DeepSpeed's ALST, one process (``--worker alst``)
# ---------------------------------------------------------------------------------------------------------------


def alst_worker(a) -> None:
    """One process of variant (a); writes {"steps": [...], "pieces": {...}} or {"error": ...} to a.result."""
    out = {"variant": "alst", "pieces": {}}
    try:
        out.update(_alst_run(a, out["pieces"]))
    except BaseException as e:  # recorded, then the process fails: the orchestrator records rc and the log tail
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()[-4000:]
        _write(a.result, out)
        raise
    _write(a.result, out)


def _alst_run(a, pieces: dict) -> dict:
    import torch

    import deepspeed
    import deepspeed.comm as dist
    import transformers
    from deepspeed.runtime.activation_checkpointing.offload_activations import (
        get_checkpoint_hidden_states_offloading_ctx_manager)
    from deepspeed.runtime.sequence_parallel.ulysses_sp import (TiledFusedLogitsLoss, TiledMLP, UlyssesSPAttentionHF,
                                                                 sequence_tiled_compute)
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    from transformers.models.llama import modeling_llama

    from ds_longctx.data import LongRangeCopy, SampleStream
    from ds_longctx.job.profiler import StepProfiler
    from ds_longctx.job.metrics import peak_tflops
    from ds_longctx.models.loading import load_model_config
    from ds_longctx.models.weights import deterministic_init

    cuda = torch.cuda.is_available()
    ds_cfg = json.load(open(a.ds_config))
    ds_cfg.pop("long_context", None)  # DeepSpeed's own keys only: the same optimizer, ZeRO-3 keys, bf16, clipping
    ds_cfg.pop("_comment", None)
    v = deepspeed.__version__
    if cuda:
        torch.cuda.set_device(0)
    else:  # CPU: no JIT build of DeepSpeed's shm all-reduce op (60 s; train.py skips it the same way: ds_longctx.dist.comm)
        from ds_longctx.dist.comm import disable_cpu_shm_allreduce

        disable_cpu_shm_allreduce()
    dist.init_distributed(dist_backend="nccl" if cuda else "gloo", auto_mpi_discovery=False)

    # the same weights as train.py's (b)/(c): zero.Init through transformers' HfDeepSpeedConfig (as
    # transformers' DeepSpeed integration builds a model), then ds_longctx's keyed init (HF's own init draws in
    # module order from the global RNG and differs between processes/layouts: weights.py); no ALST piece is involved
    hf_ds = HfDeepSpeedConfig(ds_cfg)  # alive while the model is built, then dropped (as model_init does for (b)/(c))
    cfg = load_model_config(a.model_config)
    torch.manual_seed(a.seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    deterministic_init(model, a.seed)
    del hf_ds
    unset_hf_deepspeed_config()

    # 1. the tutorial's Ulysses registration (returns None at SP=1: HF's SDPA attention is left as it is)
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=1, micro_batch_size=1,
        seq_length=a.seq, seq_length_is_variable=True)
    pieces["ulysses"] = (f"deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF."
                         f"register_with_transformers(sequence_parallel_size=1) -> {mpu!r} (DeepSpeed {v}: a no-op at "
                         "SP=1; HF transformers.integrations.sdpa_attention runs)")

    # 2. the tutorial's TiledMLP monkey patch (docs/_tutorials/ulysses-alst-sequence-parallelism.md, "Tiled MLP")
    def tiled_mlp_forward(self, x):
        bs, seqlen, hidden = x.shape
        t = torch.tensor(math.ceil(seqlen / hidden), device=x.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # every rank the same shard count (ZeRO-3 gathers)

        def mlp_forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

        return TiledMLP.apply(mlp_forward, self, x, int(t.item()),
                              [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight])

    modeling_llama.LlamaMLP.forward = tiled_mlp_forward
    pieces["tiled_mlp"] = (f"deepspeed.runtime.sequence_parallel.ulysses_sp.TiledMLP (DeepSpeed {v}), patched over "
                           "transformers.models.llama.modeling_llama.LlamaMLP.forward as the tutorial does, "
                           f"ceil(seq/hidden) = {math.ceil(a.seq / cfg.hidden_size)} shards")

    # 3. HF gradient checkpointing (transformers' default: non-reentrant) + the tutorial's offload for it
    model.gradient_checkpointing_enable()
    offload = get_checkpoint_hidden_states_offloading_ctx_manager()
    pieces["checkpointing"] = (f"transformers {transformers.__version__} gradient_checkpointing_enable() "
                               f"(use_reentrant=False) inside deepspeed.runtime.activation_checkpointing."
                               f"offload_activations.get_checkpoint_hidden_states_offloading_ctx_manager() "
                               f"(DeepSpeed {v}, defaults: pinned, side stream, keep_last_count=1)")

    engine, _, _, _ = deepspeed.initialize(config=ds_cfg, model=model, model_parameters=model.parameters(), mpu=mpu)
    engine.train()
    head = engine.module

    # 4. ArcticTraining's tiled logits + loss (sft_trainer.SFTTrainer.loss, its non-Liger branch): its SP=1 branch
    # is the plain HF loss, whose fp32 logits at 128K x 128256 are 64 GiB: the tiled branch is the one that fits
    def loss_fn(model_with_head=None, hidden_states=None, shift_labels=None):
        logits = model_with_head.lm_head(hidden_states)
        if (shift_labels == -100).all():  # CE of no targets is NaN: a zero loss that still sets gradients
            return (logits.sum() * 0.0).float()
        good = (shift_labels != -100).sum()
        return model_with_head.loss_function(logits=logits, labels=None, vocab_size=model_with_head.config.vocab_size,
                                             shift_labels=shift_labels) * good / scale_inside

    pieces["tiled_loss"] = (f"deepspeed.runtime.sequence_parallel.ulysses_sp.TiledFusedLogitsLoss (DeepSpeed {v}), "
                            "as snowflakedb/ArcticTraining arctic_training/trainer/sft_trainer.py calls it (shards of "
                            "~1 GiB fp32 logits, output_reduction='sum', divided by the valid tokens)")
    # kept as published (the cost is the same either way), said so: TiledFusedLogitsLoss runs the weights' backward
    # inside its forward with an incoming gradient of 1 and its backward rescales only the input's gradient, so
    # with 'sum' divided outside (ArcticTraining's call) lm_head's gradient is that of the SUM: x valid tokens
    pieces["known_defect"] = (
        "lm_head's gradient is the summed loss's (x valid tokens): TiledFusedLogitsLoss.forward computes the weights' "
        "gradients with incoming grad 1.0 and .backward scales only x's; ArcticTraining divides by the valid tokens "
        "outside. CPU, tiny Llama, 256 tokens (127 valid), 2026-11-27: step-1 grad norm 90.5 vs train.py's 1.59 on "
        "the same weights and batch (clipping at 1.0 hides it in a run); with 1/valid tokens inside the shards "
        "(--loss-scale inside) 1.58916 vs 1.58908 untied, 1.47988 vs 1.47979 tied (with the workaround above). "
        "Time and memory are unaffected.")
    # DeepSpeed's tiled losses under ZeRO-3 with TIED input/output embeddings (Llama-3.2-1B): the lm_head weight's
    # gradient hook fires in the loss's own backward (last shard: ds_grad_is_ready True) and again for the
    # embedding in engine.backward: stage3.py __reduce_and_partition_ipg_grads `assert len(set(p.ds_id ...)) ==
    # len(params_in_bucket)` (found on CPU, 2026-11-27, TiledFusedLogitsLoss and sequence_tiled_compute alike).
    # Our 3-line workaround (no DeepSpeed piece does it): the loss gets no compute_params and the tied weight is held
    # at ds_grad_is_ready False until the loss is built, so its shards' gradients accumulate in .grad and enter
    # ZeRO's bucket once, with the embedding's, in engine.backward (how TiledMLP's shards accumulate).
    tied = bool(getattr(cfg, "tie_word_embeddings", False)) and \
        head.lm_head.weight is head.get_input_embeddings().weight
    loss_params = [] if tied else [head.lm_head.weight]
    pieces["tied_embeddings"] = (
        "tied: DeepSpeed's tiled loss under ZeRO-3 asserts (stage3.py: the tied weight's ds_id twice in the reduce "
        "bucket); workaround of bench/alst_compare.py: compute_params=[] and lm_head.weight.ds_grad_is_ready False "
        "during the loss, True before engine.backward" if tied else "untied: DeepSpeed's tiled loss as published")
    sdpa = a.sdpa if cuda else "default"
    if sdpa == "cudnn":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        kernel = lambda: sdpa_kernel([SDPBackend.CUDNN_ATTENTION])  # noqa: E731  (only cuDNN: an error if refused)
    else:
        import contextlib

        kernel = contextlib.nullcontext
    pieces["attention"] = ("transformers' sdpa attention -> torch.nn.functional.scaled_dot_product_attention "
                           "(is_causal, no mask), backend: " + ("cuDNN only (torch.nn.attention.sdpa_kernel)" if
                                                                 sdpa == "cudnn" else "torch's default choice" +
                                                                 ("" if cuda else " (CPU)")))
    pieces["versions"] = {"deepspeed": v, "transformers": transformers.__version__, "torch": torch.__version__}

    data = SampleStream(LongRangeCopy(a.seq, cfg.vocab_size, seed=a.seed), 1)  # train.py's stream (seed, SP=1)
    prof = StepProfiler(None, cfg, world_size=1, sp_size=1, rank=0, model=head, seq_len=a.seq)
    peak = peak_tflops("bf16" if ds_cfg.get("bf16", {}).get("enabled") else "fp32")
    steps = []
    for step in range(1, a.steps + 1):
        prof.start_step(step)
        batch = {k: t.to(engine.device) for k, t in next(data).items()}
        cu = batch.pop("doc_cu_seqlens")
        if cu.tolist() != [[0, a.seq]]:  # one document per sample: plain causal attention is the same attention
            raise ValueError(f"variant (a) takes one document per sample, got doc_cu_seqlens {cu.tolist()}")
        labels = batch["shift_labels"]
        n_valid = max(int((labels != -100).sum()), 1)
        # --loss-scale inside (a check, not the published call): 1/valid tokens inside the shards, so the weights'
        # in-forward gradients are the mean's too
        scale_inside, scale_outside = (n_valid, 1) if a.loss_scale == "inside" else (1, n_valid)
        shards = max(1, math.ceil(labels.numel() * cfg.vocab_size * 4 / 2**30))
        with offload, kernel():
            if tied:
                head.lm_head.weight.ds_grad_is_ready = False
            hidden = head.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                use_cache=False).last_hidden_state
            if a.loss == "fused":
                total = TiledFusedLogitsLoss.apply(loss_fn, head, hidden, labels, None, shards, loss_params, "sum")
            else:  # the tutorial's Part 2 snippet: sequence_tiled_compute (recomputes each shard in backward)
                total = sequence_tiled_compute(loss_fn, labels.shape[1], shards,
                                               dict(hidden_states=hidden, shift_labels=labels),
                                               dict(model_with_head=head), "hidden_states", loss_params,
                                               output_unshard_dimension=0, output_reduction="sum")
            loss = total / scale_outside
            if tied:
                head.lm_head.weight.ds_grad_is_ready = True
            engine.backward(loss)
        engine.step()
        r = prof.end_step(step, tokens=a.seq)
        gn = engine.get_global_grad_norm()
        steps.append({"step": step, "loss": float(loss.item()), "grad_norm": None if gn is None else float(gn),
                      "tokens": a.seq, "tokens_per_s": r["tokens_per_s_per_gpu"],
                      "tflops": r["tflops_per_gpu"], "mfu": r["tflops_per_gpu"] / peak if peak else None,
                      "peak_mem_bytes": r["peak_memory_bytes"], "peak_mem_source": r["peak_memory_source"],
                      "peak_reserved_bytes": r.get("peak_reserved_bytes"), "step_time_s": r["step_time_s"],
                      "loss_shards": shards})
        print(f"[alst] step {step}: loss {steps[-1]['loss']:.4f} {r['step_time_s']:.2f} s", flush=True)
    return {"steps": steps, "sdpa_backend": sdpa}


# ---------------------------------------------------------------------------------------------------------------
# the orchestrator
# ---------------------------------------------------------------------------------------------------------------


def _write(path, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


def _free_port() -> int:
    from tests.dist_utils import free_port

    return free_port()


def _env(rank=0, world=1, local_rank=None, port=None, extra=None):
    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank if local_rank is None else local_rank),
               WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), LOCAL_SIZE=str(world), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port or _free_port()), PYTHONPATH=os.pathsep.join(
                   p for p in (os.environ.get("PYTHONPATH"), ROOT) if p))
    env.update(extra or {})
    return env


def _tail(path, n=40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError as e:
        return f"(no log: {e})"


def _run(cmd, log, limit, env):
    """Runs cmd (one process) with output into log under a limit; returns (rc, seconds, timed_out)."""
    t0 = time.monotonic()
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        try:
            rc = p.wait(timeout=max(1, limit))
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 15)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
                p.wait()
            rc, timed_out = p.returncode, True
    return rc, time.monotonic() - t0, timed_out


def _summary(steps):
    """Figures of one run: step-1 loss, tokens/s etc. as the median of steps >= 2 (step 1 warms up), peaks over all."""
    if not steps:
        return None
    timed = [s for s in steps if s["step"] >= 2] or steps
    # over the timed steps together: tokens / time and flops / time of their sum, the step time their mean (a
    # per-key median took the upper of two values for each key on its own: 6,632 tokens/s next to a 27.3 s step,
    # H100 2026-11-27, where the two steps' sum gives 5,568)
    t = sum(s["step_time_s"] for s in timed)

    def med(key):
        if key == "step_time_s":
            return t / len(timed)
        vals = [s[key] * s["step_time_s"] for s in timed if s.get(key) is not None]
        return sum(vals) / t if vals and t else None

    res = [s.get("peak_reserved_bytes") for s in steps if s.get("peak_reserved_bytes") is not None]
    return {"step1_loss": steps[0]["loss"], "losses": [s["loss"] for s in steps],
            "step1_grad_norm": steps[0].get("grad_norm"), "tokens_per_s": med("tokens_per_s"),
            "tflops": med("tflops"), "mfu": med("mfu"), "step_time_s": med("step_time_s"),
            "timed_steps": [s["step"] for s in timed],
            "max_memory_allocated": max(s["peak_mem_bytes"] for s in steps),
            "max_memory_reserved": max(res) if res else None,
            "memory_source": steps[0].get("peak_mem_source") or ("cuda_max_memory_allocated" if res else
                                                                  "process_max_rss (CPU: train.py's StepProfiler)")}


ACTIVE = re.compile(r"ds_longctx active: (.*)")


def _jsonl(path):
    """The complete records of a metrics file (a run ended mid-write leaves a partial last line: dropped)."""
    out = []
    if os.path.exists(path):
        for line in open(path):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def _train_variant(name, cfg_path, model, seq, steps, limit, work, seed=0, extra_args=(), env_extra=None):
    """train.py in one process (world 1, env set: no MPI discovery). Returns the round's raw record."""
    metrics = os.path.join(work, f"{name}_{time.time_ns()}.jsonl")
    log = metrics[:-6] + ".log"
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--deepspeed_config", cfg_path, "--model-config", model,
           "--seq-len", str(seq), "--steps", str(steps), "--seed", str(seed), "--eval-samples", "0", "--no-progress",
           "--log-every", "0", "--metrics", metrics, *extra_args]
    rc, wall, timed_out = _run(cmd, log, limit, _env(extra=env_extra))
    steps_rec = _jsonl(metrics)
    m = None
    with open(log, errors="replace") as f:
        for line in f:
            m = ACTIVE.search(line) or m
    rec = {"variant": name, "command": " ".join(shlex.quote(c) for c in cmd), "rc": rc, "wall_s": wall,
           "timed_out": timed_out, "steps": steps_rec, "resolved": m.group(1) if m else None}
    if rc != 0:
        rec["error"] = (f"timed out after {limit:.0f} s (the part's cap)" if timed_out else f"exit {rc}") + \
            ": " + _tail(log)
    return rec


def _alst_variant(cfg_path, model, seq, steps, limit, work, sdpa, seed=0):
    res = os.path.join(work, f"alst_{time.time_ns()}.json")
    log = res[:-5] + ".log"
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "alst", "--ds-config", cfg_path, "--model-config",
           model, "--seq", str(seq), "--steps", str(steps), "--seed", str(seed), "--sdpa", sdpa, "--result", res,
           "--out", "-"]
    rc, wall, timed_out = _run(cmd, log, limit, _env())
    rec = {"variant": "alst", "command": " ".join(shlex.quote(c) for c in cmd), "rc": rc, "wall_s": wall,
           "timed_out": timed_out}
    if os.path.exists(res):
        rec.update(json.load(open(res)))
    rec.setdefault("steps", [])
    if rc != 0:
        rec["error"] = (f"timed out after {limit:.0f} s (the part's cap)" if timed_out else f"exit {rc}") + \
            ": " + rec.get("error", "") + "\n" + _tail(log)
    return rec


def planned_config(src, dst, seq=None) -> None:
    """(c): the shipped config with the planner's "auto" for heads_per_chunk, keep_on_device, keep_attention_output."""
    from ds_longctx.config import AUTO_KEYS  # the planner-resolved keys: heads_per_chunk and the two reinvestments

    c = json.load(open(src))
    for path in AUTO_KEYS:
        sec, key = path.split(".")
        c["long_context"].setdefault(sec, {})[key] = "auto"
    if seq:
        c["long_context"]["sequence_length"] = seq
    _write(dst, c)


def resolved_values(line):
    """heads_per_chunk / keep_on_device / keep_attention_output from train.py's 'ds_longctx active:' line."""
    if not line:
        return {}
    out = {}
    for key, pat in (("heads_per_chunk", r"heads_per_chunk=(\d+)"), ("keep_on_device", r"keep_on_device=(\d+)"),
                     ("keep_attention_output", r"keep_attention_output=(\d+)")):
        m = re.search(pat, line)
        out[key] = int(m.group(1)) if m else (0 if key != "heads_per_chunk" else None)
    return out


def part1(a, res, save):
    part = res.setdefault("part1", {"rounds": [], "notes": []})
    part.update(cap_s=a.cap1, seq=a.seq, steps=a.steps, model=a.model_config, shipped_config=a.config)
    cfg_c = os.path.join(a.work, "planned.json")
    planned_config(a.config, cfg_c)
    part["planned_config"] = json.load(open(cfg_c))["long_context"]
    t0 = time.monotonic()
    import torch

    sdpa = a.sdpa if torch.cuda.is_available() else "default"  # CPU: torch's own choice, no cuDNN to ask for
    round_s = None
    for r in range(1, a.rounds + 1):
        left = a.cap1 - (time.monotonic() - t0)
        if round_s is not None and left < round_s:
            part["notes"].append(f"round {r} not started: {left:.0f} s of the cap left, a round took {round_s:.0f} s")
            break
        rt0 = time.monotonic()
        rnd = {"round": r, "runs": []}
        part["rounds"].append(rnd)
        for v in a.variants.split(","):
            left = a.cap1 - (time.monotonic() - t0)
            if left < 10:
                rnd["runs"].append({"variant": v, "skipped": f"{left:.0f} s of the part's cap left"})
                continue
            if v == "alst":
                rec = _alst_variant(a.config, a.model_config, a.seq, a.steps, left, a.work, sdpa)
                if rec.get("rc") != 0 and sdpa == "cudnn" and not rec.get("timed_out"):
                    # the failed run stays in the round with its error; (a) runs again at once, and in later
                    # rounds, on torch's default SDPA choice, recorded as such (sdpa_backend "default")
                    part["notes"].append(f"round {r}: (a) with SDPA on cuDNN only failed (error in its record); (a) "
                                         "ran again with torch's default SDPA backend, and does in later rounds")
                    sdpa = "default"
                    rec["summary"] = _summary(rec.get("steps"))
                    rnd["runs"].append(rec)
                    save()
                    left = a.cap1 - (time.monotonic() - t0)
                    rec = _alst_variant(a.config, a.model_config, a.seq, a.steps, left, a.work, sdpa)
            elif v == "ds_longctx_shipped":
                rec = _train_variant(v, a.config, a.model_config, a.seq, a.steps, left, a.work)
            else:
                rec = _train_variant(v, cfg_c, a.model_config, a.seq, a.steps, left, a.work)
                rec["picks"] = resolved_values(rec.get("resolved"))
            rec["summary"] = _summary(rec.get("steps"))
            rnd["runs"].append(rec)
            print(f"== part 1 round {r} {v}: rc {rec.get('rc')} {rec['wall_s']:.0f} s "
                  f"{json.dumps(rec['summary'])[:300]}", flush=True)
            save()
        round_s = time.monotonic() - rt0
    part["wall_s"] = time.monotonic() - t0
    part["summary"] = _compare(part)
    save()


def _compare(part):
    """Per variant: figures over its successful rounds (median of the rounds' medians), then the ratios."""
    by, sdpa = {}, {}
    for rnd in part["rounds"]:
        for rec in rnd["runs"]:
            if rec.get("summary") and rec.get("rc") == 0:
                by.setdefault(rec["variant"], []).append(rec["summary"])
                if rec.get("sdpa_backend"):
                    sdpa.setdefault(rec["variant"], set()).add(rec["sdpa_backend"])
    out = {}
    for v, sums in by.items():
        def med(key):
            vals = [s[key] for s in sums if s.get(key) is not None]
            return statistics.median(vals) if vals else None
        out[v] = {"rounds_ok": len(sums), "tokens_per_s": med("tokens_per_s"), "tflops": med("tflops"),
                  "mfu": med("mfu"), "step_time_s": med("step_time_s"),
                  "max_memory_allocated": max(s["max_memory_allocated"] for s in sums),
                  "max_memory_reserved": med("max_memory_reserved"), "memory_source": sums[0]["memory_source"],
                  "step1_losses": [s["step1_loss"] for s in sums],
                  "step1_grad_norms": [s.get("step1_grad_norm") for s in sums]}
        if v in sdpa:
            out[v]["sdpa_backend"] = sorted(sdpa[v])
    ratios = {}
    a, b, c = out.get("alst"), out.get("ds_longctx_shipped"), out.get("ds_longctx_planned")

    def ratio(x, y, key):
        return x[key] / y[key] if x and y and x.get(key) and y.get(key) else None

    ratios["planned_over_alst_tokens_per_s"] = ratio(c, a, "tokens_per_s")
    ratios["shipped_over_alst_tokens_per_s"] = ratio(b, a, "tokens_per_s")
    ratios["shipped_over_alst_max_memory_allocated"] = ratio(b, a, "max_memory_allocated")
    ratios["shipped_over_alst_max_memory_reserved"] = ratio(b, a, "max_memory_reserved")
    ratios["planned_over_alst_max_memory_allocated"] = ratio(c, a, "max_memory_allocated")
    ratios["planned_over_alst_max_memory_reserved"] = ratio(c, a, "max_memory_reserved")
    losses = [l for v in out.values() for l in v["step1_losses"]]
    ratios["step1_loss_spread_rel"] = (max(losses) - min(losses)) / abs(min(losses)) if losses else None
    ratios["goals"] = "issue 32: (c)/(a) tokens/s >= 1.2; (b)/(a) memory < 1; step-1 losses equal within bf16"
    return {"variants": out, "ratios": ratios}


# --- part 2 ----------------------------------------------------------------------------------------------------


def _plan(cfg_path, model, seq, log_dir, full_depth=False, extra=(), limit=300):
    out = os.path.join(log_dir, f"plan_{time.time_ns()}.json")
    cmd = [sys.executable, "-m", "ds_longctx.planner.cli", "plan", "--deepspeed_config", cfg_path, "--model-config",
           model, "--gpus", "1", "--gpu-mem", "h100", "--host-mem", "none", "--seq-len", str(seq), "--json",
           *(["--full-depth"] if full_depth else []), *extra]
    with open(out, "w") as f:
        try:
            p = subprocess.run(cmd, stdout=f, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=_env(),
                               timeout=max(1, limit))
        except subprocess.TimeoutExpired:
            return {"command": " ".join(shlex.quote(c) for c in cmd), "rc": None,
                    "error": f"the planner did not finish in {limit:.0f} s (what was left of the part's cap)"}
    rec = {"command": " ".join(shlex.quote(c) for c in cmd), "rc": p.returncode}
    if p.returncode:
        rec["error"] = p.stderr[-3000:]
        return rec
    d = json.load(open(out))
    t = d.get("time") or {}
    rec.update(fits=d.get("fits"), step_peak_bytes=d.get("step_peak_bytes"),
               peak_device_bytes=d.get("peak_device_bytes"),
               activation_peak_bytes=d.get("activation_peak_bytes"), step_s=t.get("seconds"),
               tokens_per_s=t.get("tokens_per_s"), mfu=t.get("mfu"), extrapolated=d.get("extrapolated"),
               layers_simulated=d.get("layers_simulated"), reserved_device_bytes=d.get("reserved_device_bytes"),
               allocator=d.get("allocator"), max_context=d.get("max_context"))
    return rec


def _pinned(cfg_src, picks, dst, seq, allocator_steps=None):
    """(c)'s config with its resolved picks written in (the planner plans one setting, not "auto")."""
    c = json.load(open(cfg_src))
    lc = c["long_context"]
    lc["sequence_length"] = seq
    if picks.get("heads_per_chunk"):
        lc["attention"]["heads_per_chunk"] = picks["heads_per_chunk"]
    lc["activation_checkpointing"]["keep_on_device"] = picks.get("keep_on_device") or 0
    lc["activation_checkpointing"]["keep_attention_output"] = picks.get("keep_attention_output") or 0
    if allocator_steps:
        lc.setdefault("profile", {}).update(allocator_check=True, steps=allocator_steps)
    _write(dst, c)


def part2(a, res, save):
    import torch

    part = res.setdefault("part2", {"notes": []})
    part["cap_s"] = a.cap2
    t0 = time.monotonic()
    p1 = (res.get("part1") or {}).get("summary", {}).get("variants", {})
    c_runs = [rec for rnd in (res.get("part1") or {}).get("rounds", []) for rec in rnd["runs"]
              if rec.get("variant") == "ds_longctx_planned" and rec.get("picks")]
    picks = c_runs[0]["picks"] if c_runs else None
    if picks is None:  # part 1 did not run (c): resolve the picks with a one-step run of (c) first
        cfg_c = os.path.join(a.work, "planned.json")
        planned_config(a.config, cfg_c)
        rec = _train_variant("ds_longctx_planned", cfg_c, a.model_config, a.seq, 1, a.cap2 / 2, a.work)
        picks = resolved_values(rec.get("resolved"))
        part["resolve_run"] = {k: rec.get(k) for k in ("command", "rc", "wall_s", "error", "resolved")}
    part["picks"] = picks
    cfg_p = os.path.join(a.work, "planned_pinned.json")
    _pinned(a.config, picks, cfg_p, a.seq)
    part["plan"] = _plan(cfg_p, a.model_config, a.seq, a.work, limit=a.cap2 / 3)
    save()
    if torch.cuda.is_available():
        cfg_alloc = os.path.join(a.work, "planned_alloc.json")
        # one step, its allocations replayed from the snapshot before it (a second step would not fit the cap)
        _pinned(a.config, picks, cfg_alloc, a.seq, allocator_steps=[1])
        left = a.cap2 - (time.monotonic() - t0)
        rec = _train_variant("ds_longctx_planned_allocator_check", cfg_alloc, a.model_config, a.seq, 1, left, a.work)
        part["allocator_run"] = rec
        am = next((s.get("allocator_model") for s in rec.get("steps", []) if s.get("allocator_model")), None)
        part["allocator_model"] = am
    else:
        part["notes"].append("allocator_check replays CUDA allocator traces: not run on CPU (dry run)")
    c = p1.get("ds_longctx_planned")
    pl = part["plan"]
    am = part.get("allocator_run") or {}
    if not c and am.get("steps"):  # part 1 did not run (c): its one-step allocator run is (c) on this machine
        c = _summary(am["steps"])
    if c and pl.get("step_s"):
        part["planner_step_s_over_measured"] = pl["step_s"] / c["step_time_s"]
        # the planner's peak is peak_device_bytes (max of the backward's and the optimizer step's); step_peak_bytes
        # alone is the optimizer step's (compared with it, H100 2026-11-27, the 1B's 27.0 GB matched to 0.3% while
        # the predicted backward peak, 38.2 GB, was never reached)
        part["planner_peak_over_max_memory_allocated"] = (pl["peak_device_bytes"] / c["max_memory_allocated"]
                                                           if pl.get("step_peak_bytes") else None)
        part["planner_peak_over_max_memory_reserved"] = (pl["peak_device_bytes"] / c["max_memory_reserved"]
                                                          if c.get("max_memory_reserved") else None)
    part["goals"] = "issue 32: allocator model within 5% of max_memory_reserved; planner step time within 10% of (c)"
    part["wall_s"] = time.monotonic() - t0
    save()


# --- part 3 ----------------------------------------------------------------------------------------------------


def sp2_worker(a) -> None:
    """One rank of the SP=2 run on one device: the process group over gloo on device 0 (started here, before
    train.py's main: ds_longctx.initialize.init_distributed then finds it and keeps it), then train.py's loop."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    import deepspeed

    from ds_longctx.dist.comm import disable_cpu_shm_allreduce
    from ds_longctx.dist.runtime import run
    from ds_longctx.train import main

    # on CPU (the dry run) DeepSpeed's CPU backend would JIT-build its shared-memory all-reduce op here, into the
    # shared extensions folder: two ranks building at once, and a rank killed mid-build leaves a lock every later
    # process waits on forever (a dry run's timed-out SP=2 ranks did, 2026-11-29). ds_longctx's own runs skip it.
    disable_cpu_shm_allreduce()
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    run(main, json.loads(a.train_args))


def part3(a, res, save):
    import torch

    part = res.setdefault("part3", {"notes": []})
    part["cap_s"] = a.cap3
    part["finding"] = (
        "torch's ProcessGroupGloo::alltoall_base takes CUDA tensors (AsyncAlltoallCUDAWork: pinned host copies on side "
        "streams, gloo's alltoall/alltoallv on the host, copies back): "
        "torch/csrc/distributed/c10d/ProcessGroupGloo.cpp "
        "(pytorch/pytorch main, read 2026-11-27); torch.distributed.all_to_all_single and DeepSpeed's "
        "_dim_zero_all_to_all go through it. ZeRO-3's collectives have CUDA paths there too: _allgather_base -> "
        "allgather (AsyncAllgatherCUDAWork), reduce_scatter_tensor built from allreduce (CUDA work). NCCL refuses two "
        "ranks on one device (duplicate GPU). So SP=2 on one device runs over gloo, both ranks on cuda:0 "
        "(LOCAL_RANK=0 on both), the process group started by this "
        "script's worker before train.py's main.")
    t0 = time.monotonic()
    cuda = torch.cuda.is_available()
    cfg2 = os.path.join(a.work, "sp2.json")
    cfg1 = os.path.join(a.work, "sp1.json")
    c = json.load(open(a.config))
    c["long_context"]["activation_checkpointing"]["keep_on_device"] = 0  # small model: every layer offloaded
    for sp, path in ((2, cfg2), (1, cfg1)):
        d = json.loads(json.dumps(c))
        d["sequence_parallel_size"] = sp
        d["long_context"]["sequence_length"] = a.seq3
        _write(path, d)
    model = os.path.join(a.work, f"sp_model_{a.depth3}.json")
    m = json.load(open(a.model3))
    m["num_hidden_layers"] = a.depth3
    _write(model, m)
    steps = 2
    port = _free_port()
    procs, logs = [], []
    metrics = os.path.join(a.work, f"sp2_{time.time_ns()}.jsonl")
    train_args = ["--deepspeed_config", cfg2, "--model-config", model, "--seq-len", str(a.seq3), "--steps", str(steps),
                  "--eval-samples", "0", "--no-progress", "--log-every", "0", "--metrics", metrics]
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "sp2", "--train-args", json.dumps(train_args),
           "--out", "-"]
    lim = a.cap3 * 0.6
    for rank in range(2):
        log = metrics[:-6] + f"_rank{rank}.log"
        logs.append(log)
        f = open(log, "w")
        procs.append((subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                                       env=_env(rank=rank, world=2, local_rank=0 if cuda else rank, port=port)), f))
    rcs, timed_out = [], False
    for p, f in procs:
        try:
            rcs.append(p.wait(timeout=max(1, lim - (time.monotonic() - t0))))
        except subprocess.TimeoutExpired:
            timed_out = True
            for q, _ in procs:
                if q.poll() is None:
                    os.killpg(q.pid, 9)
            rcs.append(p.wait())
        f.close()
    sp2 = {"command": " ".join(shlex.quote(x) for x in cmd) + "   (2 ranks, RANK 0/1, LOCAL_RANK " +
           ("0/0, CUDA_VISIBLE as given" if cuda else "0/1") + ", gloo)", "rcs": rcs, "timed_out": timed_out,
           "steps": _jsonl(metrics)}
    if any(rcs):
        sp2["error"] = "\n".join(f"--- rank {i} (rc {rc}):\n{_tail(log, 30)}" for i, (rc, log) in
                                 enumerate(zip(rcs, logs)))
    part["sp2"] = sp2
    save()
    left = a.cap3 - (time.monotonic() - t0)
    sp1 = _train_variant("sp1", cfg1, model, a.seq3, steps, left, a.work)
    part["sp1"] = sp1
    l2 = [s["loss"] for s in sp2["steps"]]
    l1 = [s["loss"] for s in sp1.get("steps", [])]
    if l1 and l2:
        part["losses"] = {"sp2": l2, "sp1": l1,
                          "max_rel_diff": max(abs(x - y) / abs(y) for x, y in zip(l2, l1))}
    part["wall_s"] = time.monotonic() - t0
    save()


# --- part 4 ----------------------------------------------------------------------------------------------------


def part4(a, res, save):
    part = res.setdefault("part4", {"runs": [], "notes": []})
    part.update(cap_s=a.cap4, depth=a.depth4, config=a.config4)
    t0 = time.monotonic()
    model = os.path.join(a.work, f"model4_{a.depth4}.json")
    m = json.load(open(a.model4))
    m["num_hidden_layers"] = a.depth4
    _write(model, m)
    last = None
    for seq in a.seq4:
        left = a.cap4 - (time.monotonic() - t0)
        if last is not None:
            # attention dominates: the next length's step ~ (seq/last_seq)^2 x the last, plus its start-up
            need = last["startup_s"] + last["step_s"] * (seq / last["seq"]) ** 2 * 1.1 * a.steps4
            if need > left:
                part["notes"].append(f"{seq} not run: predicted {need:.0f} s from {last['seq']}'s step, "
                                     f"{left:.0f} s left")
                break
        cfg = os.path.join(a.work, f"cfg4_{seq}.json")
        c = json.load(open(a.config4))
        c["long_context"]["sequence_length"] = seq
        # torch's AdamW on the offloaded CPU states instead of DeepSpeedCPUAdam: no JIT build of the cpu_adam op in
        # the cap (~1 min on a fresh machine); device memory, what this part measures, is the same either way
        c["optimizer"]["params"]["torch_adam"] = True
        if a.alloc_check4:  # issue 48: the real allocator trace of these steps, replayed and explained per stream/frame
            c["long_context"].setdefault("profile", {}).update(allocator_check=True, steps=a.alloc_check4)
        if a.dry_run:  # the tiny model has fewer layers than the 8B config keeps on the device
            c["long_context"]["activation_checkpointing"]["keep_on_device"] = min(
                c["long_context"]["activation_checkpointing"].get("keep_on_device", 0), a.depth4)
        _write(cfg, c)
        rec = _train_variant(f"8b_depth{a.depth4}_{seq}", cfg, model, seq, a.steps4, left, a.work,
                             extra_args=["--allow-beyond-max-position"])
        rec["summary"] = _summary(rec.get("steps"))
        # per step: allocated, reserved, and (allocator_check) the model's replay, the real reserved per stream and
        # the frames that stranded memory (measure/allocator.check_step)
        rec["memory_by_step"] = [{k: s.get(k) for k in ("step", "peak_mem_bytes", "peak_reserved_bytes",
                                                         "allocator_model")} for s in rec.get("steps", [])]
        part["runs"].append(rec)
        save()  # before the planner: a cap that ends during the plan keeps the measurement
        s = rec["summary"]
        if a.plan4:
            rec["plan"] = _plan(cfg, model, seq, a.work, limit=a.cap4 - (time.monotonic() - t0) - 5)
            if s and rec["plan"].get("step_peak_bytes"):
                rec["planner_peak_over_max_memory_allocated"] = (rec["plan"]["peak_device_bytes"] /
                                                                 s["max_memory_allocated"])
                if rec["plan"].get("reserved_device_bytes") and s.get("max_memory_reserved"):
                    rec["planner_reserved_over_max_memory_reserved"] = (rec["plan"]["reserved_device_bytes"] /
                                                                        s["max_memory_reserved"])
        else:
            rec["plan"] = {"skipped": "--no-plan4: the planner's figures for this config are CPU work "
                                      "(bench/reserved_replay.py, bench/results/reserved_replay_cpu.json)"}
        save()
        if rec.get("rc") != 0 or not s:
            break
        last = {"seq": seq, "step_s": s["step_time_s"], "startup_s": max(0.0, rec["wall_s"] - s["step_time_s"] *
                                                                          len(rec.get("steps") or [1]))}
    # the planner's full-depth one-GPU maximum is CPU work (a --max-context search takes minutes): not in the device
    # call; the figure as issue 32 states it, with the command that gives it
    part["full_depth_max_context"] = (
        "1.56M tokens (issue 32's figure) for ds_configs/llama3-8b-1gpu-512k.json at 2 TiB host: python -m "
        "ds_longctx.planner.cli plan --deepspeed_config ds_configs/llama3-8b-1gpu-512k.json --model-config "
        "ds_configs/models/llama3-8b.json --gpus 1 --gpu-mem h100 --host-mem 2TiB --max-context (run on CPU)")
    part["alst_published"] = "ALST (arXiv 2506.13996): Llama-3.1-8B, 500K tokens on one H100-80GB"
    part["wall_s"] = time.monotonic() - t0
    save()


# ---------------------------------------------------------------------------------------------------------------


def device_line():
    import torch

    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        return f"{p.name}, {p.total_memory / 2**30:.1f} GiB, torch {torch.__version__}, CUDA {torch.version.cuda}"
    return f"CPU ({os.cpu_count()} cores, {os.uname().nodename}), torch {torch.__version__}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", default="1", help="comma-separated parts to run, in order (1,2,3,4)")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny model (tiny-llama at 4 layers), 256 tokens, "
                   "2 steps, 2 rounds, gloo: the same code paths")
    p.add_argument("--out", required=True, help="JSON results (merged: parts already there are kept)")
    p.add_argument("--config", default=SHIPPED, help="(b)'s ds_config; (c) and (a) derive from it")
    p.add_argument("--model-config", default=MODEL_1B)
    p.add_argument("--seq", type=int, default=131072)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=None, help="a b c rounds at most, the cap decides (default 3; 1 "
                   "on --dry-run)")
    p.add_argument("--variants", default="alst,ds_longctx_shipped,ds_longctx_planned",
                   help="part 1's variants, in each round's order (a comma-separated subset)")
    p.add_argument("--sdpa", choices=("cudnn", "default"), default="cudnn", help="(a)'s SDPA backend on CUDA")
    # caps (s), sized for run_all.sh's 530 s. Part 1 from the measured 25.4 s/step of (b) at 128K (bench/RESULTS.md,
    # GPU): a process is ~20 s start-up + 3 steps ~ 80-95 s for (b), less for (a) and (c) (predicted ~15-20 s/step),
    # ~250 s a round: one round fits 280 s (a second would need ~500 s: --rounds/--cap1 for a longer call)
    p.add_argument("--cap1", type=float, default=280)
    p.add_argument("--cap2", type=float, default=90, help="one 1-step run of (c) with allocator_check + the planner")
    p.add_argument("--cap3", type=float, default=75)
    p.add_argument("--cap4", type=float, default=80)
    p.add_argument("--seq3", type=int, default=8192, help="part 3's length (SP=2 over gloo host copies is slow)")
    p.add_argument("--depth3", type=int, default=2, help="part 3's layers (model: --model-config's)")
    p.add_argument("--config4", default=CFG_8B)
    p.add_argument("--model4", default=MODEL_8B)
    p.add_argument("--depth4", type=int, default=2)
    p.add_argument("--seq4", type=int, nargs="+", default=None, help="part 4's lengths, ascending (default 131072 "
                   "262144 524288; --dry-run: 128 256)")
    p.add_argument("--steps4", type=int, default=1, help="part 4's steps per length")
    p.add_argument("--alloc-check4", type=lambda v: [int(x) for x in v.split(",") if x], default=None,
                   help="part 4: steps (e.g. 1,2) with profile.allocator_check (CUDA: the real allocator trace "
                        "replayed and explained per stream and frame)")
    p.add_argument("--no-plan4", dest="plan4", action="store_false", help="part 4: no planner run on the device "
                   "machine (the planner is CPU work: bench/reserved_replay.py)")
    p.add_argument("--work", help="scratch directory for configs, logs, metrics (default: a new temp dir)")
    # internal: one process of a variant
    p.add_argument("--worker", choices=("alst", "sp2"), help=argparse.SUPPRESS)
    p.add_argument("--ds-config", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--loss", choices=("fused", "tiled_compute"), default="fused", help=argparse.SUPPRESS)
    p.add_argument("--loss-scale", choices=("published", "inside"), default="published", help=argparse.SUPPRESS)
    p.add_argument("--train-args", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    known = ("alst", "ds_longctx_shipped", "ds_longctx_planned")
    bad = [v for v in a.variants.split(",") if v not in known]
    if bad:
        p.error(f"--variants {a.variants!r}: {', '.join(bad)} not known; pick from {', '.join(known)}")
    if a.worker == "alst":
        return alst_worker(a)
    if a.worker == "sp2":
        return sp2_worker(a)

    a.work = a.work or tempfile.mkdtemp(prefix="alst_compare_")
    os.makedirs(a.work, exist_ok=True)
    if a.dry_run:
        tiny = os.path.join(a.work, "tiny4.json")
        m = json.load(open(TINY))
        m["num_hidden_layers"] = 4  # the shipped config keeps 3 layers' inputs on the device: more layers than that
        m["tie_word_embeddings"] = True  # as Llama-3.2-1B: (a)'s tied-embedding path runs in the dry run too
        _write(tiny, m)
        a.model_config = a.model3 = a.model4 = tiny
        a.rounds = a.rounds or 1
        a.seq, a.steps, a.seq3, a.depth3, a.depth4 = 256, 2, 256, 2, 2
        a.seq4 = [x for x in (a.seq4 or []) if x <= 256] or [128, 256]  # tiny lengths only
    else:
        a.model3 = a.model_config
    a.seq4 = a.seq4 or [131072, 262144, 524288]
    a.rounds = a.rounds or 3
    if os.environ.get("STEP_LIMIT"):  # run_all.sh's limit for this step: each cap under it, with time to write
        room = float(os.environ["STEP_LIMIT"]) - 15
        a.cap1, a.cap2, a.cap3, a.cap4 = (min(c, room) for c in (a.cap1, a.cap2, a.cap3, a.cap4))
    parts = [int(x) for x in a.part.split(",")]
    res = json.load(open(a.out)) if os.path.exists(a.out) else {}
    res.setdefault("issue", 32)
    res.setdefault("runs", []).append({"command": " ".join(shlex.quote(x) for x in [sys.executable, *sys.argv]),
                                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                                           timespec="seconds"),
                                       "device": device_line(), "parts": parts, "dry_run": a.dry_run,
                                       "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")})

    def save():
        _write(a.out, res)

    save()
    for n in parts:
        fn = {1: part1, 2: part2, 3: part3, 4: part4}[n]
        try:
            fn(a, res, save)
        except Exception as e:  # a part that breaks is recorded; the next part still runs
            res.setdefault(f"part{n}", {})["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
            save()
            print(f"== part {n} failed: {e}", flush=True)
    print(json.dumps({k: res[k].get("summary") or {kk: vv for kk, vv in res[k].items() if kk in (
        "planner_step_s_over_measured", "planner_peak_over_max_memory_allocated", "losses", "error")}
        for k in res if k.startswith("part")}, indent=1, default=str)[:6000])


if __name__ == "__main__":
    main()
