"""Packed documents and padding: attention is causal within each document on every attention path.

Reference: HF's own packed path in one process (attention_mask=None, position_ids restarting per
document, use_cache=False), itself checked against running every document alone. Through
ds_longctx.initialize (ZeRO-3, real gloo worlds): loss and SGD(lr=1) parameter deltas equal the
reference at fp32 rel 1e-6 for "none"/"ulysses"/"untied_ulysses" (fused and attention-function
level), SP 1/2/4, MHA/GQA/KV replication, with boundaries inside a shard, on a shard edge, several
per shard, a one-token document and a document spanning every shard (three rows of one batch).
Right padding is an ignored document; padding or packing that bypasses shard_batch on SP>1 is an
error on every rank.
"""
from __future__ import annotations

import math

import pytest
import torch

from ds_longctx.attention.documents import Documents, DocumentBackend
from ds_longctx.data.batch import document_structure
from ds_longctx.attention.kernels import get_backend, reference_attention
from ds_longctx.errors import BatchError
from ds_longctx.data import shard_batch
from dist_utils import result_or_raise, runs_per_degree
from sp_cases import full_params
from tiny_models import build, tiny_config

SEQ, VOCAB = 16, 64
# row 0: boundaries 3, 4, 9 (inside shards, several per shard, a one-token document)
# row 1: boundaries 8, 12 (exactly on shard edges at SP=2 and SP=4)
# row 2: a one-token document, a 14-token one spanning every shard at SP=4, a one-token document
DOC_LENS = [[3, 1, 5, 7], [8, 4, 4], [1, 14, 1]]
SHAPES = {"mha": dict(heads=4, kv_heads=4), "gqa": dict(heads=4, kv_heads=2), "mqa": dict(heads=4, kv_heads=1),
          "gqa_repl": dict(heads=8, kv_heads=2, head_dim=4)}


def _positions(lens_rows):
    return torch.stack([torch.cat([torch.arange(n) for n in lens]) for lens in lens_rows])


def packed_batch(seed=7):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (len(DOC_LENS), SEQ), generator=g)
    labels = ids.clone()
    labels[0, 5] = labels[2, 0] = -100
    return {"input_ids": ids, "labels": labels, "position_ids": _positions(DOC_LENS)}


def padded_batch(seed=8):
    """Row 0 right-padded (11 real tokens), row 1 packed [6, 10] and full."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[0, 11:] = 0
    pos = torch.stack([torch.arange(SEQ), _positions([[6, 10]])[0]])
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": mask, "position_ids": pos}


def reference(shape, batch):
    """One process, HF's own path: loss and SGD(lr=1) deltas."""
    model = build(tiny_config(**SHAPES[shape], vocab=VOCAB), seed=0)
    model.train()
    kw = {k: batch[k] for k in ("input_ids", "labels", "position_ids", "attention_mask") if k in batch}
    loss = model(**kw, use_cache=False).loss
    loss.backward()
    return loss.item(), {n: -p.grad.detach().clone() for n, p in model.named_parameters()}


def padded_reference(shape):
    """Padding by HF's padding mask (row 0) and HF's packing (row 1): pad labels ignored."""
    b = padded_batch()
    labels = b["labels"].clone()
    labels[b["attention_mask"] == 0] = -100
    model = build(tiny_config(**SHAPES[shape], vocab=VOCAB), seed=0)
    model.train()
    # HF does not combine a padding mask with packed detection: give it the explicit 4-D mask
    seg = torch.tensor([[0] * 11 + [1] * 5, [0] * 6 + [1] * 10])
    allowed = (seg[:, :, None] == seg[:, None, :]) & torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    mask4 = torch.zeros(2, 1, SEQ, SEQ).masked_fill(~allowed[:, None], torch.finfo(torch.float32).min)
    loss = model(input_ids=b["input_ids"], labels=labels, position_ids=b["position_ids"], attention_mask=mask4,
                 use_cache=False).loss
    loss.backward()
    return loss.item(), {n: -p.grad.detach().clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------------------------------------
# unit level
# ---------------------------------------------------------------------------------------------


def test_hf_packed_path_is_document_masked():
    """The reference itself: HF's packed position_ids == every document run alone."""
    model = build(tiny_config(vocab=VOCAB), seed=0)
    b = packed_batch()
    out = model(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False).logits
    for i, lens in enumerate(DOC_LENS):
        a = 0
        for n in lens:
            alone = model(input_ids=b["input_ids"][i:i + 1, a:a + n], use_cache=False).logits[0]
            torch.testing.assert_close(out[i, a:a + n], alone, rtol=1e-5, atol=1e-6)
            a += n
    cross = model(input_ids=b["input_ids"], position_ids=b["position_ids"]).logits  # with a cache: not masked
    assert not torch.allclose(out, cross, atol=1e-3)


def test_structure_from_positions_lengths_and_padding():
    b = packed_batch()
    cu, pos, n_real = document_structure(b["input_ids"], b["position_ids"])
    assert cu.tolist() == [[0, 3, 4, 9, 16], [0, 8, 12, 16, 16], [0, 1, 15, 16, 16]] and n_real == [16] * 3
    cu2, pos2, _ = document_structure(b["input_ids"], doc_lens=[lens + [0] for lens in DOC_LENS])
    assert torch.equal(cu2[:, :4], cu[:, :4]) and torch.equal(pos2, b["position_ids"])
    p = padded_batch()
    cu3, pos3, n3 = document_structure(p["input_ids"], p["position_ids"], p["attention_mask"])
    assert cu3.tolist() == [[0, 11, 16], [0, 6, 16]] and n3 == [11, 16]
    assert pos3[0].tolist() == list(range(11)) + list(range(5))


def test_shard_batch_gives_every_rank_the_global_documents():
    b = packed_batch()
    shards = [shard_batch(b, r, 4) for r in range(4)]
    for s in shards:
        assert torch.equal(s["doc_cu_seqlens"], shards[0]["doc_cu_seqlens"])
    # the boundary at 12 sits on the edge of shard 3: its local ids [0, 1, 2, 3] look contiguous
    assert shards[3]["position_ids"][1].tolist() == [0, 1, 2, 3]
    assert torch.equal(torch.cat([s["position_ids"] for s in shards], 1), b["position_ids"])


def test_padding_targets_ignored_and_bad_padding_rejected():
    p = padded_batch()
    s = shard_batch(p, 0, 1)
    assert (s["shift_labels"][0, 10:] == -100).all() and (s["shift_labels"][0, :10] != -100).all()
    assert "attention_mask" not in s
    left = p["attention_mask"].flip(1)
    with pytest.raises(BatchError, match="batch.attention_mask: sample 0 is not right-padded"):
        shard_batch(dict(p, attention_mask=left), 0, 2)
    with pytest.raises(BatchError, match=r"batch.doc_lens: sample 0: document lengths \[3, 4\] must"):
        shard_batch({"input_ids": p["input_ids"][:1], "doc_lens": [[3, 4]]}, 0, 2)
    with pytest.raises(BatchError, match="already set"):
        shard_batch(shard_batch(packed_batch(), 0, 1), 0, 1)


@pytest.mark.parametrize("kv", [4, 2])
def test_document_backend_equals_block_diagonal_reference(kv):
    g = torch.Generator().manual_seed(0)
    b, S, h, d = 3, SEQ, 4, 8
    q = torch.randn(b, S, h, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(b, S, kv, d, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(b, S, h, d, generator=g, dtype=torch.float64)
    cu, _, _ = document_structure(torch.zeros(b, S, dtype=torch.long), packed_batch()["position_ids"])
    be = DocumentBackend(get_backend("sdpa", "cpu"), Documents(cu))
    out, lse = be.forward(q, k, v, True, d ** -0.5)
    dq, dk, dv = be.backward(dout, q, k, v, out, lse, True, d ** -0.5)
    qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
    ref = torch.zeros_like(q)
    for i, lens in enumerate(DOC_LENS):
        a = 0
        for n in lens:
            o, l = reference_attention(qr[i:i + 1, a:a + n], kr[i:i + 1, a:a + n], vr[i:i + 1, a:a + n], True,
                                       d ** -0.5)
            torch.testing.assert_close(lse[i:i + 1, :, a:a + n], l, rtol=1e-10, atol=1e-10)
            ref[i:i + 1, a:a + n] = o
            a += n
    ref.backward(dout)
    torch.testing.assert_close(out, ref.detach(), rtol=1e-10, atol=1e-10)
    for got, want in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------------------------
# through ds_longctx.initialize, ZeRO-3, real worlds
# ---------------------------------------------------------------------------------------------

IMPLS = {"none": {"implementation": "none"}, "ulysses": {"implementation": "ulysses"},
         "fused": {"implementation": "untied_ulysses", "fuse_projections": True},
         "function": {"implementation": "untied_ulysses", "fuse_projections": False}}


def _engine(shape, impl, sp, ckpt=False):
    import ds_longctx
    from sp_cases import ds_config

    lc = {"attention": IMPLS[impl]}
    if ckpt:
        lc["activation_checkpointing"] = {"enabled": True, "offload": "cpu", "pin_memory": False}
    config = ds_config(3, sp, lc)
    model = build(tiny_config(**SHAPES[shape], vocab=VOCAB), seed=0)  # same weights as the reference
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    engine, _, _, _ = ds_longctx.initialize(model=model, optimizer=opt, config=config)
    return engine


def _step(engine, batch):
    before = full_params(engine.module)
    loss = engine(**batch).loss
    engine.backward(loss)
    engine.step()
    after = full_params(engine.module)
    return loss.item(), {n: after[n] - before[n] for n in after}


def _worker(rank, world, cases):
    from ds_longctx.dist.comm import sp_group, sp_rank

    out = {}
    for case in cases:
        kind, shape, impl = case[:3]
        engine = _engine(shape, impl, world, ckpt=(kind == "ckpt"))
        r = sp_rank(sp_group()) if world > 1 else 0  # the SP group exists once an engine was built
        if kind == "error":  # a batch cut by hand (no doc_cu_seqlens): every rank must raise
            src = packed_batch() if case[3] == "packed" else padded_batch()
            chunk = SEQ // world
            sl = slice(r * chunk, (r + 1) * chunk)
            shard = {"input_ids": src["input_ids"][:, sl], "shift_labels": src["labels"][:, sl],
                     "position_ids": (src["position_ids"] if case[3] == "packed" else
                                      torch.arange(SEQ).expand(2, SEQ))[:, sl]}
            if case[3] == "padded":
                shard["attention_mask"] = src["attention_mask"][:, sl]
            try:
                engine(**shard)
                out[case] = "no error"
            except BatchError as e:
                out[case] = str(e)
            continue
        src = padded_batch() if kind.startswith("padded") else packed_batch()
        if kind.endswith("direct"):  # SP=1: the full batch straight to engine(**batch)
            out[case] = _step(engine, src)
        else:
            out[case] = _step(engine, shard_batch(src, r, world))
    return out


def _compare(results, cases):
    refs = {}
    for case in cases:
        kind, shape = case[:2]
        if kind == "error":
            for rank_out in results:
                assert "doc_cu_seqlens" in rank_out[case] and "shard_batch" in rank_out[case], (case, rank_out[case])
            continue
        key = (shape, kind.startswith("padded"))
        if key not in refs:
            refs[key] = padded_reference(shape) if key[1] else reference(shape, packed_batch())
        ref_loss, ref_deltas = refs[key]
        for rank_out in results:
            loss, deltas = rank_out[case]
            assert math.isclose(loss, ref_loss, rel_tol=1e-6), (case, loss, ref_loss)
            for n, ref in ref_deltas.items():
                torch.testing.assert_close(deltas[n], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{case} {n}: {m}")


# One spawn per SP degree (SP groups are once per process); ~1.5 s per engine on the 2-core box.
SP_CASES = {
    1: [("packed", "gqa", "none"), ("packed", "mha", "fused"), ("direct", "gqa", "function"),
        ("padded", "gqa", "none"), ("padded_direct", "gqa", "fused")],
    2: [("packed", "mha", "ulysses"), ("packed", "mha", "function"), ("packed", "gqa", "fused"),
        ("packed", "gqa", "function"), ("packed", "mqa", "ulysses"), ("packed", "mqa", "fused"),
        ("padded", "gqa", "ulysses"), ("padded", "gqa", "function"),
        ("ckpt", "gqa", "ulysses"), ("ckpt", "gqa", "fused"),  # documents reach the recompute in backward
        ("error", "gqa", "ulysses", "packed"), ("error", "gqa", "fused", "padded")],
    4: [("packed", "gqa_repl", "ulysses"), ("packed", "gqa_repl", "fused"), ("packed", "mha", "function")],
}


@pytest.fixture(scope="module")
def sp_results():
    """The three spawns (SP 1, 2, 4) started side by side, once; each test below checks its own."""
    return runs_per_degree(_worker, SP_CASES)


@pytest.mark.distributed
@pytest.mark.parametrize("sp", [1, 2, 4])
def test_packed_training_equals_hf_packed_reference(sp, sp_results):
    cases = SP_CASES[sp]
    results = result_or_raise(sp_results[sp])
    _compare(results, cases)


@pytest.mark.parametrize("own", [True, False])
def test_our_attention_gets_documents_and_no_hf_packed_mask(own, monkeypatch):
    """SP=1, function level: with our attention HF builds no [b, 1, S, S] packed mask (quadratic, unused);
    with "none" (own=False) HF's packed mask is the attention. Logits equal HF's packed path either way."""
    from ds_longctx.attention import hf
    from ds_longctx.attention.documents import is_no_mask
    from tiny_models import spec_for

    from ds_longctx.config import parse
    from ds_longctx.patching.sp_batch import install_document_forward

    model = build(tiny_config(vocab=VOCAB), seed=0)
    untied = spec_for(model, parse({"long_context": {"attention": {"implementation": "untied_ulysses",
                                                                   "fuse_projections": False}}}))
    hf.install_untied(model, untied)
    seen, orig = [], hf._function_level_attention

    def spy(state, module, q, k, v, mask, *a, **kw):
        shape = None if mask is None else tuple(mask.shape)
        if is_no_mask(mask) and mask.stride() == (0, 0, 0, 0):  # a view of one element: no [S, S] memory
            shape = "no_mask"
        seen.append((shape, kw.get("ds_longctx_documents") is not None))
        return orig(state, module, q, k, v, mask, *a, **kw)

    monkeypatch.setattr(hf, "_function_level_attention", spy)
    inner = model.forward
    model.forward = lambda input_ids=None, attention_mask=None, position_ids=None, labels=None, shift_labels=None, \
        **kw: inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kw)
    # own=False: the spec of implementation "none" (transformers' attention builds its packed mask)
    install_document_forward(model, untied if own else spec_for(model, parse({"long_context": {}})))
    b = packed_batch()
    out = model.forward(input_ids=b["input_ids"], position_ids=b["position_ids"]).logits
    ref = build(tiny_config(vocab=VOCAB), seed=0)(input_ids=b["input_ids"], position_ids=b["position_ids"],
                                                   use_cache=False).logits
    assert seen[0] == (("no_mask", True) if own else ((3, 1, SEQ, SEQ), True))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_packed_batch_refused_where_transformers_mask_ignores_positions():
    """Under "none" transformers' own attention sees packed documents only where the decoder hands position_ids to
    its mask builder; GPT-OSS (and GraniteMoeHybrid, OPT, BLOOM, ...) does not, so its tokens attended across
    documents (issue 36's finding). A packed batch with targets in a later document is refused there; a right-padded
    batch (the tail has no targets) and any batch of a model whose mask reads positions still run."""
    import transformers as tf

    from ds_longctx.config import parse
    from ds_longctx.errors import BatchError
    from ds_longctx.models.packing import mask_ignores_positions
    from ds_longctx.patching.sp_batch import install_document_forward
    from tiny_models import spec_for

    llama = build(tiny_config(vocab=VOCAB), seed=0)
    assert not mask_ignores_positions(llama)
    cfg = tf.GptOssConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_hidden_layers=2,
                          vocab_size=VOCAB, intermediate_size=48, num_local_experts=2, num_experts_per_tok=1,
                          layer_types=["sliding_attention", "full_attention"], sliding_window=4,
                          pad_token_id=0, eos_token_id=1, bos_token_id=1)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    oss = tf.GptOssForCausalLM(cfg).eval()
    assert mask_ignores_positions(oss)
    install_document_forward(oss, spec_for(oss, parse({"long_context": {}})))
    b = packed_batch()
    ids, pos = b["input_ids"], b["position_ids"]
    labels = ids.clone()
    with pytest.raises(BatchError, match="GptOssForCausalLM's causal mask is built without position_ids"):
        oss.forward(input_ids=ids, position_ids=pos, labels=labels)
    # one document and a right-padded tail without targets: a plain causal mask is exact for the real tokens
    one = ids[:1, :SEQ]
    mask = torch.ones_like(one)
    mask[:, SEQ - 3:] = 0
    oss.forward(input_ids=one, attention_mask=mask, labels=one.clone())
