"""ds_longctx: multi-million-token training for DeepSpeed + Hugging Face causal LMs.

Public API: ``initialize`` (drop-in for ``deepspeed.initialize``), ``enable``/``disable`` (route
``deepspeed.initialize`` through ds_longctx for Trainer/TRL/Accelerate), ``model_init`` (ZeRO-3
partitioned construction), ``LongContextConfig`` and ``plan`` (the memory planner).
"""
from .config import ConfigError, LongContextConfig

__version__ = "0.1.0"


def initialize(*args, **kwargs):
    from .engine import initialize as _initialize

    return _initialize(*args, **kwargs)


def model_init(*args, **kwargs):
    from .engine import model_init as _model_init

    return _model_init(*args, **kwargs)


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


__all__ = ["initialize", "model_init", "enable", "disable", "plan", "LongContextConfig", "ConfigError", "__version__"]
