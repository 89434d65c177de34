"""The "ulysses" document core (attention/documents.py document_core) is flat in the number of documents.

Exactness: bit-equal (output and q/k/v gradients) to the per-document path it replaced, which sliced
each document out of the gathered q/k/v (kept here as the reference), for HF's sdpa and eager
attention functions, MHA and GQA, several samples with different documents. Flatness: in backward,
the elements written by all ops stay within a small multiple of q/k/v's size at 64 documents (the
slicing path wrote documents x the whole input: a full-size zero gradient per slice; checked too).
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ds_longctx.attention.documents import DOCS_KWARG, Documents, document_core

S, D = 64, 8


def _sliced_reference(core, module, query, key, value, docs, **kwargs):
    """The per-document path before the split (slices of the gathered q/k/v)."""
    rows = []
    for i, spans in enumerate(docs.bounds):
        parts = []
        for a, e in spans:
            sl = (slice(i, i + 1), slice(None), slice(a, e))
            parts.append(core(module, query[sl], key[sl], value[sl], None, **kwargs)[0])
        rows.append(torch.cat(parts, 1) if len(parts) > 1 else parts[0])
    return torch.cat(rows, 0) if len(rows) > 1 else rows[0]


class _Module:
    is_causal = True
    training = True

    def __init__(self, groups):
        self.num_key_value_groups = groups


def _core(impl):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.llama.modeling_llama import eager_attention_forward

    return {"sdpa": sdpa_attention_forward, "eager": eager_attention_forward}[impl]


def _inputs(h, hk, lens_rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    b = len(lens_rows)
    q, k, v = (torch.randn(b, n, S, D, generator=g).requires_grad_(True) for n in (h, hk, hk))
    cu = [[0] + torch.tensor(lens).cumsum(0).tolist() for lens in lens_rows]
    width = max(len(r) for r in cu)
    docs = Documents(torch.tensor([r + [S] * (width - len(r)) for r in cu]))  # zero-length entries: padding
    return q, k, v, docs, torch.randn(b, S, h, D, generator=g)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("h,hk", [(4, 4), (4, 2)])
def test_split_core_bit_equal_to_sliced_path(impl, h, hk):
    core = _core(impl)
    lens_rows = [[3, 1, 20, 40], [64], [1] * 16 + [48]]
    q, k, v, docs, dout = _inputs(h, hk, lens_rows)
    kw = dict(dropout=0.0, scaling=D ** -0.5)
    out = document_core(core, impl)(_Module(h // hk), q, k, v, None, **kw, **{DOCS_KWARG: docs})[0]
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = _sliced_reference(core, _Module(h // hk), q, k, v, docs, **kw)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    assert torch.equal(out, ref)
    for a, b in zip(grads, ref_grads):
        assert torch.equal(a, b)


class _Written(TorchDispatchMode):
    """Elements of every op's tensor outputs (a full-size zero gradient per document shows here)."""

    def __init__(self):
        super().__init__()
        self.filled = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.filled += t.numel()
        return out


@pytest.mark.parametrize("flat", [True, False])
def test_backward_does_not_fill_documents_times_the_input(flat):
    core = _core("sdpa")
    q, k, v, docs, dout = _inputs(4, 2, [[1] * 64])  # 64 one-token documents
    kw = dict(dropout=0.0, scaling=D ** -0.5)
    if flat:
        out = document_core(core, "sdpa")(_Module(2), q, k, v, None, **kw, **{DOCS_KWARG: docs})[0]
    else:  # the sliced path: the check must catch it
        out = _sliced_reference(core, _Module(2), q, k, v, docs, **kw)
    written = _Written()
    with written:
        torch.autograd.grad(out, (q, k, v), dout)
    size = q.numel() + k.numel() + v.numel()
    if flat:  # measured 5x: the per-document grads (q, k, v, the expanded k/v of GQA) and one cat each
        assert written.filled <= 8 * size, (written.filled, size)
    else:
        assert written.filled >= 32 * size, (written.filled, size)
