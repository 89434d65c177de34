"""patch_model's handle undoes every patch; the attention registry routes per module; print(model) shows
what was swapped in. One process, SP=1 (no process group), real tiny HF models."""
import pytest
import torch

from tiny_models import build, tiny_config

FULL = {"attention": {"implementation": "untied_ulysses", "heads_per_chunk": 1},
        "activation_checkpointing": {"enabled": True}, "tiled_mlp": {"enabled": True, "shards": 2},
        "tiled_loss": {"enabled": True, "shards": 2}, "rms_norm": {"enabled": True}}


def _lc(fuse: bool):
    from ds_longctx.config import parse

    lc = {**FULL, "attention": {**FULL["attention"], "fuse_projections": fuse}}
    return parse({"long_context": lc})


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def _state(model):
    """Everything a patch could leave behind on the model's modules."""
    return [(name, type(m), sorted(m.__dict__.get("_forward_hooks", {}).keys()).__len__(),
             len(m._forward_pre_hooks), "forward" in m.__dict__, m.__dict__.get("_z3_leaf", False),
             sorted(k for k in m.__dict__ if k.startswith("_ds_longctx")))
            for name, m in model.named_modules()]


@pytest.mark.parametrize("fuse", [True, False])
def test_remove_undoes_every_patch(fuse):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from ds_longctx.attention import registry
    from tiny_models import patch

    model = build(tiny_config(), seed=0)
    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(0))
    before_logits, before_state, before_fn = _logits(model, ids), _state(model), ALL_ATTENTION_FUNCTIONS["sdpa"]
    handle = patch(model, _lc(fuse))
    assert _state(model) != before_state
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    # earlier tests may have left other models installed, so ask the registry about this model's modules
    assert any(registry.is_installed(m) for m in model.modules()) == (not fuse)
    handle.remove()
    assert not any(registry.is_installed(m) for m in model.modules())
    assert _state(model) == before_state
    if not hasattr(before_fn, "_ds_longctx_dispatcher"):  # else an earlier test's (dead) model held the slot
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is before_fn
    assert "ds_longctx" not in repr(model)
    assert not hasattr(model, "_ds_longctx_patch") and not hasattr(model, "_ds_longctx_memory")
    assert torch.equal(_logits(model, ids), before_logits)
    patch(model, _lc(fuse)).remove()  # and it can be patched again


def test_unpatched_model_keeps_original_attention():
    """The function-level install routes only the patched model's modules; another model in the same
    process calls the original function (DeepSpeed's register_with_transformers is process-global)."""
    from ds_longctx.attention import registry
    from tiny_models import patch

    other = build(tiny_config(), seed=1)
    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(0))
    ref = _logits(other, ids)
    model = build(tiny_config(), seed=0)
    calls = []
    handle = patch(model, _lc(False))
    inst = handle.attention.function_level
    inner = inst.fn

    def counting(module, *args, **kwargs):
        calls.append(module)
        return inner(module, *args, **kwargs)

    # route through a counter to see who is dispatched where
    slot = registry._SLOTS[inst.impl]
    for m in list(slot.modules.keys()):
        slot.modules[m] = counting
    try:
        assert torch.equal(_logits(other, ids), ref) and not calls
        _logits(model, ids)
        assert len(calls) == tiny_config().num_hidden_layers
    finally:
        inst.fn = counting
        handle.remove()


def test_registry_restored_undoes_installs_inside_it():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from ds_longctx.attention import registry

    before = ALL_ATTENTION_FUNCTIONS["sdpa"]
    outer = build(tiny_config(), seed=0)
    keep = registry.install(outer, "sdpa", lambda *a, **k: None, "outer")
    try:
        with registry.restored():
            inner = build(tiny_config(), seed=1)
            registry.install(inner, "sdpa", lambda *a, **k: None, "inner")
            registry.install(build(tiny_config(), seed=2), "eager" if "eager" in ALL_ATTENTION_FUNCTIONS else
                             "sdpa", lambda *a, **k: None, "third")
        assert not any(registry.is_installed(m) for m in inner.modules())
        assert all(registry.is_installed(m) for m in outer.modules())
        with pytest.raises(RuntimeError, match="already installed"):
            registry.install(outer, "sdpa", lambda *a, **k: None, "twice")
    finally:
        keep.remove()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is before


def test_displaced_foreign_wrapper_is_put_back():
    """registry.displace (how a prior DeepSpeed register_with_transformers wrapper is taken out so our SP
    attention does not run on top of it): while ds_longctx owns the name neither the patched model nor
    another model calls the wrapper; releasing the name puts the wrapper back. Both orders: wrapper
    written before our install, and wrapper already behind our dispatcher when it is displaced."""
    import gc

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from ds_longctx.attention import registry

    gc.collect()  # models of earlier tests are gone; their (empty) slot is released for a clean start
    slot = registry._SLOTS.get("sdpa")
    assert slot is None or len(slot.modules) == 0, "an earlier test left a patched model alive"
    if slot is not None:
        registry._release("sdpa")
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    wrapped = []

    def foreign(module, *args, **kwargs):  # stands in for a library's process-global SP wrapper
        wrapped.append(module)
        return sdpa(module, *args, **kwargs)

    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(0))
    other = build(tiny_config(), seed=1)
    try:
        for behind_dispatcher in (False, True):
            ALL_ATTENTION_FUNCTIONS["sdpa"] = foreign  # the foreign library writes the table itself
            model = build(tiny_config(), seed=0)
            if behind_dispatcher:
                inst = registry.install(model, "sdpa", sdpa, "test")
                assert registry.original("sdpa") is foreign
                registry.displace("sdpa", sdpa)
            else:
                registry.displace("sdpa", sdpa)
                assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa
                inst = registry.install(model, "sdpa", sdpa, "test")
            assert registry.original("sdpa") is sdpa
            wrapped.clear()
            _logits(model, ids)
            _logits(other, ids)
            assert not wrapped  # neither the patched model nor the fallback runs the wrapper
            inst.remove()
            assert ALL_ATTENTION_FUNCTIONS["sdpa"] is foreign and "sdpa" not in registry._DISPLACED
            _logits(other, ids)
            assert len(wrapped) == tiny_config().num_hidden_layers  # the wrapper is in force again
        registry.displace("sdpa", sdpa)  # no install follows: undisplace puts it back
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa
        registry.undisplace("sdpa")
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is foreign
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa


def test_print_model_shows_swaps():
    from tiny_models import patch

    model = build(tiny_config(), seed=0)
    handle = patch(model, _lc(True))
    text = repr(model)
    assert "ds_longctx: attention=untied Ulysses (fused projections" in text
    assert "checkpointed_layers=2" in text and "tiled_mlps=2" in text and "loss=SP token mean" in text
    # on each attention module (HF prints repeated identical layers once)
    assert "fused untied Ulysses (sp=1, heads_per_chunk=1, kernel=auto)" in text.split("(layers)")[1]
    handle.remove()


def test_kernel_override_is_scoped():
    from ds_longctx.attention import kernels

    class Fake(kernels.TorchCPUFlash):
        name = "test_fake"

    assert type(kernels.get_backend("sdpa", "cpu")) is kernels.TorchCPUFlash
    with kernels.overridden("cpu", Fake):
        assert type(kernels.get_backend("sdpa", "cpu")) is Fake
        assert type(kernels.get_backend("auto", "cpu")) is Fake
    assert type(kernels.get_backend("auto", "cpu")) is kernels.TorchCPUFlash
    assert "test_fake" not in kernels.BACKENDS
