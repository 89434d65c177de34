"""The training command's flags: one table (every flag states whether the ranks must hold it alike) and the checks
of every value on every rank before any collective."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, Tuple

from ..config import check_shards
from ..config.shipped import resolve_config_path
from ..data import TASKS
from ..data.sources import check_data_path
from ..errors import ConfigError
from ..eval import needle, ruler
from ..job.checkpoint import find_resume_tag
from ..models import text_config

# How the ranks must agree on a flag (agreement.check_agreement names the one that differs, before any collective
# that could hang on it): "value": the same value on every rank (what is trained, on what data, when the job saves,
# evaluates or exports: collectives at those steps); "content": compared by what it names, not its text (the
# ds_config's keys, the data's content: two nodes may mount one file at two paths); "local": may differ per rank
# (set by the launcher, or what rank 0 alone prints or writes). Every flag states one: a new flag cannot miss the
# check silently.
AGREE_MODES = ("value", "content", "local")


def flag(parser, name: str, *aliases: str, agree: str, **kwargs):
    """``parser.add_argument(name, *aliases, **kwargs)``, recording how the ranks must agree on it (read back by
    :func:`flag_agreement`)."""
    if agree not in AGREE_MODES:
        raise ValueError(f"{name}: agree={agree!r} is not one of {AGREE_MODES}")
    action = parser.add_argument(name, *aliases, **kwargs)
    action.agree = agree
    return action


def flag_agreement() -> Dict[str, Tuple[str, str]]:
    """Every flag of the command -> (its agreement mode, its argparse dest), read off the parser itself."""
    return {a.option_strings[0]: (a.agree, a.dest) for a in build_parser()._actions if a.option_strings and
            a.dest != "help"}


def agreed_flags() -> Dict[str, str]:
    """The flags every rank must hold alike, by value: flag -> argparse dest."""
    return {f: dest for f, (mode, dest) in flag_agreement().items() if mode == "value"}


DESCRIPTION = """ds_longctx's main job: train a causal LM on long sequences with DeepSpeed.

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


def _prog() -> str:
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "train.py"
    return "python -m ds_longctx.train" if name == "__main__.py" else name


def _duration_s(text: str) -> float:
    """'900', '900s', '30m', '2h', '1.5h' -> seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    t = text.strip().lower()
    try:
        value = float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (e.g. 900, 30m, 2h)") from None
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=_prog(), description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    flag(p, "--deepspeed_config", "--deepspeed-config", agree="content", dest="deepspeed_config", required=True,
                   help="the ds_config.json: DeepSpeed's keys plus the long_context section (a path, or the name of "
                   "a shipped config such as tiny-cpu.json)")
    flag(p, "--local_rank", "--local-rank", agree="local", type=int, default=-1, help="set by the deepspeed launcher")
    src = p.add_mutually_exclusive_group()
    flag(src, "--model", agree="value", help="HF model id or local path (pretrained weights)")
    flag(src, "--model-config", agree="value", help="local HF config.json: random init (default: the tiny preset)")
    flag(p, "--tokenizer", agree="value", help="tokenizer for --data files (default: --model)")
    flag(p, "--seq-len", agree="value", type=int, default=None, help="global tokens per sample (default: "
                   "long_context.sequence_length or 512)")
    flag(p, "--steps", agree="value", type=int, default=None, help="optimizer steps to train, in all (default: 200; a resumed "
                   "run trains the steps past its checkpoint)")
    flag(p, "--seed", agree="value", type=int, default=0, help="seed of the random init and the copy task's data: the same "
                   "seed gives the same weights and samples for every SP degree, ZeRO stage and process count")
    flag(p, "--data", agree="content", default="copy", help="built-in task name ('copy'), or a .txt/.jsonl/.parquet/.arrow file "
                   "or a datasets save_to_disk directory: tokenized once into a token cache beside it (corpus.py)")
    flag(p, "--data-column", agree="value", default="text", help="the text column of --data/--eval-data (.jsonl key or "
                   "table column; default: text)")
    flag(p, "--concat-documents", agree="value", action="store_true", help="--data FILE: plain concatenation, attention "
                   "across documents (default: packed, position_ids restart per document, document-masked attention)")
    flag(p, "--eval-data", agree="content", help="held-out data (same kinds as --data): its loss and perplexity under SP, equal "
                   "to one process's, at the end and every --eval-every steps")
    flag(p, "--eval-every", agree="value", type=int, default=0, help="evaluate --eval-data / --eval-needle every this many "
                   "steps (0: at the end only)")
    flag(p, "--eval-needle", agree="value", metavar="LENGTHS", help="at the eval points, the needle-in-a-haystack test "
                   "(ds-longctx needle's sharded evaluation, under this run's SP and memory stack) at these document "
                   "lengths (e.g. 1K,4K; each at most --seq-len and divisible by the SP degree): the table in the log, "
                   "the cells in --metrics ('needle')")
    flag(p, "--eval-task", agree="value", default="needle", help="--eval-needle's test: 'needle' (the passkey "
                   "needle, default) or RULER's tasks (ds-longctx ruler's: comma-separated of " + ", ".join(ruler.TASKS)
                   + ", or all): a table per task in the log, the cells in --metrics ('ruler')")
    flag(p, "--eval-style", agree="value", default="ruler", choices=ruler.STYLES, help="--eval-task's RULER text: "
                   "'ruler' (RULER's English templates; default) or 'kv' (bare words, a word-level tokenizer of "
                   "ruler.kv_vocabulary(), as bench/extend_demo.py's)")
    flag(p, "--needle-depths", agree="value", default="0,0.25,0.5,0.75,1", help="--eval-needle's depths of the fact (fractions "
                   "of the document; default 0,0.25,0.5,0.75,1)")
    flag(p, "--needle-samples", agree="value", type=int, default=1, help="--eval-needle's documents per length and depth "
                   "(default 1)")
    flag(p, "--metrics", agree="local", help="write one JSON object per step to this file (rank 0; appended on a resume)")
    flag(p, "--log-every", agree="local", type=int, default=10, help="without a terminal (SLURM, nohup): one plain line every "
                   "this many steps (0: none; default 10)")
    ck = p.add_argument_group("checkpoints")
    flag(ck, "--save", agree="value", help="checkpoint directory: checked before step 1, written at the end and as below")
    flag(ck, "--save-every", agree="value", type=int, default=0, help="also save every this many steps (0: only at the end)")
    flag(ck, "--save-interval", agree="value", type=_duration_s, default=0.0, help="also save when this much wall clock "
                    "passed since the last save (e.g. 30m, 2h; 0: off)")
    flag(ck, "--keep-last", agree="value", type=int, default=0, help="keep only the newest this many checkpoints (0: all)")
    flag(ck, "--resume", agree="value", help="a checkpoint directory to continue from, or 'auto': --save's when it holds "
                    "one (a requeued job's same command line), else start at step 1")
    flag(ck, "--new-stage", agree="value", action="store_true", help="with --resume: continue the run as a new stage at "
                    "another --seq-len (and/or --rope-theta/--rope-scaling; context extension): the weights and the "
                    "optimizer state carried (DeepSpeed's checkpoint load), the learning-rate schedule restarted for "
                    "this stage's steps (--steps minus the checkpoint's step; a scheduler's total_num_steps 'auto' is "
                    "that count), the memory stack re-planned for the new length, the data position per "
                    "--stage-data; the stage (index, length, RoPE) is recorded in its checkpoints")
    flag(ck, "--stage-data", agree="value", choices=("restart", "keep"), default=None, help="--new-stage's data position: "
                    "'restart' (default: the stage's data from its first sample; --data may change) or 'keep' (the "
                    "same token position: sample ceil(samples consumed x old length / new length) of the same data)")
    flag(ck, "--stages", agree="value", metavar="LEN:STEPS,...", help="a context-extension schedule in one run, e.g. "
                    "64K:1000,256K:500,1M:200: 1000 steps at 64K tokens, then 500 at 256K, then 200 at 1M (K=1024); "
                    "each stage saved to --save at its end and continued exactly as --resume DIR --new-stage would "
                    "(weights and optimizer state carried, the learning-rate schedule restarted, the memory stack "
                    "re-planned, the data per --stage-data); the engine is rebuilt in the same processes. With "
                    "--resume auto a requeued job continues in the stage its checkpoint is in. Replaces --seq-len, "
                    "--steps and --new-stage; the RoPE (--rope-theta/--rope-scaling) is the same in every stage (to "
                    "change it with the length, run the stages as separate --new-stage commands)")
    flag(ck, "--save-hf", agree="value", help="at the end, write the model as a Hugging Face directory (safetensors, config, "
                    "generation config, and the run's tokenizer where it has one: --tokenizer or --model's; the "
                    "built-in copy task has none)")
    flag(p, "--eval-samples", agree="value", type=int, default=8, help="held-out samples for the task accuracy")
    flag(p, "--allow-beyond-max-position", agree="value", action="store_true", help="train with --seq-len above the "
                   "model's max_position_embeddings on purpose (context extension); refused otherwise")
    flag(p, "--rope-theta", agree="value", type=float, default=None, help="the model's RoPE base (context extension: e.g. "
                   "500000 -> 8000000); recorded in the checkpoints and --save-hf's config")
    flag(p, "--rope-scaling", agree="value", default=None, help="RoPE scaling TYPE:FACTOR[,key=value...] (linear, dynamic, "
                   "yarn, longrope, llama3, proportional; e.g. yarn:4 or "
                   "llama3:8,low_freq_factor=1,high_freq_factor=4); raises max_position_embeddings by the factor")
    flag(p, "--no-progress", agree="local", action="store_true", help="no progress bar (rank 0 still logs the layout, a "
                   "plain line every --log-every steps without a terminal, and the final loss)")
    return p


def parse_args(argv=None):
    args = build_parser().parse_args(argv)
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
        if args.eval_task != "needle":
            ruler.parse_tasks(args.eval_task, "--eval-task")
    elif args.eval_task != "needle" or args.eval_style != "ruler":
        raise ConfigError("--eval-task" if args.eval_task != "needle" else "--eval-style", "chooses --eval-needle's "
                          "test, and there is no --eval-needle", "add --eval-needle LENGTHS (the documents' lengths)")
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


def _check_local_or_hub(flag, value):
    """A value that can only be a local path (absolute, ./ ../ ~, or more than one '/': a hub id is 'org/name')
    must exist; otherwise transformers reports 'Repo id must be in the form ...'."""
    if not value or os.path.exists(os.path.expanduser(value)):
        return
    if os.path.isabs(value) or value.startswith((".", "~")) or value.count("/") > 1:
        raise ConfigError(flag, f"local path {value!r} does not exist", "give an existing model directory, or a "
                            "hub id of the form 'org/name'")


def check_max_position(args, model_config, seq_len):
    """--seq-len above the model's max_position_embeddings is refused unless asked for: RoPE models run but see
    positions they were never trained on (RoPE-scaled configs already state their scaled length)."""
    mpe = getattr(text_config(model_config), "max_position_embeddings", None)
    if isinstance(mpe, int) and seq_len > mpe and not args.allow_beyond_max_position:
        flag = "--seq-len" if args.seq_len is not None else "long_context.sequence_length"
        raise ConfigError(flag, f"{seq_len} is above the model's max_position_embeddings {mpe}",
                            f"use at most {mpe}, set rope_scaling/max_position_embeddings in the model config, or pass "
                            "--allow-beyond-max-position to train past it on purpose (context extension)")
