"""activation_checkpointing.keep_attention_output: the first forward keeps each layer's attention output
and LSE where its input goes, and the recompute in backward skips q/k/v and the attention forward.

Exactness: with the switch on, the loss and every gradient (SGD deltas through real engines) are
bit-equal to the switch off: the kept out/lse are the first forward's, which the recompute rebuilt
bit-for-bit before. SP 1 (one process, module level: fused and attention-function level, no offload,
host arena, keep_on_device, reentrant, packed documents, Qwen3's q/k-norm) and SP 2/4 through
ds_longctx.initialize (ZeRO-1/3, GQA, KV replication, packed documents, offload and keep_on_device),
and against the single-process model. The switch must actually skip: the staged attention forward runs
once per layer instead of twice. The host arena holds the layer input plus the attention output plus
the LSE per offloaded layer, exactly what the planner reports.
"""
from __future__ import annotations

import math

import pytest
import torch

from dist_utils import result_or_raise, runs_per_degree
from sp_cases import ds_config, full_params, sample
from tiny_models import build, tiny_config

from ds_longctx.config import ConfigError, parse

LAYERS, B, S = 3, 2, 24
SHAPE = dict(heads=4, kv_heads=2, head_dim=8, layers=LAYERS)


def _lc(fuse=True, keep=False, **ac):
    return parse({"long_context": {
        "attention": {"implementation": "untied_ulysses", "fuse_projections": fuse},
        "activation_checkpointing": dict({"enabled": True, "keep_attention_output": keep}, **ac)}})


class _CountForwards:
    """Counts runs of the staged attention forward (the real one runs)."""

    def __init__(self, monkeypatch):
        from ds_longctx.attention import block, untied

        self.n = 0
        real = untied._staged_forward

        def counted(*a, **k):
            self.n += 1
            return real(*a, **k)

        monkeypatch.setattr(untied, "_staged_forward", counted)
        monkeypatch.setattr(block, "_staged_forward", counted)


def _train_step(model, batch):
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _batch(packed=False, seed=3):
    ids = torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(seed))
    batch = {"input_ids": ids, "labels": ids}
    if packed:  # row 0: documents 5, 1, 18; row 1: 12, 12
        batch["position_ids"] = torch.stack([torch.cat([torch.arange(n) for n in lens])
                                             for lens in ([5, 1, 18], [12, 12])])
    return batch


SP1 = [  # (arch, fuse, activation_checkpointing keys, packed)
    ("llama", True, {}, False),
    ("llama", False, {}, False),
    ("llama", True, {"offload": "cpu"}, False),
    ("llama", False, {"offload": "cpu"}, False),
    ("llama", True, {"offload": "cpu", "keep_on_device": 1}, False),
    ("llama", True, {"offload": "cpu", "use_reentrant": True}, False),
    ("qwen3", True, {"offload": "cpu"}, False),
    ("llama", True, {"offload": "cpu"}, True),
    ("llama", False, {}, True),
    ("llama", True, {"offload": "nvme", "nvme_path": "TMP"}, True),
]


def _aio_available():
    from deepspeed.ops.op_builder import AsyncIOBuilder

    return AsyncIOBuilder().is_compatible(verbose=False)


def _sp1_id(a, f, ac, p):
    where = "-".join(f"{k}={v}" for k, v in ac.items()) or "device"
    return f"{a}-{'fused' if f else 'function'}-{where}{'-packed' if p else ''}"


@pytest.mark.parametrize("arch,fuse,ac,packed", SP1, ids=[_sp1_id(*c) for c in SP1])
def test_sp1_bit_equal_and_recompute_skips_attention(arch, fuse, ac, packed, monkeypatch, tmp_path):
    from tiny_models import patch

    if ac.get("offload") == "nvme":
        if not _aio_available():
            pytest.skip("DeepSpeed's async_io op needs libaio-dev (.ci/run installs it)")
        ac = dict(ac, nvme_path=str(tmp_path))

    count = _CountForwards(monkeypatch)
    cfg = tiny_config(arch, **SHAPE)
    runs = {}
    for keep in (False, True):
        model = build(cfg, seed=0)
        handle = patch(model, _lc(fuse, keep, **ac))
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        results = []
        try:
            for step in range(2):  # step 2 reuses the arena's blocks
                count.n = 0
                results.append(_train_step(model, _batch(packed, seed=step)) + (count.n,))
                opt.step()
            stats = handle.memory.stats() if handle.memory is not None else {}
        finally:
            handle.remove()
        runs[keep] = results, stats
    for (loss0, g0, n0), (loss1, g1, n1) in zip(runs[False][0], runs[True][0]):
        assert torch.equal(loss0, loss1), (loss0, loss1)
        for n in g0:
            assert torch.equal(g0[n], g1[n]), n
        assert n0 == 2 * LAYERS and n1 == LAYERS, (n0, n1)  # forward + recompute vs forward only
    st = runs[True][1]
    if ac.get("offload") == "cpu":
        offloaded = LAYERS - ac.get("keep_on_device", 0)
        layer = B * S * cfg.hidden_size * 4
        out = B * S * cfg.num_attention_heads * cfg.head_dim * 4
        lse = B * cfg.num_attention_heads * S * 4  # fp32 [stages, b, u, S]: heads x S per rank at SP 1
        assert st["arena_bytes"] == offloaded * (layer + out + lse), st
        assert st["host_bytes"] == 0 and st["arena_in_use_bytes"] == 0, st  # all given back after backward
        assert runs[False][1]["arena_bytes"] == offloaded * layer


def test_arena_bytes_equal_the_planners_host_figure_with_kept_attention():
    """The planner runs the same code on fake tensors: its 'offloaded activations' equal the arena's bytes,
    and its per-layer figure (used for the NVMe / keep_on_device alternatives) includes out and LSE."""
    from tiny_models import patch
    from ds_longctx.planner import Planner

    cfg = tiny_config(**SHAPE)
    model = build(cfg)
    handle = patch(model, _lc(True, True, offload="cpu"))
    _train_step(model, _batch())
    measured = handle.memory.stats()["arena_bytes"]
    handle.remove()
    lc = {"attention": {"implementation": "untied_ulysses"},
          "activation_checkpointing": {"enabled": True, "offload": "cpu", "keep_attention_output": True}}
    ds = {"train_micro_batch_size_per_gpu": B, "zero_optimization": {"stage": 0}, "long_context": lc}
    r = Planner(ds, cfg, 1, "1GiB", reserve="0", device="cpu", full_depth=True).run(S)
    per_layer = B * S * cfg.hidden_size * 4 + B * S * 32 * 4 + B * 4 * S * 4
    assert r.host["offloaded activations"] == measured == LAYERS * per_layer, (r.host, measured)
    assert r.offload["layer_input_bytes"] == per_layer, r.offload


@pytest.mark.parametrize("fuse", [True, False])
def test_first_layers_keep_the_rest_recompute(fuse, monkeypatch):
    """keep_attention_output N: the first N layers keep (their recompute skips attention), the others recompute;
    bit-equal to off; the arena holds the kept outputs of those N only, as the planner says (full depth)."""
    from tiny_models import patch
    from ds_longctx.planner import Planner

    count = _CountForwards(monkeypatch)
    cfg = tiny_config(**SHAPE)
    runs = {}
    for keep in (False, 1, 2):
        model = build(cfg, seed=0)
        handle = patch(model, _lc(fuse, keep, offload="cpu", keep_on_device=1))
        try:
            count.n = 0
            runs[keep] = _train_step(model, _batch()) + (count.n, handle.memory.stats()["arena_bytes"])
        finally:
            handle.remove()
    layer = B * S * cfg.hidden_size * 4
    kept = B * S * cfg.num_attention_heads * cfg.head_dim * 4 + B * cfg.num_attention_heads * S * 4
    for keep in (1, 2):
        assert torch.equal(runs[keep][0], runs[False][0])
        assert all(torch.equal(runs[keep][1][n], g) for n, g in runs[False][1].items())
        assert runs[keep][2] == 2 * LAYERS - keep, (keep, runs[keep][2])  # the first `keep` skip the recompute
        # 2 offloaded layers (keep_on_device 1): the kept outputs of the first `keep` go with them
        assert runs[keep][3] == 2 * layer + keep * kept, (keep, runs[keep][3])
        lc = {"attention": {"implementation": "untied_ulysses", "fuse_projections": fuse},
              "activation_checkpointing": {"enabled": True, "offload": "cpu", "keep_on_device": 1,
                                           "keep_attention_output": keep}}
        ds = {"train_micro_batch_size_per_gpu": B, "zero_optimization": {"stage": 0}, "long_context": lc}
        r = Planner(ds, cfg, 1, "1GiB", reserve="0", device="cpu", full_depth=True).run(S)
        assert r.host["offloaded activations"] == runs[keep][3], (keep, r.host)
    assert runs[False][2] == 2 * LAYERS


@pytest.mark.parametrize("lc,match", [
    ({"activation_checkpointing": {"enabled": False, "keep_attention_output": True},
      "attention": {"implementation": "untied_ulysses"}}, "checkpointing is off"),
    ({"activation_checkpointing": {"enabled": False, "keep_attention_output": 2},
      "attention": {"implementation": "untied_ulysses"}}, "checkpointing is off"),
    ({"activation_checkpointing": {"enabled": True, "keep_attention_output": True},
      "attention": {"implementation": "ulysses"}}, "needs attention.implementation 'untied_ulysses'"),
    ({"activation_checkpointing": {"enabled": True, "keep_attention_output": True},
      "attention": {"implementation": "none"}}, "needs attention.implementation 'untied_ulysses'"),
])
def test_refused_where_nothing_would_be_kept(lc, match):
    with pytest.raises(ConfigError, match=match) as e:
        parse({"long_context": lc})
    assert e.value.key == "long_context.activation_checkpointing.keep_attention_output"


# ---------------------------------------------------------------------------------------------
# SP 2 and 4 through ds_longctx.initialize: on vs off bit-equal, and both equal one process
# ---------------------------------------------------------------------------------------------

SHAPES = {"gqa": dict(heads=4, kv_heads=2), "mqa": dict(heads=4, kv_heads=1),  # SP 2 > 1 kv head: replication
          "gqa_repl": dict(heads=8, kv_heads=2, head_dim=4)}  # SP 4 > 2 kv heads
SEQ, VOCAB = 16, 64
DOC_LENS = [[3, 1, 5, 7], [8, 4, 4]]
CASES = {  # (shape, fuse, zero stage, activation_checkpointing keys, packed)
    2: [("gqa", True, 3, {"offload": "cpu"}, False),
        ("gqa", False, 1, {}, False),
        ("mqa", True, 1, {"offload": "cpu", "keep_on_device": 1}, False),
        ("gqa", True, 3, {"offload": "cpu"}, True),
        ("mqa", False, 3, {"offload": "cpu", "keep_on_device": 1}, True)],
    4: [("gqa_repl", True, 3, {"offload": "cpu"}, True),
        ("gqa_repl", False, 1, {}, False)],
}


def _sp_batch(packed):
    if not packed:
        return sample(SEQ, VOCAB, bsz=2)
    b = sample(SEQ, VOCAB, bsz=2)
    b["position_ids"] = torch.stack([torch.cat([torch.arange(n) for n in lens]) for lens in DOC_LENS])
    return b


def _sp_worker(rank, world, cases):
    import ds_longctx
    from ds_longctx.dist.comm import sp_group, sp_rank
    from ds_longctx.data import shard_batch

    from ds_longctx.attention import block, untied

    real, count = untied._staged_forward, [0]

    def counted(*a, **k):  # the real staged forward, counted
        count[0] += 1
        return real(*a, **k)

    untied._staged_forward = block._staged_forward = counted
    out = {}
    for case in cases:
        shape, fuse, stage, ac, packed = case
        for keep in (False, True):
            count[0] = 0
            lc = {"attention": {"implementation": "untied_ulysses", "fuse_projections": fuse},
                  "activation_checkpointing": dict({"enabled": True, "keep_attention_output": keep,
                                                    "pin_memory": False}, **ac)}
            model = build(tiny_config(**SHAPES[shape], vocab=VOCAB), seed=0)
            opt = torch.optim.SGD(model.parameters(), lr=1.0)
            engine, _, _, _ = ds_longctx.initialize(model=model, optimizer=opt, config=ds_config(stage, world, lc))
            before = full_params(engine.module)
            shard = shard_batch(_sp_batch(packed), sp_rank(sp_group()), world)
            loss = engine(**shard).loss
            engine.backward(loss)
            engine.step()
            after = full_params(engine.module)
            out[(_key(case), keep)] = (loss.item(), {n: after[n] - before[n] for n in after}, count[0])
            engine.destroy()
    return out


def _key(case):
    shape, fuse, stage, ac, packed = case
    return (shape, fuse, stage, tuple(sorted(ac.items())), packed)


def _reference(shape, packed):
    model = build(tiny_config(**SHAPES[shape], vocab=VOCAB), seed=0)
    model.train()
    loss = model(**_sp_batch(packed), use_cache=False).loss
    loss.backward()
    return loss.item(), {n: -p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def sp_results():
    """The SP 2 and SP 4 spawns started side by side, once; each test below checks its own."""
    return runs_per_degree(_sp_worker, CASES)


@pytest.mark.distributed
@pytest.mark.parametrize("sp", [2, 4])
def test_sp_engines_bit_equal_on_vs_off_and_equal_one_process(sp, sp_results):
    cases = CASES[sp]
    results = result_or_raise(sp_results[sp])
    for case in cases:
        ref_loss, ref_deltas = _reference(case[0], case[4])
        for rank_out in results:
            off, on = rank_out[(_key(case), False)], rank_out[(_key(case), True)]
            assert off[2] == 2 * 2 and on[2] == 2, (case, off[2], on[2])  # 2 layers: forward + recompute vs forward
            assert on[0] == off[0], (case, on[0], off[0])  # the loss, bit-equal
            for n in off[1]:
                assert torch.equal(on[1][n], off[1][n]), (case, n)
            assert math.isclose(on[0], ref_loss, rel_tol=1e-6), (case, on[0], ref_loss)
            for n, ref in ref_deltas.items():
                torch.testing.assert_close(on[1][n], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{case} {n}: {m}")
