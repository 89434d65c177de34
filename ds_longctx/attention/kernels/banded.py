"""The banded kernel (torch only, CPU and CUDA): attention in query tiles over the band of keys a causal sliding
window reaches, with soft-capping; exact forward and backward from the saved log-sum-exp."""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from .base import Backend, KernelError


BANDED_QUERY_TILE = 128  # query rows per tile of the banded kernel: its scores are [b, h, tile, tile + window - 1]


BANDED_TILE_ELEMENTS = 1 << 24  # at most this many scores per tile (fewer rows when the band or batch is wide)


def _banded_tiles(s_q: int, s_k: int, causal: bool, window: int, bh: int = 1, offset: Optional[int] = None):
    """(q0, q1, k0, k1) per query tile: the keys any row of the tile may see (causal bottom-right aligned,
    inside the window); keys outside [k0, k1) are never read. ``bh``: batch x query heads (the tile's rows
    shrink so that a tile holds at most BANDED_TILE_ELEMENTS scores: a soft-capped full layer's band is the
    whole sequence). ``offset``: query row i sits at key position i + offset (None: s_k - s_q, bottom right)."""
    off = s_k - s_q if offset is None else offset
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


def banded_attention_forward(q, k, v, causal: bool, scale: float, window: int = 0, softcap: float = 0.0,
                             offset: Optional[int] = None):
    """Attention with a sliding window and/or soft-capping, computed tile by tile over the band: each query
    tile reads only the keys its rows may see (never an S x S score or mask). Layout as the module doc
    (GQA natively); out in q's dtype, lse [b, h, s_q] fp32 (fp64 for fp64 inputs). ``offset``: query row i sits at
    key position i + offset (None: s_k - s_q, the causal mask's bottom-right alignment; the ring's blocks of keys
    wholly before their queries give their own). Every query row must see at least one key."""
    b, s_q, h, d = q.shape
    s_k, hk = k.shape[1], k.shape[2]
    off = s_k - s_q if offset is None else offset
    rep = h // hk
    acc = _acc_dtype(q)
    out = torch.empty(b, s_q, h, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(b, h, s_q, dtype=acc, device=q.device)
    for q0, q1, k0, k1 in _banded_tiles(s_q, s_k, causal, window, b * h, off):
        qt = q[:, q0:q1].to(acc).reshape(b, q1 - q0, hk, rep, d)
        kt, vt = k[:, k0:k1].to(acc), v[:, k0:k1].to(acc)
        sc, _ = _banded_scores(qt, kt, scale, softcap, q0, k0, off, causal, window)
        m = torch.logsumexp(sc, dim=-1)  # [b, hk, rep, t]
        p = torch.exp(sc - m[..., None])
        o = torch.einsum("bhrtn,bnhd->bthrd", p, vt)
        out[:, q0:q1] = o.reshape(b, q1 - q0, h, -1).to(q.dtype)
        lse[:, :, q0:q1] = m.reshape(b, h, q1 - q0)
    return out, lse


def banded_attention_backward(dout, q, k, v, out, lse, causal: bool, scale: float, window: int = 0,
                              softcap: float = 0.0, offset: Optional[int] = None):
    """Gradients of :func:`banded_attention_forward` from its LSE (the scores are recomputed per tile, the
    soft-cap's derivative is 1 - tanh^2); dk/dv accumulate over the tiles in fp32 (fp64 for fp64)."""
    b, s_q, h, d = q.shape
    s_k, hk = k.shape[1], k.shape[2]
    off = s_k - s_q if offset is None else offset
    rep = h // hk
    acc = _acc_dtype(q)
    dq = torch.empty_like(q)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    lse4 = lse.reshape(b, hk, rep, s_q)
    for q0, q1, k0, k1 in _banded_tiles(s_q, s_k, causal, window, b * h, off):
        t = q1 - q0
        qt = q[:, q0:q1].to(acc).reshape(b, t, hk, rep, d)
        kt, vt = k[:, k0:k1].to(acc), v[:, k0:k1].to(acc)
        do = dout[:, q0:q1].to(acc).reshape(b, t, hk, rep, -1)
        ot = out[:, q0:q1].to(acc).reshape(b, t, hk, rep, -1)
        sc, th = _banded_scores(qt, kt, scale, softcap, q0, k0, off, causal, window)
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
