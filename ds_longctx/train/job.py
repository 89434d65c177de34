"""The job's assembly: the model (``build_model``: --model's weights or a deterministic random init; also the
needle command's), the tokenizer, the data, and :func:`prepare`: every check, the process group, the agreement, the
save directory, what a resume loads, the engine, the loader, the profiler and the step log, as one :class:`Job`."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..config import auto_keys, check_train_batch_size, load_ds_config, parse, resolved_ds_config
from ..config.rope_scaling import apply_rope
from ..config.shipped import default_model_config, shipped_configs_dir
from ..data import TASKS, SampleStream
from ..data.corpus import open_corpus
from ..data.token_cache import data_identity as corpus_identity
from ..data.token_cache import tokenizer_content_sha256
from ..dist.launch import check_launch
from ..dist.layout import zero_stage
from ..errors import ConfigError
from ..eval import needle, ruler
from ..initialize import init_distributed, initialize, model_init, predicted_step
from ..job import checkpoint as ckpt
from ..job import watchdog
from ..job.agreement import check_agreement
from ..job.checkpoint import find_resume_tag
from ..job.metrics import StepLog, peak_tflops
from ..job.preflight import reserve_offload_storage
from ..job.profiler import StepProfiler
from ..models import text_config
from ..models.loading import load_model_config  # --model-config's HF config (a file or a directory)
from ..models.weights import deterministic_init
from ..patching.compat import check_model_scale
from ..planner import planned_work
from .args import agreed_flags, check_max_position, validate_args
from .log import info
from .stages import new_stage_mode, stage_line, stage_schedule


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


def build_model(args, ds_config, model_config):
    """The model of ``model_config`` (prepare's: --rope-theta / --rope-scaling applied): --model's weights, else
    a deterministic random init (``args.model``, ``args.seed``). Built inside ZeRO-3's partitioned construction
    when ``ds_config`` asks for it (None: one process's plain model; the needle command's without a ds_config)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    with model_init(ds_config) if ds_config is not None else contextlib.nullcontext():
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
    or the file's content hash and size (token_cache.data_identity: hashed once per file version), the column and the
    tokenizer's content (vocabulary, merges, special tokens: token_cache.tokenizer_content_sha256), which decides the
    token ids trained on."""
    if args.data in TASKS:
        return {"task": args.data}
    ident = dict(corpus_identity(args.data), column=args.data_column)
    if tokenizer is not None:
        ident["tokenizer_sha256"] = tokenizer_content_sha256(tokenizer)
    return ident


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
    needle_cases: Any            # --eval-needle's documents (needle.build_cases, or ruler.build_cases' for
                                 # --eval-task), or None
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
    values = {"cli": {flag: getattr(args, dest) for flag, dest in agreed_flags().items()} | {"--seq-len": seq_len},
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
        resume_dir = args.save if has_checkpoint(args.save) else None
        if dist.get_rank() == 0:
            info(f"--resume auto: resuming from {args.save}" if resume_dir else
                 f"--resume auto: no checkpoint in {args.save}: starting at step 1")
    plan, new_stage = None, None
    stage, stages = {"index": 1, "seq_len": seq_len, "rope": ckpt.rope_facts(model_config), "start_step": 0,
                     "start_sample": 0, "data": "start"}, []
    if resume_dir:
        new_stage = new_stage_mode(args, resume_dir, seq_len, stage["rope"])
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
    ds_config = stage_schedule(ds_config, args.steps - int(stage["start_step"]))

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
        lengths = needle.parse_lengths(args.eval_needle, "--eval-needle")
        depths = needle.parse_depths(args.needle_depths, "--needle-depths")
        tok = needle_tokenizer(tokenizer, model.config)
        if args.eval_task == "needle":
            needle_cases = needle.build_cases(tok, lengths, depths, seed=args.seed, samples=args.needle_samples, sp=sp)
        else:  # RULER's tasks, one after another (loop.needle_now reports each)
            needle_cases = [c for task in ruler.parse_tasks(args.eval_task, "--eval-task")
                            for c in ruler.build_cases(tok, task, lengths, depths, seed=args.seed,
                                                       samples=args.needle_samples, style=args.eval_style, sp=sp)]
    return Job(args=args, lc=lc, seq_len=seq_len, world=world, sp=sp, dp=dp, micro=micro, gas=gas, record=record,
               model=model, tokenizer=tokenizer, dataset=dataset, eval_set=eval_set, needle_cases=needle_cases,
               engine=engine, batches=batches,
               saves=saves, profiler=profiler, steplog=steplog, start=start, peak=peak_tflops(record["dtype"]))


def needle_tokenizer(tokenizer, model_config):
    if tokenizer is not None:
        return tokenizer
    return needle.ByteTokenizer(text_config(model_config).vocab_size)  # a built-in task has none: UTF-8 bytes


def has_checkpoint(path: str) -> bool:
    try:
        find_resume_tag(path)
        return True
    except ConfigError:
        return False
