"""ds_longctx's main job: train a causal LM on long sequences with DeepSpeed.

    deepspeed --num_gpus 2 train.py --deepspeed_config ds_configs/tiny-cpu.json          # CPU demo
    deepspeed --num_gpus 2 --module ds_longctx.train --deepspeed_config tiny-cpu.json      # from the wheel
    deepspeed train.py --deepspeed_config ds_configs/llama3-8b-5m.json --model meta-llama/Llama-3.1-8B \\
        --save ckpt/ --save-every 50 --save-interval 2h --resume auto --save-hf final/

The embedded default (no download) is a small Llama preset on the long-range copy task: a random block then its
copy, so the loss can only fall below ln(vocab-2) if attention reaches across sequence shards. The same --seed
gives the same weights and data for every SP degree, ZeRO stage and process count.

A run of days: --save checks its directory (writable, free space for one checkpoint, not in use by another run)
before step 1, saves every --save-every steps and every --save-interval of wall clock, keeps the last
--keep-last, and on SIGTERM or SIGUSR1 (SLURM's --signal=USR1@T, preemption) finishes the step, saves and exits
0. --resume continues at the next unseen sample with the optimizer and schedule carried, on any world size, SP
or DP degree (DeepSpeed's universal checkpoint). --save-hf writes a model from_pretrained loads.

Context extension: --rope-theta / --rope-scaling set the model's RoPE; --resume DIR --new-stage continues a run at
another --seq-len (a stage: weights and optimizer state carried, the learning-rate schedule restarted for the
stage, the data position per --stage-data, the memory stack re-planned, the planner's predicted peak stated before
step 1); --stages 64K:N1,256K:N2,... runs such stages one after another in one job; --eval-needle LENGTHS scores
passkey retrieval under SP at the eval points (ds-longctx needle's evaluation).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import logging
import math
import os
import sys
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from .job import checkpoint as ckpt
from .dist import comm
from .eval import needle
from .job import watchdog
from .job.agreement import check_agreement
from .attention import registry
from .job.checkpoint import find_resume_tag
from .patching.compat import active_stack_line, check_model_scale
from .config import auto_keys, check_shards, check_train_batch_size, load_ds_config, parse, resolved_ds_config
from .data.corpus import check_data_path, open_corpus, tokenizer_content_sha256
from .data.corpus import data_identity as corpus_identity
from .data import TASKS, SampleStream, shard_batch
from .errors import ConfigError
from .eval.evaluate import eval_loader, evaluate
from .initialize import init_distributed, initialize, model_init, predicted_step
from .dist.launch import check_launch
from .dist.layout import zero_stage
from .loss import IGNORE_INDEX
from .measure.profiler import StepProfiler, format_flops
from .job.metrics import StepLog, peak_tflops, step_record
from .models import text_config
from .models.loading import load_model_config  # --model-config's HF config (a file or a directory)
from .config.rope_scaling import apply_rope
from .config.shipped import default_model_config, resolve_config_path, shipped_configs_dir  # noqa: F401 (also train.X)
from .planner import planned_work
from .planner.units import fmt_bytes
from .job.preflight import reserve_offload_storage
from .dist.runtime import graceful_stop, stop_requested, stop_saved
from .models.weights import deterministic_init


def _logger():
    """The job's lines on stdout under the ``ds_longctx`` logger (quiet them all with
    ``logging.getLogger("ds_longctx").setLevel(logging.WARNING)``)."""
    log = logging.getLogger("ds_longctx.train")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("[ds_longctx] %(message)s"))
        log.addHandler(handler)
        log.propagate = False
        if logging.getLogger("ds_longctx").level == logging.NOTSET:
            logging.getLogger("ds_longctx").setLevel(logging.INFO)
    return log


def info(text: str) -> None:
    _logger().info(text)


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------


def _duration_s(text: str) -> float:
    """'900', '900s', '30m', '2h', '1.5h' -> seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    t = text.strip().lower()
    try:
        value = float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (e.g. 900, 30m, 2h)") from None
    return value


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config", required=True,
                   help="the ds_config.json: DeepSpeed's keys plus the long_context section (a path, or the name of "
                   "a shipped config such as tiny-cpu.json)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1, help="set by the deepspeed launcher")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="HF model id or local path (pretrained weights)")
    src.add_argument("--model-config", help="local HF config.json: random init (default: the tiny preset)")
    p.add_argument("--tokenizer", help="tokenizer for --data files (default: --model)")
    p.add_argument("--seq-len", type=int, default=None, help="global tokens per sample (default: "
                   "long_context.sequence_length or 512)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps to train, in all (default: 200; a resumed "
                   "run trains the steps past its checkpoint)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random init and the copy task's data: the same "
                   "seed gives the same weights and samples for every SP degree, ZeRO stage and process count")
    p.add_argument("--data", default="copy", help="built-in task name ('copy'), or a .txt/.jsonl/.parquet/.arrow file "
                   "or a datasets save_to_disk directory: tokenized once into a token cache beside it (corpus.py)")
    p.add_argument("--data-column", default="text", help="the text column of --data/--eval-data (.jsonl key or "
                   "table column; default: text)")
    p.add_argument("--concat-documents", action="store_true", help="--data FILE: plain concatenation, attention "
                   "across documents (default: packed, position_ids restart per document, document-masked attention)")
    p.add_argument("--eval-data", help="held-out data (same kinds as --data): its loss and perplexity under SP, equal "
                   "to one process's, at the end and every --eval-every steps")
    p.add_argument("--eval-every", type=int, default=0, help="evaluate --eval-data / --eval-needle every this many "
                   "steps (0: at the end only)")
    p.add_argument("--eval-needle", metavar="LENGTHS", help="at the eval points, the needle-in-a-haystack test "
                   "(ds-longctx needle's sharded evaluation, under this run's SP and memory stack) at these document "
                   "lengths (e.g. 1K,4K; each at most --seq-len and divisible by the SP degree): the table in the log, "
                   "the cells in --metrics ('needle')")
    p.add_argument("--needle-depths", default="0,0.25,0.5,0.75,1", help="--eval-needle's depths of the fact (fractions "
                   "of the document; default 0,0.25,0.5,0.75,1)")
    p.add_argument("--needle-samples", type=int, default=1, help="--eval-needle's documents per length and depth "
                   "(default 1)")
    p.add_argument("--metrics", help="write one JSON object per step to this file (rank 0; appended on a resume)")
    p.add_argument("--log-every", type=int, default=10, help="without a terminal (SLURM, nohup): one plain line every "
                   "this many steps (0: none; default 10)")
    ck = p.add_argument_group("checkpoints")
    ck.add_argument("--save", help="checkpoint directory: checked before step 1, written at the end and as below")
    ck.add_argument("--save-every", type=int, default=0, help="also save every this many steps (0: only at the end)")
    ck.add_argument("--save-interval", type=_duration_s, default=0.0, help="also save when this much wall clock "
                    "passed since the last save (e.g. 30m, 2h; 0: off)")
    ck.add_argument("--keep-last", type=int, default=0, help="keep only the newest this many checkpoints (0: all)")
    ck.add_argument("--resume", help="a checkpoint directory to continue from, or 'auto': --save's when it holds "
                    "one (a requeued job's same command line), else start at step 1")
    ck.add_argument("--new-stage", action="store_true", help="with --resume: continue the run as a new stage at "
                    "another --seq-len (and/or --rope-theta/--rope-scaling; context extension): the weights and the "
                    "optimizer state carried (DeepSpeed's checkpoint load), the learning-rate schedule restarted for "
                    "this stage's steps (--steps minus the checkpoint's step; a scheduler's total_num_steps 'auto' is "
                    "that count), the memory stack re-planned for the new length, the data position per "
                    "--stage-data; the stage (index, length, RoPE) is recorded in its checkpoints")
    ck.add_argument("--stage-data", choices=("restart", "keep"), default=None, help="--new-stage's data position: "
                    "'restart' (default: the stage's data from its first sample; --data may change) or 'keep' (the "
                    "same token position: sample ceil(samples consumed x old length / new length) of the same data)")
    ck.add_argument("--stages", metavar="LEN:STEPS,...", help="a context-extension schedule in one run, e.g. "
                    "64K:1000,256K:500,1M:200: 1000 steps at 64K tokens, then 500 at 256K, then 200 at 1M (K=1024); "
                    "each stage saved to --save at its end and continued exactly as --resume DIR --new-stage would "
                    "(weights and optimizer state carried, the learning-rate schedule restarted, the memory stack "
                    "re-planned, the data per --stage-data); the engine is rebuilt in the same processes. With "
                    "--resume auto a requeued job continues in the stage its checkpoint is in. Replaces --seq-len, "
                    "--steps and --new-stage; the RoPE (--rope-theta/--rope-scaling) is the same in every stage (to "
                    "change it with the length, run the stages as separate --new-stage commands)")
    ck.add_argument("--save-hf", help="at the end, write the model as a Hugging Face directory (safetensors, config, "
                    "generation config, and the run's tokenizer where it has one: --tokenizer or --model's; the "
                    "built-in copy task has none)")
    p.add_argument("--eval-samples", type=int, default=8, help="held-out samples for the task accuracy")
    p.add_argument("--allow-beyond-max-position", action="store_true", help="train with --seq-len above the "
                   "model's max_position_embeddings on purpose (context extension); refused otherwise")
    p.add_argument("--rope-theta", type=float, default=None, help="the model's RoPE base (context extension: e.g. "
                   "500000 -> 8000000); recorded in the checkpoints and --save-hf's config")
    p.add_argument("--rope-scaling", default=None, help="RoPE scaling TYPE:FACTOR[,key=value...] (linear, dynamic, "
                   "yarn, longrope, llama3, proportional; e.g. yarn:4 or "
                   "llama3:8,low_freq_factor=1,high_freq_factor=4); raises max_position_embeddings by the factor")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (rank 0 still logs the layout, a "
                   "plain line every --log-every steps without a terminal, and the final loss)")
    args = p.parse_args(argv)
    args.deepspeed_config = resolve_config_path(args.deepspeed_config)
    if args.steps is None and not args.stages:  # with --stages the schedule gives the steps (stage_runs)
        args.steps = 200
    return args


def _check_writable_file(flag, path):
    """``path`` can be created or overwritten by this process."""
    if os.path.isdir(path):
        raise ConfigError(flag, f"{path!r} is a directory", "give a file path")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        existing = parent
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing):  # a regular file on the way: mkdir -p would fail too
            raise ConfigError(flag, f"{existing!r} is a file, not a directory, so {path!r} cannot be created under "
                              "it", "give a path whose directories are directories")
        raise ConfigError(flag, f"directory {parent!r} does not exist", f"create it (mkdir -p {parent})")
    if not os.access(parent, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ConfigError(flag, f"{path!r} is not writable", "give a path this user can write")


def _check_writable_dir(key, path):
    """``path`` exists as a writable directory or can be created (checked at start, not after the last step)."""
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(key, f"{path!r} exists and is not a directory", "give a directory")
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(key, f"{existing!r} is not a directory", "give a directory path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(key, f"{existing!r} is not writable by this user", "give a directory this user can write")


def _model_config_path(path):
    return os.path.join(path, "config.json") if os.path.isdir(path) else path


def validate_args(args, lc):
    """Every CLI value, checked on every rank before any collective (a rank that raised alone would leave the
    others waiting). Returns the sequence length."""
    sp = lc.sequence_parallel_size
    for flag, value, least, fix in (("--steps", args.steps, 1, "give the number of optimizer steps"),
                                    ("--seed", args.seed, 0, "give a non-negative seed"),
                                    ("--eval-samples", args.eval_samples, 0, "use 0 to skip the eval"),
                                    ("--log-every", args.log_every, 0, "use 0 for no plain lines"),
                                    ("--save-every", args.save_every, 0, "use 0 to save only at the end"),
                                    ("--save-interval", args.save_interval, 0, "use 0 for no wall-clock saves"),
                                    ("--keep-last", args.keep_last, 0, "use 0 to keep every checkpoint"),
                                    ("--eval-every", args.eval_every, 0, "use 0 to evaluate at the end only"),
                                    ("--needle-samples", args.needle_samples, 1, "give documents per cell")):
        if value < least:
            raise ConfigError(flag, f"must be >= {least}, got {value}", fix)
    if not args.save:
        for flag, value in (("--save-every", args.save_every), ("--save-interval", args.save_interval),
                            ("--keep-last", args.keep_last)):
            if value:
                raise ConfigError(flag, "needs --save (where to write the checkpoints)", f"add --save DIR or drop "
                                    f"{flag}")
        if args.resume == "auto":
            raise ConfigError("--resume", "'auto' resumes from --save's directory, and there is no --save",
                                "add --save DIR (the same on every start of the job)")
    seq_len = args.seq_len if args.seq_len is not None else (lc.sequence_length or 512)
    flag = "--seq-len" if args.seq_len is not None else "long_context.sequence_length"
    if seq_len < 1:
        raise ConfigError(flag, f"must be >= 1, got {seq_len}", "give the global tokens per sample")
    if seq_len % sp:
        raise ConfigError(flag, f"{seq_len} is not divisible by sequence_parallel_size={sp}",
                            f"use a multiple of {sp}, e.g. {(seq_len // sp + 1) * sp}")
    if args.data in TASKS:
        if args.data == "copy" and (seq_len < 4 or seq_len % 2):
            raise ConfigError(flag, f"the copy task needs an even length >= 4, got {seq_len}",
                                "use an even sequence length")
    elif not os.path.exists(args.data):
        raise ConfigError("--data", f"{args.data!r} is neither a task ({sorted(TASKS)}) nor an existing path",
                            "give a task name, a .txt/.jsonl/.parquet/.arrow file or a datasets save_to_disk "
                            "directory")
    for f, path in (("--data", None if args.data in TASKS else args.data), ("--eval-data", args.eval_data)):
        if path is not None:
            check_data_path(f, path, args.data_column)
            if not (args.tokenizer or args.model):
                raise ConfigError(f, "a file needs a tokenizer", "pass --tokenizer (or --model)")
    if args.eval_every and not (args.eval_data or args.eval_needle):
        raise ConfigError("--eval-every", "needs --eval-data or --eval-needle (what to evaluate)", "add --eval-data "
                          "PATH or --eval-needle LENGTHS, or drop --eval-every")
    if args.eval_needle:
        for n in needle.parse_lengths(args.eval_needle, "--eval-needle"):
            if n > seq_len or n % sp:
                raise ConfigError("--eval-needle", f"length {n} is " + (f"above --seq-len {seq_len} (the memory "
                                  "stack is planned for the trained length)" if n > seq_len else
                                  f"not divisible by sequence_parallel_size={sp}"),
                                  f"give lengths <= {seq_len} that are multiples of {sp}; evaluate longer documents "
                                  "with ds-longctx needle")
        needle.parse_depths(args.needle_depths, "--needle-depths")
    if args.model_config is not None and not os.path.isfile(_model_config_path(args.model_config)):
        raise ConfigError("--model-config", f"{_model_config_path(args.model_config)!r} does not exist",
                            "give the path of a HF config.json (or a directory holding one)")
    for flag, value in (("--model", args.model), ("--tokenizer", args.tokenizer)):
        _check_local_or_hub(flag, value)
    if lc.profile.enabled:
        _check_writable_dir("long_context.profile.output_dir", lc.profile.output_dir)
    if args.metrics:
        _check_writable_file("--metrics", args.metrics)
    if args.save:
        _check_writable_dir("--save", args.save)
    if args.save_hf:
        _check_writable_dir("--save-hf", args.save_hf)
        if os.path.isdir(args.save_hf) and os.listdir(args.save_hf):
            raise ConfigError("--save-hf", f"{args.save_hf!r} is not empty", "give a new or empty directory (an "
                                "export never mixes its files with another model's)")
    if args.resume and args.resume != "auto":
        find_resume_tag(args.resume)  # raises when there is no usable checkpoint
    if args.new_stage and not args.resume:
        raise ConfigError("--new-stage", "needs --resume (the checkpoint the new stage continues)",
                          "add --resume DIR (the previous stage's --save), or drop --new-stage")
    if args.stage_data and not args.new_stage:
        raise ConfigError("--stage-data", "applies to a new stage only", "add --new-stage or drop --stage-data")
    check_shards(lc, seq_len)  # against the length trained (--seq-len), not only the config's sequence_length
    return seq_len


def parse_stages(text: str) -> list:
    """--stages' value: 'LEN:STEPS,...' (LEN with K/M = 1024 / 1048576, as --eval-needle's lengths) -> [(length,
    steps of that stage), ...]. Each stage changes the length (two stages at one length and RoPE would be one stage:
    a requeued job could not tell them apart)."""
    out = []
    for part in str(text).split(","):
        length, sep, steps = part.strip().partition(":")
        if not sep:
            raise ConfigError("--stages", f"{part.strip()!r} is not LEN:STEPS", "give stages like 64K:1000,256K:500")
        try:
            n = int(steps)
        except ValueError:
            raise ConfigError("--stages", f"{part.strip()!r}: {steps!r} is not a number of steps",
                              "give stages like 64K:1000,256K:500 (the steps of each stage)") from None
        if n < 1:
            raise ConfigError("--stages", f"{part.strip()!r}: a stage needs at least one step",
                              "give each stage's steps as a positive integer")
        out.append((needle.parse_lengths(length, "--stages")[0] if length.strip() else 0, n))
        if out[-1][0] < 1:
            raise ConfigError("--stages", f"{part.strip()!r} has no length", "give stages like 64K:1000,256K:500")
    if len(out) < 2:
        raise ConfigError("--stages", f"{text!r} is one stage", "give two stages or more (or train one length with "
                          "--seq-len and --steps)")
    for (a, _), (b, _) in zip(out, out[1:]):
        if a == b:
            raise ConfigError("--stages", f"two stages in a row at length {a}", "merge them into one stage (their "
                              "steps added): each stage changes the length")
    return out


def stage_runs(args, lc) -> list:
    """--stages' runs: one argument namespace per stage, each checked as its own command line would be
    (validate_args at its length) before anything is launched. Stage 1 is the plain run (--resume auto as given);
    stage k > 1 is --resume SAVE --new-stage at its length with --steps the steps up to its end, --save-hf on the
    last stage only. Refuses the flags the schedule replaces and a --resume other than 'auto', naming them."""
    schedule = parse_stages(args.stages)
    for flag, value in (("--seq-len", args.seq_len), ("--steps", args.steps), ("--new-stage", args.new_stage)):
        if value:
            raise ConfigError(flag, "is given by --stages (each stage's length and steps; every stage after the first "
                              "is a new stage)", f"drop {flag}")
    if not args.save:
        raise ConfigError("--stages", "needs --save (each stage is saved there at its end and the next one continues "
                          "from it)", "add --save DIR")
    if args.resume not in (None, "auto"):
        raise ConfigError("--resume", f"{args.resume!r} with --stages: the schedule resumes from --save only",
                          "use --resume auto (a requeued job continues in the stage its checkpoint is in), or "
                          "continue a finished schedule with --resume DIR --new-stage")
    runs, end = [], 0
    for k, (length, steps) in enumerate(schedule):
        end += steps
        a = argparse.Namespace(**vars(args))
        a.seq_len, a.steps, a.stage_of_schedule = length, end, (k + 1, len(schedule))
        a.save_hf = args.save_hf if k == len(schedule) - 1 else None
        if k == 0:
            a.new_stage, a.stage_data = False, None
        else:
            a.resume, a.new_stage = args.save, True
        check = argparse.Namespace(**vars(a))
        check.resume, check.new_stage, check.stage_data = None, False, None  # the checkpoint is written by then
        try:
            validate_args(check, lc)
        except ConfigError as e:  # say which stage of the schedule
            raise ConfigError("--stages" if e.key == "--seq-len" else e.key,
                              f"in stage {k + 1} of --stages ({length} tokens): {e.problem}", e.fix) from None
        runs.append(a)
    return runs


def _check_local_or_hub(flag, value):
    """A value that can only be a local path (absolute, ./ ../ ~, or more than one '/': a hub id is 'org/name')
    must exist; otherwise transformers reports 'Repo id must be in the form ...'."""
    if not value or os.path.exists(os.path.expanduser(value)):
        return
    if os.path.isabs(value) or value.startswith((".", "~")) or value.count("/") > 1:
        raise ConfigError(flag, f"local path {value!r} does not exist", "give an existing model directory, or a "
                            "hub id of the form 'org/name'")


def hub_load(flag, name, load):
    """``load()`` (a transformers ``from_pretrained``) with its OSError (offline, hub unreachable, gated or private
    repo, no such id) turned into one ConfigError naming the id and the ways to run without the hub."""
    try:
        return load()
    except OSError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
        if flag == "--tokenizer":
            local = "--tokenizer <local tokenizer directory> (or a --model directory that holds one)"
        else:
            # the shipped preset where this install has it (a wheel's lies inside the package, not at ds_configs/)
            example = os.path.join(shipped_configs_dir() or "ds_configs", "models", "llama3-8b.json")
            local = (f"--model-config path/to/config.json (random init, e.g. {example}) or "
                     "--model <local model directory>")
        raise ConfigError(flag, f"{name!r} is not a local directory and could not be loaded from the Hugging Face "
                            f"hub: the hub is unreachable{' (HF_HUB_OFFLINE is set)' if offline else ''}, the repo "
                            f"is gated or private, or the id does not exist (transformers: {first[:300]})",
                            f"pass {local}; or point HF_HOME at a cache that holds it; for a gated repo accept its "
                            "license on huggingface.co and log in (`huggingface-cli login`, or set HF_TOKEN)"
                            ) from None


def check_max_position(args, model_config, seq_len):
    """--seq-len above the model's max_position_embeddings is refused unless asked for: RoPE models run but see
    positions they were never trained on (RoPE-scaled configs already state their scaled length)."""
    mpe = getattr(text_config(model_config), "max_position_embeddings", None)
    if isinstance(mpe, int) and seq_len > mpe and not args.allow_beyond_max_position:
        flag = "--seq-len" if args.seq_len is not None else "long_context.sequence_length"
        raise ConfigError(flag, f"{seq_len} is above the model's max_position_embeddings {mpe}",
                            f"use at most {mpe}, set rope_scaling/max_position_embeddings in the model config, or pass "
                            "--allow-beyond-max-position to train past it on purpose (context extension)")


# ---------------------------------------------------------------------------------------------
# model, data
# ---------------------------------------------------------------------------------------------


def build_model(args, ds_config, model_config):
    """The model of ``model_config`` (prepare's: --rope-theta / --rope-scaling applied): --model's weights, else
    a deterministic random init."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    with model_init(ds_config):
        if args.model:
            return hub_load("--model", args.model, lambda: AutoModelForCausalLM.from_pretrained(
                args.model, config=model_config, attn_implementation="sdpa"))
        cfg = model_config
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=cfg._attn_implementation)
    deterministic_init(model, args.seed)  # same weights for every SP degree, ZeRO stage, process count
    return model


def load_tokenizer(args):
    """The tokenizer of --data files (and of --save-hf), or None for a built-in task without --tokenizer/--model."""
    name = args.tokenizer or args.model
    if not name:
        return None
    from transformers import AutoTokenizer

    return hub_load("--tokenizer" if args.tokenizer else "--model", name, lambda: AutoTokenizer.from_pretrained(name))


def build_dataset(args, model_config, seq_len, tokenizer, path=None, flag="--data"):
    """--data's samples (or ``path``'s: --eval-data): the built-in task, or the file's tokens from its cache
    (tokenized once, by one process per cache; corpus.open_corpus)."""
    path = path or args.data
    if path in TASKS:
        return TASKS[path](seq_len=seq_len, vocab_size=model_config.vocab_size, seed=args.seed)
    # the tokenizer is checked against the embedding before the engine starts (an id past it is an IndexError
    # deep in the forward); the error names the largest id it produced from the file
    return open_corpus(path, tokenizer, seq_len, documents=not args.concat_documents, column=args.data_column,
                       vocab_size=text_config(model_config).vocab_size, tokenizer_name=args.tokenizer or args.model,
                       flag=flag)


def data_identity(args, tokenizer=None):
    """What a resume must find unchanged about the data (the samples and their order follow from it): the task,
    or the file's content hash and size (corpus.data_identity: hashed once per file version), the column and the
    tokenizer's content (vocabulary, merges, special tokens: corpus.tokenizer_content_sha256), which decides the
    token ids trained on."""
    if args.data in TASKS:
        return {"task": args.data}
    ident = dict(corpus_identity(args.data), column=args.data_column)
    if tokenizer is not None:
        ident["tokenizer_sha256"] = tokenizer_content_sha256(tokenizer)
    return ident


@torch.no_grad()
def copy_accuracy(engine, dataset, n, sp_rank, sp_size, group, start_index):
    """Argmax accuracy on scored tokens of held-out samples (the SP group evaluates together)."""
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


# the flags every rank must hold alike (agreement.check_agreement names the one that differs): what is trained, on
# what data, and when the job saves, evaluates or exports (collectives at those steps)
AGREED_FLAGS = {"--steps": "steps", "--seed": "seed", "--model": "model", "--model-config": "model_config",
                "--tokenizer": "tokenizer", "--data-column": "data_column", "--concat-documents": "concat_documents",
                "--eval-every": "eval_every", "--eval-samples": "eval_samples", "--eval-needle": "eval_needle",
                "--needle-depths": "needle_depths", "--needle-samples": "needle_samples",
                "--save": "save", "--save-every": "save_every", "--save-interval": "save_interval",
                "--keep-last": "keep_last", "--resume": "resume", "--save-hf": "save_hf",
                "--rope-theta": "rope_theta", "--rope-scaling": "rope_scaling", "--new-stage": "new_stage",
                "--stage-data": "stage_data", "--stages": "stages"}


def _agree(flags):
    """Every rank's flags combined (MAX): one small all-reduce, so that every rank takes the same branch."""
    t = torch.tensor([int(bool(f)) for f in flags], dtype=torch.int32)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]


# ---------------------------------------------------------------------------------------------
# the job
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Job:
    """Everything the loop uses, prepared and checked by :func:`prepare`."""
    args: argparse.Namespace
    lc: Any                      # the parsed long_context section
    seq_len: int
    world: int
    sp: int
    dp: int
    micro: int
    gas: int
    record: dict                 # the run's record (checkpoint.run_record): what a resume compares
    model: Any
    tokenizer: Any
    dataset: Any
    eval_set: Any
    needle_cases: Any            # --eval-needle's documents (needle.build_cases), or None
    engine: Any
    batches: SampleStream        # the job's sample order from the next unseen sample
    saves: Optional[ckpt.SaveDir]
    profiler: StepProfiler
    steplog: StepLog
    start: int                   # the last step done (0, or the checkpoint's)
    peak: Optional[float]        # the device's datasheet TFLOP/s (MFU), or None

    @property
    def samples_consumed(self) -> int:
        return self.batches.position


def prepare(args) -> Job:
    """Every check that needs no other rank (on every rank), the process group, the save directory (locked before
    the model is built), what a resume loads (converted to DeepSpeed's universal checkpoint on another layout),
    the model, data and engine, then what could fail after hours (NVMe bytes, free space for a checkpoint)."""
    ds_config = load_ds_config(args.deepspeed_config)
    lc = parse(ds_config)
    seq_len = validate_args(args, lc)
    if not args.model:  # a config far beyond the model (the tiny preset given an 8B config): say so now
        model_config = apply_rope(load_model_config(args.model_config or default_model_config()), args.rope_theta,
                                  args.rope_scaling)
        check_model_scale(lc, model_config, seq_len,
                          f"--model-config {args.model_config}" if args.model_config else None)
    else:
        from transformers import AutoConfig

        model_config = apply_rope(hub_load("--model", args.model, lambda: AutoConfig.from_pretrained(args.model)),
                                  args.rope_theta, args.rope_scaling)
    check_max_position(args, model_config, seq_len)
    tokenizer = load_tokenizer(args)

    init_distributed(timeout=watchdog.pg_timeout(watchdog.configured_timeout(ds_config)[0]))
    # the first collective: every rank holds the same ds_config, the same values of every flag that shapes the
    # run (a --save or --save-every that differs would have ranks save at different steps: a hang) and the same
    # data (agreement.py); then the job's watchdog
    data = data_identity(args, tokenizer)  # hashed once: compared here, recorded in the checkpoints
    values = {"cli": {flag: getattr(args, dest) for flag, dest in AGREED_FLAGS.items()} | {"--seq-len": seq_len},
              "data": {k: v for k, v in data.items() if k != "tokenizer_sha256"}}
    if tokenizer is not None:  # by content: the same --tokenizer path may hold other files on another node
        values["tokenizer"] = data.get("tokenizer_sha256") or tokenizer_content_sha256(tokenizer)
    if args.eval_data:  # by content, as --data (two nodes may mount the same file at different paths)
        values["eval_data"] = corpus_identity(args.eval_data)
    check_agreement(ds_config, values=values)
    sp = lc.sequence_parallel_size
    world = check_launch(sp)  # world vs SP, on every rank together, before the model is built
    # before model_init: transformers' HfDeepSpeedConfig parses the ds_config there and DeepSpeed's own batch
    # assertion (every rank counted as data parallel, no key named) would come first
    check_train_batch_size(ds_config, world, sp)
    dp = world // sp
    micro, gas = ckpt.batch_sizes(ds_config, dp)
    record = ckpt.run_record(world_size=world, sp=sp, dp=dp, zero_stage=zero_stage(ds_config), micro_batch=micro,
                             gas=gas, seq_len=seq_len, seed=args.seed, data=data,
                             concat_documents=args.concat_documents, model_config=model_config, ds_config=ds_config)
    saves = ckpt.SaveDir.acquire(args.save, keep_last=args.keep_last or None, name="--save") if args.save else None
    resume_dir = args.resume
    if resume_dir == "auto":
        resume_dir = args.save if _has_checkpoint(args.save) else None
        if dist.get_rank() == 0:
            info(f"--resume auto: resuming from {args.save}" if resume_dir else
                 f"--resume auto: no checkpoint in {args.save}: starting at step 1")
    plan, new_stage = None, None
    stage, stages = {"index": 1, "seq_len": seq_len, "rope": ckpt.rope_facts(model_config), "start_step": 0,
                     "start_sample": 0, "data": "start"}, []
    if resume_dir:
        new_stage = _new_stage_mode(args, resume_dir, seq_len, stage["rope"])
        # the same files, the same verdict on every rank; rank 0 converts to a universal checkpoint when needed
        plan = ckpt.resume(resume_dir, record, name="--resume", log=info, new_stage=new_stage)
        if plan.step >= args.steps:
            raise ConfigError("--steps", f"{args.steps} is not past the checkpoint's step {plan.step}",
                                f"give --steps > {plan.step} (the steps in all: this stage trains the steps after "
                                "the checkpoint's)" if new_stage else f"give --steps > {plan.step}")
        ds_config = plan.ds_config(ds_config)
        if new_stage:
            old_len = int(plan.record.get("seq_len") or seq_len)
            start_sample = ckpt.stage_start_sample(new_stage, plan.samples_consumed, old_len, seq_len)
            stage, stages = ckpt.next_stage(plan.record, seq_len, stage["rope"], new_stage, start_sample)
        else:
            stage, stages = ckpt.stage_of(plan.record), list(plan.record.get("stages") or [])
    record.update(stage=stage, stages=stages)
    ds_config = _stage_schedule(ds_config, args.steps - int(stage["start_step"]))

    if seq_len != lc.sequence_length:  # the planner ("auto"), the host-memory check: the length trained
        ds_config = dict(ds_config, long_context=dict(ds_config.get("long_context") or {}, sequence_length=seq_len))
    prediction = None
    if new_stage and dist.get_rank() == 0 and not auto_keys(lc):  # ("auto": initialize's planner predicts it)
        stage_lc = parse(ds_config)
        prediction = predicted_step(resolved_ds_config(ds_config, stage_lc), model_config, world, seq_len)
    model = build_model(args, ds_config, model_config)
    dataset = build_dataset(args, model.config, seq_len, tokenizer)
    eval_set = build_dataset(args, model.config, seq_len, tokenizer, path=args.eval_data, flag="--eval-data") \
        if args.eval_data else None
    engine, _, _, _ = initialize(args=args, model=model, config=ds_config,
                                 model_parameters=[p for p in model.parameters() if p.requires_grad])
    layout = engine.long_context_layout
    start, consumed = 0, 0
    if plan is not None:
        plan.load(engine, log=info)
        start, consumed = plan.step, plan.samples_consumed
        if new_stage:
            consumed = stage["start_sample"]
    batches = SampleStream(dataset, micro, sp_rank=layout.sp_rank, sp_size=sp, dp_rank=layout.dp_rank, dp_size=dp,
                           start=consumed)

    reserve_offload_storage(engine, seq_len)  # offload="nvme": the drive holds this rank's layer inputs
    if saves:
        saves.check_space(engine, log=info)  # room for one checkpoint of every rank, from the model states
    # time, tokens/s, TFLOPs (the one formula) and peak memory of every step; with long_context.profile enabled
    # also a torch.profiler trace (+ CUDA memory snapshot) of the chosen steps, and on rank 0 the executed FLOPs
    # per category next to the planner's (the config as initialize resolved it)
    plan_work = functools.partial(planned_work, resolved_ds_config(ds_config, engine.long_context), model.config,
                                  world) if layout.rank == 0 and lc.profile.enabled else None
    profiler = StepProfiler(lc.profile, model.config, world_size=world, sp_size=sp, rank=layout.rank,
                            model=engine.module, seq_len=seq_len, plan_work=plan_work)
    steplog = StepLog(engine, args.steps, start_step=start, metrics_path=args.metrics, append=plan is not None,
                      log_every=args.log_every, progress=not args.no_progress, rank=layout.rank, print_line=info)
    if layout.rank == 0:
        n_params = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
        info(f"world={world} sp={sp} dp={dp} seq_len={seq_len} micro_batch={micro} gas={gas} "
             f"params={n_params / 1e6:.2f}M attention={lc.attention.implementation} "
             f"zero_stage={engine.zero_optimization_stage()}")
        if new_stage:
            # the planner's prediction of this stage's step, the new peak stated before step 1: the simulation
            # that resolved "auto" for the new length, else the same planner on the config as initialize resolves
            # it (started before the model was built), against the same budgets
            predicted = engine.long_context_plan or prediction()
            info(stage_line(stage, stages[-1], plan, args, ds_config, engine, predicted))
    needle_cases = None
    if args.eval_needle:
        needle_cases = needle.build_cases(_needle_tokenizer(tokenizer, model.config),
                                          needle.parse_lengths(args.eval_needle, "--eval-needle"),
                                          needle.parse_depths(args.needle_depths, "--needle-depths"), seed=args.seed,
                                          samples=args.needle_samples, sp=sp)
    return Job(args=args, lc=lc, seq_len=seq_len, world=world, sp=sp, dp=dp, micro=micro, gas=gas, record=record,
               model=model, tokenizer=tokenizer, dataset=dataset, eval_set=eval_set, needle_cases=needle_cases,
               engine=engine, batches=batches,
               saves=saves, profiler=profiler, steplog=steplog, start=start, peak=peak_tflops(record["dtype"]))


def _new_stage_mode(args, resume_dir, seq_len, rope):
    """--new-stage's data mode ("restart" / "keep"), or None for a plain resume: also when the checkpoint is
    already in the requested stage (a later stage at this length and RoPE: a requeued job's same command line with
    --resume auto continues its stage instead of starting another). Every rank, the same files."""
    if not args.new_stage:
        return None
    _, saved, _ = find_resume_tag(resume_dir)
    there = ckpt.stage_of(saved)
    if int(there.get("index", 1)) > 1 and there.get("seq_len") == seq_len and there.get("rope") == rope:
        if dist.get_rank() == 0:
            info(f"--new-stage: {resume_dir} is already in stage {there['index']} at seq_len {seq_len} with this RoPE "
                 f"(started at step {there.get('start_step')}): continuing that stage (a plain resume)")
        return None
    return args.stage_data or "restart"


def _stage_schedule(ds_config: dict, stage_steps: int) -> dict:
    """The learning-rate schedule is per stage: DeepSpeed's scheduler starts at its step 0 with the stage (a new
    stage does not load the checkpoint's scheduler state), and a ``total_num_steps`` of "auto" (WarmupDecayLR,
    WarmupCosineLR) is the stage's steps (``--steps`` minus the step the stage started after)."""
    sched = ds_config.get("scheduler")
    params = (sched or {}).get("params") if isinstance(sched, dict) else None
    if not isinstance(params, dict):
        return ds_config
    for key, value in params.items():
        if value == "auto" and key != "total_num_steps":
            raise ConfigError(f"scheduler.params.{key}", "'auto' is understood for total_num_steps only (the "
                              "stage's steps)", f"give {key} a value")
    if params.get("total_num_steps") != "auto":
        return ds_config
    return dict(ds_config, scheduler=dict(sched, params=dict(params, total_num_steps=stage_steps)))


def stage_line(stage, prev, plan, args, ds_config, engine, predicted) -> str:
    """Rank 0's statement of a new stage, before step 1: what is carried, where the data and the schedule start,
    the memory stack as initialize re-planned it for the new length and the planner's predicted peak of its step
    (``predicted``: initialize.predicted_step's PlanResult)."""
    rope = (stage.get("rope") or {}).get("parameters")
    old_rope = (prev.get("rope") or {}).get("parameters")
    sched = ds_config.get("scheduler") or {}
    steps = args.steps - stage["start_step"]
    data = (f"restart: from sample 0 of --data (--stage-data restart)" if stage["data"] == "restart" else
            f"keep: from sample {stage['start_sample']} at the new length, the token position "
            f"{plan.samples_consumed} samples x {prev.get('seq_len')} tokens reached (--stage-data keep)")
    how = (f"--stages, {args.stage_of_schedule[0]} of {args.stage_of_schedule[1]}"
           if getattr(args, "stage_of_schedule", None) else "--new-stage")
    return (f"stage {stage['index']} ({how}): seq_len {prev.get('seq_len')} -> {stage['seq_len']}; RoPE "
            f"{old_rope if old_rope == rope else f'{old_rope} -> {rope}'}; weights and optimizer state from "
            f"{os.path.join(plan.path, plan.tag)} (step {plan.step}, DeepSpeed's checkpoint load); data: {data}; "
            f"learning-rate schedule: "
            + (f"{sched.get('type')} restarted for this stage's {steps} steps (steps {stage['start_step'] + 1}.."
               f"{args.steps}, params {sched.get('params')})" if sched else
               f"no scheduler: the ds_config's optimizer lr for this stage's {steps} steps")
            + f"; memory stack re-planned for {stage['seq_len']} tokens: "
            f"{active_stack_line(engine.long_context_spec, engine.module)}; " + predicted_peak_text(predicted))


def predicted_peak_text(r) -> str:
    """The planner's peak of one rank's step (planner.PlanResult) in words: the figure, its parts (what the length
    changes: the activations at the backward's peak), the optimizer step's, the budget."""
    states = r.breakdown.get("model_states", 0)
    return (f"planner: predicted peak {fmt_bytes(r.peak_device_bytes)} per rank at {r.sequence_length} tokens "
            f"(backward: model states {fmt_bytes(states)} + activations {fmt_bytes(r.activation_peak_bytes - states)}"
            f"; optimizer step {fmt_bytes(r.step_peak_bytes)}) of {fmt_bytes(r.device_budget_bytes)} per device "
            f"({'fits' if r.fits else 'does NOT fit'}: {r.binding_detail})")


def train_step(job: Job) -> float:
    """One optimizer step: ``gas`` micro batches of this rank's shards; the loss averaged over them and over the
    data-parallel replicas (the SP ranks of a group already agree)."""
    engine, losses = job.engine, []
    for _ in range(job.gas):
        batch = {k: v.to(engine.device) for k, v in next(job.batches).items()}
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().float())
    loss_t = torch.stack(losses).mean()
    if job.dp > 1:
        dist.all_reduce(loss_t)
        loss_t /= job.world
    return loss_t.item()


def evaluate_now(job: Job, step: int) -> dict:
    """--eval-data's held-out loss and perplexity (every rank: a collective)."""
    stats = evaluate(job.engine, eval_loader(job.eval_set, job.engine))
    job.steplog.note(f"eval after step {step} ({job.args.eval_data}): loss {stats['loss']:.4f}, perplexity "
                     f"{stats['perplexity']:.4g} over {stats['tokens']} tokens")
    return {"eval_loss": stats["loss"], "eval_perplexity": stats["perplexity"], "eval_tokens": stats["tokens"]}


def _needle_tokenizer(tokenizer, model_config):
    if tokenizer is not None:
        return tokenizer
    return needle.ByteTokenizer(text_config(model_config).vocab_size)  # a built-in task has none: UTF-8 bytes


def needle_now(job: Job, step: int) -> dict:
    """--eval-needle's test on the engine (every rank: a collective; the same report everywhere): the table in the
    log, the cells (exact-match accuracy, mean answer log-likelihood per length and depth) for the metrics."""
    results = needle.score_cases(job.engine, job.needle_cases)
    report = needle.summarize(job.needle_cases, results)
    acc = sum(r["exact_match"] for r in results) / len(results)
    job.steplog.note(f"needle after step {step} (--eval-needle {job.args.eval_needle}): exact match {acc:.3f} over "
                     f"{len(results)} documents\n{needle.table(report)}")
    return {"needle": {"accuracy": acc, "cells": report["cells"]}}


def save(job: Job, step: int, why: str) -> None:
    t0 = time.monotonic()
    tag = job.saves.save(job.engine, step, dict(job.record, samples_consumed=job.samples_consumed),
                         client_state={"step": step}, hf_config=job.model.config, tokenizer=job.tokenizer)
    job.steplog.note(f"saved {tag} ({why}) to {job.saves.path} in {time.monotonic() - t0:.2f} s")


def train(job: Job):
    """The loop. Returns (the last step's loss, None) or, after a preemption signal, (its loss, (step, signal))."""
    args = job.args
    loss, last_finite, last_save = float("nan"), None, time.monotonic()
    with graceful_stop() if job.saves else contextlib.nullcontext():
        for step in range(job.start + 1, args.steps + 1):
            job.profiler.start_step(step)
            loss = train_step(job)
            prof = job.profiler.end_step(step, tokens=job.seq_len * job.micro * job.gas)  # this SP group's tokens
            rec = step_record(step, loss, prof, job.engine, tokens=job.seq_len * job.micro * job.gas * job.dp,
                              peak=job.peak)
            if step == args.steps or args.eval_every and step % args.eval_every == 0:
                if job.eval_set is not None:
                    rec.update(evaluate_now(job, step))
                if job.needle_cases:
                    rec.update(needle_now(job, step))
            job.steplog.step(rec)
            if "flops_by_category" in rec:
                info(f"step {step}: executed FLOPs per category, measured vs the planner's (this rank):\n"
                     + "\n".join(format_flops(rec["flops_by_category"])))
            if not math.isfinite(loss):  # the same value on every rank (all-reduced): every rank stops here
                last = f"step {last_finite[0]}: {last_finite[1]:.6g}" if last_finite else "none (the first step)"
                raise ConfigError(f"step {step}", f"the loss is {loss} (last finite loss: {last})",
                                    "lower the learning rate or check the data and the config (lr, loss scaling, "
                                    "bf16/fp16); --resume the last checkpoint to continue")
            last_finite = (step, loss)
            if job.saves:
                due = args.save_interval and time.monotonic() - last_save >= args.save_interval
                # every rank takes the same branch (the metrics file is rank 0's)
                stopping, due, metrics_failed = _agree([stop_requested(), due, job.steplog.failed])
                if stopping or metrics_failed or step == args.steps or due or \
                        (args.save_every and step % args.save_every == 0):
                    save(job, step, "preemption signal" if stopping else "the metrics file failed" if metrics_failed
                         else "last step" if step == args.steps else "--save-interval" if due else "--save-every")
                    last_save = time.monotonic()
                if metrics_failed:
                    raise _metrics_error(job, f"step {step} is saved to {job.saves.path}")
                if stopping:
                    stop_saved(f"step {step}")
                    return loss, (step, stop_requested() or "a signal on another rank")
            elif job.steplog.failed:  # rank 0 alone: nothing to save, the job ends here
                raise _metrics_error(job, "no --save: nothing was saved")
    return loss, None


def _metrics_error(job: Job, saved: str) -> ConfigError:
    what = job.steplog.failed or "the metrics file on rank 0 could not be written (rank 0 names it)"
    return ConfigError("--metrics", f"{what}; {saved}", "free space on its filesystem or give --metrics another "
                       "path, then continue with --resume auto (the file is cut back to the resumed step)")


def finish(job: Job, loss: float, stopped) -> None:
    """After the loop: the save directory released; then, unless a signal stopped the run, the profile summary,
    --save-hf's export and the copy task's accuracy."""
    job.steplog.close()
    if job.saves:
        job.saves.close()
    rank = job.engine.long_context_layout.rank
    if stopped:
        if rank == 0:
            info(f"stopped after step {stopped[0]} on {stopped[1]}: saved; continue with --resume {job.saves.path} "
                 "(or --resume auto)")
            _report_stop(f"step {stopped[0]} saved to {job.saves.path} on {stopped[1]}")
        return
    if job.lc.profile.enabled:
        path = job.profiler.write_summary()
        if rank == 0:
            info(f"profile: per-step records in {path}, traces of steps {sorted(job.lc.profile.steps)} in "
                 f"{job.lc.profile.output_dir}")
    if job.args.save_hf:
        ckpt.export_hf(job.engine, job.args.save_hf, tokenizer=job.tokenizer, log=info)
    if job.args.data == "copy" and job.args.eval_samples:
        group = comm.sp_group() if job.sp > 1 else None
        acc = copy_accuracy(job.engine, job.dataset, job.args.eval_samples, comm.sp_rank(group), job.sp, group,
                            start_index=len(job.dataset) - job.args.eval_samples)
        if rank == 0:
            chance = 1.0 / (job.model.config.vocab_size - 2)
            info(f"final loss {loss:.4f} (no-attention floor ln(V-2) = {job.dataset.chance_loss:.4f}); copy accuracy "
                 f"{acc:.3f} (chance {chance:.3f})")


def _report_stop(text: str) -> None:
    """For ``ds-longctx launch`` (preemptible.py): the graceful stop's save is complete, so that the wrapper exits 0
    even when the deepspeed runner or launch.py itself was signalled (they exit 1 or die of the signal)."""
    path = os.environ.get("DS_LONGCTX_STOP_REPORT")
    if path:
        try:
            with open(path, "w") as f:
                f.write(text + "\n")
        except OSError as e:
            info(f"could not write the stop report {path}: {e}")


# DeepSpeed's ZeRO-3 calls torch.distributed's deprecated names; torch then warns (FutureWarning, once per process)
# about DeepSpeed's code, which a user of train.py can neither see nor change: filtered where we launch only
DEEPSPEED_DEPRECATIONS = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"


def quiet_deepspeed_warnings() -> None:
    import warnings

    warnings.filterwarnings("ignore", message=DEEPSPEED_DEPRECATIONS, category=FutureWarning)


def main(argv=None):
    quiet_deepspeed_warnings()
    args = parse_args(argv)
    if args.stages:
        return run_stages(args)
    job = prepare(args)
    loss, stopped = train(job)
    finish(job, loss, stopped)
    return loss


def run_stages(args):
    """--stages: the stages one after another in these processes, each as its own command line would run it
    (stage_runs); the model patches of a stage are undone and its engine dropped before the next is built. With
    --resume auto, the stages that --save's checkpoint is past are skipped (every rank reads the same files). A
    preemption signal ends the schedule at its save."""
    runs = stage_runs(args, parse(load_ds_config(args.deepspeed_config)))
    done = int(find_resume_tag(args.save)[1]["step"]) if args.resume == "auto" and _has_checkpoint(args.save) else 0
    loss = None
    for a in runs:
        k, n = a.stage_of_schedule
        if k < n and done >= a.steps:
            info(f"--stages: stage {k} of {n} ({a.seq_len} tokens, steps up to {a.steps}) is done in {args.save} "
                 f"(step {done}): skipped")
            continue
        with registry.restored():  # this stage's installs on its model undone at its end
            job = prepare(a)
            loss, stopped = train(job)
            finish(job, loss, stopped)
            del job
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if stopped:
            break
    return loss


def _has_checkpoint(path: str) -> bool:
    try:
        find_resume_tag(path)
        return True
    except ConfigError:
        return False


if __name__ == "__main__":
    # an error on any rank ends the whole job; every rank ends without interpreter finalization (the exit-time
    # gloo abort): see ds_longctx/dist/runtime.py
    from ds_longctx.dist.runtime import run

    run(main)
