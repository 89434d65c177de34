"""Issue 37, "through the HF Trainer + enable()": the families of the issue trained by transformers' Trainer with
``ds_longctx.enable()`` at SP=2 (ZeRO-3, the memory stack: checkpointing offloaded, tiled MLP and loss, RMSNorm), in
ONE spawn one after the other, equal to one process (per-step losses and SGD parameter deltas): Llama 4 (chunks shorter
than the sample; its MLP untiled: Llama4TextMLP is refused by tiled_mlp) under 'ulysses', DeepSeek-V3 (MLA; MoE blocks
tiled, the router's auxiliary loss on) under untied."""
import math

import pytest
import torch

from arch_cases import VOCAB

STEPS, LR, SEQ, SAMPLES = 2, 0.05, 16, 2


def _build(name: str):
    """The family's tiny random-init model (seed 0)."""
    if name == "llama4_text":
        from chunked_cases import build_llama4

        return build_llama4(0)
    if name == "deepseek_v3":
        from moe_cases import AUX, build_moe

        return build_moe("deepseek_v3", 0, **AUX)
    raise KeyError(name)


# GPT-OSS (sinks) is not among them: Accelerate refuses its flex_attention for SP itself (DeepSpeedSequenceParallel
# Config: "'eager' and 'flex_attention' are not supported"), before ds_longctx sees it; through ds_longctx.initialize
# it trains (tests/test_sinks_sp.py)
# Gemma 4 is not among them yet: through the Trainer at SP=2 ('ulysses', the example's stack) its losses equal one
# process but its embed_tokens deltas do not (8.5e-5 off at lr 0.05 on 132 of 2048 entries, 2026-11-28; through
# ds_longctx.initialize it is exact, tests/test_gemma4_sp.py): open, reported to the lead
FAMILIES = {"llama4_text": "ulysses", "deepseek_v3": "untied_ulysses"}


def _worker(rank, world):
    from eco_cases import ProcessState  # (puts examples/ on sys.path)
    import hf_trainer

    out = {}
    for name, impl in FAMILIES.items():
        state = ProcessState()
        hf_trainer.tiny_model = lambda seed=0, name=name: _build(name)
        config = hf_trainer.ds_config(2, impl)
        if name == "llama4_text":  # Llama4TextMLP is not one tiled_mlp knows (refused by name): untiled
            config["long_context"]["tiled_mlp"] = {"enabled": False}
        out[name] = hf_trainer.train(sp=2, attention=impl, record_params=True, steps=STEPS, seq_len=SEQ,
                                     samples=SAMPLES, sample_order=list(range(SAMPLES)), lr=LR, config=config,
                                     output_dir=f"/tmp/ds_longctx_test_trainer_families{rank}")
        state.reset()  # the next Trainer starts as in a fresh process
    return out


def _reference(name: str):
    """One process, no Trainer: SGD(LR) on the example's samples in order (the Trainer's steps at SP=1)."""
    import eco_cases  # noqa: F401  (puts examples/ on sys.path)
    from _common import RandomTokens

    model = _build(name).train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    data, losses = RandomTokens(SAMPLES, SEQ, VOCAB, seed=0), []
    for i in range(STEPS):
        loss = model(input_ids=data[i]["input_ids"][None], labels=data[i]["labels"][None], use_cache=False).loss
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= LR * p.grad
                    p.grad = None
    return losses, {n: p.detach() - before[n] for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def trained():
    from dist_utils import run_distributed

    return run_distributed(_worker, 2)


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_trainer_with_enable_equals_one_process(name, trained):
    losses, deltas = _reference(name)
    assert max(float(d.abs().max()) for d in deltas.values()) > 0
    for rank_out in trained:
        got = rank_out[name]
        print(name, got["losses"], losses)
        assert len(got["losses"]) == STEPS
        for a, b in zip(got["losses"], losses):
            assert math.isclose(a, b, rel_tol=1e-5), (name, got["losses"], losses)
        for n, ref in deltas.items():
            torch.testing.assert_close(got["after"][n] - got["before"][n], ref, rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"{name} {n}: {m}")
