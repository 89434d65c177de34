"""Memory stack at module level (one process, no engine): tiled loss, tiled MLP, checkpoint-input
offload. Each test compares against the untiled / un-offloaded computation on the same weights."""
import math
import weakref

import pytest
import torch

from tiny_models import build, memory_stack, tiny_config

from ds_longctx.config import parse
from ds_longctx.loss import causal_lm_loss_sum
from ds_longctx.memory import (HostCopyTarget, auto_shards, resolve_shards,
                               tiled_causal_lm_loss_sum)
from ds_longctx.measure.live_bytes import LiveBytesTracker


def _lc(**section):
    return parse({"long_context": section})


# ---------------------------------------------------------------------------------------------
# tiled loss
# ---------------------------------------------------------------------------------------------


def _loss_case(b, s, h, vocab, shards, ignore=None, upstream=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    lm_head = torch.nn.Linear(h, vocab, bias=False)
    with torch.no_grad():
        lm_head.weight.copy_(torch.randn(vocab, h, generator=g) * 0.2)
    hidden = torch.randn(b, s, h, generator=g)
    labels = torch.randint(0, vocab, (b, s), generator=g)
    if ignore is not None:
        labels[ignore] = -100
    out = {}
    for name in ("ref", "tiled"):
        x = hidden.clone().requires_grad_(True)
        lm_head.weight.grad = None
        if name == "ref":
            loss, count, _ = causal_lm_loss_sum(x, lm_head, labels)
        else:
            loss, count = tiled_causal_lm_loss_sum(x, lm_head, labels, shards)
        (loss * upstream).backward()
        out[name] = (loss.detach(), int(count), x.grad.clone(), lm_head.weight.grad.clone())
    return out


@pytest.mark.parametrize("case", [
    dict(b=1, s=16, shards=4),  # even
    dict(b=2, s=13, shards=4),  # uneven last shard, batch > 1 (tiles cross the batch boundary)
    dict(b=1, s=16, shards=4, ignore=(slice(None), slice(0, 9))),  # first two shards all ignored
    dict(b=1, s=5, shards=12),  # more shards than tokens: empty tiles
    dict(b=2, s=16, shards=3, upstream=0.037),  # a non-unit upstream gradient (SP token mean, GAS)
    dict(b=1, s=16, shards=None),  # "auto"
])
def test_tiled_loss_matches_untiled(case):
    case = dict(case)
    out = _loss_case(case.pop("b"), case.pop("s"), 8, 40, **case)
    (rl, rc, rgx, rgw), (tl, tc, tgx, tgw) = out["ref"], out["tiled"]
    assert tl.dtype == torch.float32
    assert math.isclose(tl.item(), rl.item(), rel_tol=1e-6), (tl.item(), rl.item())
    assert tc == rc
    torch.testing.assert_close(tgx, rgx, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tgw, rgw, rtol=1e-5, atol=1e-6)


def test_tiled_loss_all_ignored_is_zero_not_nan():
    out = _loss_case(1, 10, 8, 40, shards=3, ignore=(slice(None), slice(None)))
    tl, tc, tgx, tgw = out["tiled"]
    assert tl.item() == 0.0 and tc == 0
    assert torch.isfinite(tgx).all() and torch.count_nonzero(tgx) == 0 and torch.count_nonzero(tgw) == 0


def test_auto_shards_without_dist():
    assert auto_shards(100, 32) == 4 and auto_shards(1, 32) == 1
    assert resolve_shards(None, 65, 32) == 3 and resolve_shards(5, 65, 32) == 5


def _peak_during_loss(fn, s, h, vocab):
    lm_head = torch.nn.Linear(h, vocab, bias=False)
    hidden = torch.randn(1, s, h, requires_grad=True)
    labels = torch.randint(0, vocab, (1, s))
    with LiveBytesTracker() as tr:
        loss = fn(hidden, lm_head, labels)
        loss.backward()
        del loss
    return tr.peak


def test_tiled_loss_never_holds_full_logits():
    s, h, vocab = 256, 16, 512
    full_logits = s * vocab * 4
    untiled = _peak_during_loss(lambda x, m, y: causal_lm_loss_sum(x, m, y)[0], s, h, vocab)
    tiled = _peak_during_loss(lambda x, m, y: tiled_causal_lm_loss_sum(x, m, y, 8)[0], s, h, vocab)
    assert untiled >= full_logits  # the tracker sees the [seq, vocab] logits when they exist...
    # ...and the tiled loss peaks below one [seq, vocab] fp32 tensor (weight + hidden grads included)
    assert tiled < full_logits, (tiled, full_logits)
    assert tiled < untiled / 3, (tiled, untiled)


# ---------------------------------------------------------------------------------------------
# tiled MLP
# ---------------------------------------------------------------------------------------------


def _mlp_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_tiled_mlp_matches_plain(arch):
    cfg = tiny_config(arch, layers=2)
    ids = torch.randint(0, cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    plain = build(cfg)
    ref_loss, ref = _mlp_grads(plain, ids)
    for shards in (4, 30):  # uneven tiles; more tiles than rows (empty tiles)
        tiled = build(cfg)
        handle = memory_stack(tiled, _lc(tiled_mlp={"enabled": True, "shards": shards}))
        assert len(handle.tiled_mlps) == cfg.num_hidden_layers
        calls = []
        hooks = [m.gate_proj.register_forward_hook(lambda *a: calls.append(1)) for m in handle.tiled_mlps]
        loss, grads = _mlp_grads(tiled, ids)
        for hk in hooks:
            hk.remove()
        # exactly `shards` tiles forward and again in backward, whatever the length: the count ranks
        # must agree on under ZeRO-3 (torch.chunk would give 10 tiles for 22 rows in 30 chunks... or fewer)
        assert len(calls) == 2 * shards * cfg.num_hidden_layers
        assert torch.allclose(loss, ref_loss, rtol=1e-6, atol=0)
        for n in ref:
            torch.testing.assert_close(grads[n], ref[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
        assert all(getattr(p, "ds_grad_is_ready", True) for p in tiled.parameters())
        handle.remove()
        calls.clear()


def test_tiled_mlp_rejects_unsupported_model():
    from ds_longctx.config import ConfigError

    with pytest.raises(ConfigError, match=r"^long_context\.tiled_mlp\.enabled: Sequential has no MLP.*Fix: set "
                                          r"long_context\.tiled_mlp\.enabled=false for this model \(its MLP"):
        memory_stack(torch.nn.Sequential(torch.nn.Linear(4, 4)), _lc(tiled_mlp={"enabled": True}))


def test_tiled_mlp_op_refuses_in_op_terms():
    """The op (install_tiled_mlp, plain shard count) names no config key: the same refusal as a TilingError
    (a ValueError) with the untiled fix; apply_memory_stack above names the key."""
    from ds_longctx.errors import ConfigError
    from ds_longctx.memory.tiling import TilingError, install_tiled_mlp

    with pytest.raises(TilingError, match=r"^Sequential has no MLP.*Fix: do not tile it for this model") as e:
        install_tiled_mlp(torch.nn.Sequential(torch.nn.Linear(4, 4)), 2)
    assert isinstance(e.value, ValueError) and not isinstance(e.value, ConfigError)
    assert "long_context" not in str(e.value)


# ---------------------------------------------------------------------------------------------
# checkpointing + offload
# ---------------------------------------------------------------------------------------------


class RecordingTarget(HostCopyTarget):
    """The real CPU host target, also keeping a copy of what it was given and what it gave back."""

    def __init__(self):
        self.sent, self.returned = [], []

    def to_host(self, t):
        self.sent.append(t.detach().clone())
        return super().to_host(t)

    def to_device(self, host, device):
        out, ev = super().to_device(host, device)
        self.returned.append(out.detach().clone())
        return out, ev


def _train_step(model, ids):
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss  # forward ...
    loss.backward()  # ... and backward as separate calls, no context manager around them
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("reentrant", [False, True])
def test_offload_moves_restores_and_keeps_grads(reentrant):
    layers, b, s = 3, 2, 24
    cfg = tiny_config(layers=layers)
    ids = torch.randint(0, cfg.vocab_size, (b, s), generator=torch.Generator().manual_seed(2))
    ref_loss, ref = _train_step(build(cfg), ids)

    ck = build(cfg)
    memory_stack(ck, _lc(activation_checkpointing={"enabled": True, "use_reentrant": reentrant}))
    ck_loss, ck_grads = _train_step(ck, ids)

    model = build(cfg)
    target = RecordingTarget()
    handle = memory_stack(model, _lc(activation_checkpointing={"enabled": True, "offload": "cpu",
                                                                     "use_reentrant": reentrant}), offload_target=target)
    handle.offloader.record_events = True
    # when each layer's attention backward has produced its weight grads (o_proj's first, q_proj's last)
    for i, layer in enumerate(model.model.layers, start=1):
        layer.self_attn.q_proj.weight.register_post_accumulate_grad_hook(
            lambda p, i=i: handle.offloader.stats.events.append(("attention grads", i)))
    loss, grads = _train_step(model, ids)

    layer_bytes = b * s * cfg.hidden_size * 4
    st = handle.stats()
    assert st["offloaded_tensors"] == layers and st["offloaded_bytes"] == layers * layer_bytes
    assert st["restored_tensors"] == layers and st["restored_bytes"] == layers * layer_bytes
    assert st["host_bytes_peak"] == layers * layer_bytes
    assert handle.host_bytes() == 0  # host copies die with the graph after backward
    # bit-exact round trip, in reverse layer order
    assert len(target.returned) == layers
    for sent, back in zip(target.sent, reversed(target.returned)):
        assert torch.equal(sent, back)
    # gradients identical to checkpointing without offload and to no checkpointing
    assert torch.equal(loss, ck_loss) and torch.equal(loss, ref_loss)
    for n in ref:
        assert torch.equal(grads[n], ck_grads[n]), n
        assert torch.equal(grads[n], ref[n]), n
    # prefetch: the last input starts back when forward leaves the stack; every other one is
    # prefetched exactly one layer ahead, once its successor's attention backward is done (not at its
    # restore: the attention backward is the layer's peak), never all at once
    ev = handle.offloader.stats.events
    assert ev[:layers] == [("offload", i) for i in range(1, layers + 1)]
    assert ev[layers] == ("prefetch", layers)
    expect = []
    for i in range(layers, 0, -1):
        expect += [("restore", i), ("attention grads", i)]
        if i > 1:
            expect.append(("prefetch", i - 1))
    assert ev[layers + 1:] == expect
    assert st["prefetched_tensors"] == layers


def test_offload_holds_at_most_one_layer_input_per_boundary():
    """Live bytes at each decoder-layer boundary during forward: checkpointing alone keeps one more
    layer input per layer; with offload the device holds at most one besides the current one."""
    layers, b, s = 4, 1, 64
    cfg = tiny_config(layers=layers)
    ids = torch.randint(0, cfg.vocab_size, (b, s))
    layer_bytes = b * s * cfg.hidden_size * 4

    def boundaries(offload):
        model = build(cfg)
        model.train()
        handle = memory_stack(model, _lc(activation_checkpointing={"enabled": True, "offload": offload}))
        alive, live = [], []
        inputs = []

        def pre(m, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            inputs.append(weakref.ref(x))
            live.append(tr.live)
            alive.append(sum(r() is not None for r in inputs[:-1]))  # earlier layers' inputs still alive

        for layer in handle.checkpointed_layers:
            layer.register_forward_pre_hook(pre, with_kwargs=True)
        with LiveBytesTracker() as tr:
            # the tracker charges a parameter's storage when an op first returns a view of it (the
            # weight transpose inside each Linear); charge them all now so boundaries see activations
            with torch.no_grad():
                model(input_ids=ids, use_cache=False)
            live.clear(), alive.clear(), inputs.clear()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        return live, alive

    live_ck, alive_ck = boundaries("none")
    live_off, alive_off = boundaries("cpu")
    growth_ck = [live_ck[i] - live_ck[0] for i in range(layers)]
    growth_off = [live_off[i] - live_off[0] for i in range(layers)]
    assert growth_ck == [i * layer_bytes for i in range(layers)], growth_ck
    # with offload nothing grows per layer; the one extra input from boundary 1 on is layer 0's,
    # the embedding output, which HF's decoder forward keeps in a local (`inputs_embeds`) until it returns
    assert growth_off == [0] + [layer_bytes] * (layers - 1), growth_off
    assert alive_ck == list(range(layers)) and alive_off == [0] + [1] * (layers - 1), (alive_ck, alive_off)


def test_offload_idle_in_eval():
    cfg = tiny_config(layers=2)
    model = build(cfg)
    handle = memory_stack(model, _lc(activation_checkpointing={"enabled": True, "offload": "cpu"}))
    model.eval()
    with torch.no_grad():
        model(input_ids=torch.randint(0, cfg.vocab_size, (1, 8)))
    assert handle.stats()["offloaded_tensors"] == 0 and handle.host_bytes() == 0


def test_tiled_loss_trains_lm_head_when_hidden_is_frozen():
    lm_head = torch.nn.Linear(8, 40, bias=False)
    hidden = torch.randn(1, 9, 8)  # no grad: e.g. a frozen body
    labels = torch.randint(0, 40, (1, 9))
    causal_lm_loss_sum(hidden, lm_head, labels)[0].backward()
    ref, lm_head.weight.grad = lm_head.weight.grad.clone(), None
    loss, _ = tiled_causal_lm_loss_sum(hidden, lm_head, labels, 4)
    loss.backward()
    torch.testing.assert_close(lm_head.weight.grad, ref, rtol=1e-5, atol=1e-6)
