"""Issue 37, "through the HF Trainer + enable()": the families of the issue trained by transformers' Trainer with
``ds_longctx.enable()`` at SP=2 and SP=4 (ZeRO-3, the memory stack: checkpointing offloaded, tiled MLP and loss,
RMSNorm), one spawn per degree (side by side), the families one after the other in it, equal to one process (per-step
losses and SGD parameter deltas; the second of the two samples packed: three documents, one crossing the SP shard
edge): Llama 4 (chunks shorter than the sample; its dense Llama4TextMLP tiled), DeepSeek-V3 (MLA; MoE blocks tiled,
the router's auxiliary loss on), Gemma 4 (per-layer head dims and inputs, KV sharing; the example's stack), the
multimodal gemma4 (on text), and GPT-OSS (attention sinks, flex_attention: Accelerate's own refusal of it deferred by
enable() to where ds_longctx runs it); each family under 'ulysses' at one degree and untied at the other (CASES).

Tolerance: per tensor, elementwise (rtol 1e-4, atol 1e-6) against the one-process float32 run; a tensor outside it is
measured against the truth, the one-process run in float64 (the same weights cast; issue 52: no tolerance tuned to one
machine's last bits, as tests/test_gemma4_sp.py): its error (gemma4_cases.tensor_errors' measure) must be within 8x the
float32 rounding of this model and these steps, measured as the largest error of the one-process float32 runs (sdpa
and eager attention) against that truth. Gemma 4's tiny models at lr 0.05 need it: the first SGD step (gradient norm
16.5, against 2.5-4.8 for Llama, Llama 4, DeepSeek-V3, Gemma 2/3) lands where the second step's gradient moves 2.5e-4
(relative) when the step-1 weights move by one ulp (Llama 4: 1.1e-6), so summation order alone moves some deltas by
more than 1e-4 (the eager-vs-sdpa spread's 3x, the rule before, failed at 4.27e-5 against 2.37e-5 on one box: SP=4's
q_proj of layer 3). A 1% gradient error that leaves the losses unchanged is still caught
(test_the_tolerance_catches_a_gradient_error)."""
import functools
import math

import pytest
import torch

from arch_cases import VOCAB

STEPS, LR, SEQ, SAMPLES = 2, 0.05, 16, 2
DOC_LENS = (5, 7, 4)  # the second sample's documents (packed)


def _build(name: str, attn: str | None = None):
    """The family's tiny random-init model (seed 0); ``attn``: GPT-OSS's attention (flex_attention by default)."""
    if name == "llama4_text":
        from chunked_cases import build_llama4

        return build_llama4(0)
    if name in ("gemma4_text", "gemma4"):
        from gemma4_cases import build_gemma4

        return build_gemma4(0, multimodal=name == "gemma4", **GEMMA4)
    if name == "gpt_oss":  # sinks (not zero), sliding and full layers: flex_attention (no SDPA path in HF)
        from sink_cases import build_gpt_oss

        return build_gpt_oss(0, attn=attn or "flex_attention")
    if name == "deepseek_v3":
        from moe_cases import AUX, build_moe

        return build_moe("deepseek_v3", 0, **AUX)
    raise KeyError(name)


# GPT-OSS (sinks): loaded with flex_attention (no SDPA path), which Accelerate's DeepSpeedSequenceParallelConfig
# refuses by itself; enable() defers that refusal to Accelerate's prepare, where a long_context config lets it
# through (ds_longctx runs the attention, sinks included: untied's function level); the reference is eager, each
# document of the packed sample alone (GPT-OSS's masks ignore position_ids: tests/sink_cases.reference)
# Gemma 4: tests/test_gemma4_sp.py's model (global layers' keys as values, the last two layers sharing KV)
GEMMA4 = dict(k_eq_v=True, kv_shared=2)
# (``gemma4``: the multimodal Gemma4ForConditionalGeneration on text, the whole stack: tiled_mlp tiles its language
# model's MLPs, not the vision tower's)
# {SP degree: {family: attention implementation}}: every family under both implementations, one at each degree
CASES = {2: {"llama4_text": "ulysses", "deepseek_v3": "untied_ulysses", "gemma4_text": "ulysses",
             "gemma4": "untied_ulysses", "gpt_oss": "untied_ulysses"},
         4: {"llama4_text": "untied_ulysses", "deepseek_v3": "ulysses", "gemma4_text": "untied_ulysses",
             "gemma4": "ulysses", "gpt_oss": "ulysses"}}
FAMILIES = sorted(CASES[2])
assert all(sorted(c) == FAMILIES for c in CASES.values()) and \
    all({c[f] for c in CASES.values()} == {"ulysses", "untied_ulysses"} for f in FAMILIES)


def _data(n: int, seq_len: int, vocab: int, seed: int = 0):
    """The example's samples (examples/_common.RandomTokens), the second packed: documents of DOC_LENS tokens
    (position_ids restarting), the one of 7 crossing the shard edge at 8."""
    import eco_cases  # noqa: F401  (puts examples/ on sys.path)
    from _common import RandomTokens

    class Packed(RandomTokens):
        def __getitem__(self, i):
            out = super().__getitem__(i)
            if i == 1:
                out["position_ids"] = torch.cat([torch.arange(k) for k in DOC_LENS])
            return out

    return Packed(n, seq_len, vocab, seed)


def _worker(rank, world, cases: dict):
    """SP=world (one SP group): each family of ``cases`` ({family: implementation}) trained by the Trainer."""
    from eco_cases import ProcessState  # (puts examples/ on sys.path)
    import hf_trainer

    out = {}
    for name, impl in cases.items():
        state = ProcessState()
        hf_trainer.tiny_model = lambda seed=0, name=name: _build(name)
        hf_trainer.RandomTokens = _data
        config = hf_trainer.ds_config(world, impl)  # the memory stack: its MoE blocks (GPT-OSS's, DeepSeek's) tiled
        out[name] = hf_trainer.train(sp=world, attention=impl, record_params=True, steps=STEPS, seq_len=SEQ,
                                     samples=SAMPLES, sample_order=list(range(SAMPLES)), lr=LR, config=config,
                                     output_dir=f"/tmp/ds_longctx_test_trainer_families{rank}")
        state.reset()  # the next Trainer starts as in a fresh process
    return out


@functools.lru_cache(maxsize=None)  # (read only: the tests compare with it)
def _reference(name: str, attn: str = "sdpa", last_step_scale: float = 1.0, dtype: torch.dtype = torch.float32):
    """One process, no Trainer: SGD(LR) on the example's samples in order (the Trainer's steps at SP=1).
    ``attn``: the attention kernel; ``last_step_scale``: the last step's gradient scaled (a wrong variant); ``dtype``:
    the float32 model cast (float64: the truth, the same weights)."""
    model = (_build(name, "eager") if name == "gpt_oss" else _build(name)).to(dtype).train()
    if dtype == torch.float64 and model._can_set_experts_implementation():
        model.set_experts_implementation("eager")  # (grouped_mm: float32 and half types only; the same sums)
    if attn != "sdpa" and name != "gpt_oss":
        model.set_attn_implementation(attn)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    data, losses = _data(SAMPLES, SEQ, VOCAB, seed=0), []
    for i in range(STEPS):
        loss = _loss(name, model, {k: v[None] for k, v in data[i].items()})
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= LR * (last_step_scale if i == STEPS - 1 else 1.0) * p.grad
                    p.grad = None
    return losses, {n: p.detach() - before[n] for n, p in model.named_parameters()}, before


def _loss(name: str, model, sample: dict):
    """One process: HF's loss of ``sample``; GPT-OSS's packed sample (its masks ignore position_ids) with each
    document run alone, the logits concatenated, the loss over the whole sample (tests/sink_cases.reference)."""
    starts = (sample["position_ids"][0] == 0).nonzero().flatten().tolist() + [SEQ]
    if name != "gpt_oss" or len(starts) == 2:
        return model(**sample, use_cache=False).loss  # (packed: no cache)
    logits = torch.cat([model(input_ids=sample["input_ids"][:, a:e], use_cache=False).logits
                        for a, e in zip(starts, starts[1:])], dim=1)
    return torch.nn.functional.cross_entropy(logits[0, :-1], sample["labels"][0, 1:], ignore_index=-100)


ROUNDING_FACTOR = 8  # a delta's error against the float64 truth, in units of the float32 rounding (module doc)


@functools.lru_cache(maxsize=None)
def _truth_and_rounding(name: str):
    """(the float64 one-process deltas as float32, the float32 rounding: the largest error of the one-process float32
    runs, sdpa and eager, against them)."""
    from gemma4_cases import tensor_errors

    truth = {n: d.float() for n, d in _reference(name, dtype=torch.float64)[1].items()}
    params = _reference(name)[2]
    rounding = max(max(tensor_errors(truth, _reference(name, attn=attn)[1], params).values())
                   for attn in ("sdpa", "eager"))
    assert 0 < rounding < 1e-3, (name, rounding)  # measured, small: the references agree (largest: gemma4_text 7.9e-5)
    return truth, rounding


def _off(name: str, got: dict, ref: dict, params: dict) -> dict:
    """The tensors of ``got`` (deltas) not equal to ``ref`` within the tolerance (module doc): {name: (error against
    the float64 truth, allowed)}."""
    from gemma4_cases import tensor_errors

    loose = {n for n in ref if not torch.allclose(got[n], ref[n], rtol=1e-4, atol=1e-6)}
    if not loose:
        return {}
    truth, rounding = _truth_and_rounding(name)
    errs = tensor_errors({n: truth[n] for n in loose}, got, params)
    allowed = ROUNDING_FACTOR * rounding
    print(name, "loose tensors", len(loose), "worst error / float32 rounding", max(errs.values()) / rounding)
    return {n: (errs[n], allowed) for n in loose if errs[n] > allowed}


@pytest.fixture(scope="module")
def trained():
    from dist_utils import runs_per_degree

    return runs_per_degree(_worker, CASES)


@pytest.mark.distributed
@pytest.mark.parametrize("sp,name", [(sp, name) for sp in sorted(CASES) for name in FAMILIES])
def test_trainer_with_enable_equals_one_process(sp, name, trained):
    from dist_utils import result_or_raise

    losses, deltas, params = _reference(name)
    assert max(float(d.abs().max()) for d in deltas.values()) > 0
    ranks = result_or_raise(trained[sp])
    assert len(ranks) == sp
    for rank_out in ranks:
        got = rank_out[name]
        print(sp, name, CASES[sp][name], got["losses"], losses)
        assert len(got["losses"]) == STEPS
        for a, b in zip(got["losses"], losses):
            assert math.isclose(a, b, rel_tol=1e-5), (sp, name, got["losses"], losses)
        bad = _off(name, {n: got["after"][n] - got["before"][n] for n in deltas}, deltas, params)
        assert not bad, (sp, name, bad)


@pytest.mark.parametrize("name", ["gemma4_text"])  # the loosest tolerance (the others: elementwise)
def test_the_tolerance_catches_a_gradient_error(name):
    """The test can fail: one process whose last step's gradient is 1% off (its losses unchanged) is off on
    embed_tokens, the tensor with the loosest tolerance, and on most tensors."""
    losses, deltas, params = _reference(name)
    wrong_losses, wrong, _ = _reference(name, last_step_scale=1.01)
    assert wrong_losses == losses
    bad = _off(name, wrong, deltas, params)
    moved = [n for n, d in deltas.items() if d.abs().max() > 0]  # (not the multimodal model's unused towers)
    embed = next(n for n in moved if n.endswith(".embed_tokens.weight"))
    assert embed in bad and len(bad) > len(moved) // 2, (len(bad), len(moved))


@pytest.mark.parametrize("name", FAMILIES)
def test_packing_changes_the_one_process_loss(name):
    """The packed sample is not trained as one document: its loss differs from the same tokens unpacked."""
    sample = {k: v[None] for k, v in _data(SAMPLES, SEQ, VOCAB, seed=0)[1].items()}
    model = _build(name, "eager") if name == "gpt_oss" else _build(name)
    with torch.no_grad():
        packed = _loss(name, model, sample).item()
        plain = _loss(name, model, dict(sample, position_ids=torch.arange(SEQ)[None])).item()
    assert abs(packed - plain) > 1e-3, (packed, plain)


def test_accelerate_flex_refusal_stays_for_what_ds_longctx_does_not_run():
    """enable() lets Accelerate's sp_attn_implementation='flex_attention' through when the config is built and
    refuses it at Accelerate's prepare unless the DeepSpeed config has a long_context section; 'eager' stays refused
    (naming it and the fix); disable() restores Accelerate's own check."""
    import types

    from accelerate.utils import DeepSpeedSequenceParallelConfig

    import ds_longctx
    from ds_longctx.hf import integration
    from ds_longctx.errors import ConfigError

    with pytest.raises(ValueError, match="flex_attention"):
        DeepSpeedSequenceParallelConfig(sp_attn_implementation="flex_attention")
    ds_longctx.enable()
    try:
        assert DeepSpeedSequenceParallelConfig(sp_attn_implementation="flex_attention").sp_attn_implementation == \
            "flex_attention"
        with pytest.raises(ConfigError, match="'eager' cannot run sequence parallel") as e:
            DeepSpeedSequenceParallelConfig(sp_attn_implementation="eager")
        assert "flex_attention" in str(e.value) and "sdpa" in str(e.value)
        with pytest.raises(ValueError, match="Must be one of"):  # Accelerate's other checks still run
            DeepSpeedSequenceParallelConfig(sp_attn_implementation="no_such_kernel")
        integration._in_accelerate.depth = 1  # as inside Accelerator._prepare_deepspeed
        integration._in_accelerate.accelerator = types.SimpleNamespace(deepspeed_config={"long_context": {}})
        integration.check_sp_attn("flex_attention")  # ds_longctx runs it (its initialize checks the model)
        integration._in_accelerate.accelerator = types.SimpleNamespace(deepspeed_config={})  # DeepSpeed's own SP
        with pytest.raises(ValueError, match="'flex_attention' are not supported.*'long_context' section"):
            integration.check_sp_attn("flex_attention")
    finally:
        integration._in_accelerate.depth, integration._in_accelerate.accelerator = 0, None
        ds_longctx.disable()
    with pytest.raises(ValueError, match="flex_attention"):
        DeepSpeedSequenceParallelConfig(sp_attn_implementation="flex_attention")
