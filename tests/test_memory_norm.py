"""Memory-efficient RMSNorm against HF's LlamaRMSNorm (and its Qwen/Mistral copies): bit-equal output,
matching gradients, less memory held for backward, and the same loss/grads on a whole tiny model."""
import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.mistral.modeling_mistral import MistralRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from tiny_models import build, memory_stack, tiny_config

from ds_longctx.config import parse
from ds_longctx.memory import norm as norm_mod
from ds_longctx.memory.norm import (install_memory_efficient_rmsnorm, is_llama_style_rmsnorm,
                                    uninstall_memory_efficient_rmsnorm)
from ds_longctx.measure.live_bytes import LiveBytesTracker


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _pair(cls, hidden, dtype, eps=1e-6, seed=0):
    torch.manual_seed(seed)
    ref = cls(hidden, eps=eps).to(dtype)
    with torch.no_grad():
        ref.weight.normal_(1.0, 0.3)
    new = cls(hidden, eps=eps).to(dtype)
    new.load_state_dict(ref.state_dict())
    assert install_memory_efficient_rmsnorm(new) == [new]
    return ref, new


def _run(mod, x, g):
    mod.weight.grad = None
    x = x.clone().requires_grad_(True)
    y = mod(x)
    y.backward(g)
    return y.detach(), x.grad, mod.weight.grad


@pytest.mark.parametrize("cls", [LlamaRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm, MistralRMSNorm])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_hf(cls, dtype):
    ref, new = _pair(cls, 64, dtype, eps=1e-5)
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(2, 37, 64, generator=g) * 3).to(dtype)
    gy = torch.randn(2, 37, 64, generator=g).to(dtype)
    y0, gx0, gw0 = _run(ref, x, gy)
    y1, gx1, gw1 = _run(new, x, gy)
    assert y1.dtype == y0.dtype and torch.equal(y1, y0)
    if dtype == torch.float32:
        assert _rel(gx1, gx0) < 1e-6 and _rel(gw1, gw0) < 1e-6
    else:
        torch.testing.assert_close(gx1, gx0, rtol=1.6e-2, atol=1e-2)
        torch.testing.assert_close(gw1, gw0, rtol=1.6e-2, atol=1e-1)
        assert _rel(gx1, gx0) < 1e-2 and _rel(gw1, gw0) < 1e-2


def test_backward_tiles_match_one_tile(monkeypatch):
    """Several backward tiles (with a ragged last one) give the one-tile gradients."""
    ref, new = _pair(LlamaRMSNorm, 32, torch.float32)
    x = torch.randn(3, 41, 32)
    gy = torch.randn(3, 41, 32)
    _, gx0, gw0 = _run(ref, x, gy)
    monkeypatch.setattr(norm_mod, "_TILE_ELEMS", 32 * 10)  # 10 rows per tile over 123 rows
    _, gx1, gw1 = _run(new, x, gy)
    assert _rel(gx1, gx0) < 1e-6 and _rel(gw1, gw0) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_tiles_bit_equal_and_bounded(monkeypatch, dtype):
    """The forward runs over row tiles (ragged last one): output bit-equal to HF's whole-tensor forward,
    and its fp32 temporaries are bounded by the tile, not the sequence."""
    ref, new = _pair(LlamaRMSNorm, 64, dtype)
    x = (torch.randn(2, 301, 64) * 3).to(dtype)
    y0 = ref(x).detach()
    monkeypatch.setattr(norm_mod, "_TILE_ELEMS", 64 * 16)  # 16 rows per tile over 602 rows
    with LiveBytesTracker() as tr:
        y1 = new(x.clone().requires_grad_(True))
    assert y1.dtype == y0.dtype and torch.equal(y1.detach(), y0)
    n = 602 * 64
    out_and_rstd = n * x.element_size() + 602 * 4
    # whole-tensor forward: + fp32 copy and fp32 square (8 B/elem); tiled: a few 16-row fp32 tiles
    assert tr.peak <= n * x.element_size() + out_and_rstd + 4 * 16 * 64 * 4, (tr.peak, out_and_rstd)


@pytest.mark.parametrize("dtype,wdtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                          (torch.float16, torch.float16), (torch.bfloat16, torch.float32)])
def test_rederived_tile_bit_equal_to_forward_rows(dtype, wdtype):
    """rms_norm_tile (the fused attention block's backward re-derives its input from it, per row tile, without
    the fp32 copy of x) gives the forward's rows bit for bit."""
    x = (torch.randn(301, 64, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    w = (1 + 0.3 * torch.randn(64, generator=torch.Generator().manual_seed(2))).to(wdtype)
    out, rstd = norm_mod.rms_norm_rows(x, w, 1e-6)
    for lo, hi in ((0, 301), (17, 160), (300, 301)):
        tile = norm_mod.rms_norm_tile(x, rstd.reshape(-1, 1), w, lo, hi)
        assert tile.dtype == out.dtype and torch.equal(tile, out[lo:hi]), (lo, hi)


def test_fp32_weight_bf16_input_promotes_like_hf():
    ref, new = _pair(LlamaRMSNorm, 48, torch.float32)
    x = torch.randn(1, 20, 48).to(torch.bfloat16)
    gy = torch.randn(1, 20, 48)
    y0, gx0, gw0 = _run(ref, x, gy)
    y1, gx1, gw1 = _run(new, x, gy)
    assert y1.dtype == torch.float32 and torch.equal(y1, y0)
    assert gx1.dtype == gx0.dtype and gw1.dtype == gw0.dtype
    assert _rel(gx1, gx0) < 1e-2 and _rel(gw1, gw0) < 1e-5


def _saved_bytes(mod, x):
    """Live bytes created by the forward and still held when it returns (what backward keeps)."""
    x = x.clone().requires_grad_(True)
    with LiveBytesTracker() as tr:
        y = mod(x)
        held = tr.live
        # the output itself is not a saved tensor; count it out so only what backward keeps remains
        out_bytes = y.untyped_storage().nbytes()
        y.sum().backward()
    return held - out_bytes, tr.peak


def test_holds_less_memory_than_hf_bf16():
    ref, new = _pair(LlamaRMSNorm, 256, torch.bfloat16)
    x = torch.randn(1, 4096, 256).to(torch.bfloat16)
    ref_saved, ref_peak = _saved_bytes(ref, x)
    new_saved, new_peak = _saved_bytes(new, x)
    elems = 4096 * 256
    # HF keeps the fp32 input copy and the bf16 normalized value (plus rstd): >= 6 bytes per element
    assert ref_saved >= 6 * elems, ref_saved
    # ours keeps only the (already-live) input and the fp32 rstd [4096, 1]
    assert new_saved <= 4096 * 4 + 1024, new_saved
    assert new_peak < ref_peak, (new_peak, ref_peak)


def test_only_llama_style_norms_are_patched():
    class OtherRMSNorm(torch.nn.Module):  # same name pattern and attributes, different formula
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(4))
            self.variance_epsilon = 1e-6

        def forward(self, x):
            return x * (1.0 + self.weight)

    assert not is_llama_style_rmsnorm(OtherRMSNorm())
    assert is_llama_style_rmsnorm(LlamaRMSNorm(4))
    model = torch.nn.Sequential(OtherRMSNorm(), LlamaRMSNorm(4))
    patched = install_memory_efficient_rmsnorm(model)
    assert patched == [model[1]]
    uninstall_memory_efficient_rmsnorm(patched)
    assert "forward" not in model[1].__dict__


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_model_patched_matches_unpatched(arch):
    cfg = tiny_config(arch, layers=2)
    ref = build(cfg, seed=0)
    model = build(cfg, seed=0)
    handle = memory_stack(model, parse({"long_context": {"rms_norm": {"enabled": True}}}))
    # two per decoder layer + the final norm (+ q_norm/k_norm per layer on Qwen3)
    per_layer = 4 if arch == "qwen3" else 2
    assert len(handle.rms_norms) == per_layer * cfg.num_hidden_layers + 1
    assert handle.stats()["rms_norms"] == len(handle.rms_norms)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    l0, g0 = _loss_and_grads(ref, ids)
    l1, g1 = _loss_and_grads(model, ids)
    assert torch.equal(l1, l0)
    for n in g0:
        assert _rel(g1[n], g0[n]) < 1e-5, n
    handle.remove()
    assert all("forward" not in m.__dict__ for m in model.modules() if type(m).__name__.endswith("RMSNorm"))
    l2, _ = _loss_and_grads(model, ids)
    assert torch.equal(l2, l0)


def test_stack_with_checkpointing_and_tiled_mlp():
    cfg = tiny_config("llama", layers=2)
    ref = build(cfg, seed=0)
    model = build(cfg, seed=0)
    lc = parse({"long_context": {"rms_norm": {"enabled": True}, "activation_checkpointing": {"enabled": True},
                                 "tiled_mlp": {"enabled": True, "shards": 3}}})
    handle = memory_stack(model, lc)
    model.train()
    ids = torch.randint(0, cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(4))
    l0, g0 = _loss_and_grads(ref, ids)
    l1, g1 = _loss_and_grads(model, ids)
    assert torch.allclose(l1, l0, rtol=1e-6)
    for n in g0:
        assert _rel(g1[n], g0[n]) < 1e-5, n
    handle.remove()
