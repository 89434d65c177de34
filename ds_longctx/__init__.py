"""ds_longctx: multi-million-token training for DeepSpeed + Hugging Face causal LMs.

Public API: ``initialize`` (drop-in for ``deepspeed.initialize``), ``enable``/``disable`` (route
``deepspeed.initialize`` through ds_longctx for Trainer/TRL/Accelerate), ``model_init`` (ZeRO-3
partitioned construction), ``LongContextConfig`` and ``plan`` (the memory planner); ``shutdown`` (end
every rank's script with it), ``main_guard``/``run`` (an error on any rank ends the whole job).
"""
from .config import LongContextConfig
from .errors import ConfigError
# Imported eagerly (initialize.py imports no DeepSpeed at import time): binding the function here, after
# the submodule of the same name loaded, keeps `ds_longctx.initialize` the function for good.
from .initialize import initialize, model_init
from .runtime import main_guard, run, shutdown

__version__ = "0.1.0"


def enable() -> None:
    """Route every later ``deepspeed.initialize`` whose config has a ``long_context`` section through
    ds_longctx (HF Trainer, TRL, Accelerate, plain scripts). Idempotent; undo with ``disable()``."""
    from .integration import enable as _enable

    _enable()


def disable() -> None:
    """Undo ``enable()``."""
    from .integration import disable as _disable

    _disable()


def plan(*args, **kwargs):
    from .planner import plan as _plan

    return _plan(*args, **kwargs)


__all__ = ["initialize", "model_init", "enable", "disable", "plan", "shutdown", "main_guard", "run", "LongContextConfig",
           "ConfigError", "__version__"]
