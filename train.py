"""ds_longctx's main job: train a causal LM on long sequences with DeepSpeed.

    deepspeed --num_gpus 2 train.py --deepspeed_config ds_configs/tiny-cpu.json          # CPU demo
    deepspeed train.py --deepspeed_config ds_configs/llama3-8b-5m.json --model meta-llama/Llama-3.1-8B

The embedded default (no download) is a small Llama preset on the long-range copy task: a random
block then its copy, so the loss can only fall below ln(vocab-2) if attention reaches across
sequence shards. The same --seed gives the same weights and data for every SP degree, ZeRO stage
and process count.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_MODEL_CONFIG = os.path.join(HERE, "ds_configs", "models", "tiny-llama.json")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config", required=True)
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1, help="set by the deepspeed launcher")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="HF model id or local path (pretrained weights)")
    src.add_argument("--model-config", help="local HF config.json: random init (default: the tiny preset)")
    p.add_argument("--tokenizer", help="tokenizer for --data files (default: --model)")
    p.add_argument("--seq-len", type=int, default=None, help="global tokens per sample (default: "
                   "long_context.sequence_length or 512)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default="copy", help="built-in task name ('copy') or a .jsonl/.txt file")
    p.add_argument("--concat-documents", action="store_true", help="--data FILE: plain concatenation, attention "
                   "across documents (default: packed, position_ids restart per document, document-masked attention)")
    p.add_argument("--metrics", help="write one JSON object per step to this file (rank 0)")
    p.add_argument("--save", help="save a checkpoint here at the end")
    p.add_argument("--resume", help="resume from a checkpoint saved with --save")
    p.add_argument("--eval-samples", type=int, default=8, help="held-out samples for the task accuracy")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def load_model_config(path):
    from transformers import CONFIG_MAPPING

    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path) as f:
        d = json.load(f)
    attn = d.pop("attn_implementation", "sdpa")
    cfg = CONFIG_MAPPING[d.pop("model_type")](**d)
    cfg._attn_implementation = attn
    return cfg


def build_model(args, ds_config):
    import ds_longctx
    from ds_longctx.engine import deterministic_init
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    with ds_longctx.model_init(ds_config):
        if args.model:
            return AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa")
        cfg = load_model_config(args.model_config or DEFAULT_MODEL_CONFIG)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=cfg._attn_implementation)
    deterministic_init(model, args.seed)  # same weights for every SP degree, ZeRO stage, process count
    return model


def build_dataset(args, model_config, seq_len):
    from ds_longctx.data import TASKS, TokenFileDataset

    if args.data in TASKS:
        return TASKS[args.data](seq_len=seq_len, vocab_size=model_config.vocab_size, seed=args.seed)
    from transformers import AutoTokenizer

    tok = args.tokenizer or args.model
    if tok is None:
        raise SystemExit("--data FILE needs --tokenizer or --model (a local tokenizer)")
    return TokenFileDataset(args.data, AutoTokenizer.from_pretrained(tok), seq_len,
                            documents=not args.concat_documents, vocab_size=model_config.vocab_size)


def step_flops(model_config, n_params, tokens_per_sample, samples):
    """6·N per token (fwd+bwd matmuls) + causal attention 6·L·H·d·S² per sample (fwd 2, bwd 4, halved
    by causality, x2 for QK^T and PV)."""
    tc = model_config.get_text_config()
    hd = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    attn = 6 * tc.num_hidden_layers * tc.num_attention_heads * hd * tokens_per_sample ** 2
    return samples * (6 * n_params * tokens_per_sample + attn)


def peak_mem_bytes():
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # CPU: process peak RSS


@torch.no_grad()
def copy_accuracy(engine, dataset, n, sp_rank, sp_size, group, start_index):
    """Argmax accuracy on scored tokens of held-out samples (the SP group evaluates together)."""
    from ds_longctx.data import shard_batch

    engine.eval()
    correct = total = 0
    for i in range(n):
        item = dataset[start_index + i]
        batch = shard_batch({k: v.unsqueeze(0) for k, v in item.items()}, sp_rank, sp_size)
        logits = engine(input_ids=batch["input_ids"].to(engine.device),
                        position_ids=batch["position_ids"].to(engine.device), use_cache=False).logits
        target = batch["shift_labels"].to(logits.device)
        valid = target != -100
        correct += int((logits.argmax(-1)[valid] == target[valid]).sum())
        total += int(valid.sum())
    engine.train()
    t = torch.tensor([correct, total], dtype=torch.float64)
    if group is not None:
        dist.all_reduce(t, group=group)
    return float(t[0] / max(t[1], 1))


def main(argv=None):
    args = parse_args(argv)
    import ds_longctx
    from ds_longctx import comm
    from ds_longctx.config import load_ds_config, parse

    ds_config = load_ds_config(args.deepspeed_config)
    lc = parse(ds_config)
    seq_len = args.seq_len or lc.sequence_length or 512
    model = build_model(args, ds_config)
    dataset = build_dataset(args, model.config, seq_len)
    engine, _, loader, _ = ds_longctx.initialize(args=args, model=model, config=ds_config, training_data=dataset,
                                                 model_parameters=[p for p in model.parameters()
                                                                   if p.requires_grad])
    rank, world = dist.get_rank(), dist.get_world_size()
    sp = lc.sequence_parallel_size
    group = comm.sp_group() if sp > 1 else None
    dp = world // sp
    micro = engine.train_micro_batch_size_per_gpu()
    gas = engine.gradient_accumulation_steps()
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    flops = step_flops(model.config, n_params, seq_len, micro * gas * dp)

    start = 0
    if args.resume:
        _, client = engine.load_checkpoint(args.resume)
        if client is None:
            raise SystemExit(f"--resume {args.resume}: no checkpoint found there")
        start = int(client["step"])
    batches = itertools.islice(itertools.cycle(loader) if len(loader) else iter(()), start * gas, None)

    metrics = open(args.metrics, "a" if args.resume else "w") if args.metrics and rank == 0 else None
    bar = None
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, initial=start, desc="train", dynamic_ncols=True, file=sys.stdout,
                   mininterval=1.0)
    if rank == 0:
        print(f"[ds_longctx] world={world} sp={sp} dp={dp} seq_len={seq_len} micro_batch={micro} gas={gas} "
              f"params={n_params / 1e6:.2f}M attention={lc.attention.implementation} "
              f"zero_stage={engine.zero_optimization_stage()}", flush=True)
    loss_value = float("nan")
    for step in range(start + 1, args.steps + 1):
        t0 = time.perf_counter()
        losses = []
        for _ in range(gas):
            batch = {k: v.to(engine.device) for k, v in next(batches).items()}
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().float())
        loss_t = torch.stack(losses).mean()
        if dp > 1:  # report the mean over data-parallel replicas (SP ranks already agree)
            dist.all_reduce(loss_t)
            loss_t /= world
        loss_value = loss_t.item()
        dt = time.perf_counter() - t0
        tokens = seq_len * micro * gas * dp
        rec = {"step": step, "loss": loss_value, "tokens": tokens, "tokens_per_s": tokens / dt,
               "tflops": flops / dt / 1e12 / world, "peak_mem_bytes": peak_mem_bytes(),
               "lr": engine.get_lr()[0] if engine.get_lr() else None, "step_time_s": dt}
        if metrics:
            metrics.write(json.dumps(rec) + "\n")
            metrics.flush()
        if bar:
            bar.set_postfix(loss=f"{loss_value:.4f}", tok_s=f"{rec['tokens_per_s']:.0f}",
                            tflops=f"{rec['tflops']:.3f}", peak=f"{rec['peak_mem_bytes'] / 2**20:.0f}MiB")
            bar.update(1)
    if bar:
        bar.close()
    if args.save:
        engine.save_checkpoint(args.save, tag=f"step{args.steps}", client_state={"step": args.steps})
    if args.data in ("copy",) and args.eval_samples:
        acc = copy_accuracy(engine, dataset, args.eval_samples, comm.sp_rank(group), sp, group,
                            start_index=len(dataset) - args.eval_samples)
        if rank == 0:
            chance = 1.0 / (model.config.vocab_size - 2)
            print(f"[ds_longctx] final loss {loss_value:.4f} (no-attention floor ln(V-2) = "
                  f"{dataset.chance_loss:.4f}); copy accuracy {acc:.3f} (chance {chance:.3f})", flush=True)
    if metrics:
        metrics.close()
    # tear gloo down before interpreter exit: a rank exiting with the group alive aborted
    # ("terminate called without an active exception") about one run in three
    dist.barrier()
    dist.destroy_process_group()
    return loss_value


if __name__ == "__main__":
    main()
