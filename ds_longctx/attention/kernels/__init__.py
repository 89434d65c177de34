"""Attention kernel backends with one interface that keeps the log-sum-exp.

Layout (every backend, both directions):
    q: [b, s_q, h_q, d]    k, v: [b, s_k, h_kv, d]    (h_q a multiple of h_kv: GQA/MQA)
    out: [b, s_q, h_q, d]  (same dtype as q)
    lse: [b, h_q, s_q] float32, natural log (may be a strided view; treat it as opaque)

    forward(q, k, v, causal, scale, window=None, softcap=None) -> (out, lse)
    backward(dout, q, k, v, out, lse, causal, scale, window=None, softcap=None) -> (dq, dk, dv)
    (dk/dv shaped like k/v)

``window`` is transformers' sliding window (query at position p attends keys in (p - window, p], with
positions aligned bottom right like the causal mask), ``softcap`` the attention logit soft-capping
(Gemma2: scores = softcap * tanh(scale * q.k / softcap)). A backend applies them only when it says so
(``supports_window`` / ``supports_softcap``); :meth:`KernelChoice.for_layer` picks one that does, or refuses.
Who applies what: torch's CUDA flash op the window (window_size_left = window - 1, right 0: flash_window),
flash-attn 2/3 the window and the soft-cap (as far as the installed release takes them), the banded kernels
both (CPU and CUDA), cuDNN and torch's CPU flash op neither. A native window / soft-cap is probed once against
the banded kernel (verify_native_pattern) before it is trusted.

Inputs may be strided views as long as the head_dim is contiguous. A backend that cannot do GQA
itself gets k/v expanded here and dk/dv summed back. Nothing here knows about sequence parallelism.

The package: ``base`` (the contract, :class:`KernelError`, the registry by name), one module per backend family
(``sdpa``: torch's ops; ``banded``: the banded kernel and the probe of native windows against it; ``flash_attn``:
flash-attn 2/3), ``ops`` (the custom ops with fakes and FLOP formulas), ``choice`` (the shipped backends
registered, "auto" measured, names resolved per layer) and ``reference`` (the test reference).
"""
from . import ops  # noqa: F401  (registers torch.ops.ds_longctx.attention_forward / _backward)
from .banded import (BANDED_QUERY_TILE, PATTERN_PROBE_TOLERANCE, TorchBanded, TorchBandedCUDA,
                     banded_attention_backward, banded_attention_forward, verify_native_pattern)
from .base import (BACKENDS, Backend, KernelError, _AUTO_ORDER, _OVERRIDES, flash_window, overridden,
                   register_backend, torch_flash_window_kwargs)
from .choice import (MEASURE_MAX_TOKENS, KernelChoice, MeasuredChoice, _BANDED, available_backends, backend_for,
                     get_backend, is_available, is_known, kernel_names)
from .flash_attn import FlashAttn2, FlashAttn3, call_by_name, flash_pattern_kwargs
from .ops import attention_backward, attention_forward, backward_workspace_bytes
from .reference import reference_attention
from .sdpa import TorchCPUFlash, TorchCUDAcuDNN, TorchCUDAFlash, Windowed

__all__ = ["Backend", "BACKENDS", "KernelChoice", "Windowed", "TorchBanded", "TorchBandedCUDA", "TorchCPUFlash",
           "TorchCUDAFlash", "TorchCUDAcuDNN", "FlashAttn2", "FlashAttn3", "banded_attention_forward",
           "banded_attention_backward", "MeasuredChoice", "available_backends", "backend_for", "get_backend",
           "is_available", "is_known", "reference_attention", "register_backend", "overridden", "kernel_names",
           "KernelError", "attention_forward", "attention_backward", "backward_workspace_bytes",
           "verify_native_pattern", "flash_window", "torch_flash_window_kwargs", "flash_pattern_kwargs",
           "call_by_name", "BANDED_QUERY_TILE", "PATTERN_PROBE_TOLERANCE", "MEASURE_MAX_TOKENS"]
