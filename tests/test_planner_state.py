"""The planner runs many simulations in one process: each must install exactly what training installs,
whatever ran before it (regressions: process-global attention/kernel state leaking between runs)."""
import pytest

from sp_cases import ds_config
from tiny_models import tiny_config

MODEL = dict(heads=4, kv_heads=2, vocab=64, layers=2, intermediate=48)


def _untied(fuse: bool, kernel: str = "auto"):
    return {"attention": {"implementation": "untied_ulysses", "heads_per_chunk": 1, "fuse_projections": fuse,
                          "kernel": kernel}}


@pytest.mark.parametrize("fuse", [False, True])
def test_second_simulation_installs_untied_again(fuse):
    """(a) fuse_projections=false: the second simulation (the planner runs 2 and 3 layers) used to find
    hf's own 'already installed' flag set after the table had been restored, and ran plain attention."""
    from ds_longctx.config import parse
    from ds_longctx.planner.simulate import no_memo, simulate_step

    cfg = ds_config(3, 2, _untied(fuse))
    lc = parse(cfg)
    mc = tiny_config(**MODEL)
    with no_memo():  # both simulated (the memo would answer the second from the first)
        first = simulate_step(mc, cfg, lc, 2, 1024, 2)
        second = simulate_step(mc, cfg, lc, 2, 1024, 2)
    assert second.peak_device == first.peak_device
    assert second.breakdown == first.breakdown
    # and untied really differs from plain attention on this shape (so the comparison can fail)
    plain = {"attention": {"implementation": "ulysses"}}
    other = simulate_step(mc, ds_config(3, 2, plain), parse(ds_config(3, 2, plain)), 2, 1024, 2)
    assert other.breakdown["attention"] != first.breakdown["attention"]


def test_planner_with_sdpa_kernel():
    """(b) "kernel": "sdpa" failed in the planner: hf.py held its own reference to the real get_backend,
    so the meta stand-in device reached torch's flash SDPA lookup."""
    from ds_longctx.planner import Planner

    mc = tiny_config(**MODEL)
    sdpa = Planner(ds_config(3, 2, _untied(True, "sdpa")), mc, 2, "80GiB").run(1024)
    auto = Planner(ds_config(3, 2, _untied(True, "auto")), mc, 2, "80GiB").run(1024)
    assert sdpa.peak_device_bytes == auto.peak_device_bytes  # "sdpa" means torch's flash on the GPU


def test_sdpa_on_the_stand_in_is_the_flash_kernel_during_a_simulation_only():
    """Issue 23 item 2: SDPA on the meta stand-in runs as CUDA's flash kernel (out + fp32 LSE saved, GQA's K/V
    with their own head count, no S x S score matrix) through a kernel registered for the simulation only: seen
    in checkpoint recomputation, gone after the block (meta is torch's math fallback again), CPU untouched."""
    import torch
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.checkpoint import checkpoint

    from ds_longctx.planner.simulate import _flash_sdpa_on_meta, _meta_kernels

    S = 256

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.calls.append((func._overloadpacket.__name__, [tuple(a.shape) for a in args
                                                               if isinstance(a, torch.Tensor)], out))
            return out

    def step(fake_mode):
        with fake_mode:
            q = torch.empty(1, 4, S, 16, device="meta", dtype=torch.bfloat16, requires_grad=True)
            kv = [torch.empty(1, 2, S, 16, device="meta", dtype=torch.bfloat16, requires_grad=True) for _ in "kv"]
            with Ops() as ops:
                out = checkpoint(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                enable_gqa=True),
                                 q, *kv, use_reentrant=False)
                out.sum().backward()
        return ops.calls

    def squares(calls):  # any result with an S x S trailing block: the math kernel's scores
        return [n for n, _, out in calls for t in (out if isinstance(out, (tuple, list)) else [out])
                if isinstance(t, torch.Tensor) and tuple(t.shape[-2:]) == (S, S)]

    with _meta_kernels("meta"), _flash_sdpa_on_meta("meta"):
        calls = step(FakeTensorMode())
        # CPU tensors keep torch's own SDPA inside the block
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 2, 8, 4, generator=g) for _ in range(3))
        ref = torch.softmax((q @ k.transpose(-1, -2)) / 2 + torch.full((8, 8), float("-inf")).triu(1), -1) @ v
        assert torch.allclose(F.scaled_dot_product_attention(q, k, v, is_causal=True), ref, atol=1e-6)
    names = [n for n, _, _ in calls]
    # forward, its recompute in backward (checkpoint), backward: the flash stand-in each time
    assert names.count("attention_forward") == 2 and names.count("attention_backward") == 1, names
    fwd = next(c for c in calls if c[0] == "attention_forward")
    assert fwd[1] == [(1, S, 4, 16), (1, S, 2, 16), (1, S, 2, 16)]  # K/V not repeated to 4 heads
    assert fwd[2][1].dtype == torch.float32 and tuple(fwd[2][1].shape) == (1, 4, S)  # the saved LSE
    assert squares(calls) == []
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::scaled_dot_product_attention", "AutogradMeta")
    # after the block: torch's math fallback on meta again (so the test above can fail)
    after = step(FakeTensorMode())
    assert "attention_forward" not in [n for n, _, _ in after] and squares(after)


def test_transformers_packed_mask_swap_is_what_keeps_hf_attention_linear(monkeypatch):
    """planner/simulate._contiguous_positions, the one swap of a transformers function the planner makes: on fake
    tensors transformers cannot read the position_ids, assumes a packed batch and materializes [s, s] masks. Under
    transformers' own attention (implementation "none", where no no-mask is handed over) a 2-layer step at 8,192
    tokens is 42 MB with the swap and 4.32 GB without it (the masks: about 64 bytes per query-key pair), so the
    swap is what the simulation's number rests on there; it is undone after the step."""
    import contextlib

    import transformers.masking_utils as mu

    from ds_longctx.config import parse
    from ds_longctx.planner import simulate

    seq = 8192
    cfg = ds_config(3, 1, {"attention": {"implementation": "none"}})
    lc, mc = parse(cfg), tiny_config(**MODEL)
    original = mu.find_packed_sequence_indices
    swapped = simulate.simulate_step(mc, cfg, lc, 1, seq, 2)
    assert mu.find_packed_sequence_indices is original  # undone
    monkeypatch.setattr(simulate, "_contiguous_positions", contextlib.nullcontext)
    with simulate.no_memo():  # the same inputs: simulated again with the swap undone, not answered by the memo
        unswapped = simulate.simulate_step(mc, cfg, lc, 1, seq, 2)
    assert swapped.peak_device < seq * seq, swapped.peak_device  # linear in s: below one byte per pair
    assert unswapped.peak_device - swapped.peak_device > 32 * seq * seq, (unswapped.peak_device, swapped.peak_device)


def test_memo_answers_a_repeated_step_with_a_copy_of_the_simulated_one(monkeypatch):
    """simulate_step's memo: the same inputs again are answered without simulating, equal to a fresh simulation (a
    copy: the caller's changes do not reach the memo); any input the step reads (the dtype from ds_config, a model
    config attribute, the section, the length) simulates anew."""
    import copy

    from ds_longctx.config import parse
    from ds_longctx.planner import simulate

    cfg = ds_config(3, 2, _untied(True))
    lc, mc = parse(cfg), tiny_config(**MODEL)
    real, runs = simulate._simulate_step, []
    monkeypatch.setattr(simulate, "_simulate_step", lambda *a: runs.append(a[4:6]) or real(*a))
    simulate.clear_memo()
    with simulate.no_memo():
        fresh = simulate.simulate_step(mc, cfg, lc, 2, 1024, 2)
    simulate.simulate_step(mc, cfg, lc, 2, 1024, 2)
    assert runs == [(1024, 2)] * 2
    hit = simulate.simulate_step(copy.deepcopy(mc), copy.deepcopy(cfg), parse(cfg), 2, 1024, 2)
    assert runs == [(1024, 2)] * 2
    for name in ("peak_device", "breakdown", "host_at_peak", "peak_host", "num_layers", "notes", "work"):
        assert getattr(hit, name) == getattr(fresh, name), name
    hit.breakdown["attention"] += 1
    hit.work.clear()
    again = simulate.simulate_step(mc, cfg, lc, 2, 1024, 2)
    assert again.breakdown == fresh.breakdown and again.work == fresh.work and len(runs) == 2
    wide = tiny_config(**dict(MODEL, intermediate=64))
    plain = ds_config(3, 2, {"attention": {"implementation": "ulysses"}})
    simulate.simulate_step(mc, dict(cfg, bf16={"enabled": True}), lc, 2, 1024, 2)  # bf16, not the default fp32
    simulate.simulate_step(wide, cfg, lc, 2, 1024, 2)
    simulate.simulate_step(mc, plain, parse(plain), 2, 1024, 2)
    simulate.simulate_step(mc, cfg, lc, 2, 2048, 2)
    assert runs == [(1024, 2)] * 5 + [(2048, 2)], runs
