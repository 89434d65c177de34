"""Kernel backends: the CPU flash backend against a float64 math reference (out, lse, grads) in the
[b, s, h, d] interface layout; kernel selection errors."""
from __future__ import annotations

import pytest
import torch

from ds_longctx.attention.kernels import BACKENDS, available_backends, get_backend, reference_attention
from ds_longctx.config import check_kernel, get_backend as config_get_backend
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
