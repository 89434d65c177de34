"""Issue 37, item 4: attention sinks (GPT-OSS's per-head ``sinks``, transformers' ``s_aux``) under 'ulysses' from the
kernel's LSE (out * sigmoid(lse - sink), and its backward through the kernel's own backward given the corrected
LSE: attention/ulysses._SinkAttention), on sliding and full layers, equal to transformers' eager attention in one
process, plain and packed. The untied path still refuses sinks, naming 'ulysses'."""
import math

import pytest
import torch

from arch_cases import max_delta_error
from dist_utils import result_or_raise, runs_per_degree
from sink_cases import batch, reference, sp_step

ULYSSES = {"attention": {"implementation": "ulysses"},
           "activation_checkpointing": {"enabled": True, "offload": "cpu", "pin_memory": False},
           "tiled_loss": {"enabled": True, "shards": 2}}
CASES = {2: ["plain", "packed"], 4: ["packed"]}


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


def _worker(rank, world, kinds):
    return {kind: sp_step(ULYSSES, batch(kind), world) for kind in kinds}


@pytest.fixture(scope="module")
def sp_results():
    return runs_per_degree(_worker, CASES)


@pytest.mark.distributed
@pytest.mark.parametrize("sp", sorted(CASES))
def test_sinks_under_ulysses_equal_eager_one_process(sp, sp_results):
    results = result_or_raise(sp_results[sp])
    for kind in CASES[sp]:
        ref_loss, ref_deltas, params = reference(batch(kind))
        assert abs(reference(batch(kind), sinks_zero=True)[0] - ref_loss) > 1e-3  # the sinks move the loss
        sinks = [n for n in ref_deltas if n.endswith("sinks")]
        assert sinks and all(float(ref_deltas[n].abs().max()) > 0 for n in sinks)
        for rank, r in enumerate(results):
            loss, deltas = r[kind]
            err, where = max_delta_error(ref_deltas, deltas, params)
            print(sp, rank, kind, ref_loss, loss, err, where)
            assert math.isclose(loss, ref_loss, rel_tol=1e-5), (kind, loss, ref_loss)
            assert err < 1e-5, (kind, err, where)


def test_sinks_under_untied_are_refused_naming_ulysses():
    """Untied has no sink correction in its stage loop: GPT-OSS (flex_attention or eager on CPU; flash on a GPU) is
    refused before any collective, naming 'ulysses' (which applies the sinks, above) as the fix, never run without
    its sinks."""
    from ds_longctx.checks import check_against
    from ds_longctx.config import parse
    from ds_longctx.models.windows import sinks_error
    from eco_cases import config_error
    from sink_cases import gpt_oss_config

    lc = parse({"sequence_parallel_size": 2, "long_context": {"attention": {"implementation": "untied_ulysses"}}})
    for impl in ("flex_attention", "eager"):
        cfg = gpt_oss_config()
        cfg._attn_implementation = impl
        e = config_error(check_against, lc, cfg, 2)
        assert e is not None and "'ulysses'" in e.split("Fix:")[1], (impl, e)
    e = str(sinks_error(0, "untied_ulysses"))  # the function level's refusal (a flash core on a GPU)
    assert "attention sinks" in e and "implementation 'ulysses'" in e, e
