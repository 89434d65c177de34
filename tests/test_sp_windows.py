"""Sliding windows, attention soft-capping and flex_attention exact under SP (issue 19 items 1-3).

Unit: the banded kernel (attention/kernels/banded.py) against a dense masked fp64 reference (out, lse, dq, dk, dv)
over windows inside one query tile, across tiles and covering everything, GQA/MQA, soft-capping; its FLOP
count against a brute-force count; the kernel choice (a named kernel without the capability is refused
naming the layer; 'auto' takes the banded kernel).

Spawned SP=2 (real engines, ZeRO-3, gloo): models with a window shorter than the 16-token sample (so a
query's window crosses the shard edge at token 8), dense and packed (a document boundary inside shard 0),
on "ulysses" and untied (fused and attention-function level); Gemma2 (window + soft-capping) and Llama under
flex_attention on "ulysses". Each equals one process (HF's own attention: sdpa, or eager for Gemma2): loss
and SGD(lr=1) parameter deltas.
"""
import math

import pytest
import torch


VOCAB, SEQ = 64, 16
BASE = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_hidden_layers=2,
            vocab_size=VOCAB, intermediate_size=48, max_position_embeddings=256, tie_word_embeddings=False)


# ---------------------------------------------------------------------------------------------
# the banded kernel
# ---------------------------------------------------------------------------------------------

# (b, s, h, hk, window, softcap): windows of 1, inside one 128-row query tile, across tiles, >= s; MQA/GQA/MHA
KERNEL_CASES = [(1, 40, 4, 2, 5, None), (2, 300, 4, 1, 130, None), (1, 300, 2, 2, None, 0.7),
                (1, 260, 4, 2, 129, 2.0), (1, 50, 2, 1, 1, None), (1, 70, 2, 2, 200, 5.0)]


@pytest.mark.parametrize("tile_elements", [None, 700])
@pytest.mark.parametrize("b,s,h,hk,window,softcap", KERNEL_CASES)
def test_banded_kernel_equals_dense_masked_reference(b, s, h, hk, window, softcap, tile_elements, monkeypatch):
    """700: tiles of a few query rows (what a wide band gets at long context), odd tile edges."""
    from ds_longctx.attention.kernels import (banded, banded_attention_backward, banded_attention_forward,
                                              reference_attention)

    if tile_elements is not None:
        monkeypatch.setattr(banded, "BANDED_TILE_ELEMENTS", tile_elements)

    g = torch.Generator().manual_seed(s + h)
    q = torch.randn(b, s, h, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(b, s, hk, 8, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(b, s, hk, 8, dtype=torch.float64, generator=g, requires_grad=True)
    ro, rl = reference_attention(q, k, v, True, 0.4, window, softcap)
    do = torch.randn(ro.shape, dtype=torch.float64, generator=g)
    rdq, rdk, rdv = torch.autograd.grad(ro, (q, k, v), do)
    q, k, v = q.detach(), k.detach(), v.detach()
    out, lse = banded_attention_forward(q, k, v, True, 0.4, window or 0, softcap or 0.0)
    dq, dk, dv = banded_attention_backward(do, q, k, v, out, lse, True, 0.4, window or 0, softcap or 0.0)
    for name, got, ref in (("out", out, ro), ("lse", lse, rl), ("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10, msg=name)
    if window and window < s:  # the window matters: the plain causal result differs
        assert not torch.allclose(reference_attention(q, k, v, True, 0.4)[0], ro, atol=1e-3)


def test_banded_kernel_through_the_ops_and_the_choice():
    """fp32 through KernelChoice('auto').for_layer (the custom ops): the banded kernel on CPU; the same result
    as the fp64 reference to fp32 rounding. A named kernel (or 'sdpa') without windows is refused naming the
    layer; a full-causal layer keeps the plain kernel."""
    from ds_longctx.attention.kernels import KernelChoice, reference_attention

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 33, n, 8, generator=g) for n in (4, 2, 2))
    be = KernelChoice("auto").for_layer(torch.device("cpu"), 7, 3.0, "layer 3")
    assert be.inner.name == "torch_banded" and be.pattern == (7, 3.0)
    out, lse = be.forward(q, k, v, True, 0.3)
    ro, rl = reference_attention(q.double(), k.double(), v.double(), True, 0.3, 7, 3.0)
    torch.testing.assert_close(out.double(), ro, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse.double(), rl, rtol=1e-5, atol=1e-6)
    assert KernelChoice("auto").for_layer(torch.device("cpu"), None, None).name == "sdpa_cpu_flash"
    # the op refuses in kernel terms (no config key: the attention install names long_context.attention.kernel,
    # test_sp_attention_refusals.py through a patched model's forward)
    from ds_longctx.attention.kernels import KernelError, get_backend

    with pytest.raises(KernelError, match=r"^layer 3 has a sliding window of 7 tokens.*Fix: use kernel 'auto'") as e:
        KernelChoice("sdpa").for_layer(torch.device("cpu"), 7, None, "layer 3")
    assert "long_context" not in str(e.value)
    # the plain CPU kernel refuses a window instead of dropping it
    with pytest.raises(KernelError, match="cannot apply a sliding window"):
        get_backend("sdpa", "cpu").forward(q, k, v, True, 0.3, 7)


def test_window_flops_count_the_band():
    from ds_longctx.measure.flops import causal_pairs

    for sq, sk, w in [(16, 16, 5), (16, 16, 16), (16, 16, 40), (7, 12, 3), (12, 12, 1), (300, 300, 129)]:
        off = sk - sq
        brute = sum(1 for i in range(sq) for j in range(sk) if j <= i + off and j > i + off - w)
        assert causal_pairs(sq, sk, True, w) == brute, (sq, sk, w)


# ---------------------------------------------------------------------------------------------
# SP=2: equal to one process
# ---------------------------------------------------------------------------------------------


def model_config(name):
    import transformers as tf

    if name == "gemma3":  # layer_types: both layers slide (pattern 6), query_pre_attn_scalar, q/k-norm
        return tf.Gemma3TextConfig(**BASE, sliding_window=5), "sdpa"
    if name == "mistral":  # one window on every layer
        return tf.MistralConfig(**BASE, sliding_window=3), "sdpa"
    if name == "qwen2":  # use_sliding_window: layers >= max_window_layers slide
        return tf.Qwen2Config(**BASE, use_sliding_window=True, sliding_window=7, max_window_layers=1), "sdpa"
    if name == "gemma2":  # alternating window 4 / full, soft-capping 2 (small: it changes the result)
        return tf.Gemma2Config(**BASE, sliding_window=4, attn_logit_softcapping=2.0), "eager"
    if name == "llama":
        return tf.LlamaConfig(**BASE), "sdpa"
    raise KeyError(name)


def build(name, attn=None):
    from transformers import AutoModelForCausalLM

    cfg, ref_attn = model_config(name)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation=attn or ref_attn)


def batch(packed):
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[:, :2] = -100
    out = {"input_ids": ids, "labels": labels}
    if packed:  # documents [5, 11]: a boundary inside shard 0, the second document spans the shard edge
        out["position_ids"] = torch.cat([torch.arange(5), torch.arange(11)])[None]
    return out


def reference(name, packed):
    """One process, HF's own attention (its mask: window, packed documents): loss and SGD(lr=1) deltas."""
    model = build(name)
    loss = model(**batch(packed), use_cache=False).loss
    loss.backward()
    return loss.item(), {n: -p.grad.detach().clone() for n, p in model.named_parameters()}, \
        {n: p.detach().clone() for n, p in model.named_parameters()}


IMPLS = {"ulysses": {"implementation": "ulysses"},
         "fused": {"implementation": "untied_ulysses", "heads_per_chunk": 1, "fuse_projections": True},
         "function": {"implementation": "untied_ulysses", "heads_per_chunk": 1, "fuse_projections": False}}
# (model, implementation, attn_implementation under SP, packed)
CASES = [("gemma3", "ulysses", None, True), ("gemma3", "function+stack", None, False),
         ("mistral", "function", None, False), ("mistral", "fused+stack", None, True),
         ("qwen2", "fused", None, True), ("qwen2", "function", None, True), ("qwen2", "ulysses", None, False),
         ("gemma2", "ulysses", "flex_attention", False), ("gemma2", "ulysses+stack", "flex_attention", True),
         ("llama", "ulysses", "flex_attention", False), ("llama", "ulysses", "flex_attention", True)]
# "+stack": the memory stack on top (offloaded checkpointing: the windowed layers recomputed in backward)
STACK = {"activation_checkpointing": {"enabled": True, "offload": "cpu", "pin_memory": False},
         "tiled_mlp": {"enabled": True, "shards": 3}, "tiled_loss": {"enabled": True, "shards": 2},
         "rms_norm": {"enabled": True}}


def _sp_worker(rank, world):
    import ds_longctx
    from ds_longctx.data import shard_batch
    from sp_cases import ds_config, full_params

    out = {}
    for case in CASES:
        name, impl, attn, packed = case
        model = build(name, attn)
        engine, *_ = ds_longctx.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                           config=ds_config(3, world, dict(STACK if "+stack" in impl else {},
                                                                           attention=IMPLS[impl.split("+")[0]])))
        before = full_params(engine.module)
        loss = engine(**shard_batch(batch(packed), rank, world)).loss
        engine.backward(loss)
        engine.step()
        after = full_params(engine.module)
        engine.module._ds_longctx_patch.remove()
        out[case] = (loss.item(), {n: after[n] - before[n] for n in after})
    return out


@pytest.mark.distributed
def test_windows_softcap_and_flex_at_sp2_equal_one_process():
    from arch_cases import max_delta_error
    from dist_utils import run_distributed

    results = run_distributed(_sp_worker, 2)
    refs = {}
    for case in CASES:
        name, _, _, packed = case
        if (name, packed) not in refs:
            refs[name, packed] = reference(name, packed)
        ref_loss, ref_deltas, params = refs[name, packed]
        for r in results:
            loss, deltas = r[case]
            assert math.isclose(loss, ref_loss, rel_tol=1e-5), (case, loss, ref_loss)
            err, where = max_delta_error(ref_deltas, deltas, params)
            assert err < 1e-5, (case, err, where)


def test_the_references_depend_on_the_window_and_softcap():
    """The test above can fail: with the window widened past the sample (or the soft-cap off) one process
    gives another loss, for every model and batch it uses."""
    for name in ("gemma3", "mistral", "qwen2", "gemma2"):
        for packed in (False, True):
            ref = reference(name, packed)[0]
            model = build(name)
            model.config.sliding_window = 10 ** 6
            for m in model.modules():
                if getattr(m, "sliding_window", None):
                    m.sliding_window = 10 ** 6
            if name == "gemma2":
                model.config.attn_logit_softcapping = None
                for m in model.modules():
                    if hasattr(m, "attn_logit_softcapping"):
                        m.attn_logit_softcapping = None
            with torch.no_grad():
                wide = model(**batch(packed), use_cache=False).loss.item()
            assert abs(wide - ref) > 2e-4, (name, packed, wide, ref)


def test_planner_stand_in_counts_the_window():
    """The planner's meta stand-in kernel (flash-attention-2's memory) takes a windowed layer and its FLOP
    formula counts only the band: what the planner's time model charges such a layer."""
    from torch.utils.flop_counter import FlopCounterMode

    from ds_longctx.attention import kernels
    from ds_longctx.measure.flops import attention_flops
    from ds_longctx.planner.simulate import _meta_backend_class

    q = torch.empty(1, 64, 4, 8, device="meta")
    k = v = torch.empty(1, 64, 2, 8, device="meta")
    counted = {}
    with kernels.overridden("meta", _meta_backend_class()):
        for window in (None, 5):
            be = kernels.KernelChoice("auto").for_layer(torch.device("meta"), window, None, "layer 0")
            with FlopCounterMode(display=False) as fc:
                out, lse = be.forward(q, k, v, True, 0.3)
                be.backward(out, q, k, v, out, lse, True, 0.3)
            counted[window] = fc.get_total_flops()
    for window, got in counted.items():
        assert got == sum(attention_flops(1, 4, 64, 64, 8, True, bwd, window) for bwd in (False, True))
    assert counted[5] * 5 < counted[None]  # 5 of 64 keys per query at most


@pytest.mark.parametrize("impl", ["ulysses", "fused", "function"])
def test_planner_step_charges_the_band(impl):
    """simulate_step (the planner's step on the meta stand-in, SP=2) of a Mistral model: a 100-token window on
    1024 tokens leaves a tenth of the attention FLOPs, exactly the band's count, and the same peak memory
    (flash-class kernels hold no scores)."""
    from ds_longctx.config import parse
    from ds_longctx.measure.flops import attention_flops
    from ds_longctx.planner.simulate import simulate_step
    from sp_cases import ds_config
    from tiny_models import tiny_config

    got = {}
    for window in (None, 100):
        cfg = ds_config(3, 2, {"attention": IMPLS[impl]})
        mc = tiny_config("mistral", heads=4, kv_heads=2, vocab=64, layers=2, intermediate=48, sliding_window=window)
        step = simulate_step(mc, cfg, parse(cfg), 2, 1024, 2)
        got[window] = (sum(v[0] for k, v in step.work.items() if k[0] == "attention"), step.peak_device)
    # per rank: 2 of the 4 heads over the gathered 1024 tokens, 2 layers, forward + backward
    per_layer = {w: sum(attention_flops(1, 2, 1024, 1024, 8, True, bwd, w) for bwd in (False, True))
                 for w in (None, 100)}
    assert got[100][0] / got[None][0] == pytest.approx(per_layer[100] / per_layer[None], rel=1e-12)
    assert got[100][0] < got[None][0] / 4
    assert got[100][1] == got[None][1]
