"""The planner on hybrid models: the gated delta rule runs as fla's chunked kernel (planner/recurrent.py) on the meta
stand-in, not transformers' per-chunk Python loop, and only during a simulation."""
import sys

import pytest
import torch

from sp_cases import ds_config
from test_hybrid import UNTIED, hybrid_config


def test_gated_delta_stand_in_shapes_and_grads_on_meta():
    """q/k with fewer heads than v (the GQA-like grouping of Qwen3.5): out has v's heads, every input gets a gradient
    of its own shape (q/k summed back over their value heads), a length that is not whole chunks."""
    from ds_longctx.planner.recurrent import gated_delta_on_meta

    def t(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, device="meta", dtype=dtype, requires_grad=True)

    q, k, v, g, beta = t(1, 300, 2, 16), t(1, 300, 2, 16), t(1, 300, 4, 8), t(1, 300, 4, dtype=torch.float32), \
        t(1, 300, 4)
    out, state = gated_delta_on_meta(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    assert out.shape == (1, 300, 4, 8) and out.dtype == v.dtype and state is None
    out.sum().backward()
    for x in (q, k, v, g, beta):
        assert x.grad is not None and x.grad.shape == x.shape
    _, state = gated_delta_on_meta(q, k, v, g, beta, output_final_state=True)
    assert state.shape == (1, 4, 16, 8)


@pytest.mark.parametrize("family", ["qwen3_5"])
def test_simulation_runs_the_stand_in_and_restores_transformers(family, monkeypatch):
    """A simulated SP=2 untied step of a Gated DeltaNet model calls the stand-in once per layer pass (forward and
    the checkpoint's recompute: it is the mixers' core), and the transformers module has its own function back
    after the simulation."""
    import ds_longctx.planner.recurrent as recurrent
    from ds_longctx.config import parse
    from ds_longctx.planner.simulate import no_memo, simulate_step

    calls = []
    real = recurrent.gated_delta_on_meta
    monkeypatch.setattr(recurrent, "gated_delta_on_meta", lambda *a, **k: calls.append(1) or real(*a, **k))
    mc = hybrid_config(family)
    extra = dict(UNTIED, activation_checkpointing={"enabled": True, "offload": "cpu", "pin_memory": False})
    cfg = ds_config(3, 2, extra, bf16={"enabled": True})
    with no_memo():  # simulated here, whatever ran before
        res = simulate_step(mc, cfg, parse(cfg), 2, 2048, 2)
    assert calls, "the simulation never reached the stand-in"
    hf = next(m for n, m in sys.modules.items() if n.endswith(f"modeling_{family}"))
    assert hf.torch_chunk_gated_delta_rule is not recurrent.gated_delta_on_meta
    assert getattr(hf.torch_chunk_gated_delta_rule, "__name__", "") == "torch_chunk_gated_delta_rule"
    assert res.peak_device > 0


def test_layers_of_several_kinds_extrapolate_per_kind():
    """Qwen3.5's first layers are all Gated DeltaNet: extrapolated from 2 and 3 of them, the attention layers' work
    was missing (its plan at 1M: MFU 459%, no attention time). Per kind, the extrapolated step's FLOPs equal the
    full-depth simulation's (affine per kind: exact), and attention is in them."""
    from ds_longctx.planner import Planner
    from ds_longctx.planner.core import _mixed_layer_types

    mc = hybrid_config("qwen3_5")
    mc.num_hidden_layers = 6
    mc.layer_types = ["linear_attention"] * 3 + ["full_attention", "linear_attention", "full_attention"]
    assert _mixed_layer_types(mc) is not None
    cfg = ds_config(3, 2, dict(UNTIED), bf16={"enabled": True})
    planner = Planner(cfg, mc, 2, "h100")
    ext, full = planner.run(1024), planner.run(1024, full_depth=True)
    assert ext.extrapolated and not full.extrapolated
    fe, ff = ext.time["flops"], full.time["flops"]
    assert ff.get("attention_forward", 0) > 0 and set(fe) == set(ff)
    for k in ff:
        assert fe[k] == pytest.approx(ff[k], rel=1e-6), k
