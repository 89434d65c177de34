"""TRL's RL and preference trainers under sequence parallelism (issue 51): GRPOTrainer, RLOOTrainer, DPOTrainer and
DistillationTrainer, stock, after ``ds_longctx.enable()``, with ``parallelism_config=ParallelismConfig(
sp_backend="deepspeed", sp_size=N)`` and a DeepSpeed config with a ``long_context`` section (the SFT route's recipe).

The SP group is one TRL process. TRL's data flow is cross-process: rewards are gathered over the processes and
normalised per group of ``num_generations`` completions (a prompt's completions are spread over processes), token
counts are summed over them, the entropy mask takes a quantile of the gathered entropies, each process keeps its
slice by ``process_index``. So every rank of an SP group holds the same generation batch, the same completions and
rewards, and runs TRL's own loss code on the same full per-token tensors; only the model's forward and backward are
sharded along the sequence, inside the model call (patching/sp_batch.py -> objectives/replicated.py: the batch is
packed, sharded, run, its per-token log-probabilities gathered back). TRL sees ``world / sp`` processes. (Taking
turns on each rank's batch, the SFT route, would normalise rewards over half groups and give no memory per rank.)

What ``install`` patches, each through the PatchTable enable() owns (undone by ``disable()``):

* ``GRPOConfig`` / ``RLOOConfig`` / ``DistillationConfig.__post_init__``: an SP-only ``parallelism_config`` passes
  TRL's refusal (context parallelism stays refused), and the batch sizes TRL derives from the world size
  (``generation_batch_size``) are derived from ``world / sp``. The refusal is made at the trainer's accelerator
  instead, unless the DeepSpeed config has a ``long_context`` section.
* ``transformers.Trainer.create_accelerator_and_postprocess``: for those trainers and DPOTrainer with SP, the deferred
  refusal and the start-time refusals (:func:`check_rl_trainer`), then the accelerator's class is swapped for a view
  of it whose ``num_processes`` / ``process_index`` are the data-parallel size and rank, whose ``gather``,
  ``gather_for_metrics``, ``reduce`` and ``pad_across_processes`` run over the data-parallel group (the ranks of the
  same SP rank), whose ``prepare_data_loader`` therefore shards over data-parallel ranks only, and whose SP data
  adapter hands the loader on as it is, checked to give every rank of the group the same batch.
* ``Trainer.set_initial_training_values``: without the turns adapter, the loader's length is not multiplied by SP.
* the names ``gather`` / ``gather_object`` in TRL's GRPO, RLOO and distillation modules: over the data-parallel group.
* ``add_fused_lm_head`` (TRL's utils and each trainer module that imported it): TRL's, and the temperature recorded on
  the model, which ds_longctx's loss forward (its own fused path) applies.
* ``unwrap_model_for_generation`` in those modules: TRL's, and inside it the ds_longctx patch suspended
  (patching.patch.suspended): generation runs transformers' model on whole sequences.
* ``_generate`` (GRPO, RLOO, distillation): every rank of the group starts from SP rank 0's random state and ends with
  SP rank 0's completions and random state (TRL seeds each process differently); ``_calculate_rewards`` (GRPO,
  RLOO): SP rank 0's rewards (a non-deterministic reward function cannot split the group).
* ``set_seed`` in those modules: ``device_specific`` seeds by the data-parallel rank (TRL at ``world / sp`` processes).
* ``prepare_deepspeed`` in the GRPO and RLOO modules: a reward model (no lm_head) is prepared without the
  ``long_context`` section and the SP degree (it scores whole texts on each rank).
* ``DistillationTrainer._compute_loss`` (it calls the backbones itself): see objectives/distill.py.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import pickle
import random
from typing import Optional

import torch
import torch.distributed as dist

from ..config import SECTION
from ..dist.comm import sp_group
from ..errors import BatchError, ConfigError
from ..models import text_config
from ..objectives.distill import sharded_compute_loss
from ..patching.patch import FUSED_SETTINGS, get_patch, suspended

_TRL = "trl.trainer"
_RL_MODULES = ("grpo_trainer", "rloo_trainer", "distillation_trainer")
_FUSED_MODULES = ("utils", "grpo_trainer", "rloo_trainer", "dpo_trainer", "sft_trainer", "kto_trainer",
                  "distillation_trainer")
_CONFIGS = (("grpo_config", "GRPOConfig"), ("rloo_config", "RLOOConfig"), ("distillation_config", "DistillationConfig"))
_TRAINERS = (("grpo_trainer", "GRPOTrainer"), ("rloo_trainer", "RLOOTrainer"), ("dpo_trainer", "DPOTrainer"),
             ("distillation_trainer", "DistillationTrainer"))
_GENERATES = (("grpo_trainer", "GRPOTrainer"), ("rloo_trainer", "RLOOTrainer"),
              ("distillation_trainer", "DistillationTrainer"))
_VIEW = "_ds_longctx_dp_view"


def _module(name: str):
    try:
        return importlib.import_module(f"{_TRL}.{name}")
    except ImportError:
        return None


def _trainer_classes() -> tuple:
    out = []
    for mod, cls in _TRAINERS:
        m = _module(mod)
        if m is not None and hasattr(m, cls):
            out.append(getattr(m, cls))
    return tuple(out)


def install(table) -> None:
    """Install the TRL routes into ``table`` (hf/patches.PatchTable, undone by ``disable()``); nothing without TRL."""
    if importlib.util.find_spec("trl") is None:
        return
    # every module imported before any is patched: a module importing another's patched name would keep the wrapper
    for mod in {m for m, _ in _CONFIGS + _TRAINERS} | set(_RL_MODULES + _FUSED_MODULES):
        _module(mod)
    for mod, cls in _CONFIGS:
        m = _module(mod)
        if m is not None and hasattr(m, cls):
            klass = getattr(m, cls)
            table.install(f"rl:{cls}.__post_init__", klass, "__post_init__",
                          _config_post_init(klass.__dict__["__post_init__"]), klass.__dict__["__post_init__"])
    import transformers

    trainer = transformers.Trainer
    table.install("rl:create_accelerator", trainer, "create_accelerator_and_postprocess",
                  _create_accelerator(trainer.__dict__["create_accelerator_and_postprocess"], table),
                  trainer.__dict__["create_accelerator_and_postprocess"])
    table.install("rl:set_initial_training_values", trainer, "set_initial_training_values",
                  _initial_values(trainer.__dict__["set_initial_training_values"]),
                  trainer.__dict__["set_initial_training_values"])
    for mod in _RL_MODULES:
        m = _module(mod)
        if m is None:
            continue
        if hasattr(m, "gather"):
            table.install(f"rl:{mod}.gather", m, "gather", _dp_gather_fn)
        if hasattr(m, "gather_object"):
            table.install(f"rl:{mod}.gather_object", m, "gather_object", _dp_gather_object_fn)
        if hasattr(m, "unwrap_model_for_generation"):
            table.install(f"rl:{mod}.unwrap", m, "unwrap_model_for_generation",
                          _unwrapped_unpatched(m.unwrap_model_for_generation))
        if hasattr(m, "prepare_deepspeed"):
            table.install(f"rl:{mod}.prepare_deepspeed", m, "prepare_deepspeed",
                          _prepare_reward_models(m.prepare_deepspeed))
        if hasattr(m, "set_seed"):
            table.install(f"rl:{mod}.set_seed", m, "set_seed", _dp_seeded(m.set_seed))
    utils = _module("utils")
    original_fused = getattr(utils, "add_fused_lm_head", None)
    if original_fused is not None:
        wrapped = _recording_fused_head(original_fused)
        for mod in _FUSED_MODULES:
            m = _module(mod)
            if m is not None and getattr(m, "add_fused_lm_head", None) is original_fused:
                table.install(f"rl:{mod}.add_fused_lm_head", m, "add_fused_lm_head", wrapped)
    for mod, cls in _GENERATES:
        m = _module(mod)
        if m is None or not hasattr(m, cls):
            continue
        klass = getattr(m, cls)
        if "_generate" in klass.__dict__:
            table.install(f"rl:{cls}._generate", klass, "_generate", _group_generation(klass.__dict__["_generate"]),
                          klass.__dict__["_generate"])
        if "_calculate_rewards" in klass.__dict__:
            table.install(f"rl:{cls}._calculate_rewards", klass, "_calculate_rewards",
                          _group_rewards(klass.__dict__["_calculate_rewards"]), klass.__dict__["_calculate_rewards"])
    m = _module("distillation_trainer")
    klass = getattr(m, "DistillationTrainer", None) if m is not None else None
    if klass is not None and "_compute_loss" in klass.__dict__:
        table.install("rl:DistillationTrainer._compute_loss", klass, "_compute_loss",
                      sharded_compute_loss(klass.__dict__["_compute_loss"], _sp_layout), klass.__dict__["_compute_loss"])
    table.install("rl:active_view", _STATE, "view", None)  # disable() forgets the layout of the last RL trainer


# ---------------------------------------------------------------------------------------------
# the configs: TRL's SP refusal deferred, batch sizes from the data-parallel world
# ---------------------------------------------------------------------------------------------

def _sp_only(pc) -> bool:
    return pc is not None and getattr(pc, "sp_enabled", False) and not getattr(pc, "cp_enabled", False)


def _config_post_init(original):
    @functools.wraps(original)
    def __post_init__(self):
        pc = getattr(self, "parallelism_config", None)
        if not _sp_only(pc):
            return original(self)
        sp = pc.sp_size
        klass = type(self)
        had = "world_size" in klass.__dict__
        base = getattr(klass, "world_size")
        klass.world_size = property(lambda s: max(1, base.fget(s) // sp))  # TRL derives the generation batch from it
        pc.sp_size = 1  # TRL's refusal: made at the trainer's accelerator (check_rl_trainer) where the DS config is known
        try:
            original(self)
        finally:
            pc.sp_size = sp
            if had:
                klass.world_size = base
            else:
                del klass.world_size
        self._ds_longctx_sp = sp

    return __post_init__


# ---------------------------------------------------------------------------------------------
# the accelerator as the SP group sees it: data-parallel collectives
# ---------------------------------------------------------------------------------------------

class _DPView:
    """The data-parallel layout of an SP run (DeepSpeed's: SP groups are blocks of ``sp`` consecutive ranks): this
    rank's data-parallel rank and the group of the ranks with its SP rank."""

    def __init__(self, sp: int):
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % sp:
            raise ConfigError("parallelism_config.sp_size", f"is {sp}, which does not divide the {world} ranks",
                              f"use an sp_size that divides {world}")
        self.sp, self.dp, self.dp_rank, self.sp_rank = sp, world // sp, rank // sp, rank % sp
        self.group = _dp_groups(world, sp)[self.sp_rank]


_GROUPS: dict = {}


def _dp_groups(world: int, sp: int) -> list:
    """One process group per SP rank (the ranks r, r + sp, ...), made once per process (every rank makes every group,
    in the same order). ``None`` for a group of one rank (nothing to exchange)."""
    key = (world, sp)
    if key not in _GROUPS:
        groups = []
        for r in range(sp):
            ranks = list(range(r, world, sp))
            g = dist.new_group(ranks) if len(ranks) > 1 else None
            groups.append(g)
        _GROUPS[key] = groups
    return _GROUPS[key]


def view_of(accelerator) -> Optional[_DPView]:
    return getattr(accelerator, _VIEW, None) if accelerator is not None else None


def _dp_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def dp_gather(tensor, group):
    """Accelerate's ``gather`` (each process's tensors concatenated along dim 0; a 0-d tensor becomes [P]) over
    ``group``."""
    from accelerate.utils.operations import recursively_apply

    def one(t):
        t = t.clone()[None] if t.ndim == 0 else t.contiguous()
        if _dp_size(group) == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(_dp_size(group))]
        dist.all_gather(parts, t, group=group)
        return torch.cat(parts, dim=0)

    return recursively_apply(one, tensor, error_on_other_type=True)


def dp_gather_object(obj, group):
    """Accelerate's ``gather_object`` (a list per process, flattened) over ``group``."""
    if _dp_size(group) == 1:
        return list(obj) if isinstance(obj, (list, tuple)) else [obj]
    out = [None] * _dp_size(group)
    dist.all_gather_object(out, obj, group=group)
    return [x for y in out for x in y]


class _State:
    view: Optional[_DPView] = None  # the layout of the RL trainer built last in this process (one SP layout per process)


_STATE = _State()


def _dp_gather_fn(tensor):
    view = _STATE.view
    if view is None:
        from accelerate.utils import gather

        return gather(tensor)
    return dp_gather(tensor, view.group)


def _dp_gather_object_fn(obj):
    view = _STATE.view
    if view is None:
        from accelerate.utils import gather_object

        return gather_object(obj)
    return dp_gather_object(obj, view.group)


class _DPAcceleratorMixin:
    """Put in front of the accelerator's class (module doc); ``_ds_longctx_dp_view`` holds the layout."""

    @property
    def num_processes(self):
        return getattr(self, _VIEW).dp

    @property
    def process_index(self):
        return getattr(self, _VIEW).dp_rank

    def gather(self, tensor):
        return dp_gather(tensor, getattr(self, _VIEW).group)

    def reduce(self, tensor, reduction="sum", scale=1.0):
        from accelerate.utils.operations import recursively_apply

        group = getattr(self, _VIEW).group

        def one(t):
            out = t.clone()
            if _dp_size(group) > 1:
                dist.all_reduce(out, op=dist.ReduceOp.MAX if reduction == "max" else dist.ReduceOp.SUM, group=group)
            if reduction == "mean":
                out /= _dp_size(group)
            return out * scale if scale != 1.0 else out

        return recursively_apply(one, tensor, error_on_other_type=True)

    def pad_across_processes(self, tensor, dim=0, pad_index=0, pad_first=False):
        from accelerate.utils.operations import recursively_apply

        group = getattr(self, _VIEW).group

        def one(t):
            if dim >= t.ndim or _dp_size(group) == 1:
                return t
            size = torch.tensor([t.shape[dim]], device=t.device)
            sizes = dp_gather(size, group)
            top = int(sizes.max())
            if top == t.shape[dim]:
                return t
            new = list(t.shape)
            new[dim] = top
            out = t.new_zeros(tuple(new)) + pad_index
            idx = [slice(None)] * t.ndim
            idx[dim] = slice(top - t.shape[dim], top) if pad_first else slice(0, t.shape[dim])
            out[tuple(idx)] = t
            return out

        return recursively_apply(one, tensor, error_on_other_type=True)

    def gather_for_metrics(self, input_data, use_gather_object=False):
        """Accelerate's, over the data-parallel group."""
        from accelerate.utils.operations import recursively_apply

        try:
            recursively_apply(lambda x: x, input_data, error_on_other_type=True)
            all_tensors = True
        except TypeError:
            all_tensors = False
        use_gather_object = use_gather_object or not all_tensors
        group = getattr(self, _VIEW).group
        data = dp_gather_object(input_data, group) if use_gather_object else self.gather(input_data)
        try:
            remainder = self.gradient_state.remainder if self.gradient_state.end_of_dataloader else 0
        except Exception:
            return data
        if remainder > 0:
            if use_gather_object:
                return data[:remainder]
            return recursively_apply(lambda t: t[:remainder], data)
        return data

    def deepspeed_ulysses_dl_adapter(self, dl, model):
        """No turns: every rank of the group reads the same batches (the loader is sharded over data-parallel
        ranks); each batch is checked to be the same on every rank of the group."""
        return ReplicatedBatches(dl)


_VIEW_CLASSES: dict = {}


def _view_class(cls):
    if cls not in _VIEW_CLASSES:
        _VIEW_CLASSES[cls] = type(f"SPGroup{cls.__name__}", (_DPAcceleratorMixin, cls), {})
    return _VIEW_CLASSES[cls]


def digest(obj) -> str:
    """A digest of a batch of any structure (tensors by their bytes): equal on two ranks iff the same batch."""
    h = hashlib.blake2b(digest_size=16)

    def walk(x):
        if isinstance(x, torch.Tensor):
            t = x.detach().to("cpu").contiguous()
            h.update(str((tuple(t.shape), t.dtype)).encode())
            h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                h.update(repr(k).encode())
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            h.update(f"[{len(x)}".encode())
            for v in x:
                walk(v)
        else:
            try:
                h.update(pickle.dumps(x))
            except Exception:
                h.update(repr(x).encode())

    walk(obj)
    return h.hexdigest()


class ReplicatedBatches:
    """The trainer's loader as it is, each batch checked to be the same on every rank of the SP group (a BatchError
    naming the ranks otherwise: their forward would shard different batches)."""

    def __init__(self, dl):
        self.dl = dl

    def __len__(self):
        return len(self.dl)

    def __iter__(self):
        group = sp_group()
        for batch in self.dl:
            if group is not None and dist.get_world_size(group) > 1:
                got = [None] * dist.get_world_size(group)
                dist.all_gather_object(got, digest(batch), group=group)
                differ = [r for r, d in enumerate(got) if d != got[0]]
                if differ:
                    raise BatchError("train data loader", f"gave SP ranks {differ} another batch than SP rank 0 "
                                     "(an RL / preference trainer's SP group is one data-parallel rank)",
                                     "let the trainer prepare its loader (ds_longctx shards it over data-parallel "
                                     "ranks); a loader of your own must give every rank of an SP group the same batches")
            yield batch

    def set_epoch(self, epoch: int):
        if hasattr(self.dl, "set_epoch"):
            self.dl.set_epoch(epoch)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.dl, name)


# ---------------------------------------------------------------------------------------------
# the trainer's accelerator and the start-time checks
# ---------------------------------------------------------------------------------------------

def _is_rl_trainer(trainer) -> bool:
    classes = _trainer_classes()
    return bool(classes) and isinstance(trainer, classes)


def _sp_of(trainer) -> int:
    pc = getattr(trainer.args, "parallelism_config", None)
    if _sp_only(pc):
        return int(pc.sp_size)
    return int(getattr(trainer.args, "_ds_longctx_sp", 1) or 1)


def _create_accelerator(original, table):
    @functools.wraps(original)
    def create_accelerator_and_postprocess(self):
        out = original(self)
        if not _is_rl_trainer(self):
            return out
        sp = _sp_of(self)
        if sp <= 1:
            return out
        check_rl_trainer(self, sp)
        acc = self.accelerator
        view = _DPView(sp)
        setattr(acc, _VIEW, view)
        table.install(f"rl:accelerator:{id(acc)}", acc, "__class__", _view_class(type(acc)), type(acc))
        _STATE.view = view
        return out

    return create_accelerator_and_postprocess


_TRL_REFUSAL = ("{name} does not support sequence-dim parallelism (`parallelism_config.sp_size > 1`) by itself: it "
                "builds model inputs after generation inside the trainer")


def check_rl_trainer(trainer, sp: int) -> None:
    """Before any collective, every rank alike (from the trainer's arguments and the model's config): what ds_longctx
    does not run exactly for an RL / preference trainer under SP, refused naming it and what works."""
    name = type(trainer).__name__
    args = trainer.args
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    ds_config = getattr(plugin, "deepspeed_config", None) if plugin is not None else None
    if not (isinstance(ds_config, dict) and SECTION in ds_config):
        raise ConfigError("parallelism_config.sp_size", f"is {sp}: {_TRL_REFUSAL.format(name=name)}, and "
                          f"ds_longctx runs it only under a DeepSpeed config with a '{SECTION}' section (this run has "
                          f"{'none' if isinstance(ds_config, dict) else 'no DeepSpeed config'})",
                          f"train with DeepSpeed (TrainingArguments.deepspeed) and add a '{SECTION}' section to its "
                          "config after ds_longctx.enable(), or set sp_size=1")
    if getattr(args, "use_vllm", False):
        raise ConfigError("use_vllm", f"is true for {name} under sequence parallelism (sp_size={sp}): ds_longctx has "
                          "not run vLLM's colocate or server generation under SP (their process groups and gathers "
                          "span every rank, not the SP group's one TRL process)",
                          "generate with transformers (use_vllm=False), or train with sp_size=1")
    if getattr(args, "ds3_gather_for_generation", True) is False:
        raise ConfigError("ds3_gather_for_generation", f"is false for {name} under sequence parallelism: generation "
                          "runs with the ds_longctx patch suspended, which needs the policy's weights gathered for it",
                          "keep ds3_gather_for_generation=True (TRL's default)")
    model = getattr(trainer, "model", None)
    config = getattr(model, "config", None)
    tc = text_config(config) if config is not None else None
    coef = getattr(args, "router_aux_loss_coef", None)
    coef = getattr(tc, "router_aux_loss_coef", 0.0) if coef is None else coef
    if tc is not None and hasattr(tc, "output_router_logits") and coef:
        # TRL's rule (aux_loss_enabled): a mixture-of-experts config and a non-zero coefficient
        raise ConfigError("router_aux_loss_coef", f"is {coef} for {name}'s mixture-of-experts model under sequence "
                          "parallelism: TRL then adds the router's load-balancing loss through its fused LM head, "
                          "which ds_longctx's per-token path does not compute yet",
                          f"set router_aux_loss_coef=0.0 in {type(args).__name__} (no load-balancing loss: a different "
                          "objective), or train with sp_size=1")
    if getattr(args, "precompute_ref_log_probs", False):
        raise ConfigError("precompute_ref_log_probs", f"is true for {name} under sequence parallelism: TRL computes "
                          "them before training on an engine it builds around the policy itself, which ds_longctx "
                          "would patch a second time", "compute the reference log-probabilities live "
                          "(precompute_ref_log_probs=False, the default), or train with sp_size=1")


def _initial_values(original):
    @functools.wraps(original)
    def set_initial_training_values(self, args, dataloader):
        if view_of(getattr(self, "accelerator", None)) is None:
            return original(self, args, dataloader)
        total = self.get_total_train_batch_size(args)  # micro x accumulation x data-parallel ranks
        self.get_sp_size = lambda: 1  # no turns adapter: the loader's length is the steps' (module doc)
        self.get_total_train_batch_size = lambda a: total
        try:
            return original(self, args, dataloader)
        finally:
            del self.get_sp_size, self.get_total_train_batch_size

    return set_initial_training_values


# ---------------------------------------------------------------------------------------------
# temperature, generation, rewards, reward models
# ---------------------------------------------------------------------------------------------

def _recording_fused_head(original):
    @functools.wraps(original)
    def add_fused_lm_head(model, temperature: float = 1.0, *args, **kwargs):
        out = original(model, temperature, *args, **kwargs)
        setattr(model, FUSED_SETTINGS, {"temperature": float(temperature)})
        return out

    return add_fused_lm_head


def _unwrapped_unpatched(original):
    @contextlib.contextmanager
    def unwrap_model_for_generation(*args, **kwargs):
        with original(*args, **kwargs) as unwrapped:
            with suspended(unwrapped):
                yield unwrapped

    return unwrap_model_for_generation


def _sp_group_of(trainer):
    """The SP group when ``trainer`` runs under the SP view, else None."""
    if view_of(getattr(trainer, "accelerator", None)) is None:
        return None
    group = sp_group()
    return group if group is not None and dist.get_world_size(group) > 1 else None


def _sp_layout(trainer):
    """(sp, group, grad_scale) when ``trainer`` runs under the SP view (objectives/distill.py), else None."""
    group = _sp_group_of(trainer)
    if group is None:
        return None
    patch = get_patch(trainer.model_wrapped if hasattr(trainer, "model_wrapped") else trainer.model)
    grad_scale = patch.spec.grad_scale if patch is not None else 1.0
    return dist.get_world_size(group), group, grad_scale


def _dp_seeded(original):
    """TRL's ``set_seed(seed, device_specific=True)`` adds the process index: under the SP view, the data-parallel
    rank (the group is one process), so an SP run draws what TRL at ``world / sp`` processes draws."""
    @functools.wraps(original)
    def set_seed(seed, device_specific: bool = False, *args, **kwargs):
        view = _STATE.view
        if device_specific and view is not None:
            return original(seed + view.dp_rank, False, *args, **kwargs)
        return original(seed, device_specific, *args, **kwargs)

    return set_seed


def _from_sp_rank0(obj, group):
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def _rng_state():
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def _set_rng_state(state) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def _group_generation(original):
    @functools.wraps(original)
    def _generate(self, *args, **kwargs):
        group = _sp_group_of(self)
        if group is None:
            return original(self, *args, **kwargs)
        _set_rng_state(_from_sp_rank0(_rng_state(), group))
        out = original(self, *args, **kwargs)
        out, state = _from_sp_rank0((out, _rng_state()), group)
        _set_rng_state(state)
        return out

    return _generate


def _group_rewards(original):
    @functools.wraps(original)
    def _calculate_rewards(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        group = _sp_group_of(self)
        return out if group is None else _from_sp_rank0(out, group)

    return _calculate_rewards


def _prepare_reward_models(original):
    @functools.wraps(original)
    def prepare_deepspeed(model, accelerator, *args, **kwargs):
        if view_of(accelerator) is None or _is_causal_lm(model):
            return original(model, accelerator, *args, **kwargs)
        config = accelerator.state.deepspeed_plugin.deepspeed_config
        saved = {k: config.pop(k) for k in (SECTION, "sequence_parallel_size") if k in config}
        try:
            return original(model, accelerator, *args, **kwargs)
        finally:
            config.update(saved)

    return prepare_deepspeed


def _is_causal_lm(model) -> bool:
    get = getattr(model, "get_output_embeddings", None)
    return get is not None and get() is not None


__all__ = ["install", "check_rl_trainer", "view_of", "dp_gather", "dp_gather_object", "ReplicatedBatches", "digest"]
