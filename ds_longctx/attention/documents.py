"""Packed documents: causal attention *within* each document of a sample, on every attention path.

This module is attention's side: the :class:`Documents` structure the kernels read and the kernel
adapters over it. The batch's side (the packing contract, ``document_structure``, ``mask_padding_targets``,
the batch keys) is the data layer's, in ``ds_longctx/data/batch.py``.

Document boundaries are *global* information: with SP a boundary can fall exactly on a shard edge,
where a rank's local position_ids look contiguous. So the structure is derived from the full sample
before sharding (``batch.document_structure``, used by ``data.shard_batch``) and travels in the batch
as ``doc_cu_seqlens`` [b, n+1] (cumulative boundaries over the whole gathered sequence, every rank
the same tensor, rows padded by repeating the length).

How it reaches attention: the model forward wrapper (``sp_batch.install_document_forward``) turns the
batch's structure into a :class:`Documents` and passes it down as the keyword ``DOCS_KWARG``. HF's
decoder forwards its ``**kwargs`` through every decoder layer into the attention module and the
attention function, and its checkpointed layers bind them into the recompute; a context variable
set around the forward would be gone when activation checkpointing recomputes a layer in backward.
"""
from __future__ import annotations

import importlib.util
from typing import List, Optional, Tuple

import torch

from ..data.batch import BATCH_KEY
from ..errors import BatchError
from .kernels import Backend, Windowed, call_by_name, flash_pattern_kwargs, torch_flash_window_kwargs

DOCS_KWARG = "ds_longctx_documents"  # keyword carrying a Documents through HF's forward kwargs


_NO_MASK_ATTR = "_ds_longctx_no_mask"


def no_mask(batch: int, seq: int, device) -> torch.Tensor:
    """What ds_longctx's forward hands transformers as the attention mask when its own attention runs (it reads
    the batch's documents itself): a [batch, 1, seq, seq] all-True bool view of ONE element (zero strides, no
    [seq, seq] memory), marked. transformers returns a 4-D mask as given, so it builds no causal / sliding-
    window / packed [s, s] mask of its own (for a windowed layer it would: seq^2 bytes per forward), and the
    attention functions recognise it (:func:`is_no_mask`) and apply causality, windows and documents themselves."""
    m = torch.ones((), dtype=torch.bool, device=device).expand(batch, 1, seq, seq)
    setattr(m, _NO_MASK_ATTR, True)
    return m


def is_no_mask(mask) -> bool:
    return isinstance(mask, torch.Tensor) and getattr(mask, _NO_MASK_ATTR, False) is True


class Documents:
    """Document boundaries of every sample of a batch over the whole (gathered) sequence.

    ``cu``: [b, n+1] long, row i = 0 = c_0 <= c_1 <= ... <= c_n = S; zero-length entries are padding.
    ``bounds[i]``: python list of (start, end) of the non-empty documents of sample i (computed once,
    so attention layers do no device sync).
    """

    def __init__(self, cu: torch.Tensor):
        if not isinstance(cu, torch.Tensor) or cu.dim() != 2 or cu.shape[1] < 2:
            raise BatchError(f"batch.{BATCH_KEY}", f"expected a [batch, n+1] tensor of document boundaries, got "
                              f"{tuple(cu.shape) if isinstance(cu, torch.Tensor) else type(cu).__name__}",
                              "build batches with ds_longctx.data.shard_batch (or the loader of initialize)")
        # read once on the host: a batch tensor's values (tolist reads them without dispatching an op, so
        # the planner's real doc_cu_seqlens stays readable under its fake-tensor mode)
        rows = [[int(v) for v in r] for r in cu.tolist()]
        self.cu = torch.tensor(rows, dtype=torch.long)
        self.seq_len = rows[0][-1]
        for i, row in enumerate(rows):
            if row[0] != 0 or row[-1] != self.seq_len or any(b < a for a, b in zip(row[:-1], row[1:])):
                raise BatchError(f"batch.{BATCH_KEY}", f"sample {i} has boundaries {row}: they must rise from 0 "
                                  f"to the sequence length {self.seq_len}", "build batches with shard_batch")
        self.bounds: List[List[Tuple[int, int]]] = [[(a, b) for a, b in zip(r[:-1], r[1:]) if b > a] for r in rows]
        self._varlen = {}         # device -> (cu_seqlens, longest): built once per batch, used by every stage
        self.varlen_lse_shape = {}  # heads -> the varlen kernel's own LSE shape (seen in forward, given back)

    def varlen_args(self, device):
        """(cu_seqlens int32 [n+1] over the flattened [b*S] tokens, longest document): what a varlen kernel is
        given for these documents, built once per device (every layer and stage of the step reuses it)."""
        key = str(device)
        if key not in self._varlen:
            edges = [0]
            for i, spans in enumerate(self.bounds):
                edges += [i * self.seq_len + e for _, e in spans]
            longest = max(e - a for spans in self.bounds for a, e in spans)
            self._varlen[key] = (torch.tensor(edges, dtype=torch.int32, device=device), longest)
        return self._varlen[key]

    @property
    def batch(self) -> int:
        return len(self.bounds)

    @property
    def dense(self) -> bool:
        """Every sample is one document: plain causal attention is exact."""
        return all(len(b) == 1 for b in self.bounds)

    def position_ids(self, device=None) -> torch.Tensor:
        """Positions restarting at 0 at every document start: [b, S] long."""
        pos = torch.empty(self.batch, self.seq_len, dtype=torch.long)
        for i, spans in enumerate(self.bounds):
            for a, e in spans:
                pos[i, a:e] = torch.arange(e - a)
        return pos.to(device) if device is not None else pos

    def __repr__(self):
        return f"Documents(seq_len={self.seq_len}, docs={[len(b) for b in self.bounds]})"


# ---------------------------------------------------------------------------------------------
# kernels over documents (untied path): same interface as kernels.Backend, LSE per document
# ---------------------------------------------------------------------------------------------


def chunk_documents(docs: Optional["Documents"], batch: int, seq_len: int, chunk: int) -> "Documents":
    """Chunked attention (Llama 4's 'chunked_attention' layers) as documents: every document of ``docs`` (None: each
    sample one document of ``seq_len`` tokens) cut again every ``chunk`` tokens from its start, which is where
    transformers' chunked mask cuts (masking_utils.chunked_overlay: ``q // chunk == kv // chunk`` on the token's
    position, which for packed documents it remaps to the position inside the document, and-ed with the packed-
    documents mask). Causal attention within each piece is then exactly the chunked layer, on every path that runs
    documents."""
    rows = ([[0, seq_len]] * batch) if docs is None else [[int(v) for v in r] for r in docs.cu.tolist()]
    out = []
    for r in rows:
        cuts = set(r)
        for a, e in zip(r[:-1], r[1:]):
            cuts.update(range(a, e, chunk))
        out.append(sorted(cuts))
    width = max(len(r) for r in out)
    return Documents(torch.tensor([r + [seq_len] * (width - len(r)) for r in out], dtype=torch.long))


class DocumentBackend(Backend):
    """A kernel backend run per document of head-sharded q/k/v [b, S, h, d] (S = the whole sequence).

    Forward writes each document's out and LSE into the [b, S, h, d] / [b, h, S] results, so the
    untied backward (which calls ``backward`` with the saved LSE) is unchanged. On CPU it is a loop over
    documents: the per-document kernel calls are exactly the dense kernel on each document. On CUDA
    (fp16/bf16) one varlen call covers every document of the batch: flash-attn's when the kernel is
    flash_attention_2, else torch's own (``aten._flash_attention_forward`` with ``cum_seq_q/k``), so no
    flash-attn install is needed (NOT run in CI: no GPU there).

    A layer's sliding window / soft-cap (``inner`` a kernels.Windowed) is applied within each document: the
    varlen calls take the window natively (flash's window_size_left/right; same cu_seqlens), flash-attn's
    varlen the soft-cap too; a soft-capped layer on torch's varlen (no softcap) runs the per-document loop of
    the windowed kernel. Under a measured 'auto' the varlen call follows the kernel measured for the layer's
    signature (flash-attn's when that is flash_attention_2).
    """

    def __init__(self, inner: Backend, docs: Documents, varlen: bool = True):
        # varlen=False: the per-document loop on CUDA too (the GPU bench's reference for the varlen call)
        self.inner, self.docs, self.varlen = inner, docs, varlen
        self.name = f"{inner.name}+documents"
        self.device_type = inner.device_type
        self.native_gqa = True

    def _check(self, q):
        if q.shape[0] != self.docs.batch or q.shape[1] != self.docs.seq_len:
            raise ValueError(f"document attention: q {tuple(q.shape)} does not match {self.docs} "
                             "(head-sharded q must cover the whole gathered sequence)")

    def _route(self, q, k, v, causal: bool, scale: float):
        """("fa2" | "torch" | "loop", window, softcap): how this call runs. A measured "auto" chooses here (every
        rank measures at the same call, packed or not); in the backward its choice is cached."""
        if isinstance(self.inner, Windowed):
            kernel, (w, c) = self.inner.inner, self.inner.pattern
        else:
            kernel, w, c = self.inner, 0, 0.0
        if hasattr(kernel, "choose"):
            chosen = kernel.choose(q, k, v, causal, scale, w, c)
            if w or c:  # full layers keep torch's varlen under "auto" (as before windows)
                kernel = chosen
        if not self.varlen:
            return "loop", w, c
        if _varlen_ok(q, kernel):
            return "fa2", w, c
        if _torch_varlen_ok(q) and not c:
            return "torch", w, c
        return "loop", w, c

    def forward(self, q, k, v, causal: bool, scale: float):
        self._check(q)
        how, w, c = self._route(q, k, v, causal, scale)
        if how == "fa2":
            return _fa2_varlen_forward(q, k, v, self.docs, causal, scale, w, c)
        if how == "torch":
            return _torch_varlen_forward(q, k, v, self.docs, causal, scale, w)
        b, S, h, d = q.shape
        out = torch.empty(b, S, h, d, dtype=q.dtype, device=q.device)
        lse = None
        for i, spans in enumerate(self.docs.bounds):
            for a, e in spans:
                o, l = self.inner.forward(q[i:i + 1, a:e], k[i:i + 1, a:e], v[i:i + 1, a:e], causal, scale)
                if lse is None:  # the kernel's LSE dtype (fp32; fp64 for fp64 inputs on CPU)
                    lse = torch.empty(b, h, S, dtype=l.dtype, device=q.device)
                out[i:i + 1, a:e] = o
                lse[i:i + 1, :, a:e] = l
        return out, lse

    def backward(self, dout, q, k, v, out, lse, causal: bool, scale: float):
        self._check(q)
        how, w, c = self._route(q, k, v, causal, scale)
        if how == "fa2":
            return _fa2_varlen_backward(dout, q, k, v, out, lse, self.docs, causal, scale, w, c)
        if how == "torch":
            return _torch_varlen_backward(dout, q, k, v, out, lse, self.docs, causal, scale, w)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for i, spans in enumerate(self.docs.bounds):
            for a, e in spans:
                t = (slice(i, i + 1), slice(a, e))
                g = self.inner.backward(dout[t], q[t], k[t], v[t], out[t], lse[i:i + 1, :, a:e].contiguous(), causal,
                                        scale)
                dq[t], dk[t], dv[t] = g
        return dq, dk, dv


def with_documents(backend: Backend, docs: Optional[Documents]) -> Backend:
    """``backend`` itself for dense samples, else a per-document wrapper of it."""
    if docs is None or docs.dense:
        return backend
    return DocumentBackend(backend, docs)


# CUDA varlen (flash-attn 2). Written against flash_attn 2.x's private _flash_attn_varlen_forward /
# _backward (bound by parameter name like kernels.FlashAttn2); its LSE is [h, total_q] in recent
# releases, [b, h, max_s] in old ones: only the former is accepted. Never run in CI (no GPU).
def _varlen_ok(q, inner) -> bool:
    return (q.is_cuda and inner.name == "flash_attention_2" and importlib.util.find_spec("flash_attn") is not None)


def _torch_varlen_ok(q) -> bool:
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def _expand_kv(q, t):
    rep = q.shape[2] // t.shape[2]
    return t.repeat_interleave(rep, dim=2) if rep > 1 else t


def _lse_to_bhs(lse, docs, b, S, h):
    """The varlen LSE as [b, h, S]: [h, b*S] (current flash kernels) or [docs, h, longest] (padded, older)."""
    if tuple(lse.shape) == (h, b * S):
        return lse.view(h, b, S).transpose(0, 1)
    out = torch.empty(b, h, S, dtype=lse.dtype, device=lse.device)
    n = 0
    for i, spans in enumerate(docs.bounds):
        for a, e in spans:
            out[i, :, a:e] = lse[n, :, :e - a]
            n += 1
    return out


def _lse_from_bhs(lse, like_shape, docs, b, S, h):
    if tuple(like_shape) == (h, b * S):
        return lse.transpose(0, 1).reshape(h, b * S).contiguous()
    out = torch.zeros(like_shape, dtype=lse.dtype, device=lse.device)
    n = 0
    for i, spans in enumerate(docs.bounds):
        for a, e in spans:
            out[n, :, :e - a] = lse[i, :, a:e]
            n += 1
    return out


def _torch_varlen_forward(q, k, v, docs, causal, scale, window=0):
    # k/v expanded to q's heads (like TorchCUDAFlash: native GQA of the aten op is not part of its contract)

    b, S, h, d = q.shape
    cu, mx = docs.varlen_args(q.device)
    qf, kf, vf = (t.reshape(b * S, h, d) for t in (q, _expand_kv(q, k), _expand_kv(q, v)))
    res = torch.ops.aten._flash_attention_forward(qf, kf, vf, cu, cu, mx, mx, 0.0, causal, False, scale=scale,
                                                  **torch_flash_window_kwargs(window))
    docs.varlen_lse_shape[h] = tuple(res[1].shape)
    return res[0].view(b, S, h, d), _lse_to_bhs(res[1], docs, b, S, h)


def _torch_varlen_backward(dout, q, k, v, out, lse, docs, causal, scale, window=0):
    b, S, h, d = q.shape
    hk = k.shape[2]
    cu, mx = docs.varlen_args(q.device)
    raw_shape = docs.varlen_lse_shape.get(h)
    if raw_shape is None:
        raise RuntimeError(f"varlen attention backward for {docs} without its forward")
    flat = lambda t: t.reshape(b * S, h, d)  # noqa: E731
    qf, kf, vf = flat(q), flat(_expand_kv(q, k)), flat(_expand_kv(q, v))
    of, dof = flat(out), flat(dout.contiguous())
    raw = _lse_from_bhs(lse, raw_shape, docs, b, S, h)
    rng = torch.empty(2, dtype=torch.uint64, device=q.device)  # dropout 0: the rng state is never read
    unused = torch.empty((), dtype=torch.uint64, device=q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(dof, qf, kf, vf, of, raw, cu, cu, mx, mx, 0.0, causal,
                                                         rng, unused, scale=scale, **torch_flash_window_kwargs(window))
    dq, dk, dv = dq.view(b, S, h, d), dk.view(b, S, h, d), dv.view(b, S, h, d)
    if hk < h:
        dk, dv = (t.view(b, S, hk, h // hk, d).sum(3) for t in (dk, dv))
    return dq, dk, dv


def _fa2_varlen_forward(q, k, v, docs, causal, scale, window=0, softcap=0.0):
    from flash_attn import flash_attn_interface as fa

    b, S, h, d = q.shape
    cu, mx = docs.varlen_args(q.device)
    qf, kf, vf = (t.reshape(b * S, t.shape[2], d) for t in (q, k, v))
    fn = fa._flash_attn_varlen_forward
    res = call_by_name(fn, q=qf, k=kf, v=vf, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=mx, max_seqlen_k=mx,
                        softmax_scale=scale, causal=causal,
                        **flash_pattern_kwargs(fn, window, softcap, "flash_attention_2 varlen"))
    lse = next((t for t in res[1:] if isinstance(t, torch.Tensor) and t.dtype == torch.float32
                and tuple(t.shape) == (h, b * S)), None)
    if lse is None:
        raise RuntimeError("flash-attn varlen forward returned no [heads, total] float32 LSE; unsupported version "
                           "for packed documents (use the sdpa kernel)")
    return res[0].view(b, S, h, d), lse.view(h, b, S).transpose(0, 1)  # [b, h, S] view


def _fa2_varlen_backward(dout, q, k, v, out, lse, docs, causal, scale, window=0, softcap=0.0):
    from flash_attn import flash_attn_interface as fa

    b, S, h, d = q.shape
    cu, mx = docs.varlen_args(q.device)
    flat = lambda t: t.reshape(b * S, t.shape[2], d)  # noqa: E731
    qf, kf, vf, of, dof = flat(q), flat(k), flat(v), flat(out), flat(dout.contiguous())
    dq, dk, dv = torch.empty_like(qf), torch.empty_like(kf), torch.empty_like(vf)
    fn = fa._flash_attn_varlen_backward
    call_by_name(fn, dout=dof, q=qf, k=kf, v=vf, out=of,
                  softmax_lse=lse.transpose(0, 1).reshape(h, b * S).contiguous(), dq=dq, dk=dk, dv=dv,
                  cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=mx, max_seqlen_k=mx, softmax_scale=scale,
                  causal=causal, **flash_pattern_kwargs(fn, window, softcap, "flash_attention_2 varlen"))
    return dq.view_as(q), dk.view_as(k), dv.view_as(v)


# ---------------------------------------------------------------------------------------------
# the core attention given to DeepSpeed's UlyssesSPAttentionHF
# ---------------------------------------------------------------------------------------------


def document_core(core, impl: str):
    """Wrap HF attention function ``core`` (layout [b, h, S, d] after the all-to-all) to run per document.

    DeepSpeed's Ulysses calls its core with attention_mask=None, i.e. causal over the whole gathered
    sequence. With documents, the sdpa/eager cores run once per document (out [b, S, h, d] is
    concatenated); flash cores run once per sample with positions restarting per document, which
    HF's flash path turns into one varlen call (it detects packing from position_ids at batch 1).

    The documents are cut with one ``split`` per tensor and sample (the non-empty documents tile the
    sequence), not by slicing: a slice's backward writes its gradient into a zero tensor of the whole
    input and adds that up, documents x S work (aten::fill_ + add_ were 95% of the CPU time at 256
    documents); a split's backward concatenates the per-document gradients once.
    """

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        docs = kwargs.pop(DOCS_KWARG, None)
        if docs is None:
            return core(module, query, key, value, attention_mask, *args, **kwargs)
        if query.shape[0] != docs.batch or query.shape[2] != docs.seq_len:
            raise ValueError(f"document attention: query {tuple(query.shape)} does not match {docs}")
        flash = impl.startswith("flash_attention")
        pos = docs.position_ids(query.device) if flash else None
        samples = [t.split(1, 0) for t in (query, key, value)]
        rows = []
        for i, spans in enumerate(docs.bounds):
            q_i, k_i, v_i = (t[i] for t in samples)
            kw = dict(kwargs)
            if flash:
                kw["position_ids"] = pos[i:i + 1]
                rows.append(core(module, q_i, k_i, v_i, None, *args, **kw)[0])
                continue
            sizes = [e - a for a, e in spans]
            pids = kwargs["position_ids"][i:i + 1].split(sizes, 1) if "position_ids" in kw else None
            parts = []
            for n, (q, k, v) in enumerate(zip(q_i.split(sizes, 2), k_i.split(sizes, 2), v_i.split(sizes, 2))):
                if pids is not None:
                    kw["position_ids"] = pids[n]
                parts.append(core(module, q, k, v, None, *args, **kw)[0])
            rows.append(torch.cat(parts, 1) if len(parts) > 1 else parts[0])
        return (torch.cat(rows, 0) if len(rows) > 1 else rows[0]), None

    return attention


__all__ = ["Documents", "DocumentBackend", "with_documents", "document_core", "DOCS_KWARG"]
