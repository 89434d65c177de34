"""LongContextSpec: built once by one builder, frozen, trusted by the installs (heads_per_chunk and the kernel
name checked once, nothing re-checked per forward); the error types; Accelerate's deepspeed.initialize known by
an explicit mark. One process, SP=1, real tiny HF models."""
import dataclasses
import pickle

import pytest
import torch

from tiny_models import build, tiny_config

UNTIED = {"attention": {"implementation": "untied_ulysses", "heads_per_chunk": 2},
          "activation_checkpointing": {"enabled": True}, "tiled_mlp": {"enabled": True, "shards": 2},
          "tiled_loss": {"enabled": True, "shards": 2}}


def _lc(section=UNTIED, **top):
    from ds_longctx.config import parse

    return parse({"long_context": section, **top})


def test_spec_is_built_from_config_layout_and_model_and_is_frozen():
    from ds_longctx.dist.layout import Layout
    from ds_longctx.patching.spec import build_spec

    lc = _lc()
    spec = build_spec(lc, tiny_config(heads=4, kv_heads=2, head_dim=8, layers=2, vocab=64))
    assert (spec.sp, spec.dp, spec.grad_scale, spec.group) == (1, 1, 1.0, None)
    assert (spec.model.heads, spec.model.kv_heads, spec.model.head_dim, spec.model.layers, spec.model.hidden,
            spec.model.vocab, spec.model.model_type) == (4, 2, 8, 2, 32, 64, "llama")
    assert (spec.schedule.heads, spec.schedule.kv_heads, spec.schedule.sp, spec.schedule.heads_per_chunk) == (4, 2, 1, 2)
    assert spec.kernel.name == "auto" and (spec.mlp_shards, spec.loss_shards) == (2, 2)
    assert spec.fused is True  # fuse_projections 'auto' on an architecture of ds_longctx.models
    assert (spec.keep_on_device, spec.offloaded_layers, spec.kept_attention_layers) == (0, 0, 0)  # no offload
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.group = object()
    lc.attention.heads_per_chunk = 1  # the caller's config is not the spec's
    assert spec.config.attention.heads_per_chunk == 2 and spec.heads_per_chunk == 2
    # the layout carries world and degrees: nothing re-derives them from a group
    wide = build_spec(_lc(sequence_parallel_size=2), tiny_config(), Layout(world=8, sp=2, rank=5, grad_scale=2.0))
    assert (wide.sp, wide.dp, wide.layout.sp_rank, wide.layout.dp_rank, wide.grad_scale) == (2, 4, 1, 2, 2.0)
    assert wide.with_group("g").group == "g" and wide.group is None


@pytest.mark.parametrize("keep,kod,offload,want", [
    (True, 1, "cpu", (1, 3, 4, 3)),     # every layer keeps; the last keeps its input on the device
    (2, 0, "cpu", (0, 4, 2, 2)),        # the first 2 keep their attention output, all 4 inputs offloaded
    (9, 3, "cpu", (3, 1, 4, 1)),        # a count above the depth is every layer
    (False, 2, "none", (0, 0, 0, 0)),   # no offload: keep_on_device says nothing
])
def test_spec_holds_every_resolved_count_as_an_int(keep, kod, offload, want):
    """keep_on_device, the offloaded layers, the layers keeping their attention output and those of them that are
    offloaded: resolved once, here, as plain ints that the installs, the planner and train.py read."""
    from ds_longctx.patching.spec import build_spec

    section = {"attention": {"implementation": "untied_ulysses"},
               "activation_checkpointing": {"enabled": True, "offload": offload, "keep_on_device": kod,
                                            "keep_attention_output": keep}}
    spec = build_spec(_lc(section), tiny_config(layers=4))
    got = (spec.keep_on_device, spec.offloaded_layers, spec.kept_attention_layers, spec.offloaded_kept_attention_layers)
    assert got == want and all(type(v) is int for v in got)
    assert spec.heads_per_chunk == 1 and (spec.mlp_shards, spec.loss_shards) == (None, None)


def test_builder_refuses_what_the_installs_now_trust():
    from ds_longctx.config import ConfigError
    from ds_longctx.dist.layout import Layout
    from ds_longctx.patching.spec import build_spec

    with pytest.raises(ConfigError, match=r"^long_context\.attention\.heads_per_chunk: 3 does not divide the 4 query "
                                          r"heads per rank .*use one of \[1, 2, 4\]"):
        build_spec(_lc({"attention": {"implementation": "untied_ulysses", "heads_per_chunk": 3}}), tiny_config())
    with pytest.raises(ConfigError, match=r"^long_context\.attention\.heads_per_chunk: 'auto' is resolved by "
                                          r"ds_longctx\.initialize .* reached the model unresolved"):
        build_spec(_lc({"sequence_length": 64, "attention": {"implementation": "untied_ulysses",
                                                             "heads_per_chunk": "auto"}}), tiny_config())
    with pytest.raises(ConfigError, match=r"^sequence_parallel_size: is 2 but the layout has SP 1"):
        build_spec(_lc(sequence_parallel_size=2), tiny_config(), Layout(world=2, sp=1))
    with pytest.raises(ConfigError, match=r"^sequence_parallel_size: 2 does not divide the world size 3"):
        build_spec(_lc(sequence_parallel_size=2), tiny_config(), Layout(world=3, sp=2))
    with pytest.raises(ConfigError, match=r"^model\.config: is needed by attention\.implementation 'untied_ulysses'"):
        build_spec(_lc(), None)


def test_patch_model_takes_a_spec_of_this_model_only():
    """One signature: patch_model(model, spec). A parsed section is refused with the builder to call, and a spec
    built for another model config (its facts differ) is refused before anything is installed."""
    from ds_longctx.config import ConfigError
    from ds_longctx.patching.patch import patch_model
    from ds_longctx.patching.spec import build_spec

    model = build(tiny_config(), seed=0)
    with pytest.raises(TypeError, match=r"spec must be a ds_longctx\.patching\.spec\.LongContextSpec, got LongContextConfig "
                                        r"\(build one with ds_longctx\.patching\.spec\.build_spec"):
        patch_model(model, _lc())
    with pytest.raises(ConfigError, match=r"^spec: was built for another model"):
        patch_model(model, build_spec(_lc(), tiny_config(layers=3)))
    assert getattr(model, "_ds_longctx_patch", None) is None and "forward" not in model.__dict__


def _counting(monkeypatch):
    """Count the user-facing checks of heads_per_chunk and the kernel name, and every Schedule built."""
    from ds_longctx.patching import checks
    from ds_longctx.patching import spec
    from ds_longctx.attention import untied

    calls = {"heads_per_chunk": 0, "kernel": 0, "schedule": 0}

    def counted(name, fn):
        def wrapper(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapper

    monkeypatch.setattr(checks, "check_heads_per_chunk", counted("heads_per_chunk", checks.check_heads_per_chunk))
    monkeypatch.setattr(spec, "check_kernel", counted("kernel", checks.check_kernel))
    monkeypatch.setattr(untied.Schedule, "__post_init__", counted("schedule", untied.Schedule.__post_init__))
    return calls


def test_heads_per_chunk_and_kernel_are_checked_once_and_trusted_per_forward(monkeypatch):
    """The one builder checks them once; patching and a training step check nothing again."""
    from ds_longctx.patching.patch import patch_model
    from ds_longctx.patching.spec import build_spec

    calls = _counting(monkeypatch)
    model = build(tiny_config(), seed=0)
    handle = patch_model(model, build_spec(_lc(), model.config))
    assert calls == {"heads_per_chunk": 1, "kernel": 1, "schedule": 1}
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
    assert calls == {"heads_per_chunk": 1, "kernel": 1, "schedule": 1}
    handle.remove()


def test_error_types_share_one_base_and_cross_ranks_whole():
    from ds_longctx import BatchError, ConfigError, LongContextError
    from ds_longctx.errors import error_class

    for cls in (ConfigError, BatchError):
        e = cls("batch.labels" if cls is BatchError else "k", "bad", "fix it")
        assert isinstance(e, LongContextError) and isinstance(e, ValueError)
        assert str(e) == f"{e.key}: bad. Fix: fix it"
        back = pickle.loads(pickle.dumps(e))  # broadcast_object_list / multiprocessing
        assert type(back) is cls and (back.key, back.problem, back.fix) == (e.key, "bad", "fix it")
        assert error_class(cls.__name__) is cls
    assert not issubclass(BatchError, ConfigError) and not issubclass(ConfigError, BatchError)


def test_a_batch_problem_is_a_batch_error():
    from ds_longctx import BatchError
    from ds_longctx.data import shard_batch

    with pytest.raises(BatchError, match=r"^batch.input_ids: sequence length 7 is not divisible"):
        shard_batch({"input_ids": torch.zeros(1, 7, dtype=torch.long)}, 0, 2)


def test_accelerate_call_is_known_by_an_explicit_mark(monkeypatch):
    """enable() wraps Accelerator._prepare_deepspeed (what the Trainer, TRL and Accelerate loops call) so a
    deepspeed.initialize inside it is Accelerate's: there SP without a ParallelismConfig is refused with the
    Accelerate fix; the same call outside reaches ds_longctx.initialize. disable() puts the method back."""
    import deepspeed
    from accelerate import Accelerator

    from ds_longctx.hf import integration
    from ds_longctx.config import ConfigError

    seen = []
    config = {"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 2, "long_context": {}}

    def prepare_deepspeed(self, *args):  # stands in for accelerate's method: calls deepspeed.initialize
        seen.append(integration._called_from_accelerate())
        return deepspeed.initialize(model=None, config=config)

    monkeypatch.setattr(Accelerator, "_prepare_deepspeed", prepare_deepspeed)
    integration.enable()
    try:
        assert Accelerator._prepare_deepspeed is not prepare_deepspeed
        with pytest.raises(ConfigError, match=r"Accelerate \(HF Trainer / TRL\) was given no sequence-parallel setup"):
            Accelerator._prepare_deepspeed(None)
        assert seen == [True] and not integration._called_from_accelerate()
        with pytest.raises(ConfigError, match=r"^model: is required"):  # not Accelerate's: ds_longctx.initialize
            deepspeed.initialize(model=None, config=config)
    finally:
        integration.disable()
    assert Accelerator._prepare_deepspeed is prepare_deepspeed
