"""Three setups that trained silently wrong at 03d311a (issue 35), each now equal to one process:

* PEFT LoRA under the fused untied attention (the default for Llama/Qwen), which read q/k/v/o's base weights and
  dropped the adapters; also under Ulysses, the attention-function level and the whole memory stack, ZeRO-1/2/3,
  SP=2 and SP=4: three SGD steps' losses and parameter deltas (adapters move, the frozen base does not) vs one
  process with the same PeftModel, plain and packed samples; a PeftModel through the HF Trainer at SP=2.
* dynamic and LongRoPE rotary embeddings, which rescaled by the shard's highest position instead of the sequence's
  (llama, qwen3; Ulysses, untied fused and function level; plain and packed).
* Llama 4's NoPE-layer attention temperature, computed from the shard-local token index (floor_scale 8, 64 tokens).

Each feature is shown to change the one-process loss (a test that cannot fail is a defect), and what cannot be
fused is refused or, under fuse_projections 'auto', runs at the attention-function level and says so.
"""
from __future__ import annotations

import logging
import os

import pytest
import torch

import eco_cases  # noqa: F401  (puts examples/ on sys.path: hf_trainer)
from dist_utils import result_or_raise, run_distributed_side_by_side
from sp_cases import ds_config, full_params
from tiny_models import build, tiny_config

SEQ, VOCAB, STEPS = 32, 64, 3
SHAPE = dict(heads=4, kv_heads=2, vocab=VOCAB)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ULYSSES = {"attention": {"implementation": "ulysses"}}
FUSED = {"attention": {"implementation": "untied_ulysses"}}  # fuse_projections 'auto': fused for llama/qwen
FUNCTION = {"attention": {"implementation": "untied_ulysses", "fuse_projections": False}}
STACK = {"attention": {"implementation": "untied_ulysses"},
         "activation_checkpointing": {"enabled": True, "offload": "cpu", "pin_memory": False},
         "tiled_mlp": {"enabled": True, "shards": 2}, "tiled_loss": {"enabled": True, "shards": 2},
         "rms_norm": {"enabled": True}}
PATHS = {"ulysses": ULYSSES, "fused": FUSED, "function": FUNCTION, "stack": STACK}
# initializer_range 0.2: attention sharp enough that the rope type shows in the loss (at 0.02 dynamic moves it 5e-6)
DYNAMIC = dict(max_position_embeddings=24, initializer_range=0.2, rope_parameters={"rope_type": "dynamic", "factor": 4.0,
                                                             "rope_theta": 10000.0})
LONGROPE = dict(max_position_embeddings=96, initializer_range=0.2, rope_parameters={
    "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 24,
    "short_factor": [1.0, 1.1, 1.2, 1.3], "long_factor": [1.0, 2.0, 4.0, 8.0]})
ROPES = {"dynamic": DYNAMIC, "longrope": LONGROPE}


# ---------------------------------------------------------------------------------------------
# models and data (importable by the spawned workers)
# ---------------------------------------------------------------------------------------------


def lora_model(arch="llama", seed=0, dropout=0.0, variant=None, **cfg):
    """A tiny random-init model with LoRA r=4 on every projection; lora_B random (not PEFT's zeros), so the
    adapters change the output from the first step."""
    from peft import LoraConfig, get_peft_model

    model = build(tiny_config(arch, **SHAPE, **cfg), seed=seed)
    torch.manual_seed(seed + 1)
    kw = {"use_dora": True} if variant == "dora" else {}
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=dropout,
                                            init_lora_weights=False, **kw))


def llama4_model(seed=0, floor_scale=8):
    """Llama 4 text: layer 0 chunked RoPE attention (the chunk covers every sample here), layer 1 NoPE full
    attention with temperature tuning; one MoE layer."""
    from transformers import AutoModelForCausalLM, Llama4TextConfig

    cfg = Llama4TextConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                           num_hidden_layers=2, vocab_size=VOCAB, intermediate_size=48, intermediate_size_mlp=48,
                           max_position_embeddings=4096, num_local_experts=2, num_experts_per_tok=1,
                           interleave_moe_layer_step=2, no_rope_layers=[1, 0], attention_chunk_size=4096,
                           floor_scale=floor_scale, attn_scale=0.5, attn_temperature_tuning=True, use_qk_norm=False,
                           tie_word_embeddings=False, rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def model_of(kind, arch="llama", rope=None):
    if kind == "lora":
        return lora_model(arch)
    if kind == "llama4":
        return llama4_model()
    return build(tiny_config(arch, **SHAPE, **ROPES[rope]), seed=0)


def batches(seq=SEQ, packed=False):
    """STEPS samples; packed: documents of 5, 13 and 14 tokens (boundaries inside shards and across the SP=2
    edge at 16), position_ids restarting."""
    out = []
    for i in range(STEPS):
        g = torch.Generator().manual_seed(100 + i)
        ids = torch.randint(0, VOCAB, (1, seq), generator=g)
        labels = ids.clone()
        labels[:, :2] = -100
        b = {"input_ids": ids, "labels": labels}
        if packed:
            lens = [5, 13, seq - 18]
            b["position_ids"] = torch.cat([torch.arange(n) for n in lens])[None]
        out.append(b)
    return out


def reference(kind, arch, rope, packed, seq=SEQ):
    """One process, HF's own forward (packed: HF's packed path from the restarting position_ids): per-step
    losses and the SGD(lr=1) deltas of STEPS steps, by parameter name."""
    model = model_of(kind, arch, rope)
    model.train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    losses = []
    for b in batches(seq, packed):
        loss = model(**b, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach() - before[n] for n, p in model.named_parameters()}


def sp_run(kind, arch, rope, packed, path, stage, seq=SEQ, export_to=None):
    import ds_longctx
    from ds_longctx.dist.comm import sp_group, sp_rank
    from ds_longctx.data import shard_batch
    from ds_longctx.patching.patch import get_patch

    import torch.distributed as dist

    sp = dist.get_world_size()
    model = model_of(kind, arch, rope)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    lc = dict(PATHS[path], sequence_length=seq) if kind == "llama4" else PATHS[path]  # its chunk covers the sample
    engine, _, _, _ = ds_longctx.initialize(model=model, optimizer=opt, config=ds_config(stage, sp, lc))
    before = full_params(engine.module)
    losses = []
    for b in batches(seq, packed):
        loss = engine(**shard_batch(b, sp_rank(sp_group()), sp)).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    after = full_params(engine.module)
    swapped = list(get_patch(engine.module).swapped)
    if export_to is not None and (kind, arch, packed, path, stage) == ("lora", "llama", False, "fused", 3):
        from ds_longctx.job.checkpoint import export_hf

        export_hf(engine, export_dir(export_to, sp), log=lambda *a: None)  # the adapter, in peft's format
    engine.destroy()
    get_patch(engine.module).remove()
    return losses, {n: after[n] - before[n] for n in after}, swapped


def export_dir(root, sp):
    """Where the SP=``sp`` run exports its adapter: under this test run's temporary ``root`` (a fixed path would
    meet the export of an earlier run, which --save-hf refuses to overwrite)."""
    return os.path.join(str(root), f"lora_export_sp{sp}")


# (kind, arch, rope, packed, path, ZeRO stage)
def cases(sp):
    if sp == 4:
        return [("lora", "llama", None, False, "fused", 3), ("lora", "qwen3", None, True, "fused", 1),
                ("lora", "qwen3", None, True, "ulysses", 2)]
    lora = [("lora", "llama", None, False, p, z) for p, z in
            [("ulysses", 3), ("fused", 1), ("fused", 2), ("fused", 3), ("function", 3), ("stack", 3)]]
    lora += [("lora", "qwen3", None, True, "fused", 2), ("lora", "llama", None, True, "stack", 3)]
    # each rope type on each path once, both archs, plain and packed (8 of the 16 combinations: the suite's time)
    rope = [("rope", "llama", "dynamic", False, "ulysses", 1), ("rope", "qwen3", "longrope", False, "ulysses", 1),
            ("rope", "qwen3", "dynamic", False, "fused", 1), ("rope", "llama", "longrope", False, "fused", 1),
            ("rope", "llama", "dynamic", True, "function", 3), ("rope", "qwen3", "longrope", True, "function", 3),
            ("rope", "qwen3", "dynamic", True, "stack", 3), ("rope", "llama", "longrope", True, "stack", 3)]
    llama4 = [("llama4", None, None, packed, "function", 3) for packed in (False, True)]
    return lora + rope + llama4


def _seq(case):
    return 64 if case[0] == "llama4" else SEQ


def _worker(rank, world, cs, export_to):
    out = {}
    for c in cs:
        kind, arch, rope, packed, path, stage = c
        try:
            out[c] = sp_run(kind, arch, rope, packed, path, stage, _seq(c), export_to=export_to)
        except Exception as e:  # reported per case (the parent shows each failure on its own)
            import traceback

            out[c] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
    return out


def _trainer(rank, world):
    """A PeftModel (LoRA) handed to the HF Trainer + enable(): SP=2 with untied attention and the memory stack at
    ZeRO-3 (examples/hf_trainer.py), or the one-process reference without ds_longctx."""
    import hf_trainer

    sp = world
    return hf_trainer.train(sp=sp, use_ds_longctx=sp > 1, lora=True, record_params=True, steps=STEPS,
                            output_dir=f"/tmp/ds_longctx_test_lora_trainer_{sp}_{rank}")


@pytest.fixture(scope="module")
def sp_results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("lora_export"))
    runs = run_distributed_side_by_side(*[(_worker, sp, cases(sp), root) for sp in (2, 4)], (_trainer, 2),
                                        (_trainer, 1), return_exceptions=True)
    return dict(zip((2, 4, "trainer", "trainer_ref", "export_root"), runs + [root]))


def _all_cases():
    return [(sp, c) for sp in (2, 4) for c in cases(sp)]


@pytest.mark.distributed
@pytest.mark.parametrize("sp,case", _all_cases(), ids=lambda v: "-".join(map(str, v)) if isinstance(v, tuple) else
                         f"sp{v}")
def test_equals_one_process(sp, case, sp_results):
    kind, arch, rope, packed, path, stage = case
    got = result_or_raise(sp_results[sp])[0][case]
    assert not isinstance(got, str), got
    losses, deltas, swapped = got
    ref_losses, ref_deltas = reference(kind, arch, rope, packed, _seq(case))
    if kind == "rope":
        assert any(s.startswith("rope=scaled by the SP group's") for s in swapped), swapped
    if kind == "lora" and path in ("fused", "stack"):
        # fused at ZeRO-1/2; at ZeRO-3 'auto' runs the attention-function level and says why
        said = " ".join(swapped)
        if stage == 3:
            assert "attention-function level (fuse_projections 'auto': " in said and "ZeRO-3" in said, swapped
        else:
            assert "fused projections" in said, swapped
    # summation order differs (sharded attention, LoRA's merged weight, tiles) and three SGD(lr=1) steps compound
    # it: 1e-5 of the loss, 1e-4 of each delta's largest entry (the bugs fixed here moved deltas by 0.1-1 of it)
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (i, losses, ref_losses, swapped)
    assert set(deltas) == set(ref_deltas)
    for n, ref in ref_deltas.items():
        d = deltas[n]
        if kind == "lora" and "lora_" not in n:
            # the frozen base: not moved at all, on any path
            assert torch.equal(d, torch.zeros_like(d)), (n, d.abs().max())
            continue
        scale = ref.abs().max().item()
        assert scale > 0 or kind != "lora", n  # every adapter trains
        err = (d - ref).abs().max().item()
        assert err <= 1e-4 * max(scale, 1e-3), (n, err, scale, swapped)


@pytest.mark.distributed
@pytest.mark.parametrize("sp", [2, 4])
def test_exported_adapter_loads_with_peft(sp, sp_results):
    """export_hf of the fused ZeRO-3 LoRA run writes peft's adapter directory: PeftModel.from_pretrained on the
    base model gives the trained adapters (the initial ones plus the one-process deltas)."""
    from peft import PeftModel

    result_or_raise(sp_results[sp])
    _, ref_deltas = reference("lora", "llama", None, False)
    init = dict(lora_model().named_parameters())
    loaded = PeftModel.from_pretrained(build(tiny_config("llama", **SHAPE), seed=0),
                                       export_dir(sp_results["export_root"], sp))
    got = dict(loaded.named_parameters())
    lora = [n for n in init if "lora_" in n]
    assert lora and set(init) == set(got)
    for n in lora:
        err = (got[n] - init[n] - ref_deltas[n]).abs().max().item()
        assert err <= 1e-4 * ref_deltas[n].abs().max().item(), (n, err)


@pytest.mark.distributed
def test_peft_model_through_the_trainer(sp_results):
    """The usual LoRA setup (a PeftModel to the Trainer) at SP=2, ZeRO-3, untied + memory stack: per-step losses
    and parameter deltas equal the one-process Trainer's; the adapters move, the base does not."""
    got = result_or_raise(sp_results["trainer"])[0]
    ref = result_or_raise(sp_results["trainer_ref"])[0]
    assert len(got["losses"]) == STEPS
    for a, b in zip(got["losses"], ref["losses"]):
        assert abs(a - b) <= 2e-6 * max(1.0, abs(b)), (got["losses"], ref["losses"])
    assert set(got["after"]) == set(ref["after"])
    moved = 0
    for n in ref["after"]:
        d, r = got["after"][n] - got["before"][n], ref["after"][n] - ref["before"][n]
        if "lora_" not in n:
            assert torch.equal(d, torch.zeros_like(d)), n
            continue
        moved += int(r.abs().max() > 0)
        torch.testing.assert_close(d, r, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
    assert moved > 0


# ---------------------------------------------------------------------------------------------
# one process: the features change the loss (these tests can fail), and what the fused path cannot apply
# ---------------------------------------------------------------------------------------------


def test_features_change_the_one_process_loss():
    ids = batches()[0]
    lora = lora_model()
    with_adapters = lora(**ids).loss.item()
    with lora.disable_adapter():
        without = lora(**ids).loss.item()
    assert abs(with_adapters - without) > 1e-3
    plain = build(tiny_config("llama", **SHAPE, max_position_embeddings=24, initializer_range=0.2),
                  seed=0)(**ids).loss.item()
    for rope in ROPES:
        scaled = model_of("rope", "llama", rope)(**ids).loss.item()
        assert abs(scaled - plain) > 1e-2, rope
    # the first half alone (what SP rank 0 saw) is not scaled: that is the bug the SP=2 cases would show
    m = model_of("rope", "llama", "dynamic")
    half = {k: v[:, :SEQ // 2] for k, v in ids.items()}
    m(**ids)
    inv_full = m.model.rotary_emb.inv_freq.clone()
    m(**half)
    assert not torch.equal(inv_full, m.model.rotary_emb.inv_freq)
    from ds_longctx.models.temperature import temperature_modules

    assert [m.layer_idx for m in temperature_modules(llama4_model())] == [1]  # the NoPE layer (use_rope is 0)
    ids64 = batches(64)[0]
    t8 = llama4_model()(**ids64).loss.item()
    off = llama4_model()
    for mod in off.modules():
        if hasattr(mod, "attn_temperature_tuning"):
            mod.attn_temperature_tuning = False
    assert abs(t8 - off(**ids64).loss.item()) > 1e-6


def _patched(model, fuse, zero_stage=0):
    from ds_longctx.config import AttentionConfig, LongContextConfig
    from ds_longctx.dist.layout import Layout
    from ds_longctx.patching.patch import patch_model
    from ds_longctx.patching.spec import build_spec

    lc = LongContextConfig(attention=AttentionConfig(implementation="untied_ulysses", fuse_projections=fuse))
    return patch_model(model, build_spec(lc, model.config, Layout(world=1, sp=1, zero_stage=zero_stage)))


def test_fused_lora_at_one_process_applies_the_adapters():
    """SP=1, fused path: a PeftModel's loss and adapter grads equal HF's (the adapters run)."""
    ids = batches()[0]
    ref = lora_model()
    ref_loss = ref(**ids).loss
    ref_loss.backward()
    model = lora_model()
    handle = _patched(model, True)
    assert handle.attention.fused
    from ds_longctx.data import shard_batch

    loss = model(**shard_batch(ids, 0, 1)).loss
    loss.backward()
    assert abs(loss.item() - ref_loss.item()) < 1e-6
    grads = dict(model.named_parameters())
    for n, p in ref.named_parameters():
        if "lora_" in n and "self_attn" in n:
            assert p.grad.abs().max() > 0
            torch.testing.assert_close(grads[n].grad, p.grad, rtol=1e-5, atol=1e-6)
    handle.remove()


@pytest.mark.parametrize("what", ["dropout", "dora", "zero3"])
def test_unfusable_adapters_refused_or_function_level(what, caplog):
    from ds_longctx.errors import ConfigError

    kw = {"dropout": 0.1} if what == "dropout" else {"variant": "dora"} if what == "dora" else {}
    stage = 3 if what == "zero3" else 0
    with pytest.raises(ConfigError, match="fuse_projections.*(lora_dropout 0.1|DoRA|under ZeRO-3)"):
        _patched(lora_model(**kw), True, stage)
    with caplog.at_level(logging.WARNING, logger="ds_longctx"):
        handle = _patched(lora_model(**kw), "auto", stage)
    assert not handle.attention.fused and handle.attention.fused_off_because
    assert "attention-function level, not fused" in caplog.text
    assert any("attention-function level (fuse_projections 'auto': " in s for s in handle.swapped), handle.swapped
    handle.remove()


def test_prompt_learning_refused_under_sp():
    from peft import PrefixTuningConfig, get_peft_model

    from ds_longctx.errors import ConfigError
    from ds_longctx.models.adapters import hf_model_of

    model = get_peft_model(build(tiny_config("llama", **SHAPE), seed=0),
                           PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    with pytest.raises(ConfigError, match="virtual tokens"):
        hf_model_of(model, sp=2)


def test_rotary_update_is_recognised():
    from ds_longctx.models.rope import _is_transformers_update, sequence_dependent_rotaries

    m = model_of("rope", "llama", "dynamic")
    [(name, rot)] = sequence_dependent_rotaries(m)
    assert _is_transformers_update(type(rot).forward), name
    assert sequence_dependent_rotaries(build(tiny_config("llama", **SHAPE), seed=0)) == []


def test_position_dependent_code_the_fix_cannot_reach_is_refused():
    """What tools/position_audit.py found beyond the three cases: a rotary forward reading max(position_ids) itself
    (PhiMoE's LongRoPE mscale) and decoders that take no position_ids (BART-style decoders as causal LMs) are
    refused under SP, naming why."""
    from transformers import AutoModelForCausalLM, BartConfig, PhimoeConfig

    from ds_longctx.config import AttentionConfig, LongContextConfig
    from ds_longctx.errors import ConfigError
    from ds_longctx.models.rope import install
    from ds_longctx.patching.patch import _check_model_against

    cfg = PhimoeConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                       vocab_size=VOCAB, intermediate_size=48, num_local_experts=2, num_experts_per_tok=1,
                       max_position_embeddings=64, rope_parameters={
                           "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
                           "short_factor": [1.0] * 4, "long_factor": [2.0] * 4, "short_mscale": 1.0,
                           "long_mscale": 1.3})
    with pytest.raises(ConfigError, match="reads the highest position"):
        install(AutoModelForCausalLM.from_config(cfg))
    bart = AutoModelForCausalLM.from_config(BartConfig(vocab_size=VOCAB, d_model=32, decoder_layers=1, encoder_layers=1,
                                                       decoder_attention_heads=4, encoder_attention_heads=4,
                                                       decoder_ffn_dim=48, encoder_ffn_dim=48, is_decoder=True))
    lc = LongContextConfig(attention=AttentionConfig(implementation="ulysses"))
    with pytest.raises(ConfigError, match="takes no position_ids"):
        _check_model_against(bart, lc, 2)
    _check_model_against(bart, lc, 1)  # one process: its own positions are the sequence's
