"""ds-longctx: the command line.

    ds-longctx plan    --deepspeed_config CFG --model-config CONFIG.json ...   the memory planner
    ds-longctx export  CKPT_DIR OUT_DIR [--tag T] [--dtype auto|bf16|fp16|fp32]  a saved checkpoint -> a HF model
    ds-longctx convert CKPT_DIR [--tag T] [--workers N]    DeepSpeed's universal checkpoint of a tag, beside it
    ds-longctx verify  CKPT_DIR [--tag T]                  every tag's files against their checksums (exit 1: damage)
    ds-longctx configs                                     the shipped ds_configs and model configs, and where
    ds-longctx launch  [deepspeed args] train.py ...       the deepspeed runner, preemptible: a SIGTERM, SIGUSR1 or
                                                           Ctrl-C ends with the step saved and every process exit 0
    ds-longctx launch  mpirun -np N ... python train.py    the same for Open MPI's mpirun (launch/mpi.sh)
    ds-longctx needle  --model DIR --lengths 1K,4K ...     passkey retrieval by length x depth under SP (--help)
    ds-longctx ruler   --model DIR --tasks all ...         RULER's synthetic tasks the same way (--help)
    ds-longctx --version

Each command's own --help lists its options. Exit codes: 0 done (plan: fits), 1 plan does not fit, 2 bad input
(one line naming it and the fix).
"""
from __future__ import annotations

import argparse
import os
import sys

from ._version import __version__
from .config.shipped import shipped_configs_dir
from .errors import ConfigError, command_line

# each verb imports what it runs when it runs (``ds-longctx configs`` or ``launch`` load no torch)

_COMMANDS = ("plan", "export", "convert", "verify", "configs", "launch", "needle", "ruler")


def _export(argv) -> int:
    p = argparse.ArgumentParser(prog="ds-longctx export", description="Write a saved checkpoint as a Hugging Face "
                                "model directory (safetensors, config, generation config, tokenizer): DeepSpeed's "
                                "zero_to_fp32 gathers the weights; one process, no GPU.")
    p.add_argument("checkpoint", help="the --save directory (its newest complete tag unless --tag)")
    p.add_argument("out", help="output directory (new or empty)")
    p.add_argument("--tag", help="the tag to export (default: 'latest' when complete, else the newest complete)")
    p.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp16", "fp32"),
                   help="weights' dtype (auto: the dtype the run trained in)")
    p.add_argument("--model-config", help="the run's HF config.json, for a checkpoint that holds none")
    p.add_argument("--tokenizer", help="a tokenizer to save with the model (default: the one saved in the tag)")
    a = p.parse_args(argv)
    from .job.checkpoint import export_checkpoint
    from .models.loading import load_model_config

    if os.path.isdir(a.out) and os.listdir(a.out):
        raise ConfigError("OUT", f"{a.out!r} is not empty", "give a new or empty directory")
    model_config = tokenizer = None
    if a.model_config:
        model_config = load_model_config(a.model_config)
    if a.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(a.tokenizer)
    export_checkpoint(a.checkpoint, a.out, tag=a.tag, dtype=a.dtype, model_config=model_config, tokenizer=tokenizer)
    return 0


def _convert(argv) -> int:
    p = argparse.ArgumentParser(prog="ds-longctx convert", description="Convert a saved tag to DeepSpeed's universal "
                                "checkpoint (ds_to_universal) beside it, as <tag>.universal: what a resume on "
                                "another world size, SP or DP degree loads (train.py converts by itself when needed; "
                                "run this ahead of a large job's restart to take it off the restart).")
    p.add_argument("checkpoint", help="the --save directory")
    p.add_argument("--tag", help="the tag (default: 'latest' when complete, else the newest complete)")
    p.add_argument("--workers", type=int, default=4, help="processes extracting and merging (default 4)")
    a = p.parse_args(argv)
    from .job.checkpoint import convert_to_universal, find_resume_tag, verify_tag

    if a.workers < 1:
        raise ConfigError("--workers", f"must be >= 1, got {a.workers}", "give a number of processes")
    tag = a.tag or find_resume_tag(a.checkpoint, name="checkpoint", verify=verify_tag)[0]
    out = convert_to_universal(a.checkpoint, tag, workers=a.workers, verified=not a.tag)
    print(os.path.join(a.checkpoint, out))
    return 0


def _verify(argv) -> int:
    p = argparse.ArgumentParser(prog="ds-longctx verify", description="Check a checkpoint offline: every file of "
                                "every tag (or --tag's) against the size and checksum its save recorded, one line "
                                "per tag, then the tag --resume would load. Exit 1 when a checked tag is damaged.")
    p.add_argument("checkpoint", help="the --save directory, or one of its tags (ck/step40)")
    p.add_argument("--tag", help="check only this tag")
    a = p.parse_args(argv)
    from .job.checkpoint import verify_report

    lines, ok = verify_report(a.checkpoint, a.tag)
    print("\n".join(lines))
    return 0 if ok else 1


def _configs(argv) -> int:
    d = shipped_configs_dir()
    if d is None:
        print("no shipped configs found in this installation", file=sys.stderr)
        return 2
    print(f"shipped ds_configs in {d} (train.py takes a name: --deepspeed_config tiny-cpu.json):")
    for name in sorted(os.listdir(d)):
        if name.endswith(".json") and name != "targets.json":  # the planner's accelerator figures, not a config
            print(f"  {name}")
    models = os.path.join(d, "models")
    if os.path.isdir(models):
        print(f"model configs (random init: --model-config {os.path.join(models, 'tiny-llama.json')}):")
        for name in sorted(os.listdir(models)):
            if name.endswith(".json"):
                print(f"  models/{name}")
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("--version", "-V"):
        print(f"ds-longctx {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in _COMMANDS:
        print(__doc__.strip(), file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "plan":
        from .planner.cli import main as plan_main

        return plan_main(argv, shipped_dir=shipped_configs_dir())  # shipped names, as train.py takes them
    if cmd == "launch":
        from .dist.preemptible import main as launch_main

        return launch_main(rest)
    if cmd == "needle":  # under a launcher: deepspeed --no_local_rank ... --module ds_longctx.cli needle ...
        from .eval.needle_cli import cli as needle_cli

        return needle_cli(rest)
    if cmd == "ruler":  # the same, with --tasks and --style
        from .eval.ruler_cli import cli as ruler_cli

        return ruler_cli(rest)
    verbs = {"export": _export, "convert": _convert, "verify": _verify, "configs": _configs}
    return command_line(f"ds-longctx {cmd}", verbs[cmd], rest)


if __name__ == "__main__":
    sys.exit(main())
