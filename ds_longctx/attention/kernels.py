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
"""
from __future__ import annotations

import contextlib
import importlib.util
from typing import Dict, Optional, Tuple, Type

import torch
from torch.utils.flop_counter import register_flop_formula

from ..config import KERNEL_NAMES
from ..dist.verdicts import world_sum
from ..measure.flops import attention_flops, register_attention

aten = torch.ops.aten


class KernelError(ValueError):
    """A kernel that cannot run what it is asked (a window or soft-cap it does not apply, a build that drops
    them, another device's tensors), in op terms: ``problem`` and ``fix`` name kernels, not a config key. The
    layer that took the kernel name from the config (checks.get_backend, the attention installs) re-raises it
    as the ConfigError naming ``long_context.attention.kernel`` (errors.naming)."""

    def __init__(self, problem: str, fix: str):
        self.problem, self.fix = problem, fix
        super().__init__(f"{problem}. Fix: {fix}")

    def __reduce__(self):
        return (type(self), (self.problem, self.fix))


class Backend:
    name = "base"
    native_gqa = False
    device_type = "cpu"
    supports_window = False   # applies a sliding window (never silently ignores one: forward refuses)
    supports_softcap = False  # applies attention logit soft-capping

    @staticmethod
    def available() -> bool:
        return False

    def _fwd(self, q, k, v, causal, scale):
        raise NotImplementedError

    def _bwd(self, dout, q, k, v, out, lse, causal, scale):
        raise NotImplementedError

    # True: the planner's stand-in, whose kernel is the ops' fake (it never runs on real tensors)
    fake_only = False

    def _through_op(self) -> bool:
        # registered backends (and the planner's stand-in) run as the custom ops below, so fake tensors, torch's
        # FlopCounterMode and torch.compile see one op with a fake and a FLOP formula; a subclass defined
        # elsewhere (tests) is called directly
        return self.fake_only or BACKENDS.get(self.name) is type(self)

    def _fwd_pattern(self, q, k, v, causal, scale, window: int, softcap: float):
        """The kernel with a sliding window (``window`` > 0) and/or soft-capping (``softcap`` > 0); a backend
        that supports neither only ever gets window 0 and softcap 0 (``forward`` refuses the rest)."""
        if window > 0 or softcap > 0:
            raise NotImplementedError(f"{self.name} applies no sliding window or soft-capping")
        return self._fwd(q, k, v, causal, scale)

    def _bwd_pattern(self, dout, q, k, v, out, lse, causal, scale, window: int, softcap: float):
        if window > 0 or softcap > 0:
            raise NotImplementedError(f"{self.name} applies no sliding window or soft-capping")
        return self._bwd(dout, q, k, v, out, lse, causal, scale)

    def fwd(self, q, k, v, causal, scale, window: int = 0, softcap: float = 0.0):
        if self._through_op():
            return torch.ops.ds_longctx.attention_forward(q, k, v, causal, float(scale), self.name, int(window),
                                                          float(softcap))
        return self._fwd_pattern(q, k, v, causal, scale, int(window), float(softcap))

    def bwd(self, dout, q, k, v, out, lse, causal, scale, window: int = 0, softcap: float = 0.0):
        if self._through_op():
            return torch.ops.ds_longctx.attention_backward(dout, q, k, v, out, lse, causal, float(scale), self.name,
                                                           int(window), float(softcap))
        return self._bwd_pattern(dout, q, k, v, out, lse, causal, scale, int(window), float(softcap))

    def _pattern(self, causal, window, softcap) -> Tuple[int, float]:
        """(window, softcap) as the ops take them (0: none); refuses what this backend would drop."""
        w = int(window) if window else 0
        c = float(softcap) if softcap else 0.0
        if w < 0 or c < 0:
            raise ValueError(f"{self.name}: sliding window {window!r} and soft-cap {softcap!r} must be positive")
        if w and not causal:
            raise ValueError(f"{self.name}: a sliding window needs causal attention")
        if not self.fake_only and ((w and not self.supports_window) or (c and not self.supports_softcap)):
            what = " and ".join(n for n, on in (("a sliding window", w and not self.supports_window),
                                                ("attention soft-capping", c and not self.supports_softcap)) if on)
            raise KernelError(f"kernel {self.name!r} cannot apply {what}",
                              "use kernel 'auto', which picks a kernel that applies them")
        return w, c

    def forward(self, q, k, v, causal: bool, scale: float, window: Optional[int] = None,
                softcap: Optional[float] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        _check(self, q, k, v)
        w, c = self._pattern(causal, window, softcap)
        rep = q.shape[2] // k.shape[2]
        if rep > 1 and not self.native_gqa:
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        return self.fwd(q, k, v, causal, scale, w, c)

    def backward(self, dout, q, k, v, out, lse, causal: bool, scale: float, window: Optional[int] = None,
                 softcap: Optional[float] = None):
        w, c = self._pattern(causal, window, softcap)
        rep = q.shape[2] // k.shape[2]
        if rep > 1 and not self.native_gqa:
            b, s, hk, d = k.shape
            ke, ve = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
            dq, dk, dv = self.bwd(dout, q, ke, ve, out, lse, causal, scale, w, c)
            return dq, dk.view(b, s, hk, rep, d).sum(3), dv.view(b, s, hk, rep, d).sum(3)
        return self.bwd(dout, q, k, v, out, lse, causal, scale, w, c)


def _check(backend, q, k, v):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"{backend.name}: q/k/v must be [b, s, h, d], got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if q.shape[2] % k.shape[2] != 0 or k.shape != v.shape:
        raise ValueError(f"{backend.name}: {q.shape[2]} query heads are not a multiple of {k.shape[2]} kv heads "
                         f"(k {tuple(k.shape)}, v {tuple(v.shape)})")
    if q.device.type != backend.device_type:
        raise KernelError(f"{backend.name} runs on {backend.device_type} tensors, got {q.device}",
                          "use kernel 'auto' or a kernel for this device")


def _bhsd(t):
    # [b, s, h, d] -> [b, h, s, d] view: torch's flash ops take this layout and read strides
    return t.transpose(1, 2)


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


BANDED_QUERY_TILE = 128  # query rows per tile of the banded kernel: its scores are [b, h, tile, tile + window - 1]
BANDED_TILE_ELEMENTS = 1 << 24  # at most this many scores per tile (fewer rows when the band or batch is wide)


def _banded_tiles(s_q: int, s_k: int, causal: bool, window: int, bh: int = 1):
    """(q0, q1, k0, k1) per query tile: the keys any row of the tile may see (causal bottom-right aligned,
    inside the window); keys outside [k0, k1) are never read. ``bh``: batch x query heads (the tile's rows
    shrink so that a tile holds at most BANDED_TILE_ELEMENTS scores: a soft-capped full layer's band is the
    whole sequence)."""
    off = s_k - s_q
    rows = BANDED_QUERY_TILE
    span = min(s_k, window + rows - 1) if window > 0 else s_k
    rows = max(1, min(rows, BANDED_TILE_ELEMENTS // max(1, bh * span)))
    for q0 in range(0, s_q, rows):
        q1 = min(s_q, q0 + rows)
        k1 = min(s_k, q1 + off) if causal else s_k
        k0 = max(0, q0 + off - window + 1) if window > 0 else 0
        yield q0, q1, k0, k1


def _banded_scores(qt, kt, scale, softcap, q0, k0, off, causal, window):
    """Scores of a query tile [b, t, hk, rep, d] against keys [b, n, hk, d] -> (s, allowed, tanh or None),
    s [b, hk, rep, t, n] in the accumulation dtype, soft-capped, masked to -inf outside causal/window."""
    s = torch.einsum("bthrd,bnhd->bhrtn", qt, kt) * scale
    th = None
    if softcap > 0:
        th = torch.tanh(s / softcap)
        s = th * softcap
    pos = torch.arange(q0, q0 + qt.shape[1], device=qt.device)[:, None] + off
    key = torch.arange(k0, k0 + kt.shape[1], device=qt.device)[None, :]
    allowed = key <= pos if causal else torch.ones_like(key <= pos)
    if window > 0:
        allowed = allowed & (key > pos - window)
    s = s.masked_fill(~allowed, float("-inf"))
    return s, th


def _acc_dtype(t):
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def banded_attention_forward(q, k, v, causal: bool, scale: float, window: int = 0, softcap: float = 0.0):
    """Attention with a sliding window and/or soft-capping, computed tile by tile over the band: each query
    tile reads only the keys its rows may see (never an S x S score or mask). Layout as the module doc
    (GQA natively); out in q's dtype, lse [b, h, s_q] fp32 (fp64 for fp64 inputs)."""
    b, s_q, h, d = q.shape
    s_k, hk = k.shape[1], k.shape[2]
    rep = h // hk
    acc = _acc_dtype(q)
    out = torch.empty(b, s_q, h, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(b, h, s_q, dtype=acc, device=q.device)
    for q0, q1, k0, k1 in _banded_tiles(s_q, s_k, causal, window, b * h):
        qt = q[:, q0:q1].to(acc).reshape(b, q1 - q0, hk, rep, d)
        kt, vt = k[:, k0:k1].to(acc), v[:, k0:k1].to(acc)
        sc, _ = _banded_scores(qt, kt, scale, softcap, q0, k0, s_k - s_q, causal, window)
        m = torch.logsumexp(sc, dim=-1)  # [b, hk, rep, t]
        p = torch.exp(sc - m[..., None])
        o = torch.einsum("bhrtn,bnhd->bthrd", p, vt)
        out[:, q0:q1] = o.reshape(b, q1 - q0, h, -1).to(q.dtype)
        lse[:, :, q0:q1] = m.reshape(b, h, q1 - q0)
    return out, lse


def banded_attention_backward(dout, q, k, v, out, lse, causal: bool, scale: float, window: int = 0,
                              softcap: float = 0.0):
    """Gradients of :func:`banded_attention_forward` from its LSE (the scores are recomputed per tile, the
    soft-cap's derivative is 1 - tanh^2); dk/dv accumulate over the tiles in fp32 (fp64 for fp64)."""
    b, s_q, h, d = q.shape
    s_k, hk = k.shape[1], k.shape[2]
    rep = h // hk
    acc = _acc_dtype(q)
    dq = torch.empty_like(q)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    lse4 = lse.reshape(b, hk, rep, s_q)
    for q0, q1, k0, k1 in _banded_tiles(s_q, s_k, causal, window, b * h):
        t = q1 - q0
        qt = q[:, q0:q1].to(acc).reshape(b, t, hk, rep, d)
        kt, vt = k[:, k0:k1].to(acc), v[:, k0:k1].to(acc)
        do = dout[:, q0:q1].to(acc).reshape(b, t, hk, rep, -1)
        ot = out[:, q0:q1].to(acc).reshape(b, t, hk, rep, -1)
        sc, th = _banded_scores(qt, kt, scale, softcap, q0, k0, s_k - s_q, causal, window)
        p = torch.exp(sc - lse4[..., q0:q1].to(acc)[..., None])  # [b, hk, rep, t, n]
        dv[:, k0:k1] += torch.einsum("bhrtn,bthrd->bnhd", p, do)
        dp = torch.einsum("bthrd,bnhd->bhrtn", do, vt)
        delta = (do * ot).sum(-1).permute(0, 2, 3, 1)  # [b, hk, rep, t]
        ds = p * (dp - delta[..., None])
        if th is not None:
            ds = ds * (1 - th * th)
        ds = ds * scale
        dq[:, q0:q1] = torch.einsum("bhrtn,bnhd->bthrd", ds, kt).reshape(b, t, h, d).to(q.dtype)
        dk[:, k0:k1] += torch.einsum("bhrtn,bthrd->bnhd", ds, qt)
    return dq, dk.to(k.dtype), dv.to(v.dtype)


class TorchBanded(Backend):
    """Sliding windows and soft-capping in plain torch ops, tile by tile over the band (banded_attention_*):
    what 'auto' runs for a windowed or soft-capped layer on CPU (torch's CPU flash op has neither)."""
    name = "torch_banded"
    native_gqa = True
    device_type = "cpu"
    supports_window = True
    supports_softcap = True

    @staticmethod
    def available() -> bool:
        return True

    def _fwd(self, q, k, v, causal, scale):
        return banded_attention_forward(q, k, v, causal, scale)

    def _bwd(self, dout, q, k, v, out, lse, causal, scale):
        return banded_attention_backward(dout, q, k, v, out, lse, causal, scale)

    def _fwd_pattern(self, q, k, v, causal, scale, window, softcap):
        return banded_attention_forward(q, k, v, causal, scale, window, softcap)

    def _bwd_pattern(self, dout, q, k, v, out, lse, causal, scale, window, softcap):
        return banded_attention_backward(dout, q, k, v, out, lse, causal, scale, window, softcap)


class TorchBandedCUDA(TorchBanded):
    """The same banded computation on CUDA tensors: a candidate of the measured 'auto' for windowed or
    soft-capped layers on a GPU, next to the flash kernels' native window_size / softcap (NOT run in CI)."""
    name = "torch_banded_cuda"
    device_type = "cuda"

    @staticmethod
    def available() -> bool:
        return torch.cuda.is_available()


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


_FLASH_DEFAULTS = dict(dropout_p=0.0, window_size=(-1, -1), window_size_left=-1, window_size_right=-1, softcap=0.0,
                       alibi_slopes=None, return_softmax=False, deterministic=False, rng_state=None)


_PATTERN_VERIFIED: Dict[Tuple[str, bool, bool, str, str], Optional[float]] = {}  # -> error (None: being probed)
PATTERN_PROBE_TOLERANCE = 2e-2  # relative error of the probe vs the banded kernel in fp32 (bf16 inputs: ~4e-3)


def verify_native_pattern(backend: "Backend", like: torch.Tensor, window: int, softcap: float) -> None:
    """Once per (kernel, window or not, soft-cap or not, dtype, device type): a native window / soft-cap is
    checked on a 96-token probe against the banded kernel (fp32), so a build that ignores the argument (flash
    compiled with FLASHATTENTION_DISABLE_LOCAL / _SOFTCAP) is an error instead of a silently dropped window.
    Local to this process (no collective); a few milliseconds once."""
    if like.device.type == "meta":  # shapes only (the argument tests): no values to check
        return
    key = (backend.name, window > 0, softcap > 0, str(like.dtype), like.device.type)
    if key not in _PATTERN_VERIFIED:
        _PATTERN_VERIFIED[key] = None  # the probe's own call passes
        try:
            g = torch.Generator(device=like.device).manual_seed(0)
            d, w, c = like.shape[-1], 5 if window > 0 else 0, 0.5 if softcap > 0 else 0.0
            q, k, v = (torch.randn(1, 96, 2, d, generator=g, device=like.device).to(like.dtype) for _ in range(3))
            out, _ = backend._fwd_pattern(q, k, v, True, d ** -0.5, w, c)
            ref, _ = banded_attention_forward(q.float(), k.float(), v.float(), True, d ** -0.5, w, c)
            _PATTERN_VERIFIED[key] = ((out.float() - ref).norm() / ref.norm()).item()
        except BaseException:
            del _PATTERN_VERIFIED[key]  # never a pass by default
            raise
    err = _PATTERN_VERIFIED[key]
    if err is not None and not err <= PATTERN_PROBE_TOLERANCE:
        what = " and ".join(n for n, on in (("sliding window", window > 0), ("soft-capping", softcap > 0)) if on)
        raise KernelError(f"kernel {backend.name!r} does not apply its {what} on this install (a 96-token probe "
                          f"differs from the banded kernel by {err:.3g}: the build ignores it)",
                          "use kernel 'auto' (it then measures the kernels that pass, the banded one at least)")


def flash_window(window: int) -> Tuple[int, int]:
    """flash's (window_size_left, window_size_right) for transformers' sliding ``window`` with causal attention:
    query i sees keys (i - window, i], i.e. window - 1 keys to its left and none to its right (what
    transformers' own flash path passes, modeling_flash_attention_utils: (window - 1, window - 1) with causal,
    whose right part flash sets to 0 under causal). (-1, -1): no window."""
    return (int(window) - 1, 0) if window and window > 0 else (-1, -1)


def torch_flash_window_kwargs(window: int) -> Dict[str, int]:
    """Keyword arguments of aten._flash_attention_forward/_backward for a sliding ``window`` ({} for none)."""
    if not window or window <= 0:
        return {}
    left, right = flash_window(window)
    return {"window_size_left": left, "window_size_right": right}


def _params(fn):
    """The parameters of a flash-attn function; its private fwd/bwd are torch custom ops in current
    releases (CustomOpDef, whose own signature is (*args, **kwargs)): the wrapped function's."""
    import inspect

    return inspect.signature(getattr(fn, "_init_fn", fn)).parameters


def flash_pattern_kwargs(fn, window: int, softcap: float, name: str) -> Dict[str, object]:
    """Keyword arguments that give flash-attn's ``fn`` a sliding ``window`` and ``softcap`` (both 0: none), by
    the parameter names of the installed release: ``window_size_left/right`` (FA2 >= 2.7), ``window_size``
    (left, right) (FA2 2.3-2.6, FA3), ``softcap`` (FA2 >= 2.6, FA3). A release without the parameter is an
    error (never a dropped window or cap)."""
    params = _params(fn)
    kw: Dict[str, object] = {}
    if window and window > 0:
        left, right = flash_window(window)
        if "window_size_left" in params and "window_size_right" in params:
            kw.update(window_size_left=left, window_size_right=right)
        elif "window_size" in params:
            kw["window_size"] = (left, right)
        else:
            raise KernelError(f"{name}: the installed {getattr(fn, '__name__', fn)} takes no window size",
                              "upgrade flash-attn (>= 2.3) or use kernel 'auto'")
    if softcap and softcap > 0:
        if "softcap" not in params:
            raise KernelError(f"{name}: the installed {getattr(fn, '__name__', fn)} takes no softcap",
                              "upgrade flash-attn (>= 2.6) or use kernel 'auto'")
        kw["softcap"] = float(softcap)
    return kw


def _takes(module: str, fns: Tuple[str, ...], any_of: Tuple[str, ...]) -> bool:
    """Whether every one of ``fns`` of the installed ``module`` takes one of the parameters ``any_of``."""
    if not torch.cuda.is_available() or importlib.util.find_spec(module.split(".")[0]) is None:
        return False
    try:
        mod = importlib.import_module(module)
        return all(any(p in _params(getattr(mod, f)) for p in any_of) for f in fns)
    except Exception:  # noqa: BLE001 - a broken install applies nothing (check_kernel reports it unavailable)
        return False


class _Capability:
    """A class attribute read from the installed library's signatures at its first read (cached)."""

    def __init__(self, module: str, fns: Tuple[str, ...], any_of: Tuple[str, ...]):
        self.args, self.value = (module, fns, any_of), None

    def __get__(self, obj, cls=None) -> bool:
        if self.value is None:
            self.value = _takes(*self.args)
        return self.value


def _call_by_name(fn, **known):
    """flash-attn's private fwd/bwd signatures change between releases: bind by parameter name."""
    import inspect

    kwargs = {}
    for name, p in _params(fn).items():
        if name in known:
            kwargs[name] = known[name]
        elif name in _FLASH_DEFAULTS:
            kwargs[name] = _FLASH_DEFAULTS[name]
        elif p.default is inspect.Parameter.empty:
            kwargs[name] = None  # cu_seqlens_*, page tables, descales, ...: unused for dense batches
    return fn(**kwargs)


def _lse_from(res, q):
    # the LSE's position in the returned tuple differs by release; it is the [b, h, s_q] fp32 tensor
    b, s, h, _ = q.shape
    for t in res[1:]:
        if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and tuple(t.shape) == (b, h, s):
            return t
    raise RuntimeError("flash-attn forward returned no [b, h, s] float32 LSE; unsupported flash-attn version")


_FA2_FNS = ("_flash_attn_forward", "_flash_attn_backward", "_flash_attn_varlen_forward", "_flash_attn_varlen_backward")
_FA3_FNS = ("_flash_attn_forward", "_flash_attn_backward")


class _FlashAttnPrivate(Backend):
    """flash-attn's private ``_flash_attn_forward/_backward`` (FA2 and FA3 alike), the window and soft-cap passed
    by the argument names the installed release takes (flash_pattern_kwargs). ``_module`` imports the release."""
    native_gqa = True
    device_type = "cuda"

    @staticmethod
    def _module():
        raise NotImplementedError

    def _fwd(self, q, k, v, causal, scale):
        return self._fwd_pattern(q, k, v, causal, scale, 0, 0.0)

    def _bwd(self, dout, q, k, v, out, lse, causal, scale):
        return self._bwd_pattern(dout, q, k, v, out, lse, causal, scale, 0, 0.0)

    def _fwd_pattern(self, q, k, v, causal, scale, window, softcap):
        fn = self._module()._flash_attn_forward
        if window > 0 or softcap > 0:
            verify_native_pattern(self, q, window, softcap)
        res = _call_by_name(fn, q=q, k=k, v=v, softmax_scale=scale, causal=causal,
                            **flash_pattern_kwargs(fn, window, softcap, self.name))
        return res[0], _lse_from(res, q)

    def _bwd_pattern(self, dout, q, k, v, out, lse, causal, scale, window, softcap):
        fn = self._module()._flash_attn_backward
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _call_by_name(fn, dout=dout.contiguous(), q=q, k=k, v=v, out=out, softmax_lse=lse, dq=dq, dk=dk, dv=dv,
                      softmax_scale=scale, causal=causal, **flash_pattern_kwargs(fn, window, softcap, self.name))
        return dq, dk, dv


class FlashAttn2(_FlashAttnPrivate):
    """flash_attn 2.x private fwd/bwd (the public autograd wrapper does not expose a backward from the LSE).
    Sliding windows and soft-capping natively where the installed release takes them (window_size: 2.3,
    softcap: 2.6), dense and varlen (attention/documents.py)."""
    name = "flash_attention_2"
    supports_window = _Capability("flash_attn.flash_attn_interface", _FA2_FNS, ("window_size", "window_size_left"))
    supports_softcap = _Capability("flash_attn.flash_attn_interface", _FA2_FNS, ("softcap",))

    @staticmethod
    def available() -> bool:
        return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None

    @staticmethod
    def _module():
        from flash_attn import flash_attn_interface

        return flash_attn_interface


class FlashAttn3(_FlashAttnPrivate):
    """flash_attn_interface (FA3, Hopper) private fwd/bwd; window_size and softcap natively."""
    name = "flash_attention_3"
    supports_window = _Capability("flash_attn_interface", _FA3_FNS, ("window_size", "window_size_left"))
    supports_softcap = _Capability("flash_attn_interface", _FA3_FNS, ("softcap",))

    @staticmethod
    def available() -> bool:
        if not torch.cuda.is_available() or importlib.util.find_spec("flash_attn_interface") is None:
            return False
        return torch.cuda.get_device_capability()[0] >= 9

    @staticmethod
    def _module():
        import flash_attn_interface

        return flash_attn_interface


# ---------------------------------------------------------------------------------------------
# The kernels as custom ops (flash-attn's style): one op per direction with a fake (shapes and dtypes only,
# what every backend returns) and a FLOP formula (the causal mask halves the square). The real kernel is the
# named backend's _fwd/_bwd. Layout as in the module doc; out/dq/dk/dv come back as [b, s, h, d] views of
# kernel buffers, the fakes allocate them contiguous in that shape (same bytes).
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("ds_longctx::attention_forward", mutates_args=())
def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                      backend: str, window: int = 0, softcap: float = 0.0) -> Tuple[torch.Tensor, torch.Tensor]:
    out, lse = _instance(BACKENDS[backend])._fwd_pattern(q, k, v, causal, scale, window, softcap)
    # a custom op may not return an input or a view of one: never the case for a kernel's fresh buffers
    return out, lse


@attention_forward.register_fake
def _(q, k, v, causal, scale, backend, window=0, softcap=0.0):
    b, s, h, _ = q.shape
    return (torch.empty(b, s, h, v.shape[-1], dtype=q.dtype, device=q.device),
            torch.empty(b, h, s, dtype=torch.float32, device=q.device))


@torch.library.custom_op("ds_longctx::attention_backward", mutates_args=())
def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, causal: bool, scale: float, backend: str, window: int = 0,
                       softcap: float = 0.0) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = _instance(BACKENDS[backend])._bwd_pattern(dout, q, k, v, out, lse, causal, scale, window, softcap)
    return dq, dk, dv


@attention_backward.register_fake
def _(dout, q, k, v, out, lse, causal, scale, backend, window=0, softcap=0.0):
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device),
            torch.empty(v.shape, dtype=v.dtype, device=v.device))


def backward_workspace_bytes(q_shape, k_shape, itemsize: int) -> int:
    """Device memory a flash-attention-2 backward holds during the call besides its results (flash_api.cpp
    mha_bwd): an fp32 dq accumulator, the fp32 softmax_d row sums, and head-expanded dk/dv under GQA. What
    the planner charges a GPU attention backward (the CPU kernel's is not modelled). Layout [b, s, h, d]."""
    b, s, h, d = q_shape
    work = 4 * b * s * h * d + 4 * b * h * s
    if k_shape[2] != h:
        work += 2 * b * k_shape[1] * h * k_shape[3] * itemsize
    return work


def _register_flop_formulas():
    fwd, bwd = torch.ops.ds_longctx.attention_forward, torch.ops.ds_longctx.attention_backward

    @register_flop_formula(fwd)
    def _fwd_flops(q, k, v, causal, scale, backend, window=0, softcap=0.0, *args, out_shape=None, **kwargs) -> int:
        b, s, h, d = q
        return attention_flops(b, h, s, k[1], d, causal, backward=False, window=window or None)

    @register_flop_formula(bwd)
    def _bwd_flops(dout, q, k, v, out, lse, causal, scale, backend, window=0, softcap=0.0, *args, out_shape=None,
                   **kwargs) -> int:
        b, s, h, d = q
        return attention_flops(b, h, s, k[1], d, causal, backward=True, window=window or None)

    register_attention(fwd, backward=False)
    register_attention(bwd, backward=True)


_register_flop_formulas()


# The registration seam: backends by name, the per-device "auto" order, and per-device overrides.
# Callers change these only through register_backend / overridden (never by assigning module attributes).
BACKENDS: Dict[str, Type[Backend]] = {}
_AUTO_ORDER: Dict[str, Tuple[str, ...]] = {}
_OVERRIDES: Dict[str, Type[Backend]] = {}  # device type -> the backend every kernel name resolves to
_INSTANCES: Dict[type, Backend] = {}
_MEASURED: Dict[str, "MeasuredChoice"] = {}  # device type -> the "auto" of that device (several candidates)
_CONFIG_NAMES: Tuple[str, ...] = ()  # backends a config may name (the rest are reached via "auto"/"sdpa")


def register_backend(cls: Type[Backend], auto: bool = False, config_name: bool = False) -> Type[Backend]:
    """Register ``cls`` under ``cls.name``. ``auto=True`` appends it to the "auto" order of its device type
    (earlier registrations are preferred); ``config_name=True`` lets ``long_context.attention.kernel`` name
    it: config.KERNEL_NAMES lists the names a config accepts (config.py is a leaf: it imports no op), so a name
    missing there is refused here)."""
    global _CONFIG_NAMES
    if config_name and cls.name not in KERNEL_NAMES:
        raise ValueError(f"register_backend: {cls.name!r} is not in ds_longctx.config.KERNEL_NAMES; add it there for "
                         "long_context.attention.kernel to accept it")
    BACKENDS[cls.name] = cls
    if config_name and cls.name not in _CONFIG_NAMES:
        _CONFIG_NAMES += (cls.name,)
    if auto:
        _AUTO_ORDER[cls.device_type] = _AUTO_ORDER.get(cls.device_type, ()) + (cls.name,)
    return cls


@contextlib.contextmanager
def overridden(device_type: str, cls: Type[Backend]):
    """Inside the block every kernel name resolves to ``cls`` for tensors on ``device_type`` (the planner's
    meta stand-in device: a config naming a CUDA kernel means that kernel's memory on the GPU)."""
    if device_type in _OVERRIDES:
        raise RuntimeError(f"attention kernels for {device_type!r} are already overridden")
    _OVERRIDES[device_type] = cls
    try:
        yield
    finally:
        _OVERRIDES.pop(device_type, None)
        _INSTANCES.pop(cls, None)


# device type -> the banded kernels: 'auto''s kernel for a windowed / soft-capped layer where 'auto' is one kernel
# without the capability (CPU), and a measured candidate for such layers only where 'auto' measures (CUDA)
_BANDED: Dict[str, Tuple[str, ...]] = {"cpu": ("torch_banded",), "cuda": ("torch_banded_cuda",)}

# CUDA "auto" measures every available candidate (MeasuredChoice); this order only breaks exact ties
for _cls, _auto, _named in ((FlashAttn3, True, True), (FlashAttn2, True, True), (TorchCUDAcuDNN, True, True),
                            (TorchCUDAFlash, True, True), (TorchCPUFlash, True, False), (TorchBanded, False, False),
                            (TorchBandedCUDA, False, False)):
    register_backend(_cls, auto=_auto, config_name=_named)


# ---------------------------------------------------------------------------------------------
# "auto" by measurement. Kernel speed on a GPU depends on the torch/cuDNN/flash build, the chip and the
# shape (the H200 run: torch's flash op at ~310 TFLOP/s where tied SDPA's cuDNN ran ~520), so a fixed
# order is wrong somewhere; the choice is measured once per call signature instead.
# ---------------------------------------------------------------------------------------------

MEASURE_MAX_TOKENS = 32768  # time on a prefix of at most this many tokens: at 5M tokens one stage is seconds,
                            # and the ranking of kernels at 32K already holds at long sequences (same tiles)


def _cuda_timer(fn, reps: int = 2) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs after one warm-up, with CUDA events."""
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


class MeasuredChoice(Backend):
    """'auto' where several backends are available: at the first call of a signature (dtype, causal,
    head_dim, query and kv heads; not the length) each candidate's forward + backward is timed once on the
    call's own inputs (a prefix of at most MEASURE_MAX_TOKENS tokens), the per-candidate times are summed
    over every rank of the job (one collective: every rank then picks the same kernel), and the fastest
    is used for that signature from then on. A candidate that raises is out for the signature. The
    choice and its times are logged on rank 0 and kept in ``choices``.

    ``timer(fn) -> seconds`` and ``agree(tensor) -> tensor`` are injectable (CPU tests); defaults: CUDA
    events and an all-reduce over the default group. Every rank must reach a new signature at the same
    point of the program (same model, same layer order): attention calls do, packed ones included
    (``DocumentBackend`` measures the dense kernel before its varlen call).

    A layer with a sliding window or soft-capping (``window``/``softcap`` given, through :class:`Windowed`)
    has its own signature (the window and cap are part of it): its candidates are those that apply both
    (``supports_window``/``supports_softcap``) plus ``pattern_only`` (the banded kernel: exact, never a
    candidate for a full layer). It is agreed over the job like a full one: a windowed layer always runs its
    windowed kernel, whatever the sequence length (a window covering the sequence is exactly causal), so
    which signatures a rank meets, and in which order, never depends on its batch's length.
    """

    native_gqa = True  # each candidate handles GQA itself

    def __init__(self, candidates, timer=None, agree=None, pattern_only=()):
        if not candidates:
            raise ValueError("MeasuredChoice needs at least one candidate backend")
        self.candidates = list(candidates)
        self.pattern_only = list(pattern_only)
        every = self.candidates + self.pattern_only
        self.supports_window = any(c.supports_window for c in every)
        self.supports_softcap = any(c.supports_softcap for c in every)
        self.device_type = self.candidates[0].device_type
        self.name = "auto"
        self.timer = timer or _cuda_timer
        self.agree = agree or world_sum
        self.choices = {}  # signature -> {"kernel": name, "seconds": {name: s or None}}
        self._chosen = {}  # signature -> Backend

    @staticmethod
    def signature(q, k, causal: bool, window: Optional[int] = None, softcap: Optional[float] = None):
        # no sequence length: ranks of different data-parallel replicas (or documents of a packed sample) see
        # different lengths, and a signature one rank meets alone would leave the others in the collective.
        # The window and soft-cap are in it: a windowed layer and a full one may pick different kernels.
        return (str(q.dtype), bool(causal), q.shape[-1], q.shape[2], k.shape[2], int(window or 0),
                float(softcap or 0.0))

    def eligible(self, window: Optional[int] = None, softcap: Optional[float] = None):
        """The candidates for a layer with this window / soft-cap (none: the full-layer candidates)."""
        if not window and not softcap:
            return self.candidates
        return [c for c in self.candidates + self.pattern_only
                if (not window or c.supports_window) and (not softcap or c.supports_softcap)]

    def _time(self, cand, q, k, v, causal, scale, window, softcap) -> float:
        n = min(q.shape[1], MEASURE_MAX_TOKENS)
        qs, ks, vs = q[:, :n], k[:, :n], v[:, :n]

        def step():
            o, lse = cand.forward(qs, ks, vs, causal, scale, window, softcap)
            # dout = out: any tensor of the right shape
            cand.backward(o, qs, ks, vs, o, lse, causal, scale, window, softcap)

        return float(self.timer(step))

    def choose(self, q, k, v, causal: bool, scale: float, window: Optional[int] = None,
               softcap: Optional[float] = None) -> Backend:
        sig = self.signature(q, k, causal, window, softcap)
        if sig in self._chosen:
            return self._chosen[sig]
        cands = self.eligible(window, softcap)
        if not cands:
            raise KernelError(f"no kernel of {[c.name for c in self.candidates]} applies a sliding window of "
                              f"{window} and soft-capping {softcap}", "run on CPU or install flash-attn >= 2.6")
        secs = []
        for cand in cands:
            try:
                secs.append(self._time(cand, q, k, v, causal, scale, window, softcap))
            except Exception:  # noqa: BLE001 - a kernel that cannot run this signature is out for it
                secs.append(float("inf"))
        t = torch.tensor(secs, dtype=torch.float64, device=q.device)
        t = self.agree(t).cpu().tolist()
        best = min(range(len(t)), key=lambda i: (t[i], i))
        if t[best] == float("inf"):
            raise RuntimeError(f"attention 'auto': no candidate kernel ran q {tuple(q.shape)} {q.dtype}, k "
                               f"{tuple(k.shape)}, window {window}, softcap {softcap} (tried "
                               f"{[c.name for c in cands]}); name one of them as the kernel instead of 'auto' to see its "
                               "error")
        chosen = cands[best]
        self._chosen[sig] = chosen
        self.choices[sig] = {"kernel": chosen.name,
                             "seconds": {c.name: (None if s == float("inf") else s) for c, s in zip(cands, t)}}
        _log_choice(sig, self.choices[sig])
        return chosen

    def forward(self, q, k, v, causal: bool, scale: float, window=None, softcap=None):
        _check(self, q, k, v)
        w, c = self._pattern(causal, window, softcap)
        return self.choose(q, k, v, causal, scale, w, c).forward(q, k, v, causal, scale, w, c)

    def backward(self, dout, q, k, v, out, lse, causal: bool, scale: float, window=None, softcap=None):
        w, c = self._pattern(causal, window, softcap)
        sig = self.signature(q, k, causal, w, c)
        if sig not in self._chosen:
            raise RuntimeError(f"attention 'auto': backward of a signature {sig} whose forward never ran")
        return self._chosen[sig].backward(dout, q, k, v, out, lse, causal, scale, w, c)


def _log_choice(sig, choice):
    import logging

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    times = ", ".join(f"{n} {'-' if s is None else f'{s * 1e3:.2f} ms'}" for n, s in choice["seconds"].items())
    logging.getLogger("ds_longctx").info("attention 'auto' for %s: %s (%s)", sig, choice["kernel"], times)


def kernel_names() -> Tuple[str, ...]:
    """Values ``long_context.attention.kernel`` accepts: "auto" (measured on CUDA, see MeasuredChoice), the
    named backends (sdpa_cuda_cudnn: cuDNN's fused attention; sdpa_cuda_flash: torch's bundled FA2), and
    "sdpa" (torch's flash kernel for the tensors' device)."""
    return ("auto",) + _CONFIG_NAMES + ("sdpa",)


def _instance(cls: Type[Backend]) -> Backend:
    if cls not in _INSTANCES:
        _INSTANCES[cls] = cls()
    return _INSTANCES[cls]


def available_backends():
    return [n for n, cls in BACKENDS.items() if cls.available()]


def is_known(name: str) -> bool:
    return name in ("auto", "sdpa") or name in BACKENDS


def is_available(name: str) -> bool:
    """``name`` is known and its kernel can run on this machine ("auto"/"sdpa" always: resolved per device)."""
    return name in ("auto", "sdpa") or (name in BACKENDS and BACKENDS[name].available())


def backend_for(name: str, device) -> Backend:
    """The backend for ``name`` ('auto' | 'sdpa' | a backend's name) on ``device``; KernelError when there is
    none (checks.get_backend checks a config value first and names the key)."""
    dev = torch.device(device).type
    if dev in _OVERRIDES:
        return _instance(_OVERRIDES[dev])
    if not is_available(name):
        raise KernelError(f"attention kernel {name!r} is " + ("unknown" if not is_known(name) else
                          f"not available on this machine (found: {available_backends()})"),
                          "use kernel 'auto' or 'sdpa'")
    return _resolve(name, dev)


get_backend = backend_for  # the op-level name tests and benches use


class KernelChoice:
    """One kernel name, checked before (checks.check_kernel, called by the spec builder) and trusted here,
    resolved once per device type (at its first use): what an install holds instead of resolving the name per
    forward. An :func:`overridden` device type still wins at every call (the planner's stand-in)."""

    def __init__(self, name: str):
        self.name = name
        self._by_device: Dict[str, Backend] = {}

    def on(self, device: torch.device) -> Backend:
        dev = device.type if isinstance(device, torch.device) else torch.device(device).type
        if dev in _OVERRIDES:
            return _instance(_OVERRIDES[dev])
        backend = self._by_device.get(dev)
        if backend is None:
            backend = self._by_device[dev] = _resolve(self.name, dev)
        return backend

    def check_pattern(self, window: Optional[int], softcap: Optional[float], where: str) -> None:
        """At install, no tensor yet: a named kernel (or 'sdpa') that cannot apply the layer's sliding window or
        soft-capping is refused here, naming the layer; 'auto' always finds one (the banded kernel at least)."""
        if not window and not softcap or self.name == "auto":
            return
        names = ("sdpa_cpu_flash", "sdpa_cuda_flash") if self.name == "sdpa" else (self.name,)
        for n in names:
            cls = BACKENDS[n]
            asks = ((f"a sliding window of {window} tokens", window, cls.supports_window),
                    (f"attention soft-capping {softcap}", softcap, cls.supports_softcap))
            lacking = [what for what, on, ok in asks if on and not ok]
            if lacking:
                raise KernelError(f"{where} has {' and '.join(lacking)}, which kernel {n!r} ({self.name!r}) cannot "
                                  "apply", "use kernel 'auto': it runs such layers on a kernel that applies them (a "
                                  "flash kernel with window_size / softcap, or torch_banded)")

    def for_layer(self, device: torch.device, window: Optional[int], softcap: Optional[float],
                  where: str = "this layer") -> Backend:
        """The backend of one layer with its sliding window / soft-cap bound (:class:`Windowed`), or the plain
        backend for a full-causal layer. 'auto' measured on CUDA (:class:`MeasuredChoice`) measures, for such a
        layer, the kernels that apply its window / cap (flash's native window_size / softcap) and the banded
        kernel; a single-kernel 'auto' without the capability (CPU) takes the device's banded kernel; a named
        kernel without the capability is a KernelError naming ``where`` (also raised by check_pattern at
        install). An overridden device type (the planner's stand-in) keeps its override: its ops' FLOP
        formulas count the window."""
        base = self.on(device)
        if not window and not softcap:
            return base
        dev = device.type if isinstance(device, torch.device) else torch.device(device).type
        if dev not in _OVERRIDES:
            self.check_pattern(window, softcap, where)
            if (window and not base.supports_window) or (softcap and not base.supports_softcap):
                capable = [c for c in _BANDED.get(dev, ()) if BACKENDS[c].available()]
                if not capable:
                    raise KernelError(f"{where} needs a kernel with sliding windows / soft-capping, and none is "
                                      f"available for {dev} tensors", "run on CPU or CUDA")
                base = _instance(BACKENDS[capable[0]])
        return Windowed(base, window or 0, softcap or 0.0)


def _resolve(name: str, dev: str) -> Backend:
    """The backend of an already checked ``name`` for device type ``dev`` (no override)."""
    if name == "auto":
        found = [BACKENDS[c] for c in _AUTO_ORDER.get(dev, ()) if BACKENDS[c].available()]
        if not found:
            raise KernelError(f"no attention kernel with LSE is available for {dev} tensors",
                              "run on CPU or CUDA with torch>=2.3")
        if len(found) == 1:
            return _instance(found[0])
        if dev not in _MEASURED:  # one per device type: its choices hold for the whole job
            banded = [_instance(BACKENDS[c]) for c in _BANDED.get(dev, ()) if BACKENDS[c].available()]
            _MEASURED[dev] = MeasuredChoice([_instance(c) for c in found], pattern_only=banded)
        return _MEASURED[dev]
    if name == "sdpa":
        cand = {"cpu": "sdpa_cpu_flash", "cuda": "sdpa_cuda_flash"}.get(dev)
        if cand is None or not BACKENDS[cand].available():
            raise KernelError(f"torch's flash SDPA is not available for {dev} tensors",
                              "use kernel 'auto' or run on CPU/CUDA")
        return _instance(BACKENDS[cand])
    backend = _instance(BACKENDS[name])
    if backend.device_type != dev:
        raise KernelError(f"attention kernel {name!r} runs on {backend.device_type}, the tensors are on {dev}",
                          "use kernel 'auto' or move the model to the kernel's device")
    return backend


def reference_attention(q, k, v, causal: bool, scale: float, window: Optional[int] = None,
                        softcap: Optional[float] = None):
    """Plain math attention in q's dtype (use float64 inputs for a reference), a dense masked S x S: for
    tests. Same layout and window/soft-cap semantics as the backends."""
    rep = q.shape[2] // k.shape[2]
    qh, kh, vh = _bhsd(q), _bhsd(k.repeat_interleave(rep, 2)), _bhsd(v.repeat_interleave(rep, 2))
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if causal:
        sq, sk = scores.shape[-2:]
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        if window:
            mask &= ~torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq - window)
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.softmax(scores, dim=-1), vh)
    return out.transpose(1, 2), lse


__all__ = ["Backend", "BACKENDS", "KernelChoice", "Windowed", "TorchBanded", "banded_attention_forward",
           "banded_attention_backward",
           "MeasuredChoice", "available_backends", "backend_for", "get_backend", "is_available", "is_known",
           "reference_attention",
           "register_backend", "overridden", "kernel_names", "KernelError"]
