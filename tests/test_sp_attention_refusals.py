"""Attention the SP paths would compute differently is refused (issue 19), with a fix that does not lead to
wrong training: bidirectional models, flex_attention under untied, a named kernel
that cannot apply a layer's sliding window, custom 4-D masks. Sliding windows themselves are applied
(tests/test_sp_windows.py) and pass the checks. Pure checks and SP=1 forwards in one process; real
transformers configs and tiny models."""
import pytest
import torch

from eco_cases import config_error

SMALL = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_hidden_layers=2,
             vocab_size=64, intermediate_size=48, max_position_embeddings=256, tie_word_embeddings=False)


def _lc(impl, sp=2, seq=None, **extra):
    from ds_longctx.config import parse

    section = {"attention": {"implementation": impl}, **extra}
    if seq is not None:
        section["sequence_length"] = seq
    return parse({"sequence_parallel_size": sp, "long_context": section})


def _check(impl, cfg, sp=2, seq=None, attn="sdpa"):
    from ds_longctx.patching.checks import check_against

    cfg._attn_implementation = attn
    return config_error(check_against, _lc(impl, sp, seq), cfg, sp)


def _gemma3(**kw):
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(**SMALL, sliding_window=8, **kw)  # default pattern: layers 0 and 1 slide


@pytest.mark.parametrize("impl", ["ulysses", "untied_ulysses"])
def test_sliding_windows_pass_the_sp_check(impl):
    """Windows are applied on the gathered sequence now (tests/test_sp_windows.py): no refusal, whatever the
    model's way of declaring them, with or without sequence_length."""
    from transformers import Gemma2Config, MistralConfig, Qwen2Config

    assert _check(impl, _gemma3(), seq=32) is None
    assert _check(impl, Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=16, max_window_layers=1),
                  seq=64) is None
    assert _check(impl, Gemma2Config(**{**SMALL, "num_hidden_layers": 4}, sliding_window=16), seq=64) is None
    assert _check(impl, MistralConfig(**SMALL, sliding_window=4096)) is None


def _llama4(chunk=8):
    from transformers import Llama4TextConfig

    return Llama4TextConfig(**{**SMALL, "num_hidden_layers": 4}, attention_chunk_size=chunk)


def test_chunked_passes_and_bidirectional_still_refused():
    """Chunked attention (Llama4: layers 0-2) runs as documents cut at every chunk on both SP paths (issue 37:
    tests/test_chunked_sp.py), whatever the chunk vs the sample; bidirectional models are not what they compute."""
    for impl in ("ulysses", "untied_ulysses"):
        assert _check(impl, _llama4(), seq=32) is None
        assert _check(impl, _llama4()) is None
        assert _check(impl, _llama4(), seq=8) is None
        assert "bidirectionally" in _check(impl, _gemma3(use_bidirectional_attention=True), seq=8)
    assert _check("ulysses", _llama4(), sp=1, seq=32) is None
    assert _check("untied_ulysses", _llama4(), sp=1, seq=32) is None


def test_flex_attention_refused_under_untied_only():
    """'ulysses' runs flex_attention models causal (tests/test_sp_windows.py); untied's install would get the
    shard's BlockMask."""
    from transformers import LlamaConfig

    e = _check("untied_ulysses", LlamaConfig(**SMALL), attn="flex_attention")
    assert e.startswith("model.config._attn_implementation") and "flex_attention" in e and "sdpa" in e.split("Fix:")[1]
    assert _check("ulysses", LlamaConfig(**SMALL), attn="flex_attention") is None
    assert _check("ulysses", LlamaConfig(**SMALL), sp=1, attn="flex_attention") is None


def test_gemma3_tiled_mlp_and_windows_under_sp():
    """Gemma3's MLP is tiled (models/gemma.py; it used to be refused, with a fix leading to the window case):
    at SP=1 on 'none' the stack applies, and under SP its windows pass the check (they are applied)."""
    from transformers import AutoModelForCausalLM

    from tiny_models import patch

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_gemma3(), attn_implementation="sdpa")
    handle = patch(model, _lc("none", sp=1, tiled_mlp={"enabled": True}))
    assert len(handle.memory.tiled_mlps) == 2
    handle.remove()
    assert _check("ulysses", _gemma3(), seq=32) is None


def _tiny(cfg):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")


@pytest.mark.parametrize("fuse", [True, False])
def test_untied_kernel_without_windows_names_the_layer(fuse):
    """A named kernel that cannot apply the window ('sdpa': torch's flash op) is refused at the windowed layer's
    forward, naming it and the fix; with the fix ('auto') the loss is HF's."""
    from transformers import MistralConfig

    from tiny_models import patch

    model = _tiny(MistralConfig(**SMALL, sliding_window=8))
    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(input_ids=ids, labels=ids).loss
    for kernel in ("sdpa", "auto"):
        lc = _lc("untied_ulysses", sp=1, attention={"implementation": "untied_ulysses", "heads_per_chunk": 1,
                                                    "fuse_projections": fuse, "kernel": kernel})
        handle = patch(model, lc)
        try:
            with torch.no_grad():
                e = config_error(lambda: model(input_ids=ids, labels=ids))
                got = model(input_ids=ids, labels=ids).loss if e is None else None
        finally:
            handle.remove()
        if kernel == "sdpa":
            assert e is not None and e.startswith("long_context.attention.kernel")
            assert "layer 0 has a sliding window of 8 tokens" in e and "'auto'" in e.split("Fix:")[1]
        else:
            assert e is None
            torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


def _prefix_lm_mask(b, s, prefix):
    allowed = torch.ones(s, s, dtype=torch.bool).tril()
    allowed[:prefix, :prefix] = True
    return allowed.expand(b, 1, s, s).clone()


def test_custom_4d_mask_refused_without_drop_advice():
    from ds_longctx.data import shard_batch

    ids = torch.randint(0, 64, (1, 16))
    mask = _prefix_lm_mask(1, 16, 6)
    e = config_error(shard_batch, {"input_ids": ids, "attention_mask": mask}, 0, 2)
    assert e.startswith("batch.attention_mask") and "custom 4-D masks are not supported under sequence parallelism" in e
    fix = e.split("Fix:")[1]
    assert "position_ids restarting at 0" in fix and "drop" not in fix and "no mask" not in fix


def test_custom_4d_mask_at_sp1_none_is_hf_exact():
    """The refusal's fix: at SP=1 with implementation 'none' the full batch's custom mask reaches
    transformers, and the loss equals the unpatched model's."""
    from transformers import LlamaConfig

    from tiny_models import patch

    model = _tiny(LlamaConfig(**SMALL))
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    mask = _prefix_lm_mask(2, 16, 6)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        causal = model(input_ids=ids, labels=ids).loss
    assert abs(ref.item() - causal.item()) > 1e-4  # the mask matters
    handle = patch(model, _lc("none", sp=1))
    try:
        with torch.no_grad():
            got = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    finally:
        handle.remove()
    handle = patch(model, _lc("untied_ulysses", sp=1, attention={"implementation": "untied_ulysses",
                                                                       "heads_per_chunk": 1}))
    try:  # our own attention (untied, even at SP=1) cannot apply it: refused, not dropped
        e = config_error(lambda: model(input_ids=ids, attention_mask=mask, labels=ids))
        assert e is not None and "custom 4-D masks are not supported" in e
    finally:
        handle.remove()


def _sp2_worker(rank, world):
    """Each case must be a ConfigError on every rank, before any collective (else the other rank hangs)."""
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig

    import ds_longctx
    from ds_longctx.dist import comm
    from ds_longctx.data import shard_batch
    from tiny_models import patch
    from sp_cases import ds_config

    out = {}
    ulysses = {"attention": {"implementation": "ulysses"}}
    # initialize: a bidirectional model refused by the config check, on every rank
    bidi = Gemma3TextConfig(**SMALL, sliding_window=8, use_bidirectional_attention=True)
    out["initialize"] = config_error(ds_longctx.initialize, model=_tiny(bidi), config=ds_config(0, 2, ulysses),
                                     model_parameters=None)
    comm.initialize_groups(2)
    group = comm.sp_group()
    lc = _lc("ulysses", sp=2)
    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(0))
    shard = shard_batch({"input_ids": ids}, rank, 2)
    shard.pop("doc_cu_seqlens", None)
    # patch_model directly (no config check): a kernel without windows is refused at the windowed layer
    model = _tiny(MistralConfig(**SMALL, sliding_window=8))
    untied_sdpa = _lc("untied_ulysses", sp=2, attention={"implementation": "untied_ulysses", "heads_per_chunk": 1,
                                                         "kernel": "sdpa"})
    handle = patch(model, untied_sdpa, group)
    out["runtime_window"] = config_error(lambda: model(**shard))
    handle.remove()
    # a hand-cut shard with a custom 4-D mask (was a raw RuntimeError in the contiguity check)
    model = _tiny(LlamaConfig(**SMALL))
    handle = patch(model, lc, group)
    mask = _prefix_lm_mask(1, 8, 3)
    out["mask_4d"] = config_error(lambda: model(**shard, attention_mask=mask))
    out["ok_loss"] = model(**shard).loss.item()  # and the plain shard still trains
    handle.remove()
    flex = _tiny(LlamaConfig(**SMALL))
    flex.config._attn_implementation = "flex_attention"
    out["flex"] = config_error(patch, flex, _lc("untied_ulysses", sp=2), group)
    # GPT-OSS: windows and attention sinks (s_aux) run under 'ulysses' (issue 37: tests/test_sinks_sp.py, exact)
    from transformers import AutoModelForCausalLM, GptOssConfig

    torch.manual_seed(0)
    oss = AutoModelForCausalLM.from_config(GptOssConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2,
                                                        sliding_window=4), attn_implementation="flex_attention")
    handle = patch(oss, lc, group)
    out["sinks"] = config_error(lambda: oss(**shard))
    handle.remove()
    return out


@pytest.mark.distributed
def test_refusals_at_sp2_on_every_rank():
    from dist_utils import run_distributed

    for out in run_distributed(_sp2_worker, 2):
        assert "attends bidirectionally" in out["initialize"], out["initialize"]
        assert "layer 0 has a sliding window of 8 tokens" in out["runtime_window"], out["runtime_window"]
        assert "kernel 'sdpa_cpu_flash' ('sdpa') cannot apply" in out["runtime_window"]
        assert out["mask_4d"] is not None and "custom 4-D masks are not supported" in out["mask_4d"]
        assert out["flex"] is not None and "flex_attention" in out["flex"]
        assert out["sinks"] is None, out["sinks"]
        assert out["ok_loss"] > 0
