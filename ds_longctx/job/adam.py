"""DeepSpeed's CPU Adam with its bias correction computed from the step alone, so that a resumed run's updates equal
the uninterrupted run's bit for bit (issue 52).

DeepSpeed's CPU Adam kernel (``csrc/includes/cpu_adam.h``, ``Adam_Optimizer::IncrementStep``), behind ``FusedAdam`` on
the CPU accelerator and ``DeepSpeedCPUAdam`` (``offload_optimizer``), keeps ``beta1^t`` and ``beta2^t`` in the C++
object of the process: ``pow(beta, step)`` at a process's first step (or after the betas change), then a running product
``beta^t *= beta`` for each following step. The product of N float multiplications differs from ``pow(beta, N)`` in the
last bit for most N (float32, beta 0.9: 139 of steps 1-200), so a run resumed at step N-1 updates its weights by a
different last bit than the run that went on, from the first resumed step to the end, and through gradient clipping
every weight (measured: docs/reliability.md). Here every call of the kernel is preceded by one on empty tensors with
NaN betas, which makes the object forget its cached powers (NaN equals no beta): every step computes
``pow(beta, step)``, a function of the optimizer state alone, as torch's Adam and DeepSpeed's CUDA kernel do. One
empty call per step and parameter group; the arithmetic of every step is otherwise DeepSpeed's. (The C++ object has
no setter for its powers, and DeepSpeed's kernel itself is what runs: so this wrapper, not an Adam of our own.)
ZenFlow's CPU Adam (its own stepping loop) is left as it is.
"""
from __future__ import annotations

import torch

_NAN = float("nan")
_WRAPPED = "_ds_longctx_step_only_bias_correction"


def _empty_lists():
    z = torch.zeros(0, dtype=torch.float32)
    return [[z], [z], [z], [z]]


def _fused_adam_cpu(opt) -> bool:
    try:
        from deepspeed.ops.adam import FusedAdam
        from deepspeed.accelerator import get_accelerator
    except ImportError:
        return False
    return isinstance(opt, FusedAdam) and get_accelerator().device_name() == "cpu"


def _cpu_adam(opt) -> bool:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except ImportError:
        return False
    return isinstance(opt, DeepSpeedCPUAdam) and type(opt).__name__ == "DeepSpeedCPUAdam"  # not ZenFlow's


class _StepOnlyAdamOp:
    """DeepSpeedCPUAdam's ``ds_opt_adam`` (the op module) with ``adam_update`` preceded by the forgetting call."""

    def __init__(self, op):
        self._op = op
        self._empty = torch.zeros(0, dtype=torch.float32)

    def adam_update(self, opt_id, step, lr, beta1, beta2, eps, weight_decay, bias_correction, *tensors):
        z = self._empty
        self._op.adam_update(opt_id, step, lr, _NAN, _NAN, eps, weight_decay, bias_correction, z, z, z, z)
        return self._op.adam_update(opt_id, step, lr, beta1, beta2, eps, weight_decay, bias_correction, *tensors)

    def __getattr__(self, name):
        return getattr(self._op, name)


def step_only_bias_correction(optimizer) -> bool:
    """Make DeepSpeed's CPU Adam ``optimizer`` (FusedAdam on the CPU accelerator, DeepSpeedCPUAdam) compute its bias
    correction from the step alone. True when it was such an optimizer (wrapped once), False otherwise (torch's
    optimizers and DeepSpeed's CUDA FusedAdam compute it from the step already)."""
    if optimizer is None or getattr(optimizer, _WRAPPED, False):
        return bool(optimizer is not None and getattr(optimizer, _WRAPPED, False))
    if _fused_adam_cpu(optimizer):
        inner = optimizer.multi_tensor_adam

        def multi_tensor_adam(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, eps, step, *rest):
            inner(chunk_size, noop_flag, _empty_lists(), lr, _NAN, _NAN, eps, step, *rest)
            return inner(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, eps, step, *rest)

        optimizer.multi_tensor_adam = multi_tensor_adam
    elif _cpu_adam(optimizer):
        optimizer.ds_opt_adam = _StepOnlyAdamOp(optimizer.ds_opt_adam)
    else:
        return False
    setattr(optimizer, _WRAPPED, True)
    return True


def engine_optimizer(engine):
    """The torch optimizer inside a DeepSpeed engine: ZeRO's wrapped one, else the engine's basic one."""
    opt = getattr(engine, "optimizer", None)
    inner = getattr(opt, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    return getattr(engine, "basic_optimizer", None) or opt


def step_only_bias_correction_of(engine) -> bool:
    """:func:`step_only_bias_correction` of the optimizer inside ``engine`` (``ds_longctx.initialize`` calls it)."""
    return step_only_bias_correction(engine_optimizer(engine))
