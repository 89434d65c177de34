"""Sequence parallelism for head-parallel mixers that carry state along the sequence (Gated DeltaNet, Mamba2, LFM2's
gated short convolutions): split by heads.

Each head's recurrence (and each channel of the depthwise causal conv before it) reads only its own head over the
whole sequence, so Ulysses' pattern is exact by construction: the projections run on the sequence shard
(``models.hybrid``: what each family projects), one all-to-all moves the q|k|v channels of this rank's heads over the
full sequence to it (one more, fp32, the per-head decay g and beta), the conv runs on them with the conv weights of
these channels, transformers' own core function (its chunked gated-delta rule: the torch reference on CPU, the hub
kernel where transformers installed one) runs on this rank's heads, and one all-to-all brings the output back to the
sequence shard before what mixes heads again (gated norm, out projection). Under 'untied_ulysses' the conv and the
core loop over this rank's value heads ``heads_per_chunk`` at a time (whole key-head groups). A short conv (LFM2) is the same with its
conv input's channels as heads and no recurrence. A Mamba2 mixer (falcon_h1, granitemoehybrid) is the same with
x channels per head, its B/C groups (a group that several ranks' heads read goes to each of them) and dt moved, and
transformers' ``mamba2_chunk_scan``; its gated RMSNorm spans groups of heads, so it runs after the output all-to-all,
on the sequence shard, as transformers runs it. Packed documents restart the conv and the
recurrence at every document start: the conv and the core run per document (transformers' torch reference ignores
``cu_seqlens``).

The all-to-alls are ours, not DeepSpeed's ``_SeqAllToAll``: that one is shaped for [b, s, heads, head_dim] q/k/v of
one head dim, and the channels here are three groups of heads with two head dims packed per rank.
"""
from __future__ import annotations

import sys
import types
import weakref
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..models.adapters import read_weight_problem
from ..models.hybrid import mixer_for
from ..dist.layout import gathered_order
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
    """The all-to-all seq -> heads; ``order`` (with a ring: :func:`token_order`) puts the gathered sequence, which
    is the SP ranks' zigzag shards one after the other, in token order."""

    @staticmethod
    def forward(ctx, x, group, order=None):
        ctx.group, ctx.order = group, order
        y = _seq_to_heads(x, group)
        return y if order is None else y.index_select(1, order[0])

    @staticmethod
    def backward(ctx, grad):
        if ctx.order is not None:
            grad = grad.index_select(1, ctx.order[1])
        return _heads_to_seq(grad, ctx.group, dist.get_world_size(ctx.group)), None, None


class HeadsToSeq(torch.autograd.Function):
    """The all-to-all heads -> seq (``order``: as :class:`SeqToHeads`, the token-order sequence put back in the
    ranks' shard order first)."""

    @staticmethod
    def forward(ctx, y, group, order=None):
        ctx.group, ctx.order = group, order
        if order is not None:
            y = y.index_select(1, order[1])
        return _heads_to_seq(y, group, dist.get_world_size(group))

    @staticmethod
    def backward(ctx, grad):
        g = _seq_to_heads(grad, ctx.group)
        return (g if ctx.order is None else g.index_select(1, ctx.order[0])), None, None


def token_order(seq: int, sp: int, ring: int, device):
    """(gathered -> token order, token -> gathered order) index pair for an all-to-all over the whole SP group whose
    shards are the ring's zigzag shards (dist.layout.gathered_order); None without a ring."""
    if ring <= 1:
        return None
    gathered = gathered_order(seq, sp, ring)
    to_tokens = torch.empty_like(gathered)
    to_tokens[gathered] = torch.arange(seq)
    return to_tokens.to(device), gathered.to(device)


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
                           heads_per_chunk: Optional[int] = None, ring: int = 1, **kwargs):
    """One Gated DeltaNet layer of a training forward under SP (see the module doc); no cache. ``heads_per_chunk``
    (untied): the conv and the core run over this rank's value heads that many at a time (whole key-head groups),
    so their intermediates are one chunk's."""
    if kwargs.get("cache") is not None or kwargs.get("cache_params") is not None:
        raise ValueError(f"{type(module).__name__}: ds_longctx's SP path trains without a cache (use_cache=False)")
    docs = kwargs.pop(DOCS_KWARG, None)
    hf = sys.modules[type(module).__module__]  # transformers' own functions of this model (kernelized there)
    hidden_states = hf.apply_mask_to_padding_states(hidden_states, attention_mask)
    b, s, _ = hidden_states.shape
    hk, hv, dk, dv = fam.dims(module)
    qkv, gate, g, beta = fam.project(module, hidden_states)
    gw = g.shape[-1] if g.dim() == 4 else 1  # the decay's channels per value head (KDA: per key channel)
    plan = gdn_split(hk, hv, dk, dv, sp, gw)
    if group is not None:
        order = token_order(s * sp, sp, ring, hidden_states.device)
        chans, heads = plan.channels.to(qkv.device), plan.heads.to(qkv.device)
        # each rank's q | k | v channels and its value heads' decay and beta (a key head, or a value head, that
        # several ranks read is sent to each of them: index_select's backward sums their gradients)
        qkv = SeqToHeads.apply(qkv.index_select(-1, chans.flatten()).reshape(b, s, sp, -1), group, order)
        gh = g.reshape(b, s, hv, gw).index_select(2, heads.flatten()).reshape(b, s, sp, -1)
        bh = beta.float().index_select(-1, heads.flatten()).reshape(b, s, sp, -1)
        gb = SeqToHeads.apply(torch.cat([gh, bh], dim=-1), group, order)
        hq = plan.value_heads
        g, beta = gb[..., :hq * gw], gb[..., hq * gw:].to(beta.dtype)
        if gw > 1:
            g = g.reshape(b, -1, hq, gw)
    S = qkv.shape[1]
    hq, nk, dvl = plan.value_heads, plan.key_channels, plan.value_dim  # this rank's value heads, q (=k) channels
    w = module.conv1d.weight.squeeze(1)  # [2*kd + vd, K]: q | k | v channels, key-head-major
    bias = module.conv1d.bias
    idx = plan.channels[rank].to(w.device)
    w = w.index_select(0, idx)
    bias = bias.index_select(0, idx) if bias is not None else None
    x = qkv.transpose(1, 2)  # [b, channels, S]
    ratio = hq // (nk // dk)  # this rank's value heads per key head
    chunks = []
    for j, n in _head_chunks(hq, ratio, heads_per_chunk):
        kc = slice(j // ratio * dk, (j + n) // ratio * dk)  # the chunk's q (and k) channels, then its v channels
        sel = torch.cat([torch.arange(nk)[kc], nk + torch.arange(nk)[kc],
                         2 * nk + torch.arange(j * dvl, (j + n) * dvl)]).to(w.device)
        xc, wc, bc = x.index_select(1, sel.to(x.device)), w.index_select(0, sel), \
            bias.index_select(0, sel) if bias is not None else None
        nkc = (j + n) // ratio * dk - j // ratio * dk
        rows = []
        for i, spans in enumerate(_segments(docs, b, S)):
            outs = []
            for a, e in spans:
                mixed = hf.causal_conv1d_fn(xc[i:i + 1, :, a:e], wc, bc, activation=module.activation).transpose(1, 2)
                q, k, v = torch.split(mixed, [nkc, nkc, n * dvl], dim=-1)
                out, _ = getattr(hf, fam.core)(
                    q.reshape(1, e - a, -1, dk), k.reshape(1, e - a, -1, dk), v.reshape(1, e - a, n, dvl),
                    g=g[i:i + 1, a:e, j:j + n], beta=beta[i:i + 1, a:e, j:j + n], initial_state=None,
                    output_final_state=False, use_qk_l2norm_in_kernel=True)
                outs.append(out)
            rows.append(torch.cat(outs, dim=1) if len(outs) > 1 else outs[0])
        chunks.append(torch.cat(rows, dim=0) if len(rows) > 1 else rows[0])
    core = torch.cat(chunks, dim=2) if len(chunks) > 1 else chunks[0]  # [b, S, hq, dvl]
    if group is not None:
        core = HeadsToSeq.apply(core.reshape(b, S, hq * dvl), group, order)
    core = core.reshape(b, s, hv, dv)  # every rank's value channels in order: head-major, as the layer has them
    return fam.finish(module, core, gate)


@dataclass(frozen=True)
class GdnSplit:
    """How a Gated DeltaNet / KDA layer's channels go to ``sp`` ranks (models.hybrid.gdn_split_ok): ``channels``
    [sp, c] long, the q | k | v channels (of the layer's projection, = its conv's rows) each rank receives;
    ``heads`` [sp, value_heads]: the value heads whose decay and beta it receives; per rank ``value_heads`` value
    heads of ``value_dim`` channels (a slice of one head past the value heads) reading ``key_channels`` / dk key
    heads. Value channels go in equal contiguous blocks (head-major), so the outputs come back in the layer's order."""
    channels: torch.Tensor
    heads: torch.Tensor
    value_heads: int
    value_dim: int
    key_channels: int


def gdn_split(hk: int, hv: int, dk: int, dv: int, sp: int, gw: int = 1) -> GdnSplit:
    """The :class:`GdnSplit` of a layer of ``hk`` key heads of ``dk`` and ``hv`` value heads of ``dv`` over ``sp``
    ranks: whole key heads per rank (``sp`` divides the key heads) or one key head per rank (``sp`` a multiple of
    them), whose value heads, or a 1 / (sp / hv) slice of one, the rank runs. Exact either way: each value channel's
    recurrence reads only its own channel and its head's q, k, decay and beta (GDN, KDA: the state's rows along the
    value dim are independent)."""
    if not ((hk % sp == 0 or sp % hk == 0) and (hv % sp == 0 or (sp % hv == 0 and dv % (sp // hv) == 0))):
        raise ConfigError("sequence_parallel_size", f"{sp} cannot split a Gated DeltaNet layer of {hk} key heads "
                          f"and {hv} value heads of {dv} channels", "use a degree that divides the key and value "
                          "heads or is a multiple of them (models.hybrid.gdn_split_ok)")
    kd, vd = hk * dk, hv * dv
    vq = vd // sp  # value channels per rank
    ratio = hv // hk
    chans, heads = [], []
    for r in range(sp):
        v0 = r * vq
        first, last = v0 // dv, (v0 + vq - 1) // dv  # value heads of the block
        if hk % sp == 0:
            keys = list(range(r * kd // sp, (r + 1) * kd // sp))
        else:
            kh = first // ratio
            keys = list(range(kh * dk, (kh + 1) * dk))
        chans.append(keys + [kd + c for c in keys] + [2 * kd + c for c in range(v0, v0 + vq)])
        heads.append(list(range(first, last + 1)))
    return GdnSplit(torch.tensor(chans), torch.tensor(heads), len(heads[0]), min(dv, vq),
                    kd // sp if hk % sp == 0 else dk)


def short_conv_forward(module, fam, group, sp: int, rank: int, hidden_states, attention_mask=None,
                       heads_per_chunk: Optional[int] = None, ring: int = 1, **kwargs):
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
        order = token_order(s * sp, sp, ring, hidden_states.device)
        x = SeqToHeads.apply(x.reshape(b, s, sp, c), group, order)
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
        y = HeadsToSeq.apply(y.contiguous(), group, order).reshape(b, s, H)
    return fam.finish(module, y, gate)


def _mamba2_chunks(hq: int, r: int, per_chunk: Optional[int]):
    """This rank's heads in chunks of at most ``per_chunk`` (None: all at once) that are whole groups of ``r`` heads
    (one B/C group each) or lie inside one group: (first head, heads) per chunk."""
    if not per_chunk or per_chunk >= hq:
        return [(0, hq)]
    n = per_chunk // r * r if per_chunk >= r else max(d for d in range(1, per_chunk + 1) if r % d == 0)
    return [(j, min(n, hq - j)) for j in range(0, hq, n)]


def mamba2_forward(module, fam, group, sp: int, rank: int, hidden_states, attention_mask=None,
                   heads_per_chunk: Optional[int] = None, ring: int = 1, **kwargs):
    """One Mamba2 mixer (falcon_h1, granitemoehybrid) of a training forward under SP: in_proj on the sequence shard,
    one all-to-all of this rank's x channels, its B/C groups (a group shared by several ranks goes to each) and dt,
    the depthwise conv with these channels' weights and transformers' ``mamba2_chunk_scan`` with this rank's
    dt_bias / A / D over the whole sequence (per document, ``heads_per_chunk`` heads at a time under untied), the
    output back to the sequence shard before the gated norm (which spans groups of heads) and out_proj."""
    if kwargs.get("cache") is not None or kwargs.get("cache_params") is not None:
        raise ValueError(f"{type(module).__name__}: ds_longctx's SP path trains without a cache (use_cache=False)")
    if attention_mask is not None and not bool((attention_mask == 1).all()):
        # transformers zeroes padded tokens again after the conv; under SP the conv runs on the gathered sequence
        raise ValueError(f"{type(module).__name__}: ds_longctx's SP path takes no padding mask (got one with zeros); "
                         "pack the samples (position_ids restarting per document) instead of padding them")
    docs = kwargs.pop(DOCS_KWARG, None)
    hf = sys.modules[type(module).__module__]
    b, s, _ = hidden_states.shape
    nh, hd, ng, ds = module.num_heads, module.head_dim, module.n_groups, module.ssm_state_size
    di = nh * hd
    z, xbc, dt = fam.project(module, hidden_states)
    hq = nh // sp
    gq = ng // sp if ng % sp == 0 else 1  # B/C groups per rank (1: the one group all this rank's heads read)
    per_rank = [list(range(j * gq, (j + 1) * gq)) if ng % sp == 0 else [j * ng // sp] for j in range(sp)]
    gidx = torch.tensor([g for gs in per_rank for g in gs], device=xbc.device)
    x = xbc[..., :di].reshape(b, s, sp, hq * hd)
    B = xbc[..., di:di + ng * ds].reshape(b, s, ng, ds).index_select(2, gidx).reshape(b, s, sp, gq * ds)
    C = xbc[..., di + ng * ds:].reshape(b, s, ng, ds).index_select(2, gidx).reshape(b, s, sp, gq * ds)
    xbc = torch.cat([x, B, C, dt.reshape(b, s, sp, hq)], dim=-1)
    if group is not None:
        order = token_order(s * sp, sp, ring, hidden_states.device)
        xbc = SeqToHeads.apply(xbc, group, order)
    else:
        xbc = xbc.reshape(b, s, -1)
    S = xbc.shape[1]
    xbc, dt = xbc[..., :-hq], xbc[..., -hq:]
    mine = per_rank[rank]
    idx = torch.cat([torch.arange(rank * hq * hd, (rank + 1) * hq * hd)] +
                    [di + g * ds + torch.arange(ds) for g in mine] +
                    [di + (ng + g) * ds + torch.arange(ds) for g in mine]).to(module.conv1d.weight.device)
    w = module.conv1d.weight.squeeze(1).index_select(0, idx)
    bias = module.conv1d.bias.index_select(0, idx) if module.conv1d.bias is not None else None
    heads = slice(rank * hq, (rank + 1) * hq)
    A, D, dt_bias = -torch.exp(module.A_log[heads].float()), module.D[heads], module.dt_bias[heads]
    r = hq // gq  # this rank's heads per B/C group
    xt = xbc.transpose(1, 2)  # [b, channels, S]
    rows = []
    for i, spans in enumerate(_segments(docs, b, S)):
        outs = []
        for a, e in spans:
            conv = hf.causal_conv1d_fn(xt[i:i + 1, :, a:e], w, bias, activation=module.activation).transpose(1, 2)
            xs, Bs, Cs = torch.split(conv, [hq * hd, gq * ds, gq * ds], dim=-1)
            xs, Bs, Cs = xs.reshape(1, e - a, hq, hd), Bs.reshape(1, e - a, gq, ds), Cs.reshape(1, e - a, gq, ds)
            parts = []
            for j, n in _mamba2_chunks(hq, r, heads_per_chunk):
                gs = slice(j // r, (j + n) // r) if n >= r else slice(j // r, j // r + 1)
                parts.append(hf.mamba2_chunk_scan(
                    xs[:, :, j:j + n], dt[i:i + 1, a:e, j:j + n], A[j:j + n], Bs[:, :, gs], Cs[:, :, gs],
                    chunk_size=module.chunk_size, D=D[j:j + n], dt_bias=dt_bias[j:j + n], dt_softplus=True,
                    dt_limit=module.time_step_limit, return_final_states=False))
            outs.append(torch.cat(parts, dim=2) if len(parts) > 1 else parts[0])
        rows.append(torch.cat(outs, dim=1) if len(outs) > 1 else outs[0])
    y = (torch.cat(rows, dim=0) if len(rows) > 1 else rows[0]).reshape(b, S, hq * hd)
    if group is not None:
        y = HeadsToSeq.apply(y, group, order)
    return fam.finish(module, y.reshape(b, s, di), z)


def _lightning_core(module, q, k, v, heads: slice):
    """MiniMax's lightning attention over one document for the heads ``heads`` (q, k, v [1, heads, L, head_dim]):
    transformers' block loop of MiniMaxLightningAttention.forward (no cache), line for line, with its per-head decay
    buffers sliced to these heads. Ours because transformers inlines it in the layer's forward (no core function)."""
    L, bs = q.shape[2], module.block_size
    slope, qdec, kdec = module.slope_rate[heads], module.query_decay[heads], module.key_decay[heads]
    ddec = module.diagonal_decay[:, heads]
    inter = torch.zeros(q.shape[0], q.shape[1], q.shape[3], q.shape[3], device=v.device, dtype=v.dtype)
    out = []
    for i in range((L + bs - 1) // bs):
        a, e = i * bs, min(i * bs + bs, L)
        n = e - a
        qi, ki, vi = q[:, :, a:e], k[:, :, a:e], v[:, :, a:e]
        block_decay = torch.exp(-slope * n)
        intra = torch.matmul(torch.matmul(qi, ki.transpose(-1, -2)) * ddec[:, :, :n, :n], vi)
        out.append(torch.matmul(qi * qdec[:, :n], inter) + intra)
        inter = inter * block_decay + torch.matmul((ki * kdec[:, -n:]).transpose(-1, -2), vi)
    return torch.cat(out, dim=-2)


def lightning_forward(module, fam, group, sp: int, rank: int, hidden_states, attention_mask=None,
                      heads_per_chunk: Optional[int] = None, ring: int = 1, **kwargs):
    """One MiniMax lightning-attention layer of a training forward under SP: qkv projected (and activated) on the
    sequence shard, this rank's heads over the whole sequence by one all-to-all, the block recurrence per document
    (``heads_per_chunk`` heads at a time under untied), the output back before the norm over all heads, the output gate
    and out_proj. Returns (output, None) as the layer's (no cache)."""
    if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
        raise ValueError(f"{type(module).__name__}: ds_longctx's SP path trains without a cache (use_cache=False)")
    docs = kwargs.pop(DOCS_KWARG, None)
    hf = sys.modules[type(module).__module__]
    b, s, _ = hidden_states.shape
    H, hd = module.num_attention_heads, module.head_dim
    qkv, gate = fam.project(module, hidden_states)
    qkv = hf.apply_mask_to_padding_states(qkv, attention_mask)
    hq = H // sp
    if group is not None:
        order = token_order(s * sp, sp, ring, hidden_states.device)
        qkv = SeqToHeads.apply(qkv.reshape(b, s, sp, hq * 3 * hd), group, order)
    S = qkv.shape[1]
    q, k, v = torch.split(qkv.reshape(b, S, hq, 3 * hd).transpose(1, 2), hd, dim=3)  # [b, hq, S, hd] each
    rows = []
    for i, spans in enumerate(_segments(docs, b, S)):
        outs = []
        for a, e in spans:
            parts = [_lightning_core(module, q[i:i + 1, j:j + n, a:e], k[i:i + 1, j:j + n, a:e],
                                     v[i:i + 1, j:j + n, a:e], slice(rank * hq + j, rank * hq + j + n))
                     for j, n in _head_chunks(hq, 1, heads_per_chunk)]
            outs.append(torch.cat(parts, dim=1) if len(parts) > 1 else parts[0])
        rows.append(torch.cat(outs, dim=2) if len(outs) > 1 else outs[0])
    y = (torch.cat(rows, dim=0) if len(rows) > 1 else rows[0]).transpose(1, 2).reshape(b, S, hq * hd)
    if group is not None:
        y = HeadsToSeq.apply(y.contiguous(), group, order)
    return fam.finish(module, y.reshape(b, s, H * hd), gate), None


_FORWARDS = {"gated_deltanet": gated_deltanet_forward, "short_conv": short_conv_forward, "mamba2": mamba2_forward,
             "lightning": lightning_forward}


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
    named = [(n, m) for n, m in model.named_modules() if type(m).__name__ == fam.module_class]
    for n, m, conv in [(n, m, c) for n, m in named for c in ("conv", "conv1d") if getattr(m, c, None) is not None]:
        # the conv's weight is read directly below: a PEFT layer around it would drop its adapters
        problem = read_weight_problem(getattr(m, conv), f"{n}.{conv}")
        if problem:
            raise ConfigError("model", problem, f"leave the {fam.module_class}'s {conv} out of the adapter's "
                              "target_modules (LoRA on its projections runs), or train it in modules_to_save")
    mods = [m for _, m in named]
    run = _FORWARDS[fam.kind]
    # untied: the Gated DeltaNet core loops over this rank's value heads heads_per_chunk at a time (whole key-head
    # groups); a short conv has no per-head intermediates to bound (its conv output is the layer's activation)
    per_chunk = spec.heads_per_chunk if spec.config.attention.implementation == "untied_ulysses" else None
    for m in mods:
        def forward(self, hidden_states, *args, attention_mask=None, **kwargs):
            if args:  # transformers passes them by keyword; a positional call is a layout we did not check
                raise TypeError(f"{type(self).__name__}: ds_longctx's SP path takes its arguments by keyword")
            return run(self, fam, group, sp, rank, hidden_states, attention_mask, heads_per_chunk=per_chunk,
                       ring=spec.ring, **kwargs)

        m.forward = types.MethodType(forward, m)
    label = f"{fam.kind} split by heads ({len(mods)} {fam.module_class}, sp={sp}"
    label += f", heads_per_chunk={per_chunk})" if per_chunk and fam.kind != "short_conv" else ")"
    return MixerInstall(mods, label)


__all__ = ["HeadsToSeq", "MixerInstall", "SeqToHeads", "gated_deltanet_forward", "install_mixers",
           "lightning_forward", "mamba2_forward", "short_conv_forward"]
