"""'auto' by measurement (attention/kernels.MeasuredChoice) and the varlen bookkeeping, on CPU.

The candidates are real backends (the CPU flash op under several names); only the clock and the
cross-rank sum are injected, so the choice logic is tested without a GPU.
"""
import pytest
import torch

from ds_longctx.attention import kernels
from ds_longctx.attention.documents import Documents, DocumentBackend
from ds_longctx.attention.kernels import MeasuredChoice, TorchCPUFlash, reference_attention


class Named(TorchCPUFlash):
    def __init__(self, name, fail=False):
        self.name, self.fail, self.calls = name, fail, 0

    def _fwd(self, q, k, v, causal, scale):
        self.calls += 1
        if self.fail:
            raise RuntimeError(f"{self.name} cannot run this shape")
        return super()._fwd(q, k, v, causal, scale)


def _qkv(s=64, h=4, hk=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, s, n, d, generator=g) for n in (h, hk, hk)]


def _timer_from(table):
    """A clock that reports table[backend name] for each timed step (the step runs for real)."""
    current = {}

    def timer(fn):
        fn()
        return table[current["name"]]

    return timer, current


def test_fastest_candidate_is_chosen_per_signature_and_kept():
    a, b, c = Named("a"), Named("b"), Named("c")
    table = {"a": 3.0, "b": 1.0, "c": 2.0}
    seen = []

    def timer(fn):
        before = [x.calls for x in (a, b, c)]
        fn()
        ran = [x for x, n in zip((a, b, c), before) if x.calls > n][0]
        seen.append(ran.name)
        return table[ran.name]

    mc = MeasuredChoice([a, b, c], timer=timer, agree=lambda t: t)
    q, k, v = _qkv()
    out, lse = mc.forward(q, k, v, True, 0.25)
    assert seen == ["a", "b", "c"]  # each timed once
    sig = MeasuredChoice.signature(q, k, True)
    assert mc.choices[sig]["kernel"] == "b" and mc.choices[sig]["seconds"] == table
    ro, rl = reference_attention(q.double(), k.double(), v.double(), True, 0.25)
    torch.testing.assert_close(out.double(), ro, atol=1e-5, rtol=1e-5)
    calls = b.calls
    mc.forward(q, k, v, True, 0.25)  # same signature: no new measurement, b runs
    assert seen == ["a", "b", "c"] and b.calls == calls + 1
    mc.forward(q, k, v, False, 0.25)  # a new signature is measured again
    assert len(seen) == 6


def test_agreement_uses_summed_times_of_all_ranks():
    # this rank finds 'a' fastest; summed over the job 'b' is: every rank must take 'b'
    a, b = Named("a"), Named("b")
    local = {"a": 1.0, "b": 2.0}
    other_rank = torch.tensor([5.0, 0.5], dtype=torch.float64)

    def timer(fn):
        before = a.calls
        fn()
        return local["a"] if a.calls > before else local["b"]

    mc = MeasuredChoice([a, b], timer=timer, agree=lambda t: t + other_rank)
    q, k, v = _qkv(seed=1)
    mc.forward(q, k, v, True, 0.25)
    assert mc.choices[MeasuredChoice.signature(q, k, True)]["kernel"] == "b"


def test_failing_candidate_is_out_and_all_failing_is_an_error():
    bad, good = Named("bad", fail=True), Named("good")
    mc = MeasuredChoice([bad, good], timer=lambda fn: (fn(), 1.0)[1], agree=lambda t: t)
    q, k, v = _qkv(seed=2)
    mc.forward(q, k, v, True, 0.25)
    choice = mc.choices[MeasuredChoice.signature(q, k, True)]
    assert choice["kernel"] == "good" and choice["seconds"]["bad"] is None
    mc2 = MeasuredChoice([Named("x", fail=True)], timer=lambda fn: (fn(), 1.0)[1], agree=lambda t: t)
    with pytest.raises(RuntimeError, match="no candidate kernel ran"):
        mc2.forward(q, k, v, True, 0.25)


def test_backward_uses_the_forward_choice_and_refuses_an_unseen_signature():
    a, b = Named("a"), Named("b")
    mc = MeasuredChoice([a, b], timer=lambda fn: (fn(), 1.0)[1], agree=lambda t: t)
    q, k, v = _qkv(seed=3)
    with pytest.raises(RuntimeError, match="never ran"):
        mc.backward(q, q, k, v, q, torch.zeros(1, 4, 64), True, 0.25)
    out, lse = mc.forward(q, k, v, True, 0.25)
    dq, dk, dv = mc.backward(torch.ones_like(out), q, k, v, out, lse, True, 0.25)
    ref = [t.double().requires_grad_(True) for t in (q, k, v)]
    ro, _ = reference_attention(*ref, True, 0.25)
    ro.backward(torch.ones_like(ro))
    for got, r in zip((dq, dk, dv), ref):
        torch.testing.assert_close(got.double(), r.grad, atol=1e-5, rtol=1e-5)


def test_packed_documents_measure_at_the_same_call():
    # DocumentBackend asks the measured choice first, so a rank with a packed batch takes part in the
    # same agreement as a rank with a dense one (no collective mismatch)
    calls = []
    mc = MeasuredChoice([Named("a"), Named("b")], timer=lambda fn: (fn(), 1.0)[1],
                        agree=lambda t: (calls.append(1), t)[1])
    docs = Documents(torch.tensor([[0, 20, 64]]))
    q, k, v = _qkv(seed=4)
    DocumentBackend(mc, docs).forward(q, k, v, True, 0.25)
    assert calls == [1]


def test_cpu_auto_is_the_one_cpu_kernel_and_cuda_names_are_config_values():
    assert isinstance(kernels.get_backend("auto", "cpu"), TorchCPUFlash)
    names = kernels.kernel_names()
    assert "sdpa_cuda_cudnn" in names and "sdpa_cuda_flash" in names
    from ds_longctx.config import check_kernel, parse
    from pydantic import ValidationError

    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    # the config accepts the name; check_kernel says it is not available on this machine
    lc = parse({"long_context": {"attention": {"kernel": "sdpa_cuda_cudnn"}}})
    assert lc.attention.kernel == "sdpa_cuda_cudnn"
    with pytest.raises(Exception, match="not available"):
        check_kernel("sdpa_cuda_cudnn")
    with pytest.raises((ValidationError, Exception)):
        parse({"long_context": {"attention": {"kernel": "cudnn_typo"}}})


def test_varlen_arguments_cover_every_document_of_the_flattened_batch():
    docs = Documents(torch.tensor([[0, 5, 12, 16, 16], [0, 16, 16, 16, 16]]))
    cu, longest = docs.varlen_args("cpu")
    assert docs.varlen_args("cpu")[0] is cu  # built once per batch
    assert cu.dtype == torch.int32
    assert cu.tolist() == [0, 5, 12, 16, 32] and longest == 16
