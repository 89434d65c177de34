"""What a checkpoint continues (:func:`plan_resume` before ``initialize``, :meth:`ResumePlan.load` after): the
tag, a layout change through DeepSpeed's universal checkpoint, and every refusal (another model, data, length,
ZeRO stage, optimizer type) before any tensor is read."""
from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from ...errors import ConfigError
from . import manifest
from .tags import MODEL_KEYS, PARTITION_KEYS, UNIVERSAL_RECORD, UNIVERSAL_SUFFIX, find_resume_tag, save_dir_of
from .universal import convert_to_universal
from ...dist.verdicts import all_gather, broadcast, raise_everywhere, rank_world, ranks_text


@dataclass
class ResumePlan:
    """What a resume loads (decided on every rank from the same files, before ``initialize``)."""

    path: str
    tag: str
    record: dict
    note: Optional[str]
    universal: bool
    changes: List[str]              # layout or hyper-parameter changes, reported at load
    name: str = "--resume"
    new_stage: Optional[str] = None  # a new stage (train.py --new-stage): its data position, "restart" or "keep"

    @property
    def load_tag(self) -> str:
        return self.tag + UNIVERSAL_SUFFIX if self.universal else self.tag

    @property
    def step(self) -> int:
        return int(self.record["step"])

    @property
    def samples_consumed(self) -> int:
        """Global samples the checkpointed run consumed (the next one is the first to train)."""
        if "samples_consumed" in self.record:
            return int(self.record["samples_consumed"])
        r = self.record  # records of older runs: micro batches per rank x micro batch x DP degree
        return int(r.get("micro_batches_consumed", 0)) * int(r.get("micro_batch", 1)) * \
            int(r.get("data_parallel_size", 1))

    def ds_config(self, ds_config: dict) -> dict:
        """``ds_config`` with DeepSpeed's universal loading switched on when this resume needs it."""
        if not self.universal:
            return ds_config
        cfg = copy.deepcopy(ds_config)
        cfg.setdefault("checkpoint", {})["load_universal"] = True
        return cfg

    def load(self, engine, log=print) -> dict:
        """Load into ``engine`` (every rank); returns the client state saved with it (``step``, ...)."""
        t0 = time.monotonic()
        # a new stage: the weights and the optimizer state (moments, step counts) carried, the learning-rate
        # scheduler not: it starts over as the stage's own (what a fresh run's engine set is put back below)
        fresh_lrs = [g.get("lr") for g in getattr(engine.optimizer, "param_groups", None) or []]
        try:
            path, client = engine.load_checkpoint(self.path, tag=self.load_tag,
                                                  load_lr_scheduler_states=not self.new_stage)
        except Exception as e:  # DeepSpeed's and torch's load errors name no file
            raise ConfigError(self.name, f"loading {os.path.join(self.path, self.load_tag)!r} failed "
                              f"({type(e).__name__}: {str(e)[:500]})", "resume another tag or start a new run"
                              ) from None
        if client is None:
            raise ConfigError(self.name, f"DeepSpeed found no checkpoint in {os.path.join(self.path, self.load_tag)!r}",
                              "give the directory passed to --save")
        _apply_optimizer_config(engine)
        if self.new_stage:  # the checkpoint's param_groups carried its last lr: a fresh run's first lr instead
            for g, lr in zip(getattr(engine.optimizer, "param_groups", None) or [], fresh_lrs):
                g["lr"] = lr
        rank, _ = rank_world()
        if rank == 0:
            if self.note:
                log(f"warning: {self.note}")
            how = " through DeepSpeed's universal checkpoint" if self.universal else ""
            log(f"resumed from {os.path.join(self.path, self.tag)} (step {self.step}, {self.samples_consumed} "
                f"samples consumed){how} in {time.monotonic() - t0:.2f} s" + "".join(f"\n  {c}" for c in self.changes))
        return client


def _apply_optimizer_config(engine) -> None:
    """The ds_config's optimizer hyper-parameters (lr, betas, eps, weight_decay, ...) take effect after a load
    (DeepSpeed restores the checkpoint's param_groups, so a changed learning rate would silently not apply);
    a scheduler sets lr from its own config at each step."""
    params = ((engine.config or {}).get("optimizer") or {}).get("params") or {}
    for g in getattr(engine.optimizer, "param_groups", None) or []:
        for k, v in params.items():
            if k in g and k != "params":
                g[k] = tuple(v) if isinstance(g[k], tuple) else v


def _diff(a, b, prefix="") -> List[Tuple[str, Any, Any]]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _diff(a.get(k), b.get(k), f"{prefix}.{k}" if prefix else k)
        return out
    return [] if a == b else [(prefix, a, b)]


def _saved_zero_stages(saved: dict) -> Tuple[int, ...]:
    """The ZeRO stage(s) a checkpoint can have been saved with: its record's; a record of an older ds_longctx has
    none, so DeepSpeed's file names tell: per-rank model states (``zero_pp_rank_*_model_states.pt``) are stage 3,
    one ``mp_rank_*_model_states.pt`` with partitioned optimizer states stage 1 or 2 (measured: across them
    DeepSpeed's loader fails with a bare AssertionError). () when neither tells."""
    if saved.get("zero_stage") is not None:
        return (saved["zero_stage"],)
    names = list(saved.get("files") or ())
    if any(n.startswith("zero_pp_rank_") and n.endswith("_model_states.pt") for n in names):
        return (3,)
    if any(n.startswith("mp_rank_") and n.endswith("_model_states.pt") for n in names) and \
            any(n.endswith("_optim_states.pt") for n in names):
        return (1, 2)
    return ()


def verify_on_every_rank(path: str, tag: str, record: dict, problem: Optional[str]) -> Optional[str]:
    """The content check of a tag in a job (every rank, a collective: called for each tag a resume looks at, with
    this rank's structural ``problem``): the tag's files split over the ranks (``manifest.shares``: each byte read
    once per job), each rank hashes its share, every rank gets the first problem any rank found (the same verdict
    everywhere, so that ``auto`` falls back to the same tag on every rank)."""
    mine = problem
    if mine is None:
        sums = manifest.checksums_of(record)
        if sums:
            rank, world = rank_world()
            share = manifest.shares(manifest.sizes_of(record, sums), world)[rank]
            mine = manifest.verify(os.path.join(path, tag), sums, share)
    return next((p for p in all_gather(mine) if p), None)


def plan_resume(path: str, current: dict, name: str = "--resume", log=print,
                new_stage: Optional[str] = None) -> ResumePlan:
    """Decide what resuming from ``path`` means for this run (every rank, same files, same verdict; before
    ``initialize``). ``current``: this run's record as :func:`run_record` builds it. Refuses, naming the
    difference, another model, other data, another sequence length, another ZeRO stage or optimizer type;
    another world size, SP or DP degree is a universal resume (convert with :func:`ensure_universal`).

    ``new_stage`` ("restart" or "keep": train.py's ``--new-stage --stage-data``): the run continues as a new stage,
    so another sequence length is accepted; with "restart" (the data position back to 0) also other data, seed and
    --concat-documents (a stage may train on another mixture)."""
    if new_stage not in (None, "restart", "keep"):
        raise ValueError(f"new_stage: {new_stage!r}")
    tag, saved, note = find_resume_tag(path, name, verify=verify_on_every_rank)
    path = save_dir_of(path)  # ``path`` may name one tag (ck/step40): the tag is relative to its directory
    where = os.path.join(path, tag)
    saved_model, now_model = saved.get("model"), current.get("model")
    if isinstance(saved_model, dict) and isinstance(now_model, dict):
        diffs = [k for k in MODEL_KEYS if saved_model.get(k) != now_model.get(k)]
        if diffs:
            what = ", ".join(f"{k} {saved_model.get(k)!r} in the checkpoint vs {now_model.get(k)!r} now" for k in diffs)
            raise ConfigError(name, f"{where} holds a different model: {what}",
                              "resume with the model (--model / --model-config) the checkpoint was saved with")
    refusals = []
    sd, cd = saved.get("data"), current.get("data")
    if new_stage == "restart":  # the new stage reads its data from the start: it may be other data
        pass
    elif isinstance(sd, dict) and isinstance(cd, dict):
        # tokenizer_sha256: recorded since the tokenizer is part of the data identity (a record without it resumes)
        keys = [k for k in sorted(set(sd) | set(cd)) if k != "path" and sd.get(k) != cd.get(k)
                and not (k == "tokenizer_sha256" and k not in sd)]
        if keys:
            refusals.append(("the data differ: " + ", ".join(f"{k} {sd.get(k)!r} in the checkpoint vs {cd.get(k)!r} "
                                                             "now" for k in keys),
                             "resume with the data the run trained on (a path may move; its content may not), or "
                             "start a new run from the weights (ds-longctx export, then --model)" +
                             (", or --stage-data restart (a new stage on other data from its start)"
                              if new_stage == "keep" else "")))
    elif isinstance(sd, str) and isinstance(cd, dict):  # a record of an older ds_longctx: the task or the path
        same = sd == cd.get("task") or (cd.get("path") and os.path.abspath(sd) == cd.get("path"))
        if not same:
            refusals.append((f"the data differ: {sd!r} in the checkpoint vs {cd.get('task') or cd.get('path')!r} now",
                             "resume with the --data the run trained on"))
    for key, flag in (("seq_len", "--seq-len"), ("seed", "--seed"), ("concat_documents", "--concat-documents")):
        if new_stage and (key == "seq_len" or new_stage == "restart"):
            continue
        if key in saved and key in current and saved[key] != current[key]:
            how = ((f"with {flag}" if saved[key] else f"without {flag}") if key == "concat_documents"  # a switch
                   else f"with {flag} {saved[key]!r}")
            if key == "seq_len":  # a context-extension stage is the reason to change it
                fix = (f"resume {how}, or continue the run at the new length as a new stage: add --new-stage (the "
                       "weights and optimizer state carried, the learning-rate schedule restarted, the data "
                       "position per --stage-data restart|keep)")
            else:
                fix = f"resume {how}, or start a new run from the weights (ds-longctx export, then --model)"
                if new_stage == "keep":
                    fix += ", or --stage-data restart (the new stage's data from its start)"
            refusals.append((f"{key} {saved[key]!r} in the checkpoint vs {current[key]!r} now (the samples and their "
                             "order depend on it)", fix))
    stages = _saved_zero_stages(saved)
    if stages and current.get("zero_stage") not in stages:
        said = " or ".join(map(str, stages))
        refusals.append((f"ZeRO stage {said} in the checkpoint vs {current.get('zero_stage')} now "
                         "(DeepSpeed's loaders, universal included, read only the stage a checkpoint was saved with)",
                         f"resume with zero_optimization.stage {said}, or start a new run from the "
                         "weights (ds-longctx export, then --model)"))
    s_opt = (saved.get("optimizer") or {}).get("type")
    c_opt = (current.get("optimizer") or {}).get("type")
    if s_opt is not None and c_opt is not None and str(s_opt).lower() != str(c_opt).lower():
        refusals.append((f"optimizer.type {s_opt!r} in the checkpoint vs {c_opt!r} now (its state cannot carry over)",
                         f"resume with optimizer.type {s_opt!r}, or start a new run from the weights"))
    if refusals:
        problem, fix = refusals[0]
        more = f" (and {len(refusals) - 1} more difference(s): " + "; ".join(p for p, _ in refusals[1:]) + ")" \
            if len(refusals) > 1 else ""
        raise ConfigError(name, f"{where} cannot continue this run: {problem}{more}", fix)
    universal = any(saved.get(k) != current.get(k) for k in PARTITION_KEYS if k in saved)
    changes = []
    layout = [(k, saved.get(k), current.get(k)) for k in PARTITION_KEYS + ("micro_batch", "gradient_accumulation_steps")
              if k in saved and saved.get(k) != current.get(k)]
    if layout:
        changes.append("layout: " + ", ".join(f"{k} {a} -> {b}" for k, a, b in layout))
        gb = lambda r: r.get("micro_batch", 1) * r.get("gradient_accumulation_steps", 1) * r.get("data_parallel_size", 1)  # noqa: E731
        if gb(saved) != gb(current):
            changes.append(f"the global batch changes from {gb(saved)} to {gb(current)} samples per step (the "
                           "learning-rate schedule goes on by steps)")
    for section in ("optimizer", "scheduler", "gradient_clipping"):
        for key, a, b in _diff(saved.get(section), current.get(section), section):
            if key != "optimizer.type":
                changes.append(f"{key}: {a!r} in the checkpoint, {b!r} now: the ds_config's value takes effect")
    if new_stage:
        changes.append(f"a new stage (--new-stage): seq_len {saved.get('seq_len')} -> {current.get('seq_len')}, the "
                       "weights and optimizer state carried, the learning-rate scheduler restarted, data "
                       f"position: {new_stage}")
    return ResumePlan(path=path, tag=tag, record=saved, note=note, universal=universal, changes=changes, name=name,
                      new_stage=new_stage)


def ensure_universal(plan: ResumePlan, log=print) -> None:
    """Rank 0 converts (once), every rank waits for its verdict and checks it sees the result (a resume on
    another layout needs a directory every rank reads)."""
    if not plan.universal:
        return
    rank, _ = rank_world()
    outcome = None
    if rank == 0:
        try:
            convert_to_universal(plan.path, plan.tag, log=log, verified=True)  # by every rank: plan_resume
        except ConfigError as e:
            outcome = (plan.name, e.problem, e.fix)
        except OSError as e:
            outcome = (plan.name, f"converting {os.path.join(plan.path, plan.tag)!r} to a universal checkpoint "
                       f"failed ({e.strerror}: {e.filename})", f"make {plan.path!r} writable, or convert it "
                       "elsewhere with `ds-longctx convert SRC DST` and resume from DST")
    raise_everywhere(broadcast(outcome))
    seen = os.path.isfile(os.path.join(plan.path, plan.load_tag, UNIVERSAL_RECORD))
    blind = [r for r, s in enumerate(all_gather(seen)) if not s]
    if blind:
        raise ConfigError(plan.name, f"{ranks_text(blind)} do not see {os.path.join(plan.path, plan.load_tag)!r}, "
                          "written by rank 0 (a resume on another layout reads every rank's files)",
                          "put the checkpoint on a filesystem every node mounts")


def resume(path: str, record: dict, name: str = "resume", log=print, new_stage: Optional[str] = None) -> ResumePlan:
    """Every rank, after the process group exists and before ``ds_longctx.initialize``: what resuming from
    ``path`` means for this run (``record``: :func:`layout_record`'s, or train's :func:`run_record`), converted to
    DeepSpeed's universal checkpoint when the world size, SP or DP degree changed (rank 0, once). Then::

        engine, *_ = ds_longctx.initialize(..., config=plan.ds_config(ds_config))
        client_state = plan.load(engine)        # plan.step, plan.samples_consumed: where to continue
    """
    plan = plan_resume(path, record, name=name, log=log, new_stage=new_stage)
    ensure_universal(plan, log=log)
    return plan
