"""``ds-longctx needle``: the needle test's command line (``python -m ds_longctx.eval.needle_cli`` under a
launcher). The model comes from the training command's own building (:func:`ds_longctx.train.job.build_model`) or
a saved tag's weights; the test itself is :mod:`ds_longctx.eval.needle`'s."""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from ..config import load_ds_config
from ..config.rope_scaling import apply_rope
from ..config.shipped import resolve_config_path
from ..errors import ConfigError, command_line
from ..initialize import init_distributed, initialize
from ..job.checkpoint import HF_CONFIG_DIR, fp32_weights, read_tag
from ..models import text_config
from ..models.loading import load_model_config
from ..train.job import build_model, hub_load
from .needle import (ByteTokenizer, build_cases, heatmap, parse_depths, parse_lengths, placement, score_cases,
                     summarize, table, write_json)


USAGE = """ds-longctx needle: passkey retrieval by document length x depth, under SP when the ds_config says so.

    ds-longctx needle --model OUT_DIR --lengths 1K,4K --depths 0,0.25,0.5,0.75,1 --json n.json --heatmap n.png
    deepspeed --num_gpus 2 --module ds_longctx.eval.needle_cli --deepspeed_config CFG --model-config CONFIG.json \\
        --checkpoint SAVE_DIR --lengths 32K,128K --heatmap n.png
    (or: deepspeed --no_local_rank --num_gpus 2 --module ds_longctx.cli needle ...)
"""


def build_parser(prog: str = "ds-longctx needle", usage: str = USAGE):
    """The needle command's flags (``ds-longctx ruler`` adds its own to the same parser)."""
    import argparse

    p = argparse.ArgumentParser(prog=prog, description=usage, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config",
                   help="a ds_config (path or shipped name): its sequence_parallel_size, ZeRO stage and long_context "
                   "memory stack run the forward (default: one process, the plain HF model)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1, help="set by the deepspeed launcher")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="a HF model directory or id (e.g. --save-hf's or ds-longctx export's output)")
    src.add_argument("--model-config", help="a HF config.json: the model train.py builds from it (random init by "
                     "--seed, then --checkpoint's weights)")
    p.add_argument("--checkpoint", help="a train.py --save directory: its newest complete tag's weights, gathered by "
                   "DeepSpeed's zero_to_fp32 on every rank (any layout; the full fp32 model in each rank's host "
                   "memory), its model config unless --model-config")
    p.add_argument("--tag", help="--checkpoint's tag (default: its newest complete one)")
    p.add_argument("--tokenizer", help="tokenizer (default: --model's; none: UTF-8 bytes modulo the vocabulary)")
    p.add_argument("--lengths", default="1K,4K", help="document lengths in tokens (default 1K,4K)")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="where the fact sits, as fractions of the "
                   "document (default 0,0.25,0.5,0.75,1)")
    p.add_argument("--samples", type=int, default=1, help="documents (passkeys) per length and depth (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the haystacks and passkeys (and of --model-config's "
                   "random init)")
    p.add_argument("--haystack", help="a UTF-8 text file to draw the filler from (default: built-in sentences)")
    p.add_argument("--rope-theta", type=float, help="evaluate with this RoPE base (ds_longctx.config.rope_scaling)")
    p.add_argument("--rope-scaling", help="evaluate with this RoPE scaling, TYPE:FACTOR[,key=value...] "
                   "(ds_longctx.config.rope_scaling)")
    p.add_argument("--json", help="write the report (cells and every case) as JSON here")
    p.add_argument("--heatmap", help="write the accuracy heatmap PNG here (needs matplotlib)")
    return p


def check_args(a):
    """The checks every rank makes before any collective (shared with ``ds-longctx ruler``)."""
    if a.samples < 1:
        raise ConfigError("--samples", f"must be >= 1, got {a.samples}", "give a number of documents per cell")
    if not (a.model or a.model_config or a.checkpoint):
        raise ConfigError("--model", "no model given", "pass --model DIR, --model-config CONFIG.json or --checkpoint "
                          "SAVE_DIR")
    if a.haystack and not os.path.isfile(a.haystack):
        raise ConfigError("--haystack", f"{a.haystack!r} is not a file", "give a UTF-8 text file")
    return a


def parse_args(argv=None):
    return check_args(build_parser().parse_args(argv))


def _side_dir(a) -> str:
    return os.path.join(a.checkpoint, read_tag(a.checkpoint, a.tag, name="--checkpoint")[0], HF_CONFIG_DIR)


def _build(a, ds_config):
    """The model to score: --checkpoint's weights (gathered by zero_to_fp32, loaded into the full model, then
    partitioned by initialize), else the training command's own model building (--model's weights, or
    --model-config's deterministic random init)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    sd = side = None
    if a.checkpoint:
        tag, _, side = read_tag(a.checkpoint, a.tag, name="--checkpoint")
        sd = fp32_weights(a.checkpoint, tag)
    if a.model:
        cfg = hub_load("--model", a.model, lambda: AutoConfig.from_pretrained(a.model))
    elif a.model_config:
        cfg = load_model_config(a.model_config)
    elif os.path.isfile(os.path.join(side, "config.json")):
        cfg = AutoConfig.from_pretrained(side)
    else:
        raise ConfigError("--model-config", f"{side!r} holds no HF config (saved before ds_longctx kept one)",
                          "pass --model-config (the config.json the run trained)")
    apply_rope(cfg, rope_theta=a.rope_theta, rope_scaling=a.rope_scaling)
    if sd is None:
        return build_model(a, ds_config, cfg)
    torch.manual_seed(a.seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=getattr(cfg, "_attn_implementation", None)
                                             or "sdpa")
    missing, unexpected = model.load_state_dict(sd, strict=False)
    tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ConfigError("--checkpoint", f"its weights do not fit the model (missing {missing[:3]}, unexpected "
                          f"{unexpected[:3]})", "pass the --model-config (or --model) the run trained")
    return model


class Setup:
    """What a scoring command runs on: the model (an engine under a ds_config), its tokenizer, the haystack text,
    the SP degree, the model's max_position_embeddings, whether this rank prints."""

    def __init__(self, target, model, tokenizer, haystack, sp, mpe, rank0):
        self.target, self.model, self.tokenizer, self.haystack = target, model, tokenizer, haystack
        self.sp, self.mpe, self.rank0 = sp, mpe, rank0


def setup(a, lengths) -> Setup:
    """The model (--checkpoint's / --model's / --model-config's, under --deepspeed_config's SP and memory stack
    planned for the longest of ``lengths``) and its tokenizer (--tokenizer, --model's, the checkpoint's, else
    UTF-8 bytes modulo the vocabulary)."""
    ds_config = engine = None
    if a.deepspeed_config:

        ds_config = load_ds_config(resolve_config_path(a.deepspeed_config))
        ds_config = {k: v for k, v in ds_config.items() if k not in ("optimizer", "scheduler")}  # no training
        lc = dict(ds_config.get("long_context") or {})
        lc["sequence_length"] = max(lengths)  # what "auto" keys are planned for
        ds_config["long_context"] = lc
        init_distributed()
    model = _build(a, ds_config)
    if ds_config is not None:

        engine, *_ = initialize(model=model, config=ds_config)
    target = engine if engine is not None else model
    if a.tokenizer or a.model:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(a.tokenizer or a.model)
    elif a.checkpoint and os.path.isfile(os.path.join(_side_dir(a), "tokenizer_config.json")):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(_side_dir(a))
    else:
        tokenizer = ByteTokenizer(text_config(model.config).vocab_size)
    haystack = open(a.haystack, encoding="utf-8").read() if a.haystack else None
    _, sp, _, _, _ = placement(target)
    mpe = getattr(text_config(model.config), "max_position_embeddings", None)
    rank0 = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    return Setup(target, model, tokenizer, haystack, sp, mpe, rank0)


def beyond_note(lengths, mpe) -> str:
    beyond = [L for L in lengths if isinstance(mpe, int) and L > mpe]
    return f"note: lengths {beyond} are beyond the model's max_position_embeddings {mpe}" if beyond else ""


def main(argv=None) -> int:

    a = parse_args(argv)
    lengths, depths = parse_lengths(a.lengths), parse_depths(a.depths)
    run = setup(a, lengths)
    cases = build_cases(run.tokenizer, lengths, depths, seed=a.seed, samples=a.samples, haystack=run.haystack,
                        sp=run.sp)
    results = score_cases(run.target, cases)
    report = summarize(cases, results, run.tokenizer)
    report["max_position_embeddings"] = run.mpe
    if run.rank0:
        print(table(report))
        if beyond_note(lengths, run.mpe):
            print(beyond_note(lengths, run.mpe))
        if a.json:
            write_json(report, a.json)
        if a.heatmap:
            heatmap(report, a.heatmap)
    return 0


def cli(argv=None) -> int:
    """``main`` with a ConfigError as one line and exit code 2 (as the other ds-longctx commands)."""
    return command_line("ds-longctx needle", main, argv)


if __name__ == "__main__":
    sys.exit(cli())
