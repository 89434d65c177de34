"""The test reference: plain softmax attention in float64-friendly torch (scores materialised), with the same
layout, GQA, window and soft-cap semantics as every backend."""
from __future__ import annotations

import torch
from typing import Optional

from .base import _bhsd


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
