"""Sequence parallelism for head-parallel mixers that carry state along the sequence (Gated DeltaNet, LFM2's gated
short convolutions): split by heads.

Each head's recurrence (and each channel of the depthwise causal conv before it) reads only its own head over the
whole sequence, so Ulysses' pattern is exact by construction: the projections run on the sequence shard
(``models.hybrid``: what each family projects), one all-to-all moves the q|k|v channels of this rank's heads over the
full sequence to it (one more, fp32, the per-head decay g and beta), the conv runs on them with the conv weights of
these channels, transformers' own core function (its chunked gated-delta rule: the torch reference on CPU, the hub
kernel where transformers installed one) runs on this rank's heads, and one all-to-all brings the output back to the
sequence shard before what mixes heads again (gated norm, out projection). Under 'untied_ulysses' the conv and the
core loop over this rank's value heads ``heads_per_chunk`` at a time (whole key-head groups). A short conv (LFM2) is the same with its
conv input's channels as heads and no recurrence. Packed documents restart the conv and the
recurrence at every document start: the conv and the core run per document (transformers' torch reference ignores
``cu_seqlens``).

The all-to-alls are ours, not DeepSpeed's ``_SeqAllToAll``: that one is shaped for [b, s, heads, head_dim] q/k/v of
one head dim, and the channels here are three groups of heads with two head dims packed per rank.
"""
from __future__ import annotations

import sys
import types
import weakref
from typing import List, Optional

import torch
import torch.distributed as dist

from ..models.hybrid import mixer_for
from .documents import DOCS_KWARG


def _seq_to_heads(x, group):
    """[b, s, C, c] (channel block j for rank j, sequence shard) -> [b, C*s, c] (this rank's channels, whole seq)."""
    b, s, C, c = x.shape
    send = x.permute(2, 0, 1, 3).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[j]: rank j's sequence shard of this rank's channels
    return recv.permute(1, 0, 2, 3).reshape(b, C * s, c)


def _heads_to_seq(y, group, C):
    """[b, C*s, c] (this rank's channels, whole sequence) -> [b, s, C, c] (every rank's channels, sequence shard)."""
    b, S, c = y.shape
    send = y.reshape(b, C, S // C, c).permute(1, 0, 2, 3).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[j]: rank j's channels of this rank's sequence shard
    return recv.permute(1, 2, 0, 3)


class SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.group, dist.get_world_size(ctx.group)), None


class HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        return _heads_to_seq(y, group, dist.get_world_size(group))

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.group), None


def _segments(docs, b: int, S: int):
    """Per sample, the (start, end) spans that each start a fresh recurrence: the documents, or the whole row."""
    if docs is None or docs.dense:
        return [[(0, S)] for _ in range(b)]
    if docs.seq_len != S or docs.batch != b:
        raise ValueError(f"packed documents cover [{docs.batch}, {docs.seq_len}] tokens, the mixer sees [{b}, {S}]")
    return docs.bounds


def _head_chunks(hq: int, ratio: int, per_chunk: Optional[int]):
    """This rank's value heads in chunks of ``per_chunk`` (None: all at once), whole key-head groups of ``ratio``
    value heads each: (first value head, value heads) per chunk."""
    n = hq if not per_chunk else min(hq, max(ratio, per_chunk // ratio * ratio))
    return [(j, min(n, hq - j)) for j in range(0, hq, n)]


def gated_deltanet_forward(module, fam, group, sp: int, rank: int, hidden_states, attention_mask=None,
                           heads_per_chunk: Optional[int] = None, **kwargs):
    """One Gated DeltaNet layer of a training forward under SP (see the module doc); no cache. ``heads_per_chunk``
    (untied): the conv and the core run over this rank's value heads that many at a time (whole key-head groups),
    so their intermediates are one chunk's."""
    if kwargs.get("cache") is not None or kwargs.get("cache_params") is not None:
        raise ValueError(f"{type(module).__name__}: ds_longctx's SP path trains without a cache (use_cache=False)")
    docs = kwargs.pop(DOCS_KWARG, None)
    hf = sys.modules[type(module).__module__]  # transformers' own functions of this model (kernelized there)
    hidden_states = hf.apply_mask_to_padding_states(hidden_states, attention_mask)
    b, s, _ = hidden_states.shape
    hk, hv, dk, dv = module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim
    kd, vd = hk * dk, hv * dv
    qkv, gate, g, beta = fam.project(module, hidden_states)
    kq, vq, hq = kd // sp, vd // sp, hv // sp  # this rank's q (= k) channels, v channels, value heads
    if group is not None:
        per_rank = [qkv[..., :kd].reshape(b, s, sp, kq), qkv[..., kd:2 * kd].reshape(b, s, sp, kq),
                    qkv[..., 2 * kd:].reshape(b, s, sp, vq)]
        qkv = SeqToHeads.apply(torch.cat(per_rank, dim=-1), group)
        gb = SeqToHeads.apply(torch.cat([g.reshape(b, s, sp, hq), beta.float().reshape(b, s, sp, hq)], dim=-1), group)
        g, beta = gb[..., :hq], gb[..., hq:].to(beta.dtype)
    S = qkv.shape[1]
    w = module.conv1d.weight.squeeze(1)  # [2*kd + vd, K]: q | k | v channels, key-head-major
    bias = module.conv1d.bias
    idx = torch.cat([torch.arange(rank * kq, (rank + 1) * kq), torch.arange(kd + rank * kq, kd + (rank + 1) * kq),
                     torch.arange(2 * kd + rank * vq, 2 * kd + (rank + 1) * vq)]).to(w.device)
    w = w.index_select(0, idx)
    bias = bias.index_select(0, idx) if bias is not None else None
    x = qkv.transpose(1, 2)  # [b, channels, S]
    ratio = hv // hk
    chunks = []
    for j, n in _head_chunks(hq, ratio, heads_per_chunk):
        kc = slice(j // ratio * dk, (j + n) // ratio * dk)  # the chunk's q (and k) channels, then its v channels
        sel = torch.cat([torch.arange(kq)[kc], kq + torch.arange(kq)[kc],
                         2 * kq + torch.arange(j * dv, (j + n) * dv)]).to(w.device)
        xc, wc, bc = x.index_select(1, sel.to(x.device)), w.index_select(0, sel), \
            bias.index_select(0, sel) if bias is not None else None
        nk = (j + n) // ratio * dk - j // ratio * dk
        rows = []
        for i, spans in enumerate(_segments(docs, b, S)):
            outs = []
            for a, e in spans:
                mixed = hf.causal_conv1d_fn(xc[i:i + 1, :, a:e], wc, bc, activation=module.activation).transpose(1, 2)
                q, k, v = torch.split(mixed, [nk, nk, n * dv], dim=-1)
                out, _ = hf.torch_chunk_gated_delta_rule(
                    q.reshape(1, e - a, -1, dk), k.reshape(1, e - a, -1, dk), v.reshape(1, e - a, n, dv),
                    g=g[i:i + 1, a:e, j:j + n], beta=beta[i:i + 1, a:e, j:j + n], initial_state=None,
                    output_final_state=False, use_qk_l2norm_in_kernel=True)
                outs.append(out)
            rows.append(torch.cat(outs, dim=1) if len(outs) > 1 else outs[0])
        chunks.append(torch.cat(rows, dim=0) if len(rows) > 1 else rows[0])
    core = torch.cat(chunks, dim=2) if len(chunks) > 1 else chunks[0]  # [b, S, hq, dv]
    if group is not None:
        core = HeadsToSeq.apply(core.reshape(b, S, hq * dv), group)
    core = core.reshape(b, s, hv, dv)
    return fam.finish(module, core, gate)


def short_conv_forward(module, fam, group, sp: int, rank: int, hidden_states, attention_mask=None,
                       heads_per_chunk: Optional[int] = None, **kwargs):
    """One gated short-conv layer (LFM2) of a training forward under SP: the conv input's channels of this rank over
    the gathered sequence, the depthwise conv with these channels' weights (per document), back before the gate."""
    if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
        raise ValueError(f"{type(module).__name__}: ds_longctx's SP path trains without a cache (use_cache=False)")
    docs = kwargs.pop(DOCS_KWARG, None)
    hf = sys.modules[type(module).__module__]
    hidden_states = hf.apply_mask_to_padding_states(hidden_states, attention_mask)
    b, s, H = hidden_states.shape
    x, gate = fam.project(module, hidden_states)
    c = H // sp
    if group is not None:
        x = SeqToHeads.apply(x.reshape(b, s, sp, c), group)
    S = x.shape[1]
    w = module.conv.weight.squeeze(1)[rank * c:(rank + 1) * c]
    bias = module.conv.bias[rank * c:(rank + 1) * c] if module.conv.bias is not None else None
    xt = x.transpose(1, 2)
    rows = []
    for i, spans in enumerate(_segments(docs, b, S)):
        outs = [hf.causal_conv1d_fn(xt[i:i + 1, :, a:e], w, bias) for a, e in spans]
        rows.append(torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0])
    y = (torch.cat(rows, dim=0) if len(rows) > 1 else rows[0]).transpose(1, 2)  # [b, S, c]
    if group is not None:
        y = HeadsToSeq.apply(y.contiguous(), group).reshape(b, s, H)
    return fam.finish(module, y, gate)


_FORWARDS = {"gated_deltanet": gated_deltanet_forward, "short_conv": short_conv_forward}


class MixerInstall:
    """The mixer forwards installed on one model (instance attributes; ``remove()`` lets the class's show again)."""

    def __init__(self, modules: List[torch.nn.Module], label: str):
        self.modules = [weakref.ref(m) for m in modules]
        self.label = label

    def remove(self) -> None:
        for ref in self.modules:
            m = ref()
            if m is not None:
                m.__dict__.pop("forward", None)
        self.modules = []


def install_mixers(model, spec) -> Optional[MixerInstall]:
    """Route every non-attention sequence mixer of ``model`` that ds_longctx runs (models.hybrid) through the
    head-parallel SP forward for the spec's group (or whole, one process, at SP 1: documents still restart it).
    None when the model has none. No collectives."""
    fam = mixer_for(model.config)
    if fam is None:
        return None
    group = spec.group if spec.sp > 1 else None
    sp = spec.sp if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    mods = [m for m in model.modules() if type(m).__name__ == fam.module_class]
    run = _FORWARDS[fam.kind]
    # untied: the Gated DeltaNet core loops over this rank's value heads heads_per_chunk at a time (whole key-head
    # groups); a short conv has no per-head intermediates to bound (its conv output is the layer's activation)
    per_chunk = spec.heads_per_chunk if spec.config.attention.implementation == "untied_ulysses" else None
    for m in mods:
        def forward(self, hidden_states, *args, attention_mask=None, **kwargs):
            if args:  # transformers passes them by keyword; a positional call is a layout we did not check
                raise TypeError(f"{type(self).__name__}: ds_longctx's SP path takes its arguments by keyword")
            return run(self, fam, group, sp, rank, hidden_states, attention_mask, heads_per_chunk=per_chunk, **kwargs)

        m.forward = types.MethodType(forward, m)
    label = f"{fam.kind} split by heads ({len(mods)} {fam.module_class}, sp={sp}"
    label += f", heads_per_chunk={per_chunk})" if per_chunk and fam.kind == "gated_deltanet" else ")"
    return MixerInstall(mods, label)


__all__ = ["HeadsToSeq", "MixerInstall", "SeqToHeads", "gated_deltanet_forward", "install_mixers",
           "short_conv_forward"]
