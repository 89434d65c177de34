"""torch's own attention ops as backends: the CPU flash op (what CI runs), the CUDA flash op and cuDNN, and
:class:`Windowed` (a sliding window applied through the banded kernel on top of another backend)."""
from __future__ import annotations

import torch

from .base import Backend, _bhsd, aten, torch_flash_window_kwargs
from .banded import verify_native_pattern


class TorchCPUFlash(Backend):
    """aten._scaled_dot_product_flash_attention_for_cpu (+ _backward): what CI runs."""
    name = "sdpa_cpu_flash"
    native_gqa = True  # measured: the CPU flash op takes fewer kv heads in forward and backward
    device_type = "cpu"

    @staticmethod
    def available() -> bool:
        return hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward")

    def _fwd(self, q, k, v, causal, scale):
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(_bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal,
                                                                    scale=scale)
        return out.transpose(1, 2), lse

    def _bwd(self, dout, q, k, v, out, lse, causal, scale):
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse, 0.0, causal, scale=scale)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


class Windowed(Backend):
    """``inner`` with one layer's sliding window and soft-cap bound: the staged loops and the per-document
    wrapper call ``forward(q, k, v, causal, scale)`` unchanged and the pattern is applied on every call."""

    def __init__(self, inner: Backend, window: int, softcap: float):
        self.inner, self.pattern = inner, (int(window or 0), float(softcap or 0.0))
        self.name = f"{inner.name}+window{self.pattern[0]}+softcap{self.pattern[1]:g}"
        self.device_type, self.native_gqa = inner.device_type, True

    def forward(self, q, k, v, causal: bool, scale: float, window=None, softcap=None):
        return self.inner.forward(q, k, v, causal, scale, *self.pattern)

    def backward(self, dout, q, k, v, out, lse, causal: bool, scale: float, window=None, softcap=None):
        return self.inner.backward(dout, q, k, v, out, lse, causal, scale, *self.pattern)


class TorchCUDAFlash(Backend):
    """aten._scaled_dot_product_flash_attention (+ _backward): torch's bundled FA2, fp16/bf16 only. A sliding
    window runs natively (aten._flash_attention_forward's window_size_left/right); soft-capping does not."""
    name = "sdpa_cuda_flash"
    supports_window = True
    # measured on an H100, torch 2.11+cu130 (bench/results/gpu_checks_h100.json, native_gqa_probe): the op takes
    # 2 and 1 kv heads for 8 query heads, forward and backward, as exact as with expanded heads
    native_gqa = True
    device_type = "cuda"

    @staticmethod
    def available() -> bool:
        return torch.cuda.is_available() and hasattr(aten, "_scaled_dot_product_flash_attention_backward")

    def _fwd(self, q, k, v, causal, scale):
        res = aten._scaled_dot_product_flash_attention(_bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, False, scale=scale)
        return res[0].transpose(1, 2), res[1]

    def _bwd(self, dout, q, k, v, out, lse, causal, scale):
        # with dropout 0 the philox state is never read; cum_seq_* are None for dense batches
        seed = torch.empty(2, dtype=torch.uint64, device=q.device)
        offset = torch.empty((), dtype=torch.uint64, device=q.device)
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse, None, None, q.shape[1], k.shape[1], 0.0,
            causal, seed, offset, scale=scale)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)

    # A sliding window: the op under SDPA, aten._flash_attention_forward/_backward, takes window_size_left/right
    # (flash's local attention) and the [b, s, h, d] layout itself; no soft-capping (torch passes softcap 0).
    def _fwd_pattern(self, q, k, v, causal, scale, window, softcap):
        if softcap > 0:
            raise NotImplementedError(f"{self.name} applies no soft-capping")
        if window <= 0:
            return self._fwd(q, k, v, causal, scale)
        verify_native_pattern(self, q, window, softcap)
        res = aten._flash_attention_forward(q, k, v, None, None, q.shape[1], k.shape[1], 0.0, causal, False,
                                            scale=scale, **torch_flash_window_kwargs(window))
        return res[0], res[1]

    def _bwd_pattern(self, dout, q, k, v, out, lse, causal, scale, window, softcap):
        if softcap > 0:
            raise NotImplementedError(f"{self.name} applies no soft-capping")
        if window <= 0:
            return self._bwd(dout, q, k, v, out, lse, causal, scale)
        rng = torch.empty(2, dtype=torch.uint64, device=q.device)  # dropout 0: the rng state is never read
        unused = torch.empty((), dtype=torch.uint64, device=q.device)
        dq, dk, dv = aten._flash_attention_backward(dout.contiguous(), q, k, v, out, lse, None, None, q.shape[1],
                                                    k.shape[1], 0.0, causal, rng, unused, scale=scale,
                                                    **torch_flash_window_kwargs(window))
        return dq, dk, dv


class TorchCUDAcuDNN(Backend):
    """aten._scaled_dot_product_cudnn_attention (+ _backward): cuDNN's fused attention, fp16/bf16. Neither
    a sliding window nor soft-capping (the op takes neither): windowed layers never run on it."""
    name = "sdpa_cuda_cudnn"
    native_gqa = True  # measured like sdpa_cuda_flash (H100, torch 2.11+cu130, cuDNN 9.19): GQA 8/2 and 8/1 exact
    device_type = "cuda"

    @staticmethod
    def available() -> bool:
        return (torch.cuda.is_available() and torch.backends.cudnn.is_available()
                and hasattr(aten, "_scaled_dot_product_cudnn_attention_backward"))

    def _fwd(self, q, k, v, causal, scale):
        res = aten._scaled_dot_product_cudnn_attention(_bhsd(q), _bhsd(k), _bhsd(v), None, True, 0.0, causal, False,
                                                      scale=scale)
        lse = res[1]
        return res[0].transpose(1, 2), lse[..., 0] if lse.dim() == 4 else lse  # cuDNN's LSE is [b, h, s, 1]

    def _bwd(self, dout, q, k, v, out, lse, causal, scale):
        seed = torch.empty((), dtype=torch.long, device=q.device)  # unused without dropout
        offset = torch.empty((), dtype=torch.long, device=q.device)
        dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
            _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse.unsqueeze(-1), seed, offset, None, None, None,
            q.shape[1], k.shape[1], 0.0, causal, scale=scale)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
