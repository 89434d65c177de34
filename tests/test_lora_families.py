"""PEFT LoRA on the 2026 families under SP (issue 37 item 6): the adapters run on every path ds_longctx takes.

Each family's SP path (the hybrids' mixers of attention/mixers.py, MLA under ulysses and untied's function level,
Gemma 4's per-layer shapes, Llama 4's chunks, GPT-OSS's sinks, the MoE blocks under the tiled MLP) calls the
projection modules, so a ``peft`` ``lora.Linear`` there runs its adapters. Here: a LoRA-wrapped tiny model of each
family (r=4 on the mixer / attention projections it has and an MLP linear, lora_B non-zero) trained two SGD steps
at SP=2, ZeRO-3, through ``ds_longctx.initialize`` equals the same PeftModel trained in one process without
ds_longctx (losses and the LoRA parameters' deltas). The one thing the mixers read directly, the depthwise conv's
weight, is refused when a PEFT layer wraps it (models/adapters.py ``read_weight_problem``).
"""
from __future__ import annotations

import functools
import math

import pytest
import torch

from dist_utils import result_or_raise, run_distributed_side_by_side

LR = 0.1
ULYSSES = {"attention": {"implementation": "ulysses"}}
UNTIED = {"attention": {"implementation": "untied_ulysses", "heads_per_chunk": 1, "fuse_projections": False}}
STACK = {"activation_checkpointing": {"enabled": True, "offload": "cpu", "pin_memory": False},
         "tiled_mlp": {"enabled": True, "shards": 2}, "tiled_loss": {"enabled": True, "shards": 2}}
PATHS = {"ulysses": ULYSSES, "untied": UNTIED, "untied+stack": {**UNTIED, **STACK}, "ulysses+stack": {**ULYSSES, **STACK}}

# (peft itself refuses out_proj and conv1d on falcon_h1 and nemotron_h, its "Mamba-based" model types)
# family -> (LoRA target modules: the mixer's and attention's projections it has, an MLP linear; SP path; packed
# second step: the one-process reference is HF's own forward with position_ids, which masks packed documents for
# these (the hybrids' torch cores and GPT-OSS ignore them: their packed equality is test_hybrid's / test_sinks_sp's))
FAMILIES = {
    "qwen3_5": (["in_proj_qkv", "in_proj_z", "in_proj_b", "out_proj", "q_proj", "o_proj", "down_proj"],
                "untied+stack", False),
    "qwen3_next": (["in_proj_qkvz", "in_proj_ba", "out_proj", "q_proj", "v_proj", "down_proj"], "untied+stack", False),
    "kimi_linear": (["q_proj", "k_proj", "v_proj", "g_b_proj", "b_proj", "o_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                     "down_proj"], "untied", False),  # KDA, and MLA at untied's function level
    # (MLA under 'ulysses' calls the same projection modules as untied's function level: not repeated here)
    "falcon_h1": (["in_proj", "q_proj", "o_proj", "down_proj"], "ulysses", False),
    "granitemoehybrid": (["in_proj", "out_proj", "q_proj", "o_proj", "input_linear", "output_linear"],
                         "untied+stack", False),
    "bamba": (["in_proj", "out_proj", "q_proj", "down_proj"], "untied", False),
    "nemotron_h": (["in_proj", "k_proj", "down_proj"], "ulysses", False),
    "lfm2": (["in_proj", "out_proj", "q_proj", "w2"], "ulysses", False),
    "minimax": (["qkv_proj", "output_gate", "out_proj", "q_proj", "o_proj"], "ulysses", False),
    "deepseek_v3": (["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "down_proj"], "untied+stack", True),
    "gemma4": (["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"], "untied", True),
    "llama4": (["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"], "untied", True),
    "gpt_oss": (["q_proj", "k_proj", "v_proj", "o_proj"], "untied", False),
}


def _targets(case):
    t = FAMILIES[case][0]
    return t if t is not None else FAMILIES[case.split("@")[0]][0]


def base_model(case: str, sp: bool = False):
    name = case.split("@")[0]
    if name == "deepseek_v3":
        from moe_cases import build_moe

        return build_moe(name)
    if name == "gemma4":
        from gemma4_cases import build_gemma4

        return build_gemma4()
    if name == "llama4":
        from chunked_cases import build_llama4

        return build_llama4()
    if name == "gpt_oss":
        from sink_cases import build_gpt_oss

        return build_gpt_oss(attn="flex_attention" if sp else "eager")
    from test_hybrid import build_hybrid

    return build_hybrid(name)


def lora_model(case: str, sp: bool = False):
    """The family's tiny model with LoRA r=4 on its projections; lora_B random (not PEFT's zeros): the adapters
    change the loss from the first step."""
    from peft import LoraConfig, get_peft_model

    model = base_model(case, sp)
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=_targets(case),
                                            init_lora_weights=False))


def batches(case: str):
    """Two steps: plain, then packed (a 7-token document across the SP=2 shard edge) where the reference masks it."""
    from sp_cases import token_batch

    name = case.split("@")[0]
    vocab = base_model_vocab(name)
    kinds = ("plain", "packed") if FAMILIES[case][2] else ("plain", "plain")
    return [token_batch(k, vocab, 16, (5, 7, 4), seed=i) for i, k in enumerate(kinds)]


def base_model_vocab(name):
    import importlib

    mod = {"deepseek_v3": "moe_cases", "gemma4": "gemma4_cases", "llama4": "chunked_cases",
           "gpt_oss": "sink_cases"}.get(name, "test_hybrid")
    if mod != "test_hybrid":
        mod = "arch_cases"
    return importlib.import_module(mod).VOCAB


def lora_params(model):
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


@functools.lru_cache(maxsize=None)
def reference(case: str):
    """One process, no DeepSpeed, no ds_longctx: the PeftModel, two SGD steps; (losses, LoRA deltas, the first
    loss with the adapters disabled)."""
    model = lora_model(case)
    with torch.no_grad(), model.disable_adapter():
        off = model(**batches(case)[0], use_cache=False).loss.item()
    params = lora_params(model)
    before = {n: p.detach().clone() for n, p in params.items()}
    opt = torch.optim.SGD(params.values(), lr=LR)
    losses = []
    for b in batches(case):
        loss = model(**b, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach() - before[n] for n, p in params.items()}, off


def _worker(rank, world):
    import ds_longctx
    from ds_longctx.dist.comm import sp_group, sp_rank
    from ds_longctx.data import shard_batch
    from sp_cases import ds_config, full_params

    out = {}
    for case in FAMILIES:
        model = lora_model(case, sp=True)
        opt = torch.optim.SGD(list(lora_params(model).values()), lr=LR)
        engine, *_ = ds_longctx.initialize(model=model, optimizer=opt, config=ds_config(3, world, PATHS[FAMILIES[case][1]]))
        before = full_params(engine.module)
        losses = []
        for b in batches(case):
            loss = engine(**shard_batch(b, sp_rank(sp_group()), world), use_cache=False).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        after = full_params(engine.module)
        engine.destroy()
        engine.module._ds_longctx_patch.remove()
        out[case] = (losses, {n: after[n] - before[n] for n in after})
    return out


@pytest.fixture(scope="module")
def sp_results():
    return result_or_raise(run_distributed_side_by_side((_worker, 2))[0])


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(FAMILIES))
def test_lora_family_sp2_equals_one_process(case, sp_results):
    ref_losses, ref_deltas, off = reference(case.split("@")[0])  # (the same model and steps under both paths)
    assert abs(ref_losses[0] - off) > 1e-4, case  # the adapters change the loss: dropping them would show
    assert all(float(d.abs().max()) > 0 for d in ref_deltas.values()), case  # every adapter trains
    for rank_out in sp_results:
        losses, deltas = rank_out[case]
        for step, (a, b) in enumerate(zip(losses, ref_losses)):
            assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6), (case, step, a, b)
        for n, d in deltas.items():
            if n in ref_deltas and case == "gemma4":  # its sharded attention's summation order over two steps:
                # the relative error of the whole delta (test_gemma4_sp's measure), not elementwise
                err = float((d - ref_deltas[n]).norm() / ref_deltas[n].norm())
                assert err < 1e-3, (case, n, err)
            elif n in ref_deltas:
                torch.testing.assert_close(d, ref_deltas[n], rtol=1e-4, atol=1e-6, msg=lambda m: f"{case} {n}: {m}")
            else:  # the frozen base weights stay
                assert float(d.abs().max()) == 0, (case, n)
        assert set(ref_deltas) <= set(deltas)


def test_lora_on_a_mixer_conv_is_refused():
    """The mixers read the depthwise conv's weight directly (this rank's channels): LoRA on the conv (peft allows it
    at a rank that is a multiple of the channels) would never run (transformers 5.24's own forwards of these mixers
    read ``conv.weight`` too: the adapter trains nothing there either); refused at install, naming the module. A
    modules_to_save copy of the conv is what ``.weight`` reads: accepted."""
    from peft import LoraConfig, get_peft_model

    from ds_longctx.config import AttentionConfig, LongContextConfig
    from ds_longctx.errors import ConfigError
    from ds_longctx.dist.layout import Layout
    from ds_longctx.patching.patch import patch_model
    from ds_longctx.patching.spec import build_spec
    from test_hybrid import build_hybrid

    def patch(model):
        lc = LongContextConfig(attention=AttentionConfig(implementation="ulysses"))
        return patch_model(model, build_spec(lc, model.config, Layout(world=1, sp=1, zero_stage=0)))

    ids = {"input_ids": torch.randint(3, 64, (1, 16), generator=torch.Generator().manual_seed(0))}
    for name, conv, r in (("qwen3_5", "conv1d", 64), ("lfm2", "conv", 32), ("bamba", "conv1d", 96)):
        where = r".*\.conv\.conv" if name == "lfm2" else r".*\.conv1d"  # (lfm2's mixer module is named conv too)
        lora = get_peft_model(build_hybrid(name), LoraConfig(r=r, target_modules=where, init_lora_weights=False))
        with pytest.raises(ConfigError, match=rf"model\.layers\.0\.\w+\.{conv} is a PEFT lora Conv1d"):
            patch(lora)
        saved = get_peft_model(build_hybrid(name), LoraConfig(r=4, target_modules=["out_proj"],
                                                              modules_to_save=[where]))
        patch(saved).remove()
