"""``ds-longctx ruler``: RULER's synthetic tasks (:mod:`ds_longctx.eval.ruler`) by document length x depth, under SP
when the ds_config says so (``python -m ds_longctx.eval.ruler_cli`` under a launcher). The model, the tokenizer and
the flags they take are the needle command's (:mod:`ds_longctx.eval.needle_cli`); the scoring is the needle's
(``needle.score_cases``): one table and one heatmap panel per task, and a summary table (task x length)."""
from __future__ import annotations

import sys

from ..errors import ConfigError, command_line
from . import ruler
from .needle import heatmaps, parse_depths, parse_lengths, score_cases, summarize, table, write_json
from .needle_cli import beyond_note, build_parser, check_args, setup

USAGE = """ds-longctx ruler: RULER's synthetic tasks (passkey, single, multikey, multikey_dense, multivalue, multiquery,
vt) by document length x depth, teacher-forced, under SP when the ds_config says so.

    ds-longctx ruler --model OUT_DIR --tasks all --lengths 4K,16K --depths 0,0.5,1 --samples 4 --json r.json \\
        --heatmap r.png
    deepspeed --num_gpus 2 --module ds_longctx.eval.ruler_cli --deepspeed_config CFG --checkpoint SAVE_DIR \\
        --tasks single,multikey,vt --lengths 32K,128K --heatmap r.png
    (or: deepspeed --no_local_rank --num_gpus 2 --module ds_longctx.cli ruler ...)
"""


def parse_args(argv=None):
    p = build_parser("ds-longctx ruler", USAGE)
    p.add_argument("--tasks", default="all", help=f"comma-separated tasks ({', '.join(ruler.TASKS)}) or all "
                   "(default all)")
    p.add_argument("--style", default="ruler", choices=ruler.STYLES, help="ruler: RULER's English templates (real "
                   "tokenizers; default); kv: bare words, one token each (a word-level tokenizer of "
                   "ruler.kv_vocabulary(), as bench/extend_demo.py's)")
    a = check_args(p.parse_args(argv))
    a.task_list = ruler.parse_tasks(a.tasks)
    if a.style == "kv" and a.haystack:
        raise ConfigError("--haystack", "the kv style's haystack is its own rule's words", "drop --haystack, or use "
                          "--style ruler")
    return a


def run_tasks(run, tasks, lengths, depths, seed, samples, style, haystack=None):
    """Every task's report (needle.summarize's, plus "task"), scored on ``run.target`` (a collective)."""
    reports = {}
    for task in tasks:
        cases = ruler.build_cases(run.tokenizer, task, lengths, depths, seed=seed, samples=samples, style=style,
                                  haystack=haystack, sp=run.sp)
        report = summarize(cases, score_cases(run.target, cases), run.tokenizer)
        report["task"] = task
        for row, case in zip(report["results"], cases):
            row["answer"] = case.answer
        reports[task] = report
    return reports


def main(argv=None) -> int:

    a = parse_args(argv)
    lengths, depths = parse_lengths(a.lengths), parse_depths(a.depths)
    run = setup(a, lengths)
    reports = run_tasks(run, a.task_list, lengths, depths, a.seed, a.samples, a.style, run.haystack)
    if run.rank0:
        for task, report in reports.items():
            print(f"== {task}\n{table(report)}")
        print("exact match by task and length (mean over depths and samples):")
        print(ruler.summary_table(reports))
        if beyond_note(lengths, run.mpe):
            print(beyond_note(lengths, run.mpe))
        if a.json:
            write_json({"style": a.style, "seed": a.seed, "max_position_embeddings": run.mpe, "tasks": reports},
                       a.json)
        if a.heatmap:
            heatmaps(list(reports.values()), a.heatmap, list(reports), suptitle=f"RULER tasks ({a.style} style)")
    return 0


def cli(argv=None) -> int:
    """``main`` with a ConfigError as one line and exit code 2 (as the other ds-longctx commands)."""
    return command_line("ds-longctx ruler", main, argv)


if __name__ == "__main__":
    sys.exit(cli())
