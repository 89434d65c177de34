"""``initialize``: config -> checks -> SP groups -> patch model -> ``deepspeed.initialize`` -> data.

Drop-in for ``deepspeed.initialize``: same arguments, same four return values. Everything extra is
driven by the ``long_context`` section of the ds_config. The model patching itself lives in
``patch.py`` (no DeepSpeed engine needed), the rank layout in ``layout.py``.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import os
from typing import Any, Optional

import torch
import torch.distributed as dist

from .job import agreement, watchdog
from .job.adam import step_only_bias_correction_of
from .patching import compat
from .dist import comm
from .config import auto_keys, check_train_batch_size, load_ds_config, parse, with_values
from .data import SPDataLoader
from .errors import ConfigError
from .job.hostmem import check_host_memory
from .dist.launch import env_from_slurm, master_port
from .dist.layout import Layout, zero_stage
from .dist.verdicts import decided_on_rank0
from .models.adapters import hf_model_of
from .models.logits import describe_logit_path
from .patching.patch import patch_model
from .planner import plan_resolved_soon, resolve_auto
from .planner.host import machine_ram_bytes
from .planner.units import fmt_bytes, parse_bytes
from .patching.spec import build_spec

logger = logging.getLogger("ds_longctx")


def init_distributed(distributed_port: Optional[int] = None, dist_init_required: Optional[bool] = None,
                     timeout=None):
    """Start the process group from whichever launcher started us (env vars, MPI or SLURM). ``timeout`` (a
    timedelta): the groups' collective timeout (watchdog.pg_timeout of long_context.watchdog.timeout_s), else
    DeepSpeed's default; the watchdog sets it on every group at the agreement either way."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if dist.is_initialized() or dist_init_required is False:
        return
    env_from_slurm()  # srun sets only SLURM_*; MPI ranks are discovered by DeepSpeed via mpi4py
    comm.disable_cpu_shm_allreduce()
    # DeepSpeed's MPI discovery overwrites MASTER_PORT with distributed_port: pass the one in force
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                               distributed_port=master_port(distributed_port), auto_mpi_discovery=True,
                               **({} if timeout is None else {"timeout": timeout}))


def _device_budget_bytes() -> int:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # CPU runs: host RAM is the device


HOST_MEM_ENV = "DS_LONGCTX_HOST_MEM"


def _local_ranks(world: int) -> int:
    """Ranks on this machine: the launcher's count (torchrun, deepspeed, Open MPI, SLURM), else the CUDA
    devices here (capped by the world), else the whole world (a CPU run on one machine)."""
    for var in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"):
        v = os.environ.get(var, "")
        if v.isdigit() and int(v) > 0:
            return min(int(v), world)
    if torch.cuda.is_available():
        return max(1, min(world, torch.cuda.device_count()))
    return world


def _host_budget():
    """(host memory per node, where it came from): ``DS_LONGCTX_HOST_MEM`` (a size, e.g. 512GiB) when set,
    else this machine's RAM (planner/host.machine_ram_bytes, the planner's own detection)."""
    raw = os.environ.get(HOST_MEM_ENV)
    if raw:
        try:
            return parse_bytes(raw), f"{HOST_MEM_ENV}={raw}"
        except ValueError:
            raise ConfigError(HOST_MEM_ENV, f"{raw!r} is not a size", "write it like 512GiB, or unset it to use "
                              "this machine's RAM") from None
    ram = machine_ram_bytes()
    return ram, f"this machine's RAM ({fmt_bytes(ram)})"


def _auto_log(line: str) -> None:
    """The planner's "auto" lines: INFO, except the one saying even the memory-safest choice does not fit (the run
    would fail at step 1, or be refused by the host check): a warning, which Python shows by default."""
    unfit = line.startswith("ds_longctx auto: even the memory-safest settings do not fit")
    (logger.warning if unfit else logger.info)(line)


def _planner_budgets(world: int):
    """(device bytes per rank, (host bytes per node, its source), local ranks): what the planner plans against."""
    return _device_budget_bytes(), _host_budget(), _local_ranks(world)


def predicted_step(resolved: dict, model_config, world: int, seq_len: int):
    """The planner's prediction (planner.PlanResult) of this run's step, as a function to call for it (the
    simulation runs meanwhile where it needs a process of its own: planner.plan_resolved_soon): ``resolved`` the
    ds_config as ``initialize`` resolves it (config.resolved_ds_config), against the budgets "auto" is resolved
    with. This rank only, no collective (seconds of simulation: call it on one rank)."""
    device, (host, _), local = _planner_budgets(world)
    return plan_resolved_soon(resolved, model_config, world, device, seq_len, host_mem=host, gpus_per_node=local)


def _resolve_auto(ds_config: dict, model_config, world: int, predicted: Optional[list] = None) -> dict:
    """The values of the "auto" keys (config.AUTO_KEYS, and tiled shards) the planner picks as fastest fitting
    ({key inside the section: value}, planner.resolve_auto): computed on rank 0 (the simulation is pure but costs
    seconds; its Planner checks the config against the model and the world first) and broadcast with rank 0's
    ConfigError if any, so every rank gets the same values or the same error; ``predicted`` (a list) gets rank 0's
    PlanResult of the chosen configuration (the run's predicted step). Budgets: this device's memory, and
    the host memory per node (``DS_LONGCTX_HOST_MEM`` or this machine's RAM) shared by the ranks on this machine."""
    def decide():
        device, (host, source), local = _planner_budgets(world)
        logger.info(f"ds_longctx auto: budgets: device {fmt_bytes(device)} per rank, host {fmt_bytes(host)} "
                    f"per node ({source}) over {local} local rank(s): {fmt_bytes(host // local)} per rank")
        values, plan = resolve_auto(ds_config, model_config, world, device, host_mem=host, log=_auto_log,
                                    gpus_per_node=local, with_plan=True)
        if predicted is not None:
            predicted.append(plan)
        return values

    return decided_on_rank0(decide)


def initialize(args: Any = None, model: Optional[torch.nn.Module] = None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, distributed_port: Optional[int] = None, mpu=None,
               dist_init_required: Optional[bool] = None, collate_fn=None, config=None, mesh_param=None,
               config_params=None, data_shuffle: bool = False, data_seed: int = 0):
    """Same arguments and return values as ``deepspeed.initialize``:
    ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    ``training_dataloader`` (when ``training_data`` is given) yields this rank's sequence shard of
    each sample, with ``position_ids`` and ``shift_labels``; feed its batches to ``engine(**batch)``.
    """
    import deepspeed

    if model is None:
        raise ConfigError("model", "is required", "pass the Hugging Face model to ds_longctx.initialize")
    ds_config = load_ds_config(config if config is not None else config_params, args)
    ds_config = compat.resolve_sp_with_mpu(ds_config, mpu)  # accept DeepSpeed's / Accelerate's mpu
    lc = parse(ds_config)
    sp = lc.sequence_parallel_size
    init_distributed(distributed_port, dist_init_required,
                     watchdog.pg_timeout(watchdog.configured_timeout(ds_config)[0]))
    world = dist.get_world_size() if dist.is_initialized() else 1
    # the first collective: every rank's ds_config equal (unless this process already agreed on this one), then the
    # job's watchdog (agreement.py, watchdog.py)
    agreement.check_config(ds_config)
    model_config = getattr(model, "config", None)
    predicted = None  # the planner's PlanResult of the step as resolved (rank 0, when "auto" ran it)
    if auto_keys(lc):
        # "auto" resolved once, into the resolved config every rank builds the spec from (rank 0's planner, its
        # choices broadcast): nothing downstream sees "auto" or re-derives a count (spec.py)
        predicted = []
        lc = with_values(lc, _resolve_auto(ds_config, model_config, world, predicted))
        predicted = predicted[0] if predicted else None
    # same verdict on every rank, before any group is built: the spec builder checks the config against the
    # model and the world (checks.check_against) and the kernel against this machine, and resolves every count
    spec = build_spec(lc, model_config, Layout.build(ds_config, sp, world))
    if mpu is None:  # Accelerate's layout (with an mpu) has its own, clearer check
        check_train_batch_size(ds_config, world, sp)
    # a logit path the loss forward cannot reproduce (or a prompt-learning PEFT model under SP): refused before
    # any collective; a PeftModel is seen through (models/adapters.py)
    describe_logit_path(hf_model_of(model, sp))

    ds_mpu = comm.initialize_groups(sp)
    compat.check_mpu(mpu, sp)
    comm.initialize_ring_groups(sp, spec.ring)  # Ulysses x ring: the sub-groups inside every SP group
    spec = spec.with_group(comm.sp_group() if sp > 1 else None, comm.ulysses_group() if spec.ring > 1 else None,
                           comm.ring_group())
    # register_with_transformers ran first: don't wrap twice (through the registry, undone with our install)
    compat.replace_deepspeed_ulysses_registration()
    layout = spec.layout
    # the planner's host bytes for this node, before any is allocated (hostmem.py)
    check_host_memory(ds_config, spec, model, world, _host_budget(), _local_ranks(world))
    patch_model(model, spec)

    if args is not None and getattr(args, "deepspeed_config", None) is not None:
        # deepspeed.initialize refuses a config given both ways; we pass the parsed dict.
        args = copy.copy(args)
        args.deepspeed_config = None
    engine, opt, _, sched = deepspeed.initialize(
        args=args, model=model, optimizer=optimizer, model_parameters=model_parameters, lr_scheduler=lr_scheduler,
        distributed_port=master_port(distributed_port), mpu=ds_mpu, dist_init_required=dist_init_required,
        config=ds_config, mesh_param=mesh_param)
    watchdog.after_initialize(ds_config, spec.config, model_config, world)  # DeepSpeed's groups get the timeout
    step_only_bias_correction_of(engine)  # DeepSpeed's CPU Adam: a resumed run's updates equal the uninterrupted one's
    engine.long_context = spec.config
    engine.long_context_layout = layout
    engine.long_context_spec = spec
    engine.long_context_plan = predicted

    loader = None
    if training_data is not None:
        loader = SPDataLoader(training_data, batch_size=engine.train_micro_batch_size_per_gpu(),
                              sp_rank=layout.sp_rank, sp_size=sp, dp_rank=layout.dp_rank, dp_size=layout.dp,
                              collate_fn=collate_fn, shuffle=data_shuffle, seed=data_seed)
    compat.log_active_stack(spec, model)  # rank 0: what is on, as the spec resolved it
    return engine, opt, loader, sched


@contextlib.contextmanager
def model_init(config, args: Any = None):
    """Build HF models inside this context to have ZeRO-3 partition them as they are created.

    ``AutoModelForCausalLM.from_pretrained/from_config`` see the ds_config through transformers'
    ``HfDeepSpeedConfig`` and wrap construction in ``deepspeed.zero.Init``, so no rank ever holds
    the full model (DeepSpeed issue #7458). Without ZeRO-3 this is a no-op.
    """
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    ds_config = load_ds_config(config, args)
    parse(ds_config)
    if zero_stage(ds_config) != 3:
        yield
        return
    init_distributed()
    agreement.check_config(ds_config)  # before zero.Init's collectives: every rank's ds_config equal, then the watchdog
    hf_ds = HfDeepSpeedConfig(ds_config)
    try:
        yield hf_ds
    finally:
        del hf_ds
        unset_hf_deepspeed_config()


__all__ = ["initialize", "model_init", "init_distributed"]
