"""``ds_longctx.enable()``: one line for existing projects (HF Trainer, TRL, Accelerate, plain scripts).

(Named integration.py, not enable.py: a submodule named like the package function would replace
``ds_longctx.enable`` by the module on first import.)

After ``enable()``, every ``deepspeed.initialize(...)`` whose config carries a ``long_context``
section goes through :func:`ds_longctx.initialize`; other configs reach DeepSpeed untouched.
Accelerate (and so the Trainer and TRL) looks ``deepspeed.initialize`` up on the module at call
time (``accelerate.Accelerator._prepare_deepspeed``: ``import deepspeed; deepspeed.initialize``),
so replacing the module attribute is enough, and the patch is a single attribute we put back.

The Trainer's SP loss (``transformers.trainer.deepspeed_sp_compute_loss``) all-gathers every SP
rank's ``outputs.loss`` and re-weights it by token counts. ds_longctx's loss is already the
SP-global token mean with the gradient scale DeepSpeed's reduction needs, so aggregating it again
would scale its gradient by SP. While enabled, that name (which ``Trainer.compute_loss`` looks up
in ``transformers.trainer``'s globals) returns ds_longctx's loss as is for ds_longctx models and
calls the original for any other model.

Accelerate wraps the training loader in DeepSpeed's ``UlyssesSPDataLoaderAdapter``, looked up on
``deepspeed.runtime.sequence_parallel.ulysses_sp`` at call time; it cannot take packed padding-free
rows (TRL ``packing=True, padding_free=True``). While enabled, that name is
:class:`ds_longctx.hf.loader.RoutedSPAdapter`: ds_longctx's adapter (``shard_batch``, document
structure, rows of any length) for a ds_longctx engine, DeepSpeed's for any other.

Accelerate calls DeepSpeed's ``UlyssesSPAttentionHF.register_with_transformers(model)`` before
``deepspeed.initialize``; it reads ``num_key_value_heads`` and ``head_dim`` off the config directly
(GPT-NeoX has no ``num_key_value_heads``: AttributeError; Mixtral's default ``head_dim`` is None: a
TypeError in ``torch.Size``). While enabled it is given the model's config with those two read through
:func:`ds_longctx.models.attention_shape` (the values the model's attention modules compute), nothing else
changed.

Resuming (the Trainer's ``resume_from_checkpoint``, ``accelerator.skip_first_batches``) skips already-trained
batches with Accelerate's ``skip_first_batches``, which cannot take an SP adapter (it rebuilds a DataLoader from
``dataset``/``batch_sampler``, and its count is of the adapter's items, SP turns). While enabled, that name is
routed: an SP adapter (ours, the routed one, DeepSpeed's) is skipped in SP turns by
:func:`ds_longctx.hf.loader.skip_first_items`, anything else goes to Accelerate's function. It is looked up at
call time on ``transformers.trainer`` (the Trainer), ``accelerate.accelerator`` (``Accelerator.skip_first_batches``)
and ``accelerate`` / ``accelerate.data_loader`` (a script that imports it after ``enable()``); each name is
replaced and put back.

Whether a ``deepspeed.initialize`` call comes from Accelerate (whose loader then needs a
``ParallelismConfig`` for SP, checked here) is known explicitly: while enabled,
``accelerate.Accelerator._prepare_deepspeed`` is wrapped to mark its thread for the duration of the call.

Accelerate refuses every model with 'linear_attention' layers under SP
(``accelerate.accelerator._refuse_recurrent_layers_under_sequence_parallelism``: each rank would restart the state).
While enabled that name lets a model through only when the accelerator's DeepSpeed config has a ``long_context``
section (ds_longctx then runs the model) and every such layer type is one ds_longctx splits by heads exactly
(``models.hybrid``); anything else gets Accelerate's refusal.

Accelerate refuses ``sp_attn_implementation='flex_attention'`` when a ``DeepSpeedSequenceParallelConfig`` is
built (``accelerate.utils.dataclasses``), before any model or DeepSpeed config is known. A model with no SDPA path
(GPT-OSS: attention sinks) is loaded with flex_attention, and ds_longctx runs its attention (sinks included) itself
(attention/ulysses._SinkAttention, untied's function level). While enabled, that check passes 'flex_attention' and
marks the config; the refusal is made at ``register_with_transformers`` (inside ``Accelerator._prepare_deepspeed``,
before any collective, every rank alike) unless the accelerator's DeepSpeed config has a ``long_context`` section
(ds_longctx then runs the model, and its initialize refuses flex_attention where it does not run it exactly:
checks.check_sp_attention_pattern). 'eager' stays refused when the config is built (ds_longctx does not run it
under SP either), with the fix named.

TRL's RL and preference trainers (GRPO, RLOO, DPO, distillation) under SP: hf/rl.py's patches, installed into the
same table (the SP group as one TRL process; the batch built after generation sharded inside the model call).

All these patches are process-global; this module is their one owner. ``disable()`` undoes them.
"""
from __future__ import annotations

import contextlib
import inspect
import threading

from ..dist.comm import disable_cpu_shm_allreduce
from ..config import SECTION, load_ds_config
from ..errors import ConfigError
from .loader import RoutedSPAdapter, is_sp_adapter, skip_first_items
from ..initialize import initialize
from ..dist.layout import Layout
from ..loss import IGNORE_INDEX
from ..models import attention_shape, text_config
from ..models.hybrid import runs_layer_type
from ..patching.patch import get_patch
from .patches import PatchTable
from . import rl

# every patch enable() installs, with its original (hf/patches.py): "initialize" -> deepspeed.initialize, "sp_loss" ->
# transformers' SP loss, "sp_adapter" -> DeepSpeed's UlyssesSPDataLoaderAdapter, "register" ->
# UlyssesSPAttentionHF.register_with_transformers (as found in its __dict__), "accelerate_prepare" ->
# accelerate.Accelerator._prepare_deepspeed, "recurrent" / "sp_attn" -> Accelerate's two SP refusals,
# "skip:<module>" -> that module's skip_first_batches (_SKIP_SITES); disable() undoes them all
_ORIGINALS = PatchTable()
_inside = threading.local()  # ds_longctx.initialize calls deepspeed.initialize: that call is DeepSpeed's
_in_accelerate = threading.local()  # inside Accelerator._prepare_deepspeed (see _called_from_accelerate)
_LAST = {"ds_longctx": False}  # did the last routed deepspeed.initialize build a ds_longctx engine?
_ULYSSES_MODULE = "deepspeed.runtime.sequence_parallel.ulysses_sp"


def is_enabled() -> bool:
    return "initialize" in _ORIGINALS


def enable() -> None:
    """Route later ``deepspeed.initialize`` calls with a ``long_context`` section through ds_longctx.

    Idempotent; undo with :func:`disable`. Call it before ``Trainer(...)``/``accelerator.prepare``
    (any time before DeepSpeed is initialized)."""
    if is_enabled():
        return
    import deepspeed

    # a launched CPU run: DeepSpeed's shared-memory all-reduce is not JIT-built when Accelerate starts deepspeed.comm
    # (two ranks building it at once hang on its lock; comm.py), as ds_longctx.initialize does for its own start
    disable_cpu_shm_allreduce()
    _ORIGINALS.install("initialize", deepspeed, "initialize", _routed_initialize)
    _LAST["ds_longctx"] = False
    _install_sp_adapter()
    _install_register()
    _install_accelerate_mark()
    _install_skip()
    _install_recurrent_gate()
    _install_sp_attn_gate()
    rl.install(_ORIGINALS)  # TRL's RL and preference trainers under SP (hf/rl.py)
    try:
        import transformers.trainer as hf_trainer
    except ImportError:  # no transformers Trainer in this environment: nothing to patch there
        return
    if hasattr(hf_trainer, "deepspeed_sp_compute_loss"):
        _ORIGINALS.install("sp_loss", hf_trainer, "deepspeed_sp_compute_loss", _sp_compute_loss)


def disable() -> None:
    """Undo :func:`enable` (no-op when not enabled). Engines already built stay as they are."""
    if not is_enabled():
        return
    _ORIGINALS.undo()  # every patch enable() installed, in reverse order (hf/patches.py)


# ---------------------------------------------------------------------------------------------
# deepspeed.initialize
# ---------------------------------------------------------------------------------------------


def _bound(fn, args, kwargs) -> dict:
    try:
        return inspect.signature(fn).bind_partial(*args, **kwargs).arguments
    except TypeError:
        return dict(kwargs)


def _called_from_accelerate() -> bool:
    """True inside ``accelerate.Accelerator._prepare_deepspeed`` (the HF Trainer's, TRL's and a plain
    Accelerate loop's way to DeepSpeed): while enabled, that method is wrapped (:func:`_install_accelerate_mark`)
    to mark its thread for the duration of the call, so the ``deepspeed.initialize`` it makes knows where it
    comes from without looking at the caller's frames."""
    return getattr(_in_accelerate, "depth", 0) > 0


def _install_accelerate_mark() -> None:
    """Wrap ``Accelerator._prepare_deepspeed`` (looked up on the class at call time by ``prepare``) so that
    calls made inside it are marked as Accelerate's; ``disable()`` puts the original back."""
    import functools

    try:
        from accelerate import Accelerator
    except ImportError:  # no Accelerate: nothing can call deepspeed.initialize from it
        return
    original = Accelerator.__dict__.get("_prepare_deepspeed")
    if original is None:
        return

    @functools.wraps(original)
    def _prepare_deepspeed(self, *args, **kwargs):
        _in_accelerate.depth = getattr(_in_accelerate, "depth", 0) + 1
        _in_accelerate.accelerator = self  # its deepspeed_config, read by the recurrent-layer gate
        try:
            return original(self, *args, **kwargs)
        finally:
            _in_accelerate.depth -= 1
            _in_accelerate.accelerator = None

    _ORIGINALS.install("accelerate_prepare", Accelerator, "_prepare_deepspeed", _prepare_deepspeed, original)


_RECURRENT_GATE = "_refuse_recurrent_layers_under_sequence_parallelism"


def _install_recurrent_gate() -> None:
    """Route Accelerate's refusal of recurrent layers under SP (see the module doc); ``disable()`` puts it back."""
    try:
        import accelerate.accelerator as acc
    except ImportError:
        return
    original = getattr(acc, _RECURRENT_GATE, None)
    if original is None:
        return

    def gate(model, *args, **kwargs):
        accelerator = getattr(_in_accelerate, "accelerator", None)
        ds_config = getattr(accelerator, "deepspeed_config", None)
        config = getattr(model, "config", None)
        types = set(getattr(text_config(config), "layer_types", None) or []) if config is not None else set()
        recurrent = {t for t in types if "linear_attention" in t}
        if isinstance(ds_config, dict) and SECTION in ds_config and recurrent and \
                all(runs_layer_type(config, t) for t in recurrent):
            return None  # ds_longctx splits these layers by heads (attention/mixers.py); initialize checks the rest
        return original(model, *args, **kwargs)

    _ORIGINALS.install("recurrent", acc, _RECURRENT_GATE, gate, original)


_SP_ATTN_ENV = "PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION"  # Accelerate's fallback for sp_attn_implementation
_FLEX_REFUSAL = ("Invalid sp_attn_implementation: flex_attention. 'eager' and 'flex_attention' are not supported "
                 "with sequence parallelism.")


def _install_sp_attn_gate() -> None:
    """Defer Accelerate's refusal of ``sp_attn_implementation='flex_attention'`` to :func:`check_sp_attn`
    (see the module doc); ``disable()`` puts the original ``__post_init__`` back."""
    import os

    try:
        from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig
    except ImportError:
        return
    original = DeepSpeedSequenceParallelConfig.__dict__.get("__post_init__")
    if original is None:
        return

    def __post_init__(self):
        impl = self.sp_attn_implementation or os.environ.get(_SP_ATTN_ENV)
        if impl == "eager":
            raise ConfigError("sp_attn_implementation", "'eager' cannot run sequence parallel (Accelerate refuses "
                              "it, and so does ds_longctx)", "load the model with attn_implementation='sdpa' (or "
                              "flash_attention_2/3) and pass that; a model with no SDPA path (GPT-OSS: attention "
                              "sinks) is loaded with and passed 'flex_attention', which ds_longctx runs")
        if impl != "flex_attention":
            return original(self)
        self.sp_attn_implementation = "sdpa"  # Accelerate's other checks, on a name it accepts
        try:
            original(self)
        finally:
            self.sp_attn_implementation = "flex_attention"

    _ORIGINALS.install("sp_attn", DeepSpeedSequenceParallelConfig, "__post_init__", __post_init__, original)


def check_sp_attn(core_attn_implementation) -> None:
    """Inside Accelerate's ``register_with_transformers`` call: 'flex_attention' (let through by the deferred
    check, :func:`_install_sp_attn_gate`) only for a DeepSpeed config with a ``long_context`` section, which
    ds_longctx runs; anything else gets Accelerate's refusal."""
    if core_attn_implementation != "flex_attention" or "sp_attn" not in _ORIGINALS or not _called_from_accelerate():
        return  # (DeepSpeed's own register_with_transformers accepts flex_attention)
    ds_config = getattr(getattr(_in_accelerate, "accelerator", None), "deepspeed_config", None)
    if not (isinstance(ds_config, dict) and SECTION in ds_config):
        raise ValueError(f"{_FLEX_REFUSAL} (ds_longctx runs 'flex_attention' models only under a DeepSpeed config "
                         f"with a '{SECTION}' section; this one has none)")


def check_sp_wiring(ds_config: dict, mpu, from_accelerate: bool) -> None:
    """Refuse the layouts that would silently train plain data parallelism on full sequences."""
    sp = ds_config.get("sequence_parallel_size", 1)
    if not isinstance(sp, int) or sp <= 1 or mpu is not None:
        return
    if from_accelerate:
        raise ConfigError("sequence_parallel_size", f"is {sp} but Accelerate (HF Trainer / TRL) was given no "
                          "sequence-parallel setup, so its data loader would feed every rank full sequences "
                          "(plain data parallelism)",
                          f"pass parallelism_config=ParallelismConfig(sp_backend='deepspeed', sp_size={sp}) to "
                          "TrainingArguments (or to Accelerator), or set sequence_parallel_size to 1")
    if SECTION not in ds_config:
        raise ConfigError("sequence_parallel_size", f"is {sp} but the config has no '{SECTION}' section and no mpu "
                          "was passed, so nothing shards sequences (DeepSpeed would run plain data parallelism)",
                          f"add a '{SECTION}' section (ds_longctx then builds the SP groups and the data loader), "
                          "or pass DeepSpeed's mpu, or set sequence_parallel_size to 1")


# Families exact through ds_longctx.initialize (train.py, custom loops) whose run through Accelerate's route (HF
# Trainer / TRL) at SP > 1 is not equal to one process yet: refused there rather than trained wrong. None today.
# (Gemma 4 was, 2026-11-28: its embed_tokens deltas after two Trainer steps were 8.5e-5 off. Not ds_longctx: one
# process moves as much between two attention kernels, its second step being ill-conditioned at lr 0.05;
# tests/test_trainer_families.py)
TRAINER_OPEN: dict = {}


def check_trainer_family(model, ds_config: dict) -> None:
    """Refuse, before any collective (every rank decides alike from the model's config), a model family of
    :data:`TRAINER_OPEN` on Accelerate's route at SP > 1."""
    sp = ds_config.get("sequence_parallel_size", 1)
    config = getattr(model, "config", None)
    if config is None or not isinstance(sp, int) or sp <= 1:
        return
    kind = getattr(text_config(config), "model_type", None)
    if kind in TRAINER_OPEN:
        raise ConfigError("sequence_parallel_size", f"is {sp} for a {kind!r} model through the HF Trainer / TRL / "
                          f"Accelerate, which ds_longctx does not run exactly yet: {TRAINER_OPEN[kind]}",
                          "train it with ds_longctx.initialize (train.py or your own loop: exact at any SP), or "
                          "with sequence_parallel_size 1 through the Trainer")


def check_accelerate_layout(ds_config: dict, mpu) -> None:
    """Accelerate derives train_batch_size from ParallelismConfig.data_parallel_size (accelerate's
    _prepare_deepspeed), which counts only the dp sizes the user declared: SP=2 on 4 ranks without
    dp_replicate_size=2 reaches DeepSpeed as a batch-size mismatch naming neither. Say what to set."""
    import torch.distributed as dist

    if mpu is None or not dist.is_available() or not dist.is_initialized():
        return
    try:
        sp = int(mpu.get_sequence_parallel_world_size())
        tbs, micro = int(ds_config["train_batch_size"]), int(ds_config["train_micro_batch_size_per_gpu"])
        gas = int(ds_config.get("gradient_accumulation_steps", 1))
    except (KeyError, TypeError, ValueError, AttributeError):
        return  # DeepSpeed checks what is missing or not a number
    world = dist.get_world_size()
    declared = tbs // max(1, micro * gas)
    if sp > 1 and world % sp == 0 and declared * sp != world:
        raise ConfigError("parallelism_config", f"sp_size={sp} x data-parallel size {declared} covers {declared * sp} "
                          f"of the {world} ranks (Accelerate sets train_batch_size={tbs} from the dp sizes declared "
                          "in ParallelismConfig)",
                          f"pass ParallelismConfig(sp_backend='deepspeed', sp_size={sp}, "
                          f"dp_replicate_size={Layout(world=world, sp=sp).dp}) so that sp_size x dp sizes = {world}")


def _routed_initialize(*args, **kwargs):
    original = _ORIGINALS.get("initialize")
    if original is None:  # disabled while a reference to us was kept somewhere
        import deepspeed

        original = deepspeed.initialize
    if getattr(_inside, "depth", 0):
        return original(*args, **kwargs)
    _LAST["ds_longctx"] = False
    bound = _bound(original, args, kwargs)
    config = bound.get("config")
    if config is None:
        config = bound.get("config_params")
    try:
        ds_config = load_ds_config(config, bound.get("args"))
    except ConfigError:
        return original(*args, **kwargs)  # DeepSpeed reports its own config problems
    from_accelerate = _called_from_accelerate()
    check_sp_wiring(ds_config, bound.get("mpu"), from_accelerate)
    if SECTION not in ds_config:
        return original(*args, **kwargs)
    if from_accelerate:
        check_accelerate_layout(ds_config, bound.get("mpu"))
        check_trainer_family(bound.get("model"), ds_config)
    _inside.depth = getattr(_inside, "depth", 0) + 1
    try:
        out = initialize(*args, **kwargs)
    finally:
        _inside.depth -= 1
    _LAST["ds_longctx"] = True
    return out


# ---------------------------------------------------------------------------------------------
# DeepSpeed's UlyssesSPDataLoaderAdapter (as Accelerate builds it)
# ---------------------------------------------------------------------------------------------


def _install_sp_adapter() -> None:
    import functools
    import importlib

    try:
        mod = importlib.import_module(_ULYSSES_MODULE)
    except ImportError:  # a DeepSpeed without Ulysses SP: Accelerate cannot build the adapter either
        return
    original = mod.UlyssesSPDataLoaderAdapter
    _ORIGINALS.install("sp_adapter", mod, "UlyssesSPDataLoaderAdapter", functools.partial(
        RoutedSPAdapter, _deepspeed_cls=original, _is_ours=lambda: _LAST["ds_longctx"]))


# ---------------------------------------------------------------------------------------------
# Accelerate's skip_first_batches (as the Trainer and Accelerator.skip_first_batches call it on resume)
# ---------------------------------------------------------------------------------------------

# the modules whose global ``skip_first_batches`` is looked up at call time (module doc)
_SKIP_SITES = ("accelerate.data_loader", "accelerate", "accelerate.accelerator", "transformers.trainer")


def _install_skip() -> None:
    import importlib

    for site in _SKIP_SITES:
        try:
            mod = importlib.import_module(site)
        except ImportError:  # no Accelerate / transformers: nothing there calls it
            continue
        if getattr(mod, "skip_first_batches", None) is None:
            continue
        _ORIGINALS.install(f"skip:{site}", mod, "skip_first_batches", _skip_first_batches)


def _skip_first_batches(dataloader, num_batches=0):
    """Accelerate's ``skip_first_batches``, with SP adapters skipped in SP turns (module doc)."""
    original = _ORIGINALS.get("skip:accelerate.data_loader")
    if original is None:  # disabled while a reference to us was kept somewhere
        from accelerate.data_loader import skip_first_batches as original
    if is_sp_adapter(dataloader, _ORIGINALS.get("sp_adapter")):
        return skip_first_items(dataloader, num_batches, original)
    return original(dataloader, num_batches=num_batches)


# ---------------------------------------------------------------------------------------------
# DeepSpeed's UlyssesSPAttentionHF.register_with_transformers (as Accelerate calls it)
# ---------------------------------------------------------------------------------------------


def ensure_deepspeed_comm(sp: int = 1) -> None:
    """Have ``deepspeed.comm`` wrap the process group the launched process already has.

    On a CPU run Accelerate starts ``torch.distributed`` itself (``use_cpu``, MULTI_CPU: accelerate/state.py) and
    not ``deepspeed.comm``, which DeepSpeed's ``parallel_state_sp.initialize_sequence_parallel`` asserts (a bare
    ``AssertionError`` from ``register_with_transformers``); on GPUs Accelerate starts ``deepspeed.comm``. DeepSpeed
    wraps an existing group without a new rendezvous (``deepspeed.comm.init_distributed``: "the user initialized
    torch.dist themselves"). SP over more than one rank with no process group at all (``python script.py``) is
    refused naming the launch that gives it one."""
    import torch.distributed as tdist
    from deepspeed import comm as ds_dist

    if ds_dist.is_initialized():
        return
    if not (tdist.is_available() and tdist.is_initialized()):
        if sp > 1:
            raise ConfigError("parallelism_config.sp_size", f"is {sp} but this process is not part of a launched "
                              "job (no process group: one process, started without a launcher)",
                              f"launch {sp} (or a multiple of {sp}) processes: deepspeed --num_gpus {sp} script.py, "
                              f"or torchrun --nproc_per_node {sp} script.py; or set sp_size=1")
        return
    import deepspeed

    deepspeed.init_distributed(dist_backend=tdist.get_backend(), auto_mpi_discovery=False)


@contextlib.contextmanager
def _reusing_sp_groups(sp: int):
    """DeepSpeed's ``initialize_sequence_parallel`` builds the SP groups once per process and asserts they are not
    built yet ("sequence parallel group is already initialized" for a second Trainer in one process). The groups
    are a function of (world, SP) only, so a later Trainer with the same SP size reuses them: while this context is
    open (one ``register_with_transformers`` call), that function is a no-op when groups of this size exist. Another
    SP size in the same process is refused naming the fix (DeepSpeed and ds_longctx keep one SP layout per
    process; the first engine holds its groups)."""
    import importlib

    pss = importlib.import_module("deepspeed.runtime.sequence_parallel.parallel_state_sp")
    if pss._SEQUENCE_PARALLEL_GROUP is None:
        yield
        return
    have = pss.get_sequence_parallel_world_size()
    if have != sp:
        raise ConfigError("parallelism_config.sp_size", f"is {sp} but this process already built sequence-parallel "
                          f"groups of size {have} (an earlier Trainer / engine in this process); DeepSpeed keeps one "
                          "SP layout per process",
                          f"use sp_size={have} in every Trainer of this process, or train with sp_size={sp} in a "
                          "new launch")
    original = pss.initialize_sequence_parallel

    pss.initialize_sequence_parallel = lambda *args, **kwargs: None  # the size was checked above
    try:
        yield
    finally:
        pss.initialize_sequence_parallel = original


class _ResolvedConfig:
    """A model config whose ``num_key_value_heads`` and ``head_dim`` are read through every spelling
    (models.attention_shape); every other attribute is the config's own.

    Per-layer shapes (Gemma 4's global layers) give the largest over the layers, multi-head latent attention its
    config's ``head_dim``: what DeepSpeed's one wrapper is built with. Never silently wrong: a model ds_longctx runs
    never calls that wrapper (its install routes the model's attention: one Ulysses wrapper per layer shape, MLA's
    values padded, attention/ulysses.py); a model DeepSpeed's wrapper runs itself meets DeepSpeed's own shape
    assertion (query / key / value against the shapes it was built with) at the first layer of another shape."""

    def __init__(self, config, sp: int = 1):
        shape = attention_shape(config)
        heads, kv = shape.heads, shape.kv_heads
        if sp > 1 and (heads % sp or (kv % sp and sp % kv)):
            # SP past the heads (issue 47): ds_longctx runs it with a ring (attention.ring_degree); DeepSpeed's one
            # wrapper, which refuses such counts at construction, gets counts it accepts: it is never called for a
            # model ds_longctx runs, and refuses every call of one it would run by its shape assertion
            heads, kv = sp * -(-heads // sp), sp
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_text", text_config(config))
        object.__setattr__(self, "_shape", shape)
        object.__setattr__(self, "_heads", (heads, kv))
        object.__setattr__(self, "_sp", sp)

    def get_text_config(self, *args, **kwargs):
        return self if self._text is self._config else _ResolvedConfig(self._text, self._sp)

    def __getattr__(self, name):
        if name == "num_key_value_heads":
            return self._heads[1]
        if name == "num_attention_heads":
            return self._heads[0]
        if name == "head_dim":
            return self._shape.head_dim
        return getattr(self._config, name)


class _ConfigView:
    def __init__(self, config):
        self.config = config


def _install_register() -> None:
    import importlib

    try:
        cls = importlib.import_module(_ULYSSES_MODULE).UlyssesSPAttentionHF
    except (ImportError, AttributeError):
        return
    original = cls.__dict__.get("register_with_transformers")
    if original is None:
        return
    bound = cls.register_with_transformers

    def register_with_transformers(klass, model_name_or_path, *args, **kwargs):
        try:
            called = inspect.signature(bound).bind_partial(model_name_or_path, *args, **kwargs).arguments
        except TypeError:
            called = kwargs
        sp, core = called.get("sequence_parallel_size"), called.get("core_attn_implementation")
        check_sp_attn(core)
        config = getattr(model_name_or_path, "config", None)
        if config is not None:
            model_name_or_path = _ConfigView(_ResolvedConfig(config, sp if isinstance(sp, int) else 1))
        if not isinstance(sp, int) or sp <= 1:
            return bound(model_name_or_path, *args, **kwargs)
        ensure_deepspeed_comm(sp)
        with _reusing_sp_groups(sp):
            return bound(model_name_or_path, *args, **kwargs)

    _ORIGINALS.install("register", cls, "register_with_transformers", classmethod(register_with_transformers),
                       original)


# ---------------------------------------------------------------------------------------------
# transformers' Trainer SP loss
# ---------------------------------------------------------------------------------------------


def is_ds_longctx_model(model) -> bool:
    return get_patch(model) is not None


def _sp_compute_loss(accelerator, model, inputs, return_outputs, pc, *args, **kwargs):
    if not is_ds_longctx_model(model):
        return _ORIGINALS["sp_loss"](accelerator, model, inputs, return_outputs, pc, *args, **kwargs)
    # UlyssesSPDataLoaderAdapter feeds shift_labels (no labels); our forward reads them directly and
    # returns the SP-global token-mean loss: nothing to aggregate here.
    inputs = dict(inputs)
    fused = inputs.pop("fused_lm_head", False)  # TRL's SFTTrainer asks its own fused LM head for metrics
    outputs = model(**inputs)
    loss = outputs.loss
    if fused:
        outputs = _trl_metrics_output(loss, inputs, getattr(outputs, "aux_loss", None))
    return (loss, outputs) if return_outputs else loss


def _trl_metrics_output(loss, inputs, aux_loss=None):
    """What TRL's SFTTrainer reads after the loss (label_mask, entropy, is_top1, aux_loss: the router auxiliary
    loss an MoE model's output carries, logged by TRL). ds_longctx computes the loss without per-token
    log-probabilities, so entropy and token accuracy are NaN (not computed) rather than invented; the loss and
    training are unaffected."""
    import types

    import torch

    labels = inputs.get("shift_labels")
    mask = labels != IGNORE_INDEX
    nan = torch.full(mask.shape, float("nan"), device=mask.device)
    return types.SimpleNamespace(loss=loss, label_mask=mask, entropy=nan, is_top1=nan, log_probs=None,
                                 aux_loss=aux_loss)
