"""Kernel backends: the CPU flash backend against a float64 math reference (out, lse, grads) in the
[b, s, h, d] interface layout; kernel selection errors."""
from __future__ import annotations

import pytest
import torch

from ds_longctx.attention.kernels import (BACKENDS, KernelError, available_backends, get_backend,
                                         reference_attention)
from ds_longctx.patching.checks import check_kernel, get_backend as config_get_backend
from ds_longctx.config import ConfigError

CASES = [(hq, hk, causal, dtype) for hq, hk in [(4, 4), (4, 2), (4, 1)] for causal in (True, False)
         for dtype in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("hq,hk,causal,dtype", CASES,
                         ids=[f"h{a}kv{b}-{'causal' if c else 'full'}-{str(d)[6:]}" for a, b, c, d in CASES])
def test_cpu_flash_matches_float64_reference(hq, hk, causal, dtype):
    backend = get_backend("sdpa", "cpu")
    assert backend.name == "sdpa_cpu_flash"
    g = torch.Generator().manual_seed(0)
    b, s, d, scale = 2, 33, 16, 0.21  # odd length: not a multiple of any block size
    q = torch.randn(b, s, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, s, hk, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, s, hk, d, generator=g, dtype=torch.float64)
    dout = torch.randn(b, s, hq, d, generator=g, dtype=torch.float64)

    ref_in = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref_out, ref_lse = reference_attention(*ref_in, causal, scale)
    ref_out.backward(dout)

    # strided views in the interface layout, as the untied loop passes them
    qx, kx, vx = (t.to(dtype).transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    out, lse = backend.forward(qx, kx, vx, causal, scale)
    assert out.shape == (b, s, hq, d) and out.dtype == dtype
    assert lse.shape == (b, hq, s) and lse.dtype == torch.float32
    dq, dk, dv = backend.backward(dout.to(dtype), qx, kx, vx, out, lse, causal, scale)
    assert dk.shape == k.shape and dv.shape == v.shape

    tol = 2e-6 if dtype == torch.float32 else 2e-2
    for name, got, want in [("out", out, ref_out), ("lse", lse, ref_lse), ("dq", dq, ref_in[0].grad),
                            ("dk", dk, ref_in[1].grad), ("dv", dv, ref_in[2].grad)]:
        err = (got.double() - want.detach()).abs().max() / want.detach().abs().max()
        assert err <= tol, (name, err.item())


def test_gqa_expansion_path_equals_native():
    """A backend without native GQA gets k/v expanded and dk/dv summed back: same numbers."""
    native = get_backend("sdpa", "cpu")

    class Expanding(type(native)):
        native_gqa = False

    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 16, 6, 8, generator=g)
    k = torch.randn(1, 16, 2, 8, generator=g)
    v = torch.randn(1, 16, 2, 8, generator=g)
    do = torch.randn(1, 16, 6, 8, generator=g)
    o1, l1 = native.forward(q, k, v, True, 0.3)
    o2, l2 = Expanding().forward(q, k, v, True, 0.3)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    g1 = native.backward(do, q, k, v, o1, l1, True, 0.3)
    g2 = Expanding().backward(do, q, k, v, o2, l2, True, 0.3)
    for a, b in zip(g1, g2):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_auto_picks_the_cpu_flash_kernel_here():
    assert "sdpa_cpu_flash" in available_backends()
    assert get_backend("auto", "cpu").name == "sdpa_cpu_flash"


@pytest.mark.parametrize("name", ["flash_attention_2", "flash_attention_3"])
def test_unavailable_explicit_kernel_is_an_error(name):
    if BACKENDS[name].available():
        pytest.skip(f"{name} is installed here")
    with pytest.raises(ConfigError, match=rf"long_context\.attention\.kernel: '{name}' is not available.*Fix: .*"
                                          r"set it to 'auto' or 'sdpa'"):
        check_kernel(name)
    with pytest.raises(ConfigError, match=r"long_context\.attention\.kernel"):
        config_get_backend(name, "cpu")


def test_kernel_on_the_wrong_device_is_an_error():
    cpu = get_backend("sdpa", "cpu")
    meta = torch.empty(1, 4, 2, 8, device="meta")
    with pytest.raises(ValueError, match="runs on cpu tensors"):
        cpu.forward(meta, meta, meta, True, 1.0)
    with pytest.raises(ConfigError, match="long_context.attention.kernel"):
        config_get_backend("auto", "meta")


def test_unknown_kernel_name_is_an_error():
    with pytest.raises(ConfigError, match="unknown kernel 'flash_attention_9'"):
        check_kernel("flash_attention_9")


# ---------------------------------------------------------------------------------------------
# sliding windows / soft-capping on the CUDA flash kernels: the arguments (the kernels run in
# bench/gpu_checks.py's "kernels" part, vs the fp64 reference and the banded kernel)
# ---------------------------------------------------------------------------------------------


def test_flash_window_is_transformers_window_minus_one_left_and_none_right():
    """transformers: query i sees keys (i - w, i]; flash: [i - left, i + right] (right 0 under causal)."""
    from ds_longctx.attention.kernels import flash_window, torch_flash_window_kwargs

    assert flash_window(1) == (0, 0) and flash_window(7) == (6, 0) and flash_window(256) == (255, 0)
    assert flash_window(0) == flash_window(None) == (-1, -1)
    assert torch_flash_window_kwargs(7) == {"window_size_left": 6, "window_size_right": 0}
    assert torch_flash_window_kwargs(0) == {} and torch_flash_window_kwargs(None) == {}


class _Spy:
    """Records the calls of a real aten op and runs it (meta tensors: shapes and schema only)."""

    def __init__(self, op):
        self.op, self.calls = op, []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.op(*args, **kwargs)


@pytest.mark.parametrize("window", [1, 7, 256])
def test_torch_flash_window_calls_the_aten_op_with_the_window(window, monkeypatch):
    """sdpa_cuda_flash with a window: aten._flash_attention_forward/_backward (the op under SDPA) with
    window_size_left = w - 1, right 0, causal, on the [b, s, h, d] layout and GQA heads; run on meta tensors
    (the op's real schema and meta kernel: a wrong argument name or type fails here)."""
    from ds_longctx.attention import kernels

    fwd, bwd = _Spy(torch.ops.aten._flash_attention_forward), _Spy(torch.ops.aten._flash_attention_backward)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", fwd)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_backward", bwd)
    be = kernels.TorchCUDAFlash()
    q = torch.empty(2, 300, 8, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(2, 300, 2, 64, device="meta", dtype=torch.bfloat16)
    out, lse = be._fwd_pattern(q, k, k, True, 0.125, window, 0.0)
    assert out.shape == q.shape and lse.shape == (2, 8, 300)
    dq, dk, dv = be._bwd_pattern(q, q, k, k, out, lse, True, 0.125, window, 0.0)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape
    for spy in (fwd, bwd):
        (args, kw), = spy.calls
        assert kw["window_size_left"] == window - 1 and kw["window_size_right"] == 0 and kw["scale"] == 0.125
        assert args[0].shape[1:] == (300, 8, 64) and args[2 if spy is fwd else 3].shape[2] == 2  # GQA: 2 kv heads
    assert fwd.calls[0][0][8] is True and bwd.calls[0][0][11] is True  # is_causal
    # no window: the plain SDPA op, as before (no window argument anywhere)
    fwd.calls.clear()
    be._fwd_pattern(q, k, k, True, 0.125, 0, 0.0)
    assert fwd.calls == []


def test_torch_varlen_window_keeps_the_documents(monkeypatch):
    """Packed documents with a window: one varlen call with the documents' cu_seqlens unchanged and the window
    (applied within each document), forward and backward; meta tensors as above."""
    from ds_longctx.attention import documents
    from ds_longctx.attention.documents import Documents

    fwd, bwd = _Spy(torch.ops.aten._flash_attention_forward), _Spy(torch.ops.aten._flash_attention_backward)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", fwd)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_backward", bwd)
    docs = Documents(torch.tensor([[0, 100, 160, 300], [0, 300, 300, 300]]))
    q = torch.empty(2, 300, 4, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(2, 300, 2, 64, device="meta", dtype=torch.bfloat16)
    out, lse = documents._torch_varlen_forward(q, k, k, docs, True, 0.125, 7)
    documents._torch_varlen_backward(q, q, k, k, out, lse, docs, True, 0.125, 7)
    cu, longest = docs.varlen_args(q.device)  # built once: the very tensor each call is given
    for spy, (i_cu, i_max) in ((fwd, (3, 5)), (bwd, (6, 8))):
        (args, kw), = spy.calls
        assert args[i_cu] is cu and args[i_cu + 1] is cu and args[i_max] == args[i_max + 1] == longest == 300
        assert kw["window_size_left"] == 6 and kw["window_size_right"] == 0
    assert docs.varlen_args("cpu")[0].tolist() == [0, 100, 160, 300, 600]  # the documents, not the window's
    fwd.calls.clear()
    documents._torch_varlen_forward(q, k, k, docs, True, 0.125)  # no window: no window argument
    assert "window_size_left" not in fwd.calls[0][1]


# flash-attn's private fwd/bwd signatures by release (only the parameters the binding looks at)
def _fa2_27(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes,
            return_softmax):
    return dict(locals())


def _fa2_25(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, return_softmax):
    return dict(locals())


def _fa3(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, num_splits=1):
    return dict(locals())


def _fa2_22(q, k, v, dropout_p, softmax_scale, causal, return_softmax):
    return dict(locals())


@pytest.mark.parametrize("window,softcap", [(1, 0.0), (7, 0.0), (256, 50.0), (0, 30.0), (0, 0.0)])
def test_flash_attn_pattern_arguments_by_release(window, softcap):
    from ds_longctx.attention.kernels import call_by_name, flash_pattern_kwargs

    left = window - 1 if window else -1
    right = 0 if window else -1
    got = call_by_name(_fa2_27, q=1, k=2, v=3, softmax_scale=0.5, causal=True,
                        **flash_pattern_kwargs(_fa2_27, window, softcap, "fa2"))
    assert (got["window_size_left"], got["window_size_right"], got["softcap"]) == (left, right, softcap)
    assert got["causal"] is True and got["softmax_scale"] == 0.5 and got["dropout_p"] == 0.0
    got = call_by_name(_fa3, q=1, k=2, v=3, softmax_scale=0.5, causal=True,
                        **flash_pattern_kwargs(_fa3, window, softcap, "fa3"))
    assert got["window_size"] == (left, right) and got["softcap"] == softcap
    if softcap:  # FA2 before 2.6 takes no softcap: refused, never dropped
        with pytest.raises(KernelError, match="takes no softcap"):
            flash_pattern_kwargs(_fa2_25, window, softcap, "fa2")
    else:
        got = call_by_name(_fa2_25, q=1, k=2, v=3, softmax_scale=0.5, causal=True,
                            **flash_pattern_kwargs(_fa2_25, window, softcap, "fa2"))
        assert got["window_size"] == (left, right)
    if window:
        with pytest.raises(KernelError, match="takes no window size"):
            flash_pattern_kwargs(_fa2_22, window, softcap, "fa2")


def test_flash_attn_custom_op_functions_bind_by_their_wrapped_signature():
    """Current flash-attn wraps its private fwd/bwd in torch.library.custom_op, whose own signature is
    (*args, **kwargs): the binding reads the wrapped function's parameters (else nothing was passed)."""
    from ds_longctx.attention.kernels import call_by_name, flash_pattern_kwargs

    @torch.library.custom_op("ds_longctx_test::fa_fwd", mutates_args=())
    def fa_fwd(q: torch.Tensor, dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int,
               window_size_right: int, softcap: float) -> torch.Tensor:
        return q * softmax_scale + window_size_left * 100 + window_size_right * 10 + softcap + (1000 if causal else 0)

    out = call_by_name(fa_fwd, q=torch.zeros(1), softmax_scale=0.5, causal=True,
                        **flash_pattern_kwargs(fa_fwd, 7, 2.0, "fa2"))
    assert out.item() == 1000 + 600 + 0 + 2.0


def test_capabilities_declared_per_backend():
    """What each backend applies: the flash kernels' windows natively (torch's flash op: no softcap), cuDNN
    neither, the banded kernels both; flash-attn's from the installed release (none installed: neither)."""
    from ds_longctx.attention.kernels import TorchCUDAFlash

    caps = {n: (cls.supports_window, cls.supports_softcap) for n, cls in BACKENDS.items()}
    assert caps["sdpa_cuda_flash"] == (True, False)
    assert caps["sdpa_cuda_cudnn"] == (False, False) and caps["sdpa_cpu_flash"] == (False, False)
    assert caps["torch_banded"] == caps["torch_banded_cuda"] == (True, True)
    for name in ("flash_attention_2", "flash_attention_3"):
        if not BACKENDS[name].available():
            assert caps[name] == (False, False)
    # torch's flash kernel refuses a soft-cap instead of dropping it
    with pytest.raises(KernelError, match="'sdpa_cuda_flash' cannot apply attention soft-capping"):
        TorchCUDAFlash()._pattern(True, 7, 2.0)
    assert TorchCUDAFlash()._pattern(True, 7, None) == (7, 0.0)


def test_named_kernel_without_softcap_is_refused_for_a_soft_capped_layer():
    """At install (KernelChoice.check_pattern, no tensor): a named kernel that applies windows but not
    soft-capping (sdpa_cuda_flash) takes a windowed layer and refuses a soft-capped one naming the layer;
    cuDNN refuses both. The kernels are not available on this machine: the check reads their declarations."""
    from ds_longctx.attention.kernels import KernelChoice

    def choice(name):  # check_kernel would refuse a CUDA kernel here (no GPU); the pattern check is the same
        kc = object.__new__(KernelChoice)
        kc.name, kc._by_device = name, {}
        return kc

    choice("sdpa_cuda_flash").check_pattern(7, None, "layer 2")
    with pytest.raises(KernelError, match=r"layer 4 has attention soft-capping 50.0, which kernel 'sdpa_cuda_flash'.*"
                                          r"Fix: .*'auto'"):
        choice("sdpa_cuda_flash").check_pattern(None, 50.0, "layer 4")
    with pytest.raises(KernelError, match="layer 1 has a sliding window of 7 tokens, which kernel 'sdpa_cuda_cudnn'"):
        choice("sdpa_cuda_cudnn").check_pattern(7, None, "layer 1")
    with pytest.raises(KernelError, match="soft-capping 2.0, which kernel 'sdpa_cpu_flash' \\('sdpa'\\)"):
        choice("sdpa").check_pattern(None, 2.0, "layer 0")


def test_a_build_that_ignores_the_window_is_an_error_not_a_dropped_window():
    """verify_native_pattern (called by the CUDA flash backends at their first windowed / soft-capped call):
    a 96-token probe against the banded kernel. A kernel that drops the window or the cap (a flash build with
    FLASHATTENTION_DISABLE_LOCAL / _SOFTCAP) is refused; a correct one passes, probed once."""
    from ds_longctx.attention import kernels

    class Probe(kernels.TorchBanded):
        drops = False
        probes = 0

        def _fwd_pattern(self, q, k, v, causal, scale, window, softcap):
            if q.shape[1] == 96:
                type(self).probes += 1
            kernels.verify_native_pattern(self, q, window, softcap)
            if self.drops:
                window = softcap = 0
            return kernels.banded_attention_forward(q, k, v, causal, scale, window, softcap)

    class Good(Probe):
        name = "test_probe_good"

    class DropsWindow(Probe):
        name, drops = "test_probe_drops", True

    q = torch.randn(1, 40, 2, 8, dtype=torch.bfloat16)
    Good()._fwd_pattern(q, q, q, True, 0.3, 7, 0.0)
    Good()._fwd_pattern(q, q, q, True, 0.3, 9, 0.0)
    assert Good.probes == 1  # probed once per (kernel, pattern kind, dtype, device)
    Good()._fwd_pattern(q, q, q, True, 0.3, 0, 2.0)  # soft-capping: its own probe
    assert Good.probes == 2
    for window, softcap, what in ((7, 0.0, "sliding window"), (0, 2.0, "soft-capping")):
        with pytest.raises(KernelError, match=f"'test_probe_drops' does not apply its {what} on this install.*"
                                              "Fix: .*'auto'"):
            DropsWindow()._fwd_pattern(q, q, q, True, 0.3, window, softcap)
    with pytest.raises(KernelError, match="does not apply"):  # the verdict is kept
        DropsWindow()._fwd_pattern(q, q, q, True, 0.3, 7, 0.0)
