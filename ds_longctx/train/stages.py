"""Context extension's stages: --stages' schedule (one namespace per stage, each checked as its own command line),
a --new-stage's data mode, the learning-rate schedule per stage, and rank 0's statement of a new stage."""
from __future__ import annotations

import argparse
import os

import torch.distributed as dist

from ..errors import ConfigError
from ..eval import needle
from ..job import checkpoint as ckpt
from ..job.checkpoint import find_resume_tag
from ..patching.compat import active_stack_line
from ..planner.units import fmt_bytes
from .args import validate_args
from .log import info


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


def new_stage_mode(args, resume_dir, seq_len, rope):
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


def stage_schedule(ds_config: dict, stage_steps: int) -> dict:
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
