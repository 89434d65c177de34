"""Unit tests (no processes spawned) for what the ecosystem hands ds_longctx: the mpu, logits-free
outputs, enable()/disable(), the SP-wiring refusals, the rank-0 summary, and train.py's model-scale check."""
import json
import os

import pytest
import torch

import ds_longctx
from ds_longctx.hf import integration
from ds_longctx.patching import compat
from ds_longctx.config import ConfigError, parse
from tiny_models import build, tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class SPMpu:  # a Megatron-style mpu as DeepSpeed/Accelerate pass it (only the size is read here)
    def __init__(self, size):
        self.size = size

    def get_sequence_parallel_world_size(self):
        return self.size


def test_mpu_size_is_adopted_or_must_match():
    assert compat.resolve_sp_with_mpu({"train_batch_size": 1}, SPMpu(2))["sequence_parallel_size"] == 2
    assert compat.resolve_sp_with_mpu({"sequence_parallel_size": 2}, SPMpu(2)) == {"sequence_parallel_size": 2}
    with pytest.raises(ConfigError, match=r"config says 4 but the mpu .* has sequence-parallel size 2"):
        compat.resolve_sp_with_mpu({"sequence_parallel_size": 4}, SPMpu(2))
    with pytest.raises(ConfigError, match="get_sequence_parallel_world_size"):
        compat.resolve_sp_with_mpu({}, object())


def test_tiled_loss_output_names_the_key_when_logits_are_asked_for():
    from tiny_models import patch

    model = build(tiny_config(), seed=0)
    lc = parse({"long_context": {"attention": {"implementation": "none"}, "tiled_loss": {"enabled": True,
                                                                                         "shards": 2}}})
    patch(model, lc)
    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=ids, labels=ids)
    assert torch.isfinite(out.loss)
    with pytest.raises(compat.LogitsNotComputed, match="long_context.tiled_loss"):
        out.logits.float()
    assert getattr(out, "logits", None) is None and out["loss"] is out.loss
    # untiled: logits are there as usual
    model2 = build(tiny_config(), seed=0)
    patch(model2, parse({"long_context": {"attention": {"implementation": "none"}}}))
    out2 = model2(input_ids=ids, labels=ids)
    assert out2.logits.shape == (1, 16, 64)
    torch.testing.assert_close(out2.loss, out.loss, rtol=1e-6, atol=0)


def test_enable_is_idempotent_and_undone_by_disable():
    import deepspeed
    import deepspeed.runtime.sequence_parallel.ulysses_sp as ulysses_sp
    import transformers.trainer as hf_trainer

    from ds_longctx.hf.loader import RoutedSPAdapter

    orig_init, orig_loss = deepspeed.initialize, hf_trainer.deepspeed_sp_compute_loss
    orig_adapter = ulysses_sp.UlyssesSPDataLoaderAdapter
    try:
        ds_longctx.enable()
        ds_longctx.enable()
        assert deepspeed.initialize is integration._routed_initialize
        assert hf_trainer.deepspeed_sp_compute_loss is integration._sp_compute_loss
        assert integration._ORIGINALS["initialize"] is orig_init  # not wrapped twice
        assert integration._ORIGINALS["sp_adapter"] is orig_adapter
        # Accelerate's call builds the router; with no ds_longctx engine built it resolves to DeepSpeed's
        routed = ulysses_sp.UlyssesSPDataLoaderAdapter([{"input_ids": torch.zeros(1, 4)}], sp_rank=0, sp_group=None,
                                                       sp_world_size=2, device="cpu")
        assert isinstance(routed, RoutedSPAdapter) and len(routed) == 2
        assert isinstance(routed._resolve(), orig_adapter)
    finally:
        ds_longctx.disable()
    assert deepspeed.initialize is orig_init and hf_trainer.deepspeed_sp_compute_loss is orig_loss
    assert ulysses_sp.UlyssesSPDataLoaderAdapter is orig_adapter
    ds_longctx.disable()  # no-op


def test_sp_outside_a_launch_and_a_second_sp_size_are_refused_and_the_same_size_reused(monkeypatch):
    """enable()'s register_with_transformers: SP > 1 with no process group names the launch; a later Trainer with
    the SP size this process has reuses its groups (DeepSpeed's initialize_sequence_parallel a no-op while the
    call runs, put back after); another size is refused naming both. The launched Trainers:
    tests/test_examples_launched.py."""
    import torch.distributed as tdist
    from deepspeed import comm as ds_dist
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as pss

    monkeypatch.setattr(ds_dist, "is_initialized", lambda: False)
    monkeypatch.setattr(tdist, "is_initialized", lambda: False)
    with pytest.raises(ConfigError, match=r"deepspeed --num_gpus 2 script.py, or torchrun --nproc_per_node 2"):
        integration.ensure_deepspeed_comm(2)
    integration.ensure_deepspeed_comm(1)  # one process without SP: nothing to start
    monkeypatch.setattr(pss, "_SEQUENCE_PARALLEL_GROUP", object())  # an earlier Trainer's groups, of size 2
    monkeypatch.setattr(pss, "get_sequence_parallel_world_size", lambda: 2)
    original = pss.initialize_sequence_parallel
    with integration._reusing_sp_groups(2):
        assert pss.initialize_sequence_parallel(sequence_parallel_size=2) is None  # reused: no new groups
    assert pss.initialize_sequence_parallel is original
    with pytest.raises(ConfigError, match=r"already built sequence-parallel groups of size 2.*use sp_size=2"):
        with integration._reusing_sp_groups(4):
            pass
    assert pss.initialize_sequence_parallel is original


def test_sp_without_wiring_is_refused():
    lc_cfg = {"sequence_parallel_size": 2, "long_context": {}}
    with pytest.raises(ConfigError, match=r"ParallelismConfig\(sp_backend='deepspeed', sp_size=2\)"):
        integration.check_sp_wiring(lc_cfg, None, from_accelerate=True)
    integration.check_sp_wiring(lc_cfg, None, from_accelerate=False)  # ds_longctx shards (its loader)
    integration.check_sp_wiring(lc_cfg, SPMpu(2), from_accelerate=True)  # Accelerate's ALST wiring
    with pytest.raises(ConfigError, match="no 'long_context' section and no mpu"):
        integration.check_sp_wiring({"sequence_parallel_size": 2}, None, from_accelerate=False)
    integration.check_sp_wiring({"sequence_parallel_size": 1}, None, from_accelerate=True)


def test_active_stack_line_names_every_piece():
    """The rank-0 line of initialize states what the spec resolved: the fused path and why ('auto'), the kept
    layers, the shard counts."""
    from arch_cases import arch_config

    from ds_longctx.dist.layout import Layout
    from ds_longctx.patching.spec import build_spec

    cfg = json.load(open(os.path.join(ROOT, "ds_configs", "tiny-cpu.json")))
    del cfg["long_context"]["attention"]["fuse_projections"]  # the default: 'auto'
    cfg["long_context"]["activation_checkpointing"].update(keep_on_device=1, keep_attention_output=1)
    lc = parse(cfg)
    for model_config, path in ((tiny_config(), "fused projections (fuse_projections 'auto': ds_longctx.models fuses "
                                               "llama)"),
                               (arch_config("gemma3"), "attention-function level (fuse_projections 'auto': "
                                                       "ds_longctx.models has no fused path for gemma3_text)")):
        spec = build_spec(lc, model_config, Layout(world=4, sp=2, zero_stage=3, grad_scale=2.0))
        line = compat.active_stack_line(spec)
        for part in ("SP 2 x DP 2", f"attention=untied_ulysses(heads_per_chunk=1, {path})", "kernel=auto",
                     "checkpointing=on offload=cpu pinned keep_on_device=1 keep_attention_output=1 layers",
                     "tiled_mlp=on(shards=auto)", "tiled_loss=on(shards=auto)", "rms_norm=memory-efficient",
                     "zero_stage=3", "grad_scale=2", "sequence_length=512"):
            assert part in line, (part, line)


def test_5m_config_is_the_design_card_alias():
    a = json.load(open(os.path.join(ROOT, "ds_configs", "5m.json")))
    assert a == json.load(open(os.path.join(ROOT, "ds_configs", "llama3-8b-5m.json")))
    assert a["long_context"]["sequence_length"] >= 5_000_000


def test_train_refuses_an_8b_config_with_the_tiny_preset():
    from ds_longctx.models import loading
    from ds_longctx.train import loop as train_loop
    from ds_longctx.config import shipped

    with pytest.raises(ConfigError, match=r"--model .*--model-config") as e:
        train_loop.main(["--deepspeed_config", os.path.join(ROOT, "ds_configs", "5m.json")])
    assert "max_position_embeddings" in str(e.value) and "tiny default preset" in str(e.value)
    cfg = loading.load_model_config(shipped.default_model_config())
    compat.check_model_scale(parse(json.load(open(os.path.join(ROOT, "ds_configs", "tiny-cpu.json")))), cfg, 512)
    big = loading.load_model_config(os.path.join(ROOT, "ds_configs", "models", "llama3-8b.json"))
    compat.check_model_scale(parse(json.load(open(os.path.join(ROOT, "ds_configs", "5m.json")))), big,
                             parse(json.load(open(os.path.join(ROOT, "ds_configs", "5m.json")))).sequence_length,
                             "--model-config ds_configs/models/llama3-8b.json")


def test_repeated_third_party_warnings_are_shown_once_by_rank_0():
    """DeepSpeed's accelerator warning and torch's deprecated-collective FutureWarnings: rank 0 shows each once,
    however often DeepSpeed repeats it and resets the warning filters; the other ranks show none; every other
    warning passes. (Installed at import: compat.quiet_repeated_warnings; this drives fresh instances.)"""
    import logging
    import warnings

    for rank, want in ((0, 1), (1, 0)):
        shown = []
        quiet = compat._Repeats(rank, lambda message, *a, **k: shown.append(str(message)))
        text = "`torch.distributed.all_gather_into_tensor` is deprecated. Please use ..."
        for _ in range(3):
            warnings.resetwarnings()  # what re-arms Python's own "once"
            quiet.showwarning(FutureWarning(text), FutureWarning, "c10d_logger.py", 83)
        quiet.showwarning(UserWarning("something else"), UserWarning, "x.py", 1)
        assert shown == [text] * want + ["something else"], (rank, shown)
        record = logging.LogRecord("DeepSpeed", logging.WARNING, "real_accelerator.py", 213,
                                   "Setting accelerator to CPU. If you have GPU ...", (), None)
        assert [quiet.filter(record) for _ in range(2)] == [True] * want + [False] * (2 - want)
        other = logging.LogRecord("DeepSpeed", logging.WARNING, "engine.py", 1, "untested optimizer", (), None)
        assert quiet.filter(other) and quiet.filter(other)
    assert logging.getLogger("DeepSpeed").filters and compat._QUIET  # installed at import


def test_an_sp_degree_past_the_head_count_is_not_called_a_larger_model():
    """Issue 52 (with issue 47's ring): SP above the model's heads is not "a config sized for a larger model": with
    attention.ring_degree 'auto' a ring runs it, and with ring_degree 1 the head-count check names the counts and
    the ring degrees that work (tests/test_initialize_errors.py); check_model_scale says nothing of it."""
    from ds_longctx.models import loading
    from ds_longctx.config import shipped

    cfg = loading.load_model_config(shipped.default_model_config())
    lc = json.load(open(os.path.join(ROOT, "ds_configs", "tiny-cpu.json")))
    compat.check_model_scale(parse(dict(lc, sequence_parallel_size=2 * cfg.num_attention_heads)), cfg, 512)
    with pytest.raises(ConfigError, match=r"sized for a larger model .*max_position_embeddings"):  # still refused
        compat.check_model_scale(parse(dict(lc, sequence_parallel_size=2 * cfg.num_attention_heads)), cfg,
                                 4 * cfg.max_position_embeddings)
