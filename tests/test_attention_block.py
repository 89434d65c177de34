"""The attention block Function (input RMSNorm + untied attention + o_proj in one Function) against the
same pieces run separately: forward bit-equal, gradients within fp32 1e-6. What it holds is checked
against the planner in tests/test_planner.py (the untied_all case runs it inside a real ZeRO-3 engine)."""
import pytest
import torch

from ds_longctx.attention import block as block_mod
from ds_longctx.attention.block import untied_attention_block
from ds_longctx.attention.kernels import get_backend
from ds_longctx.attention.untied import ProjectionSpec, Schedule, untied_attention_fused
from ds_longctx.memory import norm as norm_mod
from ds_longctx.memory.norm import MemoryEfficientRMSNorm
from ds_longctx.models import rms_norm, rope_bshd

D_HEAD = 8


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-12)).item()


def _inputs(H, G, hidden, s, extras, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: (torch.randn(*shape, generator=g) * 0.3).to(dtype)  # noqa: E731
    p = {"x": rnd(2, s, hidden) * 3, "nw": 1 + rnd(hidden), "wq": rnd(H * D_HEAD, hidden),
         "wk": rnd(G * D_HEAD, hidden), "wv": rnd(G * D_HEAD, hidden), "wo": rnd(hidden, H * D_HEAD)}
    if extras:
        p.update(bq=rnd(H * D_HEAD), bk=rnd(G * D_HEAD), bv=rnd(G * D_HEAD), bo=rnd(hidden),
                 qn=1 + rnd(D_HEAD), kn=1 + rnd(D_HEAD))
    pos = torch.arange(s, dtype=torch.float32)
    inv = 1.0 / (10000 ** (torch.arange(0, D_HEAD, 2, dtype=torch.float32) / D_HEAD))
    ang = torch.cat([pos[:, None] * inv] * 2, -1)
    cos, sin = ang.cos().expand(2, s, D_HEAD).to(dtype), ang.sin().expand(2, s, D_HEAD).to(dtype)
    return p, cos, sin


def _run(block, p, cos, sin, H, G, u, extras, gy):
    p = {k: v.clone().requires_grad_(True) for k, v in p.items()}
    spec = ProjectionSpec(head_dim=D_HEAD, rope=rope_bshd,
                          norm=(lambda t, w: rms_norm(t, w, 1e-6)) if extras else None)
    kw = dict(schedule=Schedule(H, G, 1, u), spec=spec, bq=p.get("bq"), bk=p.get("bk"), bv=p.get("bv"),
              q_norm=p.get("qn"), k_norm=p.get("kn"), backend=get_backend("auto", "cpu"), causal=True)
    if block:
        y = untied_attention_block(p["x"], cos, sin, p["wq"], p["wk"], p["wv"], p["wo"], norm_weight=p["nw"],
                                   norm_eps=1e-5, bo=p.get("bo"), **kw)
    else:
        xn = MemoryEfficientRMSNorm.apply(p["x"], p["nw"], 1e-5)
        o, _ = untied_attention_fused(xn, cos, sin, p["wq"], p["wk"], p["wv"], **kw)
        y = torch.nn.functional.linear(o.reshape(o.shape[0], o.shape[1], -1), p["wo"], p.get("bo"))
    y.backward(gy)
    return y.detach(), {k: v.grad for k, v in p.items()}


@pytest.mark.parametrize("H,G,u", [(4, 4, 1), (4, 2, 1), (4, 2, 2), (4, 1, 1), (6, 2, 2), (6, 3, 2)])
@pytest.mark.parametrize("extras", [False, True])
def test_block_matches_separate_pieces(H, G, u, extras, monkeypatch):
    monkeypatch.setattr(norm_mod, "_TILE_ELEMS", 24 * 7)  # 7-row tiles over 2 x 37 rows: ragged re-derivation
    p, cos, sin = _inputs(H, G, 24, 37, extras)
    gy = torch.randn(2, 37, 24, generator=torch.Generator().manual_seed(5))
    y0, g0 = _run(False, p, cos, sin, H, G, u, extras, gy)
    y1, g1 = _run(True, p, cos, sin, H, G, u, extras, gy)
    assert torch.equal(y1, y0)  # same ops on the same values
    for k in g0:  # per-tile GEMMs sum in another order: fp32 rounding, up to 1.4e-6 measured on a 2-core x86 VM
        assert _rel(g1[k], g0[k]) <= 4e-6, (k, _rel(g1[k], g0[k]))


def test_block_bf16_forward_bit_equal_and_grads_close():
    H, G, u = 4, 2, 1
    p, cos, sin = _inputs(H, G, 32, 64, False, dtype=torch.bfloat16)
    gy = torch.randn(2, 64, 32, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    y0, g0 = _run(False, p, cos, sin, H, G, u, False, gy)
    y1, g1 = _run(True, p, cos, sin, H, G, u, False, gy)
    assert torch.equal(y1, y0)
    for k in g0:
        assert _rel(g1[k], g0[k]) <= 2e-2, (k, _rel(g1[k], g0[k]))



@pytest.mark.parametrize("H,G,u,extras", [(4, 2, 1, False), (6, 3, 2, True), (4, 4, 1, True)])
def test_backward_passes_shared_and_grads_bit_equal_to_one_pass_per_gemm(H, G, u, extras, monkeypatch):
    """Backward re-derives the normed input once per projection (k and v together), the stage's weight-
    gradient GEMMs riding along: chunks + stages + 1 passes over the tiles per layer. Gradients are bit-equal
    to running every GEMM in a pass of its own (the schedule before the passes were shared)."""
    monkeypatch.setattr(norm_mod, "_TILE_ELEMS", 24 * 7)
    p, cos, sin = _inputs(H, G, 24, 37, extras)
    gy = torch.randn(2, 37, 24, generator=torch.Generator().manual_seed(5))
    passes = []
    shared = block_mod._NormedProjSource

    class Counted(shared):
        def _pass(self, mms):
            passes.append(len(mms))
            super()._pass(mms)

    class OnePassPerGemm(Counted):
        def _x_mm(self, pairs):
            for pair in pairs:
                self._pass([pair])

        def _x_grad_w(self, pairs):
            for pair in pairs:
                super()._x_grad_w([pair])
                self._pass([])

    monkeypatch.setattr(block_mod, "_NormedProjSource", Counted)
    y1, g1 = _run(True, p, cos, sin, H, G, u, extras, gy)
    sc = Schedule(H, G, 1, u)
    assert len(passes) == sc.chunks + sc.stages + 1, passes
    passes.clear()
    monkeypatch.setattr(block_mod, "_NormedProjSource", OnePassPerGemm)
    y0, g0 = _run(True, p, cos, sin, H, G, u, extras, gy)
    # before: k, v, each stage's q projection, and each weight-gradient GEMM in a pass of its own
    assert len(passes) == 2 * sc.chunks + sc.stages + 3 * sc.stages, passes
    assert torch.equal(y1, y0)
    for k in g0:
        assert torch.equal(g1[k], g0[k]), k
