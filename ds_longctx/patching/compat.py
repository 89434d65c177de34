"""What the ecosystem hands to ``ds_longctx.initialize``: DeepSpeed's ``mpu``, a prior DeepSpeed Ulysses
registration (``UlyssesSPAttentionHF.register_with_transformers``), batches from DeepSpeed's
``UlyssesSPDataLoaderAdapter``, and user code that asks for logits the tiled loss never built.

Pure helpers with no collectives (except :func:`check_mpu`, which only reads group membership).
"""
from __future__ import annotations

import logging
import os
import re
import warnings
from collections.abc import Mapping
from typing import Optional

import torch.distributed as dist

from ..attention import registry
from ..errors import ConfigError

_DS_ULYSSES_MODULE = "deepspeed.runtime.sequence_parallel.ulysses_sp"


# ---------------------------------------------------------------------------------------------
# third-party warnings every rank repeats
# ---------------------------------------------------------------------------------------------

# DeepSpeed's and torch's warnings that say the same on every rank of a job, and that repeat within a process (torch
# and DeepSpeed change Python's warning filters, which re-arms even a "once" warning: its registry is the calling
# module's): shown once, by rank 0. (DeepSpeed's own launcher processes print theirs before any ds_longctx code runs.)
_REPEATED_DS_WARNINGS = ("Setting accelerator to ",)
_REPEATED_TORCH_WARNINGS = re.compile(r"`torch\.distributed\.\w+` is deprecated")
_RANK_ENV = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")


class _Repeats(logging.Filter):
    """DeepSpeed's logger filter and the ``warnings.showwarning`` wrapper of :func:`quiet_repeated_warnings`."""

    def __init__(self, rank: int, show):
        super().__init__()
        self.rank, self.show, self.seen = rank, show, set()

    def _first(self, text: str) -> bool:
        if self.rank != 0 or text in self.seen:
            return False
        self.seen.add(text)
        return True

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not msg.startswith(_REPEATED_DS_WARNINGS) or self._first(msg)

    def showwarning(self, message, category, filename, lineno, file=None, line=None):
        if not (issubclass(category, FutureWarning) and _REPEATED_TORCH_WARNINGS.match(str(message))) or \
                self._first(str(message)):
            self.show(message, category, filename, lineno, file, line)


_QUIET = []  # the installed _Repeats


def quiet_repeated_warnings() -> None:
    """Show the repeated third-party warnings above once per job (rank 0, the first time), through a filter on
    DeepSpeed's logger and a wrapper of ``warnings.showwarning`` (the deprecated torch.distributed collectives
    DeepSpeed calls): installed at import, so that it precedes DeepSpeed's import-time warning; every other warning
    passes unchanged; :func:`show_repeated_warnings` removes both. The rank is the launcher's (RANK,
    OMPI_COMM_WORLD_RANK, PMI_RANK or SLURM_PROCID; none: a single process, rank 0)."""
    if _QUIET:
        return
    rank = next((int(os.environ[v]) for v in _RANK_ENV if os.environ.get(v, "").isdigit()), 0)
    quiet = _Repeats(rank, warnings.showwarning)
    logging.getLogger("DeepSpeed").addFilter(quiet)  # the logger object DeepSpeed's LoggerFactory configures later
    warnings.showwarning = quiet.showwarning
    _QUIET.append(quiet)


def show_repeated_warnings() -> None:
    """Undo :func:`quiet_repeated_warnings`."""
    while _QUIET:
        quiet = _QUIET.pop()
        logging.getLogger("DeepSpeed").removeFilter(quiet)
        if warnings.showwarning == quiet.showwarning:
            warnings.showwarning = quiet.show


quiet_repeated_warnings()


# ---------------------------------------------------------------------------------------------
# mpu
# ---------------------------------------------------------------------------------------------


def mpu_sp_size(mpu) -> int:
    """The SP degree of a Megatron-style mpu (DeepSpeed's ``parallel_state_sp`` or lookalike)."""
    get = getattr(mpu, "get_sequence_parallel_world_size", None)
    if get is None:
        raise ConfigError("mpu", f"{type(mpu).__name__} has no get_sequence_parallel_world_size(); ds_longctx "
                          "accepts only a sequence-parallel mpu (DeepSpeed's parallel_state_sp, as returned by "
                          "UlyssesSPAttentionHF.register_with_transformers)",
                          "drop mpu= and set sequence_parallel_size in the config")
    return int(get())


def resolve_sp_with_mpu(ds_config: dict, mpu) -> dict:
    """Reconcile the config's ``sequence_parallel_size`` with an mpu's SP degree.

    Absent from the config: the mpu's degree is adopted (Accelerate's ParallelismConfig path passes
    the degree only through the mpu). Present and different: ConfigError naming both.
    """
    if mpu is None:
        return ds_config
    size = mpu_sp_size(mpu)
    if "sequence_parallel_size" not in ds_config:
        return dict(ds_config, sequence_parallel_size=size)
    sp = ds_config["sequence_parallel_size"]
    if sp != size:
        raise ConfigError("sequence_parallel_size", f"the config says {sp} but the mpu passed to initialize has "
                          f"sequence-parallel size {size} (e.g. ParallelismConfig(sp_size={size}) or "
                          f"register_with_transformers(sequence_parallel_size={size}))",
                          "make them the same (or drop sequence_parallel_size from the config to take the mpu's)")
    return ds_config


def check_mpu(mpu, sp: int) -> None:
    """An mpu other than DeepSpeed's ``parallel_state_sp`` must describe the same SP groups we build
    (contiguous rank blocks of size SP); we run on ours, so a different layout would be silently wrong."""
    if mpu is None or sp <= 1:
        return
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as pss

    if mpu is pss or not dist.is_initialized():
        return
    get_group = getattr(mpu, "get_sequence_parallel_group", None)
    if get_group is None:
        return
    ranks = dist.get_process_group_ranks(get_group())
    start = (dist.get_rank() // sp) * sp
    if sorted(ranks) != list(range(start, start + sp)):
        raise ConfigError("mpu", f"its sequence-parallel group on rank {dist.get_rank()} is ranks {sorted(ranks)}; "
                          f"ds_longctx uses contiguous blocks ({list(range(start, start + sp))})",
                          "pass DeepSpeed's parallel_state_sp (register_with_transformers returns it) or drop mpu=")


# ---------------------------------------------------------------------------------------------
# a prior DeepSpeed Ulysses registration
# ---------------------------------------------------------------------------------------------


def _deepspeed_wrapper_core(fn):
    """If ``fn`` is the wrapper ``register_with_transformers`` installed, the core attention it wraps."""
    if getattr(fn, "__module__", None) != _DS_ULYSSES_MODULE or getattr(fn, "__name__", "") != "uattn_wrapper":
        return None
    names = fn.__code__.co_freevars
    cells = dict(zip(names, (c.cell_contents for c in fn.__closure__ or ())))
    uattn = cells.get("uattn")
    return getattr(uattn, "attn", None)


def deepspeed_ulysses_registrations() -> dict:
    """``{attn_implementation: core function}`` for every key DeepSpeed's Ulysses wrapped (in the table,
    or behind our own dispatcher: a wrapper registered before our first install is its fallback)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    found = {}
    for key in list(ALL_ATTENTION_FUNCTIONS.keys()):
        # in the table (also when written over our dispatcher), else behind our dispatcher
        for fn in (ALL_ATTENTION_FUNCTIONS[key], registry.original(key)):
            core = None
            while (inner := _deepspeed_wrapper_core(fn)) is not None:  # registered more than once: unwrap all
                fn = core = inner
            if core is not None:
                found[key] = core
                break
    return found


def replace_deepspeed_ulysses_registration() -> list:
    """Put back the core attention under every key ``register_with_transformers`` wrapped, so our
    attention is installed once over the plain kernel instead of on top of DeepSpeed's Ulysses
    (which would all-to-all twice: "query input tensor does not match the required shape").
    Written through the attention registry (the table's one writer), which puts DeepSpeed's wrapper
    back when ds_longctx releases the key. Returns the keys replaced."""
    restored = []
    for key, core in deepspeed_ulysses_registrations().items():
        registry.displace(key, core)
        restored.append(key)
    return restored


# ---------------------------------------------------------------------------------------------
# outputs without logits
# ---------------------------------------------------------------------------------------------


class LogitsNotComputed(AttributeError):
    """Raised by ``outputs.logits`` when long_context.tiled_loss computed the loss without logits.

    An AttributeError, so ``getattr(out, "logits", None)`` and ``hasattr`` keep working for code that
    probes; ``out.logits.float()`` fails here with the reason instead of on None."""


_NO_LOGITS = ("outputs.logits is not available: long_context.tiled_loss is enabled, so the loss is computed "
              "from hidden states in sequence tiles and the [batch, seq, vocab] logits are never built (that is "
              "the memory it saves). Use outputs.loss (already the SP-global token mean), or set "
              "long_context.tiled_loss.enabled=false, or call the model without labels/shift_labels to get logits")


_NO_EVAL_LOGITS = ("the eval step's logits are not available: long_context.tiled_loss is enabled, so the eval loss is "
                   "computed from hidden states in sequence tiles and the [batch, seq, vocab] logits are never built. "
                   "The HF Trainer asks for logits when prediction_loss_only is False (a compute_metrics or "
                   "preprocess_logits_for_metrics is set). Fix: set long_context.tiled_loss.enabled=false (the eval "
                   "step then returns the full-length logits of each rank's own batch, equal to one process), or "
                   "evaluate the loss only (no compute_metrics, or TrainingArguments(prediction_loss_only=True))")


class LogitsNotComputedValue(Mapping):
    """Stands for the logits in an eval output of the tiled loss: the HF Trainer's ``prediction_step`` takes every
    output value but the loss as "logits" (``outputs.items()``) and drops them when ``prediction_loss_only``; any
    use of this one raises :class:`LogitsNotComputed` naming the fix instead of handing compute_metrics an empty
    tuple. A Mapping (not a tensor, so DeepSpeed's output hooks pass it by): the Trainer's first step with logits
    wanted, ``nested_detach``, iterates it, and so does Accelerate's ``pad_across_processes``."""

    __slots__ = ()

    def _refuse(self, *args):
        raise LogitsNotComputed(_NO_EVAL_LOGITS)

    __getitem__ = __iter__ = __len__ = _refuse

    def __getattr__(self, name):
        raise LogitsNotComputed(_NO_EVAL_LOGITS)

    def __repr__(self):
        return "<logits not computed: long_context.tiled_loss>"


def causal_lm_output(loss, logits, tiled_loss: bool, evaluating: bool = False):
    """The forward's output: a ``CausalLMOutputWithPast``; with the tiled loss, one whose ``.logits``
    raises :class:`LogitsNotComputed` naming the key instead of returning None. ``evaluating`` (the model
    in eval mode): the tiled output also holds a :class:`LogitsNotComputedValue` under "logits", so an eval
    loop that iterates the outputs for logits (the HF Trainer with compute_metrics) fails naming the fix."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    if not tiled_loss or logits is not None:
        return CausalLMOutputWithPast(loss=loss, logits=logits)
    out = _tiled_output_class()(loss=loss)
    if evaluating:
        out["logits"] = LogitsNotComputedValue()
    return out


# per-token fields of TRL's fused LM head (trl.trainer.utils.FusedCausalLMOutput), which ds_longctx computes
FUSED_FIELDS = ("log_probs", "entropy", "is_top1", "label_mask", "mean_logits", "log_sum_sq_probs")


def fused_lm_head_output(loss, fields: dict):
    """TRL's ``model(..., fused_lm_head=True)`` output (``add_fused_lm_head``: SFTTrainer's loss and its entropy /
    token-accuracy metrics read it), with the per-token fields ds_longctx computes (``loss.fused_token_fields``)."""
    return _fused_output_class()(loss=loss, **fields)


_FUSED_CLS = []


def _fused_output_class():
    if not _FUSED_CLS:
        from dataclasses import dataclass
        from typing import Optional

        import torch
        from transformers.utils import ModelOutput

        @dataclass
        class FusedLMHeadOutput(ModelOutput):
            loss: Optional[torch.Tensor] = None
            log_probs: Optional[torch.Tensor] = None
            entropy: Optional[torch.Tensor] = None
            log_sum_sq_probs: Optional[torch.Tensor] = None
            mean_logits: Optional[torch.Tensor] = None
            is_top1: Optional[torch.Tensor] = None
            label_mask: Optional[torch.Tensor] = None
            aux_loss: Optional[torch.Tensor] = None

        _FUSED_CLS.append(FusedLMHeadOutput)
    return _FUSED_CLS[0]


_TILED_CLS = []


def _tiled_output_class():
    if not _TILED_CLS:
        from dataclasses import dataclass

        from transformers.modeling_outputs import CausalLMOutputWithPast

        @dataclass
        class TiledLossCausalLMOutput(CausalLMOutputWithPast):
            def __getattribute__(self, name):
                if name == "logits" and object.__getattribute__(self, "__dict__").get("_sealed"):
                    raise LogitsNotComputed(_NO_LOGITS)
                return object.__getattribute__(self, name)

            def __post_init__(self):
                super().__post_init__()
                self.__dict__["_sealed"] = True

        _TILED_CLS.append(TiledLossCausalLMOutput)
    return _TILED_CLS[0]


# ---------------------------------------------------------------------------------------------
# rank-0 summary line
# ---------------------------------------------------------------------------------------------


def active_stack_line(spec, model=None) -> str:
    """One line stating what initialize switched on, as the spec resolved it (``fuse_projections``' path, the
    kept layers, the shard counts), so a user sees the keys took effect."""
    lc, layout = spec.config, spec.layout
    att = lc.attention
    parts = [f"SP {spec.sp} x DP {max(layout.dp, 1)} (world {layout.world})"]
    attn = att.implementation
    if attn == "untied_ulysses":
        path = "fused projections" if spec.fused else "attention-function level"
        if att.fuse_projections == "auto":
            how = (f"ds_longctx.models fuses {spec.model.model_type}" if spec.fused else
                   f"ds_longctx.models has no fused path for {spec.model.model_type}")
            path += f" (fuse_projections 'auto': {how})"
        attn += f"(heads_per_chunk={spec.heads_per_chunk}, {path})"
    core = getattr(getattr(model, "config", None), "_attn_implementation", None)
    parts.append(f"attention={attn} kernel={att.kernel}" + (f" core={core}" if core else ""))
    ac = lc.activation_checkpointing
    if ac.enabled:
        line = f"checkpointing=on offload={ac.offload}" + (" pinned" if ac.offload != "none" and ac.pin_memory else "")
        if ac.offload != "none":
            line += f" keep_on_device={spec.keep_on_device}"
        if spec.kept_attention_layers:
            line += f" keep_attention_output={spec.kept_attention_layers} layers"
        parts.append(line)
    else:
        parts.append("checkpointing=off")
    for name, shards in (("tiled_mlp", spec.mlp_shards), ("tiled_loss", spec.loss_shards)):
        parts.append(f"{name}=" + (f"on(shards={'auto' if shards is None else shards})" if getattr(lc, name).enabled
                                   else "off"))
    parts.append("rms_norm=" + ("memory-efficient" if lc.rms_norm.enabled else "hf"))
    parts.append(f"zero_stage={layout.zero_stage}")
    parts.append(f"grad_scale={layout.grad_scale:g}")
    if spec.sequence_length is not None:
        parts.append(f"sequence_length={spec.sequence_length}")
    return "ds_longctx active: " + ", ".join(parts)


def log_active_stack(spec, model=None) -> str:
    """Log :func:`active_stack_line` once, on rank 0, on the ``ds_longctx`` logger at INFO.

    The logger gets a stderr handler of its own when it has none (like DeepSpeed's), so the line shows
    under every launcher without logging setup; frameworks that lower DeepSpeed's or the root
    logger's verbosity (the HF Trainer does on replicas) don't hide it."""
    import logging

    line = active_stack_line(spec, model)
    if not dist.is_initialized() or dist.get_rank() == 0:
        log = logging.getLogger("ds_longctx")
        if not log.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("[ds_longctx] %(message)s"))
            log.addHandler(handler)
            log.propagate = False
            if log.level == logging.NOTSET:
                log.setLevel(logging.INFO)
        log.info(line)
    return line


# ---------------------------------------------------------------------------------------------
# train.py: a config far beyond the chosen model
# ---------------------------------------------------------------------------------------------


def check_model_scale(lc, model_config, seq_len: int, model_flag: Optional[str] = None) -> None:
    """Refuse a config sized for a much larger model than the one train.py is about to build (e.g. the
    8B 5M-token config with the tiny default preset), before any model or group is built.

    ``model_flag``: how the model was chosen ("--model-config PATH"), None for the default preset."""
    tc = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    max_pos = getattr(tc, "max_position_embeddings", None)
    which = model_flag or "the tiny default preset (ds_configs/models/tiny-llama.json)"
    problems = []
    # beyond max_position_embeddings is the point of long-context training for a chosen model (RoPE
    # scaling); for the 64K-position tiny preset it means the config was made for another model
    if model_flag is None and max_pos is not None and seq_len > max_pos:
        problems.append(f"sequence length {seq_len} exceeds the model's max_position_embeddings {max_pos}")
    # an SP degree past the heads is not a sign of a larger model: a ring runs it (attention.ring_degree, issue 47)
    if problems:
        raise ConfigError("--model", f"this config is sized for a larger model than {which}: "
                          + "; ".join(problems),
                          "pass the model the config was made for: --model <HF id or local path> (pretrained) or "
                          "--model-config <config.json> (random init), e.g. --model-config "
                          "ds_configs/models/llama3-8b.json")
