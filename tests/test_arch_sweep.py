"""A fast subset of tools/arch_sweep.py (the whole sweep: every transformers causal-LM type, about a minute):
each architecture through ds_longctx at SP=1 with the full memory stack equals transformers' own loss and
gradients, or is refused clearly and, where the refusal's fix switches a memory feature off, the fixed run is
exact. llama4_text was a raw AttributeError (its get_decoder() is the CausalLM itself)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import arch_sweep  # noqa: E402

CASES = {  # type -> (full stack, after the fixes)
    "llama4_text": ("exact", "exact"),     # its MoE block tiled (experts stacked in 3-D parameters, probed)
    "granite": ("exact", "exact"),         # logits_scaling kept; its MLP tiled (LlamaMLP's forward)
    "cohere": ("exact", "exact"),          # logit_scale kept; its MLP tiled (LlamaMLP's forward)
    "ctrl": ("refused", "exact"),          # no GradientCheckpointingLayer: checkpointing off, then tiled MLP off
    "mixtral": ("exact", "exact"),
    "bart": ("refused", "refused"),        # its own loss_fct: refused clearly
}


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_architecture_is_exact_or_refused(model_type):
    results = arch_sweep.main(["--only", model_type, "--out", ""])
    row = results[model_type]
    assert (row["full_stack"][0], row["final"]) == CASES[model_type], row
    if row["final"] == "exact":
        last = row["after_fixes"][-1][2] if row.get("after_fixes") else row["full_stack"][1]
        assert last["of_tolerance"] <= 1.0, last  # every element within the one "exact" (arch_sweep.EXACT_*)


# the families fuse_projections true refused ("set fuse_projections false", then exact): with the default 'auto'
# they run function level with no extra key
AUTO_FUNCTION_LEVEL = ("gemma3_text", "mixtral", "cohere2", "granite", "starcoder2", "smollm3", "olmo3", "phi")


@pytest.mark.parametrize("model_type", AUTO_FUNCTION_LEVEL)
def test_untied_attention_runs_other_families_with_no_extra_key(model_type):
    from ds_longctx.config import parse
    from ds_longctx.patching.spec import build_spec

    lc = parse({"long_context": {"attention": {"implementation": "untied_ulysses"}}})
    assert lc.attention.fuse_projections == "auto"
    assert build_spec(lc, arch_sweep.tiny_config(model_type)).fused is False  # function level
    status, detail = arch_sweep.run_one(model_type, {}, attention="untied")
    assert status == "exact", (status, detail)


UNTIED_CASES = {  # ds_longctx's own attention (untied, fuse_projections 'auto'): type -> (full stack, after fixes)
    "mistral": ("exact", "exact"),         # in ds_longctx.models: HF gets the 4-D no-mask
    "opt": ("refused", "exact"),           # reads the 2-D mask for its positions: keeps HF's own mask
    "doge": ("refused", "refused"),        # keeps its own attention table: our attention would never run
    "ctrl": ("refused", "exact"),          # key biases' gradients vanish in exact arithmetic (noise in both runs)
    "roberta": ("refused", "refused"),     # built bidirectional (is_decoder=False): refused at patch time
    "gemma4_unified_text": ("refused", "refused"),  # bidirectional attention (its per-layer shapes are read)
}


@pytest.mark.parametrize("model_type", sorted(UNTIED_CASES))
def test_architecture_under_our_attention_is_exact_or_refused(model_type):
    results = arch_sweep.main(["--only", model_type, "--out", "", "--attention", "untied"])
    row = results[model_type]
    assert (row["full_stack"][0], row["final"]) == UNTIED_CASES[model_type], row


SP2_CASES = {  # at SP=2 (two processes, gloo): type -> (attention, final)
    "llama": ("ulysses", "exact"),
    "qwen3_next": ("ulysses", "exact"),     # Gated DeltaNet layers split by heads (its MoE block: tiled MLP refused)
    "jamba": ("untied", "refused"),         # Mamba layers see only their shard: refused, not trained wrong
    "doge": ("ulysses", "refused"),         # its own attention table (was trained on local shards, silently)
    "deepseek_v2": ("untied", "exact"),     # multi-head latent attention (was a gloo size mismatch, then refused)
    "ctrl": ("ulysses", "exact"),           # no position_ids in its attention call: supplied (the shard's indices)
    "gpt2": ("ulysses", "exact"),           # reshapes the attention output by its last two dims (was a raw error)
    "qwen3_moe": ("untied", "exact"),       # whole stack: its MoE block tiled (per-token routing), HF's no-mask
}


@pytest.mark.distributed
def test_architectures_at_sp2_are_exact_or_refused():
    rows = {}
    for attention in ("ulysses", "untied"):
        types = ",".join(t for t, (a, _) in SP2_CASES.items() if a == attention)
        results = arch_sweep.main(["--only", types, "--out", "", "--attention", attention,
                                   "--sp", "2"])
        rows.update(results or {})
    got = {t: r["final"] for t, r in rows.items()}
    assert got == {t: f for t, (_, f) in SP2_CASES.items()}, got
    assert rows["qwen3_moe"]["full_stack"][0] == "exact", rows["qwen3_moe"]  # no memory feature switched off


def test_patch_model_directly_refuses_non_attention_layers():
    """A direct patch_model (its spec from spec.build_spec, without initialize): a hybrid model's linear-attention
    layers that ds_longctx does not split by heads would mix only their rank's shard under SP, so they are refused
    when the spec is built, not left to train wrong (Jamba's Mamba); Qwen3-Next's Gated DeltaNet is split by heads
    (tests/test_hybrid.py)."""
    from transformers import AutoModelForCausalLM

    from ds_longctx.config import parse
    from ds_longctx.errors import ConfigError
    from tiny_models import patch

    lc = parse({"sequence_parallel_size": 1, "long_context": {"attention": {"implementation": "untied_ulysses",
                                                                            "fuse_projections": False}}})
    for model_type in ("jamba",):
        model = AutoModelForCausalLM.from_config(arch_sweep.tiny_config(model_type), attn_implementation="sdpa")
        with pytest.raises(ConfigError, match="'linear_attention' layers"):
            patch(model, lc)
    model = AutoModelForCausalLM.from_config(arch_sweep.tiny_config("qwen3_next"), attn_implementation="sdpa")
    assert patch(model, lc).mixers is not None
