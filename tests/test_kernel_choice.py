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
    from ds_longctx.patching.checks import check_kernel
    from ds_longctx.config import ConfigError, parse

    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    # the config accepts the name; check_kernel says it is not available on this machine
    lc = parse({"long_context": {"attention": {"kernel": "sdpa_cuda_cudnn"}}})
    assert lc.attention.kernel == "sdpa_cuda_cudnn"
    with pytest.raises(ConfigError, match=r"^long_context\.attention\.kernel: 'sdpa_cuda_cudnn' is not available on "
                                          r"this machine"):
        check_kernel("sdpa_cuda_cudnn")
    with pytest.raises(ConfigError, match=r"^long_context\.attention\.kernel: 'cudnn_typo' is not allowed\. Fix: use "
                                          r"one of 'auto', 'flash_attention_3', .*'sdpa'"):
        parse({"long_context": {"attention": {"kernel": "cudnn_typo"}}})


def test_varlen_arguments_cover_every_document_of_the_flattened_batch():
    docs = Documents(torch.tensor([[0, 5, 12, 16, 16], [0, 16, 16, 16, 16]]))
    cu, longest = docs.varlen_args("cpu")
    assert docs.varlen_args("cpu")[0] is cu  # built once per batch
    assert cu.dtype == torch.int32
    assert cu.tolist() == [0, 5, 12, 16, 32] and longest == 16


# ---------------------------------------------------------------------------------------------
# windowed / soft-capped layers under the measured "auto"
# ---------------------------------------------------------------------------------------------


class NamedWindow(kernels.TorchBanded):
    """A candidate that applies sliding windows but not soft-capping (like torch's flash kernel on CUDA):
    the banded computation under another name."""
    supports_softcap = False

    def __init__(self, name):
        self.name, self.calls = name, 0

    def _fwd_pattern(self, q, k, v, causal, scale, window, softcap):
        self.calls += 1
        return super()._fwd_pattern(q, k, v, causal, scale, window, softcap)


def _named_timer(cands, table, seen):
    def timer(fn):
        before = [c.calls for c in cands]
        fn()
        ran = [c for c, n in zip(cands, before) if c.calls > n]
        seen.append(ran[0].name)
        return table[ran[0].name]

    return timer


class CountingBanded(kernels.TorchBanded):
    def __init__(self):
        self.name, self.calls = "banded", 0

    def _fwd_pattern(self, q, k, v, causal, scale, window, softcap):
        self.calls += 1
        return super()._fwd_pattern(q, k, v, causal, scale, window, softcap)


def test_windowed_and_full_layers_are_measured_apart():
    """The window and soft-cap are part of the signature: a full layer measures the full candidates (never the
    banded kernel), a windowed one only the candidates that apply the window plus the banded kernel, a
    soft-capped one only those that apply soft-capping; each picks its own fastest. Every signature is agreed
    across ranks (a windowed layer's signature does not depend on the sequence length)."""
    full, win, banded = Named("full"), NamedWindow("win"), CountingBanded()
    seen, agreed = [], []
    table = {"full": 1.0, "win": 2.0, "banded": 3.0}
    mc = MeasuredChoice([full, win], timer=_named_timer([full, win, banded], table, seen),
                        agree=lambda t: (agreed.append(t.tolist()), t)[1], pattern_only=[banded])
    assert mc.supports_window and mc.supports_softcap
    q, k, v = _qkv(s=48, seed=5)
    mc.forward(q, k, v, True, 0.25)
    assert seen == ["full", "win"] and agreed == [[1.0, 2.0]]
    assert mc.choices[MeasuredChoice.signature(q, k, True)]["kernel"] == "full"

    seen.clear()
    layer = kernels.Windowed(mc, 7, 0.0)
    out, lse = layer.forward(q, k, v, True, 0.25)
    assert seen == ["win", "banded"] and agreed[1:] == [[2.0, 3.0]]  # agreed like a full signature
    sig = MeasuredChoice.signature(q, k, True, 7, 0.0)
    assert sig != MeasuredChoice.signature(q, k, True) and mc.choices[sig] == {
        "kernel": "win", "seconds": {"win": 2.0, "banded": 3.0}}
    ro, rl = reference_attention(q.double(), k.double(), v.double(), True, 0.25, 7)
    torch.testing.assert_close(out.double(), ro, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), rl, atol=1e-5, rtol=1e-5)
    dq, dk, dv = layer.backward(torch.ones_like(out), q, k, v, out, lse, True, 0.25)
    ref = [t.double().requires_grad_(True) for t in (q, k, v)]
    reference_attention(*ref, True, 0.25, 7)[0].backward(torch.ones_like(ro))
    for got, r in zip((dq, dk, dv), ref):
        torch.testing.assert_close(got.double(), r.grad, atol=1e-5, rtol=1e-5)

    seen.clear()
    capped = kernels.Windowed(mc, 7, 2.0)
    out, _ = capped.forward(q, k, v, True, 0.25)
    assert seen == ["banded"]  # 'win' applies no soft-capping: not a candidate
    assert mc.choices[MeasuredChoice.signature(q, k, True, 7, 2.0)]["kernel"] == "banded"
    torch.testing.assert_close(out.double(), reference_attention(q.double(), k.double(), v.double(), True, 0.25,
                                                                 7, 2.0)[0], atol=1e-5, rtol=1e-5)
    # a faster banded kernel wins a windowed signature: the measurement decides, not a fixed order
    seen.clear()
    mc.forward(q, k, v, True, 0.25, 5)
    table["banded"] = 0.5
    mc.forward(q, k, v, True, 0.25, 9)
    assert mc.choices[MeasuredChoice.signature(q, k, True, 5)]["kernel"] == "win"
    assert mc.choices[MeasuredChoice.signature(q, k, True, 9)]["kernel"] == "banded"
    # none of the full candidates can apply a pattern without pattern_only: a clear error
    bare = MeasuredChoice([Named("x"), Named("y")], timer=lambda fn: (fn(), 1.0)[1], agree=lambda t: t)
    assert not bare.supports_window and not bare.supports_softcap
    with pytest.raises(kernels.KernelError, match="cannot apply a sliding window"):
        bare.forward(q, k, v, True, 0.25, 7)


def test_packed_documents_windowed_layer_measures_its_pattern():
    """DocumentBackend over a windowed measured layer: it asks the measured choice for the layer's pattern
    signature (not the full one), then runs it per document on CPU (no varlen here); equal to the
    per-document windowed reference."""
    full, win, banded = Named("full"), NamedWindow("win"), CountingBanded()
    mc = MeasuredChoice([full, win], timer=lambda fn: (fn(), 1.0)[1], agree=lambda t: t, pattern_only=[banded])
    docs = Documents(torch.tensor([[0, 20, 64]]))
    q, k, v = _qkv(seed=6)
    be = DocumentBackend(kernels.Windowed(mc, 5, 0.0), docs)
    assert be._route(q, k, v, True, 0.25) == ("loop", 5, 0.0)
    assert list(mc.choices) == [MeasuredChoice.signature(q, k, True, 5, 0.0)]
    out, lse = be.forward(q, k, v, True, 0.25)
    for a, e in ((0, 20), (20, 64)):
        ro, rl = reference_attention(*(t[:, a:e].double() for t in (q, k, v)), True, 0.25, 5)
        torch.testing.assert_close(out[:, a:e].double(), ro, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[:, :, a:e].double(), rl, atol=1e-5, rtol=1e-5)


def test_windowed_layer_takes_its_windowed_kernel_at_every_length():
    """Whether a window covers the sequence must not change which kernel signature a layer meets: ranks of
    data-parallel replicas with different lengths (or one rank over steps) would otherwise reach 'auto''s
    measuring collective at different layers. A window covering the sequence is exactly causal attention."""
    from types import SimpleNamespace

    from ds_longctx.attention.hf import layer_backend
    from ds_longctx.attention.kernels import KernelChoice
    from ds_longctx.models.windows import LayerAttention

    state = SimpleNamespace(backend=KernelChoice("auto"), layers=(LayerAttention(window=8, kind="sliding_attention"),))
    module = SimpleNamespace(layer_idx=0)
    short, _ = layer_backend(state, module, 6, torch.device("cpu"))    # the window covers 6 tokens
    long_, _ = layer_backend(state, module, 64, torch.device("cpu"))
    assert isinstance(short, kernels.Windowed) and isinstance(long_, kernels.Windowed)
    assert short.pattern == long_.pattern == (8, 0.0)
    q, k, v = _qkv(s=6, seed=3)
    out, lse = short.forward(q, k, v, True, 0.25)
    ro, rl = reference_attention(q.double(), k.double(), v.double(), True, 0.25)  # plain causal
    torch.testing.assert_close(out.double(), ro, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), rl, atol=1e-5, rtol=1e-5)
