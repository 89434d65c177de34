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
import sys

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


def _config_error(key, problem, fix):
    from ds_longctx.errors import ConfigError

    return ConfigError(key, problem, fix)


def _check_writable_file(flag, path):
    """``path`` can be created or overwritten by this process."""
    if os.path.isdir(path):
        raise _config_error(flag, f"{path!r} is a directory", "give a file path")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise _config_error(flag, f"directory {parent!r} does not exist", f"create it (mkdir -p {parent})")
    if not os.access(parent, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise _config_error(flag, f"{path!r} is not writable", "give a path this user can write")


def _model_config_path(path):
    return os.path.join(path, "config.json") if os.path.isdir(path) else path


def validate_args(args, lc):
    """Every CLI value, checked on every rank before any collective (a rank that raised alone would
    leave the others waiting). Returns the sequence length."""
    from ds_longctx.data import TASKS

    sp = lc.sequence_parallel_size
    if args.steps < 1:
        raise _config_error("--steps", f"must be >= 1, got {args.steps}", "give the number of optimizer steps")
    if args.seed < 0:
        raise _config_error("--seed", f"must be >= 0, got {args.seed}", "give a non-negative seed")
    if args.eval_samples < 0:
        raise _config_error("--eval-samples", f"must be >= 0, got {args.eval_samples}", "use 0 to skip the eval")
    seq_len = args.seq_len if args.seq_len is not None else (lc.sequence_length or 512)
    flag = "--seq-len" if args.seq_len is not None else "long_context.sequence_length"
    if seq_len < 1:
        raise _config_error(flag, f"must be >= 1, got {seq_len}", "give the global tokens per sample")
    if seq_len % sp:
        raise _config_error(flag, f"{seq_len} is not divisible by sequence_parallel_size={sp}",
                            f"use a multiple of {sp}, e.g. {(seq_len // sp + 1) * sp}")
    if args.data in TASKS:
        if args.data == "copy" and (seq_len < 4 or seq_len % 2):
            raise _config_error(flag, f"the copy task needs an even length >= 4, got {seq_len}",
                                "use an even sequence length")
    else:
        if not os.path.isfile(args.data):
            raise _config_error("--data", f"{args.data!r} is neither a task ({sorted(TASKS)}) nor an existing file",
                                "give a task name or the path of a .txt/.jsonl file")
        if not args.data.endswith((".txt", ".jsonl")):
            raise _config_error("--data", f"unsupported file type {args.data!r}", "use a .txt or .jsonl file")
        if not (args.tokenizer or args.model):
            raise _config_error("--data", "a file needs a tokenizer", "pass --tokenizer (or --model)")
    if args.model_config is not None and not os.path.isfile(_model_config_path(args.model_config)):
        raise _config_error("--model-config", f"{_model_config_path(args.model_config)!r} does not exist",
                            "give the path of a HF config.json (or a directory holding one)")
    if args.metrics:
        _check_writable_file("--metrics", args.metrics)
    if args.save:
        if os.path.exists(args.save) and not os.path.isdir(args.save):
            raise _config_error("--save", f"{args.save!r} exists and is not a directory", "give a directory")
        existing = os.path.abspath(args.save)
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        if not os.access(existing, os.W_OK | os.X_OK):
            raise _config_error("--save", f"{existing!r} is not writable", "give a directory this user can write")
    if args.resume:
        read_checkpoint_layout(args.resume)  # raises when there is no readable checkpoint
    return seq_len


# ---------------------------------------------------------------------------------------------
# the checkpoint's layout: a resume must run the same layout (same data order, same partitions)
# ---------------------------------------------------------------------------------------------

LAYOUT_FILE = "ds_longctx_layout.json"
# what must match for a resume to continue the same run (data position is where to continue)
LAYOUT_KEYS = ("world_size", "sequence_parallel_size", "data_parallel_size", "seq_len", "micro_batch",
               "gradient_accumulation_steps", "seed", "data", "concat_documents", "batches_per_epoch")
LAYOUT_DEFAULTS = {"concat_documents": False}
LAYOUT_FLAGS = {"world_size": "the number of processes", "sequence_parallel_size": "sequence_parallel_size",
                "data_parallel_size": "world / sequence_parallel_size", "seq_len": "--seq-len",
                "micro_batch": "train_micro_batch_size_per_gpu", "gradient_accumulation_steps":
                "gradient_accumulation_steps", "seed": "--seed", "data": "--data",
                "concat_documents": "--concat-documents (given or not)",
                "batches_per_epoch": "--data (the dataset's size)"}


def read_checkpoint_layout(path):
    """The layout record of the checkpoint DeepSpeed would load from ``path`` (its ``latest`` tag)."""
    latest = os.path.join(path, "latest")
    if not os.path.isfile(latest):
        raise _config_error("--resume", f"{path!r} holds no checkpoint (no 'latest' file)",
                            "give the directory passed to --save")
    with open(latest) as f:
        tag = f.read().strip()
    rec = os.path.join(path, tag, LAYOUT_FILE)
    if not os.path.isfile(rec):
        raise _config_error("--resume", f"checkpoint {os.path.join(path, tag)!r} has no {LAYOUT_FILE} (not saved "
                            "by this train.py)", "resume a checkpoint saved by train.py --save")
    with open(rec) as f:
        return json.load(f)


def check_resume_layout(saved, current, path):
    # a key missing from an older record means its default (concat_documents: False)
    saved = {k: saved.get(k, LAYOUT_DEFAULTS.get(k)) for k in LAYOUT_KEYS}
    diffs = [k for k in LAYOUT_KEYS if k in current and saved[k] != current[k]]
    if diffs:
        what = ", ".join(f"{k} {saved[k]!r} in the checkpoint vs {current[k]!r} now" for k in diffs)
        fix = ", ".join(f"{LAYOUT_FLAGS[k]} = {saved[k]!r}" for k in diffs)
        raise _config_error("--resume", f"{path} was saved with a different layout: {what} (a resumed run must "
                            "see the same samples in the same order and the same ZeRO partitions)",
                            f"resume with {fix}, or start a new run without --resume")


def micro_batches(loader, start):
    """Micro batches from position ``start`` (micro batches this rank consumed before), epoch after
    epoch (``loader.set_epoch``). Nothing is kept: ``itertools.cycle`` held every batch it yielded."""
    n = len(loader)
    epoch, skip = divmod(start, n)
    while True:
        loader.set_epoch(epoch)
        yield from itertools.islice(iter(loader), skip, None)
        skip, epoch = 0, epoch + 1


def host_rss_bytes():
    """Current (not peak) resident set size of this process."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


def load_model_config(path):
    from transformers import CONFIG_MAPPING

    with open(_model_config_path(path)) as f:
        d = json.load(f)
    attn = d.pop("attn_implementation", "sdpa")
    cfg = CONFIG_MAPPING[d.pop("model_type")](**d)
    cfg._attn_implementation = attn
    return cfg


def build_model(args, ds_config):
    import ds_longctx
    from ds_longctx.weights import deterministic_init
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

    from ds_longctx.models import text_config

    name = args.tokenizer or args.model
    # the tokenizer is checked against the embedding before the engine starts (an id past it is an
    # IndexError deep in the forward); the error names the largest id it produced from the file
    return TokenFileDataset(args.data, AutoTokenizer.from_pretrained(name), seq_len,
                            documents=not args.concat_documents, vocab_size=text_config(model_config).vocab_size,
                            tokenizer_name=name)


@torch.no_grad()
def copy_accuracy(engine, dataset, n, sp_rank, sp_size, group, start_index):
    """Argmax accuracy on scored tokens of held-out samples (the SP group evaluates together)."""
    from ds_longctx.data import shard_batch
    from ds_longctx.loss import IGNORE_INDEX

    engine.eval()
    correct = total = 0
    for i in range(n):
        item = dataset[start_index + i]
        batch = shard_batch({k: v.unsqueeze(0) for k, v in item.items()}, sp_rank, sp_size)
        logits = engine(input_ids=batch["input_ids"].to(engine.device),
                        position_ids=batch["position_ids"].to(engine.device), use_cache=False).logits
        target = batch["shift_labels"].to(logits.device)
        valid = target != IGNORE_INDEX
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
    from ds_longctx.measure.profiler import StepProfiler

    ds_config = load_ds_config(args.deepspeed_config)
    lc = parse(ds_config)
    seq_len = validate_args(args, lc)  # every rank, before the first collective
    if not args.model:  # a config far beyond the model (the tiny preset given an 8B config): say so now
        from ds_longctx.compat import check_model_scale

        check_model_scale(lc, load_model_config(args.model_config or DEFAULT_MODEL_CONFIG), seq_len,
                          f"--model-config {args.model_config}" if args.model_config else None)
    from ds_longctx.initialize import init_distributed
    from ds_longctx.launch import check_launch

    init_distributed(ds_config)  # (model_init would start it next) every rank passes the rendezvous, then
    check_launch(lc.sequence_parallel_size)  # world vs SP, on every rank together, before the model is built
    model = build_model(args, ds_config)
    dataset = build_dataset(args, model.config, seq_len)
    engine, _, loader, _ = ds_longctx.initialize(args=args, model=model, config=ds_config, training_data=dataset,
                                                 model_parameters=[p for p in model.parameters()
                                                                   if p.requires_grad])
    layout = engine.long_context_layout
    rank, world, sp, dp = layout.rank, layout.world, layout.sp, layout.dp
    group = comm.sp_group() if sp > 1 else None
    micro = engine.train_micro_batch_size_per_gpu()
    gas = engine.gradient_accumulation_steps()
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    # time, tokens/s, TFLOPs (the one formula) and peak memory of every step; with long_context.profile
    # enabled also a torch.profiler trace (+ CUDA memory snapshot) of the chosen steps, into its output_dir
    profiler = StepProfiler(lc.profile, model.config, world_size=world, sp_size=sp, rank=rank, model=engine.module,
                            seq_len=seq_len)

    if len(loader) == 0:
        raise _config_error("--data", f"{len(dataset)} samples give no micro batch of {micro} per data-parallel "
                            f"replica (dp={dp})", "use more data or a smaller train_micro_batch_size_per_gpu")
    run_layout = {"world_size": world, "sequence_parallel_size": sp, "data_parallel_size": dp,
                  "seq_len": seq_len, "micro_batch": micro, "gradient_accumulation_steps": gas, "seed": args.seed,
                  "data": args.data, "concat_documents": args.concat_documents, "batches_per_epoch": len(loader)}
    start = 0
    if args.resume:
        saved = read_checkpoint_layout(args.resume)
        check_resume_layout(saved, run_layout, args.resume)  # before load_checkpoint: same verdict on every rank
        _, client = engine.load_checkpoint(args.resume)
        if client is None:
            raise _config_error("--resume", f"DeepSpeed found no checkpoint in {args.resume!r}",
                                "give the directory passed to --save")
        start = int(client["step"])
        if start >= args.steps:
            raise _config_error("--steps", f"{args.steps} is not past the checkpoint's step {start}",
                                f"give --steps > {start}")
    batches = micro_batches(loader, start * gas)

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
        profiler.start_step(step)
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
        prof = profiler.end_step(step, tokens=seq_len * micro * gas)  # this rank's SP group's tokens
        dt = prof["step_time_s"]
        tokens = seq_len * micro * gas * dp
        rec = {"step": step, "loss": loss_value, "tokens": tokens, "tokens_per_s": tokens / dt,
               "tflops": prof["tflops_per_gpu"], "peak_mem_bytes": prof["peak_memory_bytes"],
               "host_rss_bytes": host_rss_bytes(), "lr": engine.get_lr()[0] if engine.get_lr() else None,
               "step_time_s": dt}
        if "peak_reserved_bytes" in prof:
            rec["peak_reserved_bytes"] = prof["peak_reserved_bytes"]
        if "artifacts" in prof:
            rec["profile_artifacts"] = prof["artifacts"]
        if metrics:
            metrics.write(json.dumps(rec) + "\n")
            metrics.flush()
        if bar:
            bar.set_postfix(loss=f"{loss_value:.4f}", tok_s=f"{rec['tokens_per_s']:.0f}",
                            tflops=f"{rec['tflops']:.3f}", peak=f"{rec['peak_mem_bytes'] / 2**20:.0f}MiB")
            bar.update(1)
    if bar:
        bar.close()
    if lc.profile.enabled:
        path = profiler.write_summary()
        if rank == 0:
            print(f"[ds_longctx] profile: per-step records in {path}, traces of steps "
                  f"{sorted(lc.profile.steps)} in {lc.profile.output_dir}", flush=True)
    if args.save:
        tag = f"step{args.steps}"
        record = dict(run_layout, step=args.steps, micro_batches_consumed=args.steps * gas)
        engine.save_checkpoint(args.save, tag=tag, client_state={"step": args.steps, "ds_longctx_layout": record})
        if rank == 0:  # read back before load_checkpoint on resume (client_state only comes with the load)
            with open(os.path.join(args.save, tag, LAYOUT_FILE), "w") as f:
                json.dump(record, f, indent=1)
        dist.barrier()
    if args.data in ("copy",) and args.eval_samples:
        acc = copy_accuracy(engine, dataset, args.eval_samples, comm.sp_rank(group), sp, group,
                            start_index=len(dataset) - args.eval_samples)
        if rank == 0:
            chance = 1.0 / (model.config.vocab_size - 2)
            print(f"[ds_longctx] final loss {loss_value:.4f} (no-attention floor ln(V-2) = "
                  f"{dataset.chance_loss:.4f}); copy accuracy {acc:.3f} (chance {chance:.3f})", flush=True)
    if metrics:
        metrics.close()
    return loss_value


if __name__ == "__main__":
    # an error on any rank ends the whole job; every rank ends without interpreter finalization
    # (the exit-time gloo abort): see ds_longctx/runtime.py
    from ds_longctx.runtime import run

    run(main)
