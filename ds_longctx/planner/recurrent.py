"""The gated delta rule on the planner's meta stand-in device, as the GPU runs it (fla's chunked kernel).

transformers' torch reference (``torch_chunk_gated_delta_rule``), which the hybrid mixers call and which the hub
swaps for fla's ``chunk_gated_delta_rule`` on CUDA, loops over 64-token chunks in Python: on fake tensors at 1M
tokens that is 16K iterations per layer and pass, each recorded by autograd (a Qwen3.5 plan at 1M did not finish
in 5 minutes, 2026-11-27). On the GPU the kernel's memory is a different thing anyway, so the simulation runs this
stand-in instead: its tensors are the ones fla's ``ChunkGatedDeltaRuleFunction`` allocates and saves (fla
``ops/gated_delta_rule/chunk.py``: forward g (fp32 cumsum), A ([T, H, 64]), w, u, the chunk states h
([NT, H, K, V]), v_new, o; saved q, k, v, g, beta, A and the l2-norm rstd; backward recomputes w, u, h and holds
dh (fp32) next to dq, dk, dv, dg, dbeta), and its matmuls are the chunk algorithm's, batched over chunks (same
FLOPs; the sequential dependence of h is not modelled: a bound on work, not a schedule). A model of fla's memory
from its source, not a measurement: the planner's figures for hybrid models say so.
"""
from __future__ import annotations

import contextlib
import sys

import torch

BT = 64  # fla's chunk size


def _chunked(x, nt):
    """[b, T, H, D] -> [b*H*NT, BT, D] (T padded to whole chunks)."""
    b, t, h, d = x.shape
    pad = nt * BT - t
    if pad:
        x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad))
    return x.permute(0, 2, 1, 3).reshape(b * h * nt, BT, d)


def _forward_work(q, k, v, nt):
    """The chunk algorithm's tensors and matmuls; returns (A, w, u, h, v_new, o) as fla allocates them."""
    kc, qc, vc = _chunked(k, nt), _chunked(q, nt), _chunked(v, nt)
    a = kc @ kc.transpose(1, 2)                       # chunk_scaled_dot_kkt: [.., BT, BT] (fp32 in fla)
    a = a.float().to(k.dtype)                         # solve_tril's output, in k's dtype
    w, u = a @ kc, a @ vc                             # recompute_w_u: [.., BT, K], [.., BT, V]
    h = kc.transpose(1, 2) @ u                        # the chunk states [.., K, V]
    v_new = u - w @ h                                 # [.., BT, V]
    o = qc @ h + (qc @ kc.transpose(1, 2)) @ v_new    # chunk_fwd_o
    return a, w, u, h, v_new, o


class _MetaGatedDelta(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, l2norm):
        b, t, hv, dv = v.shape
        ctx.hq = q.shape[2]
        if q.shape[2] != hv:  # fewer q/k heads than value heads: each q/k head serves hv / hq value heads
            q = q.repeat_interleave(hv // q.shape[2], dim=2)
            k = k.repeat_interleave(hv // k.shape[2], dim=2)
        nt = -(-t // BT)
        with torch.no_grad():
            gc = g.float().cumsum(1)                      # chunk_local_cumsum, fp32
            a, w, u, h, v_new, o = _forward_work(q, k, v, nt)
            out = o.reshape(b, hv, nt * BT, dv)[:, :, :t].transpose(1, 2).contiguous()
            del w, u, h, v_new, o
            rstd = [torch.empty(b, t, hv, dtype=torch.float32, device=v.device) for _ in range(2 if l2norm else 0)]
        ctx.save_for_backward(q, k, v, gc, beta, a, *rstd)
        ctx.nt = nt
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, gc, beta, a = ctx.saved_tensors[:6]
        nt = ctx.nt
        with torch.no_grad():
            _, w, u, h, v_new, _ = _forward_work(q, k, v, nt)  # recomputed, as fla's backward does
            doc = _chunked(dout, nt)
            qc, kc = _chunked(q, nt), _chunked(k, nt)
            dv_local = (kc @ qc.transpose(1, 2)) @ doc        # chunk_bwd_dv_local
            dh = (qc.transpose(1, 2) @ doc).float()           # chunk_gated_delta_rule_bwd_dhu: [.., K, V] fp32
            dv_c = dv_local + kc @ dh.to(kc.dtype)
            dq_c = doc @ h.transpose(1, 2) + (doc @ v_new.transpose(1, 2)) @ kc  # chunk_bwd_dqkwg
            dk_c = v_new @ dh.to(kc.dtype).transpose(1, 2) + (doc @ v_new.transpose(1, 2)).transpose(1, 2) @ qc
            dw = -(dv_c @ h.transpose(1, 2))
            da = dw @ kc.transpose(1, 2) + dv_c @ u.transpose(1, 2)  # prepare_wy_repr_bwd
            dk_c = dk_c + a.transpose(1, 2) @ dw + da @ kc
            del w, u, h, v_new, dh, dv_local, da, dw

            def back(x, like):
                b, t, hh, d = like.shape
                return x.reshape(b, hh, nt * BT, d)[:, :, :t].transpose(1, 2)

            dq, dk, dv = _hq(back(dq_c, q), ctx.hq), _hq(back(dk_c, k), ctx.hq), back(dv_c, v)
        return dq, dk, dv.to(v.dtype), torch.zeros_like(gc), torch.zeros_like(beta), None


def _hq(grad, hq):
    """Sum the gradient of repeated q/k heads back onto their hq heads."""
    b, t, hv, d = grad.shape
    return grad.reshape(b, t, hq, hv // hq, d).sum(3) if hv != hq else grad


def gated_delta_on_meta(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                        use_qk_l2norm_in_kernel=False, **kwargs):
    """``torch_chunk_gated_delta_rule``'s signature, on meta tensors: fla's memory and FLOPs (module docstring)."""
    out = _MetaGatedDelta.apply(query, key, value, g, beta, bool(use_qk_l2norm_in_kernel))
    if output_final_state:
        b, _, hv, dv = value.shape
        return out, torch.empty(b, hv, key.shape[-1], dv, dtype=torch.float32, device=value.device)
    return out, None


@contextlib.contextmanager
def gated_delta_as_kernel(model, device: str):
    """While the simulation runs on the meta stand-in: the transformers modules of ``model``'s layers that define
    ``torch_chunk_gated_delta_rule`` call :func:`gated_delta_on_meta` instead; restored on exit."""
    if device != "meta":
        yield
        return
    saved = {}
    for m in model.modules():
        mod = sys.modules.get(type(m).__module__)
        if mod is not None and mod not in saved and hasattr(mod, "torch_chunk_gated_delta_rule"):
            saved[mod] = mod.torch_chunk_gated_delta_rule
    try:
        for mod in saved:
            mod.torch_chunk_gated_delta_rule = gated_delta_on_meta
        yield
    finally:
        for mod, fn in saved.items():
            mod.torch_chunk_gated_delta_rule = fn
