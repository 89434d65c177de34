"""The loop, and only the loop: ``main`` runs the training command (one stage, or --stages one after another),
``train`` steps, logs, evaluates and saves, ``finish`` exports and reports. Everything it uses is assembled and
checked by :func:`ds_longctx.train.job.prepare`."""
from __future__ import annotations

import contextlib
import gc
import math
import os
import time

import torch
import torch.distributed as dist

from ..attention import registry
from ..config import load_ds_config, parse
from ..data import shard_batch
from ..dist import comm
from ..dist.runtime import graceful_stop, stop_requested, stop_saved
from ..dist.verdicts import any_rank
from ..errors import ConfigError
from ..eval import needle
from ..eval.evaluate import eval_loader, evaluate
from ..job import checkpoint as ckpt
from ..job.checkpoint import find_resume_tag
from ..job.metrics import step_record
from ..loss import IGNORE_INDEX
from ..job.profiler import format_flops
from .args import parse_args
from .job import Job, has_checkpoint, prepare
from .log import info
from .stages import stage_runs


@torch.no_grad()
def copy_accuracy(engine, dataset, n, sp_rank, sp_size, group, start_index):
    """Argmax accuracy on scored tokens of held-out samples (the SP group evaluates together)."""
    engine.eval()
    correct = total = 0
    for i in range(n):
        item = dataset[start_index + i]
        batch = shard_batch({k: v.unsqueeze(0) for k, v in item.items()}, sp_rank, sp_size)
        target = batch.pop("shift_labels")
        # the shard with its document structure (and, under a ring, the zigzag order it was cut in): no labels, logits
        logits = engine(**{k: v.to(engine.device) for k, v in batch.items()}, use_cache=False).logits
        target = target.to(logits.device)
        valid = target != IGNORE_INDEX
        correct += int((logits.argmax(-1)[valid] == target[valid]).sum())
        total += int(valid.sum())
    engine.train()
    t = torch.tensor([correct, total], dtype=torch.float64)
    if group is not None:
        dist.all_reduce(t, group=group)
    return float(t[0] / max(t[1], 1))


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


def needle_now(job: Job, step: int) -> dict:
    """--eval-needle's test on the engine (every rank: a collective; the same report everywhere): the table in the
    log, the cells (exact-match accuracy, mean answer log-likelihood per length and depth) for the metrics; with
    --eval-task's RULER tasks, a table per task and the cells under 'ruler'."""
    results = needle.score_cases(job.engine, job.needle_cases)
    tasks = {}
    for case, result in zip(job.needle_cases, results):
        cases, res = tasks.setdefault(getattr(case, "task", None), ([], []))
        cases.append(case)
        res.append(result)
    out = {}
    for task, (cases, res) in tasks.items():
        report = needle.summarize(cases, res)
        acc = sum(r["exact_match"] for r in res) / len(res)
        what = "needle" if task is None else f"RULER {task} (--eval-task)"
        job.steplog.note(f"{what} after step {step} (--eval-needle {job.args.eval_needle}): exact match {acc:.3f} "
                         f"over {len(res)} documents\n{needle.table(report)}")
        if task is None:
            out["needle"] = {"accuracy": acc, "cells": report["cells"]}
        else:
            out.setdefault("ruler", {})[task] = {"accuracy": acc, "cells": report["cells"]}
    return out


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
                stopping, due, metrics_failed = any_rank([stop_requested(), due, job.steplog.failed])
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
    done = int(find_resume_tag(args.save)[1]["step"]) if args.resume == "auto" and has_checkpoint(args.save) else 0
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
