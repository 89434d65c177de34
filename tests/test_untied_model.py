"""Untied Ulysses inside HF models: tiny Llama, Mistral, Qwen2 (q/k/v biases), Qwen3 (q/k-norm) and
Phi3 (fused qkv_proj: attention-function level only).

SP=1: the patched model's logits/loss equal the unpatched model's (bit-equal at the attention-function
level; fp32 1e-6 fused, where q/k/v come from GEMMs over row subsets), grads within fp32 1e-6.
SP=2 (one spawn for everything): loss and grads equal the one-process unpatched model on the full
sequence, fused and attention-function level; through ds_longctx.initialize with ZeRO-3 (model
built partitioned), loss and SGD(lr=1) parameter deltas equal the one-process model.
"""
from __future__ import annotations

import math

import pytest
import torch

from dist_utils import run_distributed
from tiny_models import build, tiny_config

SEQ, VOCAB = 16, 64
ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
SHAPE = dict(heads=4, kv_heads=2, vocab=VOCAB)


def _phi3_config(**kw):
    from transformers import Phi3Config

    cfg = Phi3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                     vocab_size=VOCAB, intermediate_size=48, max_position_embeddings=4096, tie_word_embeddings=False,
                     pad_token_id=0, **kw)
    cfg._attn_implementation = "sdpa"
    return cfg


def _model(arch, seed=0, **kw):
    if arch == "phi3":
        return build(_phi3_config(), seed=seed)
    return build(tiny_config(arch, **SHAPE, **kw), seed=seed)


def _spec(model, hpc=1, fuse=True, kernel="auto", group=None):
    """The spec of untied attention with these keys for ``model`` (spec.build_spec: checked there)."""
    from tiny_models import spec_for

    from ds_longctx.config import AttentionConfig, LongContextConfig

    attn = AttentionConfig(implementation="untied_ulysses", heads_per_chunk=hpc, fuse_projections=fuse, kernel=kernel)
    return spec_for(model, LongContextConfig(attention=attn), group)


def _ids(seed=123):
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-12)).item()


def _reference(arch, ids):
    """One process, unpatched, full sequence: loss (token mean) and grads by name."""
    model = _model(arch)
    model.train()
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    return out.loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}, out.logits.detach()


# ---------------------------------------------------------------------------------------------
# SP = 1
# ---------------------------------------------------------------------------------------------

SP1 = [(a, f, h) for a in ARCHS for f in (True, False) for h in (1, 2)] + [("phi3", False, 1), ("phi3", False, 2)]


@pytest.mark.parametrize("arch,fuse,hpc", SP1, ids=[f"{a}-{'fused' if f else 'function'}-u{h}" for a, f, h in SP1])
def test_sp1_patched_equals_unpatched(arch, fuse, hpc):
    from ds_longctx.attention.hf import install_untied

    ids = _ids()
    ref_loss, ref_grads, ref_logits = _reference(arch, ids)
    model = _model(arch)
    install_untied(model, _spec(model, hpc, fuse))
    model.train()
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    if fuse:  # a GEMM over a subset of q_proj's rows need not round like the full GEMM
        assert _rel(out.logits, ref_logits) <= 1e-6
        assert math.isclose(out.loss.item(), ref_loss, rel_tol=1e-6)
    else:  # HF's own q/k/v, the same kernel on the same heads
        assert torch.equal(out.logits, ref_logits)
        assert out.loss.item() == ref_loss
    for n, p in model.named_parameters():  # staged backward sums in another order (1.02e-6 measured, qwen3 k_norm)
        assert _rel(p.grad, ref_grads[n]) <= 4e-6, n


def test_unpatched_model_in_same_process_is_untouched():
    """The attention-function override is process-global; models that were not installed keep HF's."""
    from ds_longctx.attention.hf import install_untied

    ids = _ids(7)
    patched = _model("llama")
    install_untied(patched, _spec(patched, 1, fuse=False))
    other = _model("llama", seed=1)
    calls = []
    from ds_longctx.attention import untied

    orig = untied.UntiedQKVAttention.apply
    untied.UntiedQKVAttention.apply = lambda *a: calls.append(1) or orig(*a)
    try:
        other(input_ids=ids, use_cache=False)
        assert calls == []
        patched(input_ids=ids, use_cache=False)
        assert len(calls) == patched.config.num_hidden_layers
    finally:
        untied.UntiedQKVAttention.apply = orig


# ---------------------------------------------------------------------------------------------
# bad inputs
# ---------------------------------------------------------------------------------------------


def test_fused_on_unsupported_architecture_names_the_key():
    """fuse_projections true (not the default 'auto') on an architecture ds_longctx.models has no fused path for:
    refused when the spec is built, naming the key."""
    from ds_longctx.config import ConfigError

    with pytest.raises(ConfigError, match=r"long_context\.attention\.fuse_projections: architecture 'phi3' has no "
                                          r"fused untied attention.*Fix: set it to 'auto' \(the default\) or false"):
        _spec(_model("phi3"), 1, fuse=True)


def test_heads_per_chunk_not_dividing_is_a_config_error():
    from ds_longctx.config import ConfigError

    with pytest.raises(ConfigError, match=r"long_context\.attention\.heads_per_chunk.*3 does not divide the 4 "
                                          r"query heads.*\[1, 2, 4\]"):
        _spec(_model("llama"), 3)


def test_unavailable_kernel_is_a_config_error_not_a_fallback():
    from ds_longctx.attention.kernels import BACKENDS
    from ds_longctx.config import ConfigError

    missing = [k for k in ("flash_attention_2", "flash_attention_3") if not BACKENDS[k].available()]
    if not missing:
        pytest.skip("every flash kernel is installed here")
    with pytest.raises(ConfigError, match=r"long_context\.attention\.kernel.*not available.*set it to 'auto'"):
        _spec(_model("llama"), 1, kernel=missing[0])


@pytest.mark.parametrize("fuse", [True, False])
def test_padding_mask_is_rejected(fuse):
    from ds_longctx.attention.hf import install_untied

    model = _model("llama")
    install_untied(model, _spec(model, 1, fuse))
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with pytest.raises(ValueError, match="not plain causal"):
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)  # all-ones: plain causal


# ---------------------------------------------------------------------------------------------
# SP = 2: one spawn for the manual SP cases and the ZeRO-3 engine cases
# ---------------------------------------------------------------------------------------------

SP2 = [(a, f, h) for a in ARCHS for f in (True, False) for h in (1, 2)] + [("phi3", False, 1)]
ZERO3 = [(a, f) for a in ARCHS for f in (True, False)]


def _sp2_worker(rank, world):
    import torch.distributed as dist

    from ds_longctx.attention.hf import install_untied
    from ds_longctx.loss import shift_labels_of

    group = dist.new_group(list(range(world)))
    s = SEQ // world
    lo, hi = rank * s, (rank + 1) * s
    ids = _ids()
    shift = shift_labels_of(ids)
    count = (shift != -100).sum()
    res = {"manual": {}, "zero3": {}}
    for arch, fuse, hpc in SP2:
        model = _model(arch)
        install_untied(model, _spec(model, hpc, fuse, group=group))
        model.train()
        pos = torch.arange(lo, hi).unsqueeze(0).expand(ids.shape[0], -1)
        logits = model(input_ids=ids[:, lo:hi], position_ids=pos, use_cache=False).logits
        local = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), shift[:, lo:hi].flatten(),
                                                  ignore_index=-100, reduction="sum")
        (local / count).backward()
        named = list(model.named_parameters())
        flat = torch.cat([local.detach().view(1)] + [p.grad.flatten() for _, p in named])
        dist.all_reduce(flat, group=group)  # one collective: each rank holds its tokens' share
        grads, off = {}, 1
        for n, p in named:
            grads[n] = flat[off:off + p.numel()].view_as(p)
            off += p.numel()
        res["manual"][(arch, fuse, hpc)] = ((flat[0] / count).item(), grads)

    from sp_cases import sp_step

    for arch, fuse in ZERO3:
        lc = {"attention": {"implementation": "untied_ulysses", "heads_per_chunk": 1, "fuse_projections": fuse}}
        # fused: built partitioned (zero.Init) so install sees ZeRO-3 params; function level: built whole
        loss, deltas, init = sp_step(dict(arch=arch, **SHAPE), _zero3_batch(), 3, world, lc=lc, use_model_init=fuse)
        res["zero3"][(arch, fuse)] = (loss, deltas, init)
    return res


def _zero3_batch():
    from sp_cases import sample

    return sample(SEQ, VOCAB, bsz=1)


_SP2 = {}


def _sp2():
    if not _SP2:
        _SP2["r"] = run_distributed(_sp2_worker, 2)
    return _SP2["r"]


@pytest.mark.distributed
@pytest.mark.parametrize("arch,fuse,hpc", SP2, ids=[f"{a}-{'fused' if f else 'function'}-u{h}" for a, f, h in SP2])
def test_sp2_matches_single_process(arch, fuse, hpc):
    ref_loss, ref_grads, _ = _reference(arch, _ids())
    for rank, r in enumerate(_sp2()):
        loss, grads = r["manual"][(arch, fuse, hpc)]
        assert math.isclose(loss, ref_loss, rel_tol=1e-6), (rank, loss, ref_loss)
        assert grads.keys() == ref_grads.keys()
        for n, g in grads.items():
            assert _rel(g, ref_grads[n]) <= 1e-6, (rank, n, _rel(g, ref_grads[n]))


@pytest.mark.distributed
@pytest.mark.parametrize("arch,fuse", ZERO3, ids=[f"{a}-{'fused' if f else 'function'}" for a, f in ZERO3])
def test_zero3_sp2_initialize_matches_single_process(arch, fuse):
    init = _sp2()[0]["zero3"][(arch, fuse)][2]
    # zero.Init draws the initial weights differently from a plain build: start the reference from
    # the engine's gathered initial weights (every rank reports the same)
    model = _model(arch)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(init[n])
    batch = _zero3_batch()
    out = model(input_ids=batch["input_ids"], labels=batch["labels"])
    out.loss.backward()
    ref_loss = out.loss.item()
    ref_deltas = {n: -p.grad for n, p in model.named_parameters()}  # SGD, lr=1
    for rank, r in enumerate(_sp2()):
        loss, deltas, rank_init = r["zero3"][(arch, fuse)]
        assert all(torch.equal(rank_init[n], init[n]) for n in init)
        assert math.isclose(loss, ref_loss, rel_tol=1e-6), (rank, loss, ref_loss)
        assert deltas.keys() == ref_deltas.keys()
        for n, d in deltas.items():
            # deltas are after - before of fp32 weights ~50x larger than the step: cancellation costs
            # ~eps*|w| absolute, so compare as the Ulysses equivalence tests do
            torch.testing.assert_close(d, ref_deltas[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {n}: {m}")


@pytest.mark.parametrize("fuse", [True, False])
def test_attention_dropout_is_refused_saying_what_the_fix_changes(fuse):
    """Untied attention applies no attention dropout: training with it is refused, and the message says that
    setting it to 0 changes the regularisation (the fix must not read as 'the same training')."""
    from tiny_models import patch

    from ds_longctx.config import parse

    model = _model("llama", attention_dropout=0.1)
    patch(model, parse({"long_context": {"attention": {"implementation": "untied_ulysses",
                                                             "fuse_projections": fuse}}}))
    model.train()
    with pytest.raises(ValueError, match="does not apply attention dropout.*different regularisation.*'ulysses'"):
        model(input_ids=_ids(), labels=_ids(), use_cache=False)
    model.eval()  # no dropout in eval: runs
    model(input_ids=_ids(), labels=_ids(), use_cache=False)
