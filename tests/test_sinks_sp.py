"""Issue 37, item 4: attention sinks (GPT-OSS's per-head ``sinks``, transformers' ``s_aux``) on every SP path from
the kernel's LSE (out * sigmoid(lse - sink), and its backward through the kernel's own backward given the corrected
LSE): 'ulysses' (attention/ulysses._SinkAttention) and untied per head chunk (attention/untied._sink_corrected,
at the attention-function level: GPT-OSS has no fused path), on sliding and full layers, equal to transformers'
eager attention in one process, plain and packed. GPT-OSS has no SDPA path: it runs flex_attention, whose
BlockMask untied checks to be the shard's causal / window mask. Its MoE block (GptOssMLP, (out, router_scores)) runs
in row tiles (tiled_mlp, issue 37 item 5), and the router's auxiliary loss ("aux": a plain sample) equals HF's."""
import math

import pytest
import torch

from arch_cases import max_delta_error
from dist_utils import result_or_raise, runs_per_degree
from sink_cases import batch, reference, sp_step

STACK = {"activation_checkpointing": {"enabled": True, "offload": "cpu", "pin_memory": False},
         "tiled_mlp": {"enabled": True, "shards": 3}, "tiled_loss": {"enabled": True, "shards": 2}}
ULYSSES = {"attention": {"implementation": "ulysses"}, **STACK}
UNTIED = {"attention": {"implementation": "untied_ulysses", "heads_per_chunk": 1}, **STACK}
PATHS = {"ulysses": ULYSSES, "untied": UNTIED}
# (path, batch kind) per SP degree; SP=4 with 2 kv heads: untied replicates each kv head over 2 ranks
CASES = {2: [("ulysses", "plain"), ("ulysses", "packed"), ("untied", "plain"), ("untied", "packed"), ("untied", "aux")],
         4: [("ulysses", "packed"), ("untied", "packed"), ("ulysses", "aux")]}


@pytest.mark.parametrize("window", [None, 5])
def test_sink_attention_equals_the_eager_formula(window):
    """fp64, GQA, causal (and a sliding window): output and gradients of q, k, v and the sinks equal transformers'
    eager formula (the sink a logit column of the softmax, dropped after it)."""
    from ds_longctx.attention.kernels import KernelChoice
    from ds_longctx.attention.ulysses import _SinkAttention

    torch.manual_seed(0)
    b, h, hk, S, d = 1, 4, 2, 12, 8
    q = torch.randn(b, h, S, d, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(b, hk, S, d, dtype=torch.float64, requires_grad=True) for _ in range(2))
    s = torch.randn(h, dtype=torch.float64, requires_grad=True)
    backend = KernelChoice("auto").for_layer(q.device, window, None, "test")
    out = _SinkAttention.apply(q, k, v, s, backend, d ** -0.5)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = q @ kk.transpose(-1, -2) * d ** -0.5
    mask = torch.ones(S, S, dtype=torch.bool).tril()
    if window:
        mask &= ~torch.ones(S, S, dtype=torch.bool).tril(-window)
    scores = scores.masked_fill(~mask, float("-inf"))
    p = torch.cat([scores, s.view(1, -1, 1, 1).expand(b, h, S, 1)], -1).softmax(-1)[..., :-1]
    ref = (p @ vv).transpose(1, 2)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(ref)
    got, want = torch.autograd.grad((out * g).sum(), (q, k, v, s)), torch.autograd.grad((ref * g).sum(), (q, k, v, s))
    for a, r in zip(got, want):
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12)
    assert float(want[3].abs().max()) > 1e-3  # the sinks get a gradient (the test can fail)


def _worker(rank, world, cases):
    return {case: sp_step(PATHS[case[0]], batch(case[1]), world, aux=case[1] == "aux") for case in cases}


@pytest.fixture(scope="module")
def sp_results():
    return runs_per_degree(_worker, CASES)


@pytest.mark.distributed
@pytest.mark.parametrize("sp", sorted(CASES))
def test_sinks_under_sp_equal_eager_one_process(sp, sp_results):
    results = result_or_raise(sp_results[sp])
    refs = {}
    for path, kind in CASES[sp]:
        if kind not in refs:
            refs[kind] = reference(batch(kind), aux=kind == "aux")
            # the sinks move the loss; so does the auxiliary loss
            assert abs(reference(batch(kind), sinks_zero=True, aux=kind == "aux")[0] - refs[kind][0]) > 1e-3
            if kind == "aux":
                assert abs(reference(batch(kind))[0] - refs[kind][0]) > 1e-3
        ref_loss, ref_deltas, params = refs[kind]
        sinks = [n for n in ref_deltas if n.endswith("sinks")]
        assert sinks and all(float(ref_deltas[n].abs().max()) > 0 for n in sinks)
        for rank, r in enumerate(results):
            loss, deltas, tiled = r[(path, kind)]
            assert tiled == ["GptOssMLP"] * 2, tiled  # the MoE block of both layers in row tiles
            err, where = max_delta_error(ref_deltas, deltas, params)
            print(sp, rank, path, kind, ref_loss, loss, err, where)
            assert math.isclose(loss, ref_loss, rel_tol=1e-5), (path, kind, loss, ref_loss)
            assert err < 1e-5, (path, kind, err, where)


def test_untied_sinks_per_stage_equal_the_eager_formula():
    """SP=1, fp64, GQA, causal, a sliding window and packed documents, one head per stage: untied's per-stage sink
    correction (attention/untied.stage_sinks) equals the eager formula in output and in the gradients of q, k, v and
    the sinks; without the sinks it differs (the test can fail)."""
    from ds_longctx.attention.documents import Documents
    from ds_longctx.attention.kernels import KernelChoice
    from ds_longctx.attention.untied import Schedule, untied_attention_qkv

    torch.manual_seed(0)
    b, h, hk, S, d, window = 1, 4, 2, 12, 8, 5
    q = torch.randn(b, S, h, d, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(b, S, hk, d, dtype=torch.float64, requires_grad=True) for _ in range(2))
    s = torch.randn(h, dtype=torch.float64, requires_grad=True)
    docs = Documents(torch.tensor([[0, 7, 12]]))
    backend = KernelChoice("auto").for_layer(q.device, window, None, "test")
    out, _ = untied_attention_qkv(q, k, v, Schedule(h, hk, 1, 1), backend=backend, scale=d ** -0.5, docs=docs,
                                  sinks=s)
    kk, vv = (t.transpose(1, 2).repeat_interleave(2, 1) for t in (k, v))
    scores = q.transpose(1, 2) @ kk.transpose(-1, -2) * d ** -0.5
    i = torch.arange(S)
    doc = (i >= 7).long()
    mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window) & (doc[None, :] == doc[:, None])
    scores = scores.masked_fill(~mask, float("-inf"))
    p = torch.cat([scores, s.view(1, -1, 1, 1).expand(b, h, S, 1)], -1).softmax(-1)[..., :-1]
    ref = (p @ vv).transpose(1, 2)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)  # the stage LSE buffer is fp32
    g = torch.randn_like(ref)
    got, want = torch.autograd.grad((out * g).sum(), (q, k, v, s)), torch.autograd.grad((ref * g).sum(), (q, k, v, s))
    for a, r in zip(got, want):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6)
    assert float(want[3].abs().max()) > 1e-3
    plain, _ = untied_attention_qkv(q, k, v, Schedule(h, hk, 1, 1), backend=backend, scale=d ** -0.5, docs=docs)
    assert float((plain - ref).detach().abs().max()) > 1e-3


def test_flex_attention_under_untied_only_without_an_sdpa_path():
    """GPT-OSS (no SDPA path in transformers) passes untied's check with flex_attention; Llama (SDPA exists) is
    still refused, the fix naming sdpa; eager is refused at SP > 1 either way."""
    from ds_longctx.patching.checks import check_against
    from ds_longctx.config import parse
    from eco_cases import config_error
    from sink_cases import gpt_oss_config
    from transformers import LlamaConfig

    lc = parse({"sequence_parallel_size": 2, "long_context": {"attention": {"implementation": "untied_ulysses"}}})
    cfg = gpt_oss_config()
    cfg._attn_implementation = "flex_attention"
    assert config_error(check_against, lc, cfg, 2) is None
    cfg._attn_implementation = "eager"
    assert "eager" in config_error(check_against, lc, cfg, 2)
    llama = LlamaConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=1, intermediate_size=48)
    llama._attn_implementation = "flex_attention"
    e = config_error(check_against, lc, llama, 2)
    assert e is not None and "flex_attention" in e and "sdpa" in e.split("Fix:")[1], e


def test_block_mask_check_sees_the_pattern():
    """untied's check of a flex BlockMask (attention/hf._check_mask): HF's causal and sliding masks of the shard pass,
    a wrong window or a bidirectional mask is refused (every (query, key) pair is evaluated)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from ds_longctx.attention.hf import _block_mask_is

    s = 16
    causal = create_block_mask(lambda b, h, q, kv: kv <= q, 1, None, s, s, device="cpu")
    sliding = create_block_mask(lambda b, h, q, kv: (kv <= q) & (kv > q - 4), 1, None, s, s, device="cpu")
    full = create_block_mask(lambda b, h, q, kv: kv >= 0, 1, None, s, s, device="cpu")
    assert _block_mask_is(causal, s) and _block_mask_is(sliding, s, window=4)
    assert not _block_mask_is(sliding, s) and not _block_mask_is(sliding, s, window=5)
    assert not _block_mask_is(full, s) and not _block_mask_is(causal, 8)
