"""ds_longctx: multi-million-token training for DeepSpeed + Hugging Face causal LMs.

Public API: ``initialize`` (drop-in for ``deepspeed.initialize``), ``model_init`` (ZeRO-3
partitioned construction), ``LongContextConfig`` and ``plan`` (the memory planner); ``shutdown`` (end every rank's script with
it), ``main_guard``/``run`` (an error on any rank ends the whole job).
"""
from .config import ConfigError, LongContextConfig
from .runtime import main_guard, run, shutdown

__version__ = "0.1.0"


def initialize(*args, **kwargs):
    from .engine import initialize as _initialize

    return _initialize(*args, **kwargs)


def model_init(*args, **kwargs):
    from .engine import model_init as _model_init

    return _model_init(*args, **kwargs)


def plan(*args, **kwargs):
    from .planner import plan as _plan

    return _plan(*args, **kwargs)


__all__ = ["initialize", "model_init", "plan", "shutdown", "main_guard", "run", "LongContextConfig", "ConfigError",
           "__version__"]
