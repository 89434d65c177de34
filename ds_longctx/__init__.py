"""ds_longctx: multi-million-token training for DeepSpeed + Hugging Face causal LMs.

Public API: ``initialize`` (drop-in for ``deepspeed.initialize``), ``enable``/``disable`` (route
``deepspeed.initialize`` through ds_longctx for Trainer/TRL/Accelerate), ``model_init`` (ZeRO-3
partitioned construction), ``LongContextConfig`` and ``plan`` (the memory planner); ``patch_model`` and
``LongContextSpec`` (the resolved setup every install trusts); ``ConfigError`` (bad config) and ``BatchError``
(bad batch), both a ``LongContextError`` (a ``ValueError``); ``shutdown`` (end every rank's script with it),
``main_guard``/``run`` (an error on any rank ends the whole job); for runs of days, ``resume`` (before
``initialize``: what a checkpoint continues, on any layout), ``open_checkpoints`` (after it: the checked, locked save
directory whose ``save`` writes a tag that cannot be lost), ``export_hf`` (a model ``from_pretrained`` loads) and
``reserve_offload_storage`` (NVMe offload's bytes, before step 1); for RL and preference objectives,
``token_logprobs`` (per-token log-probabilities of given tokens on this rank's shard, and their reductions over the
SP group) and ``suspended`` (the model as transformers built it, for generation on whole sequences).
"""
from ._version import __version__
from .job.checkpoint import export_hf, open_checkpoints, resume
from .config import LongContextConfig
from .errors import BatchError, ConfigError, LongContextError
# Imported eagerly (initialize.py imports no DeepSpeed at import time): binding the function here, after
# the submodule of the same name loaded, keeps `ds_longctx.initialize` the function for good.
from .initialize import initialize, model_init
from .patching.patch import patch_model, suspended
from .dist.runtime import main_guard, run, shutdown
from .job.preflight import reserve_offload_storage
from .objectives.logprobs import TokenLogprobs, token_logprobs
from .patching.spec import LongContextSpec



def enable() -> None:
    """Route every later ``deepspeed.initialize`` whose config has a ``long_context`` section through
    ds_longctx (HF Trainer, TRL, Accelerate, plain scripts). Idempotent; undo with ``disable()``."""
    from .hf.integration import enable as _enable

    _enable()


def disable() -> None:
    """Undo ``enable()``."""
    from .hf.integration import disable as _disable

    _disable()


def plan(*args, **kwargs):
    """Plan one training step's memory without running it: ``plan(ds_config, model_config, world_size=8,
    gpu_mem="80GiB", seq_len=None, host_mem=None, reserve="2GiB", ...)`` -> ``PlanResult``.

    ``ds_config`` is a dict or a ds_config.json path, ``model_config`` a HF config or config.json path (or
    ``model="org/name"``); ``seq_len`` defaults to ``long_context.sequence_length``. One rank's step runs on
    fake tensors through the same ``patch_model`` code training uses, plus ZeRO model-state arithmetic:
    ``result.fits``, ``result.peak_device_bytes`` (max of the backward and optimizer-step peaks),
    ``result.breakdown`` and ``result.host_bytes_per_node``. Same as ``ds-longctx plan``; see
    :func:`ds_longctx.planner.plan`."""
    from .planner import plan as _plan

    return _plan(*args, **kwargs)


__all__ = ["initialize", "model_init", "enable", "disable", "plan", "shutdown", "main_guard", "run", "LongContextConfig",
           "ConfigError", "BatchError", "LongContextError", "LongContextSpec", "patch_model", "resume",
           "open_checkpoints", "export_hf", "reserve_offload_storage", "token_logprobs", "TokenLogprobs", "suspended",
           "__version__"]
