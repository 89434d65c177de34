"""Issue 19, item 3: every error whose fix changes what trains is checked by applying the fix. Each test
triggers the error, asserts its fix, applies the fix and shows the result is exact (loss and gradients equal to
transformers' own one-process forward, tolerances only for summation order) or another clear error. Units only
(SP=1 models, config checks, shard_batch): the SP=2 runs of these paths are in test_arch_batches /
test_sp_attention_refusals. The full table (every ConfigError that proposes a fix) is in the issue 19 report."""
import pytest
import torch

from eco_cases import config_error

VOCAB = 64


def _parse(lc=None, sp=1):
    from ds_longctx.config import parse

    return parse({"sequence_parallel_size": sp, "long_context": {"attention": {"implementation": "none"},
                                                                 **(lc or {})}})


def _loss_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_exact(ref, got):
    (rl, rg), (gl, gg) = ref, got
    torch.testing.assert_close(gl, rl, rtol=1e-5, atol=1e-6)
    assert set(rg) == set(gg)
    for n in rg:
        assert rg[n].abs().max() > 0 or n.endswith("bias"), n  # the test can fail: gradients reach the weights
        torch.testing.assert_close(gg[n], rg[n], rtol=1e-5, atol=1e-6, msg=n)  # the one "exact" (tools/arch_sweep.py)


def _pair(build):
    ref = build()
    return ref, __import__("copy").deepcopy(ref)


def _sample(seq=16, seed=0):
    ids = torch.randint(3, VOCAB, (1, seq), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[:, :3] = -100
    return {"input_ids": ids, "labels": labels}


def _opt():
    from transformers import AutoModelForCausalLM, OPTConfig

    torch.manual_seed(0)
    cfg = OPTConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, ffn_dim=64, vocab_size=VOCAB,
                    word_embed_proj_dim=32, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                    layerdrop=0.0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def test_tiled_mlp_unknown_class_fix_is_exact():
    """'set long_context.tiled_mlp.enabled=false for this model' -> the rest of the stack, exact."""
    from tiny_models import patch

    stack = {"activation_checkpointing": {"enabled": True, "offload": "cpu", "pin_memory": False},
             "tiled_mlp": {"enabled": True, "shards": 2}, "tiled_loss": {"enabled": True, "shards": 2}}
    ref, model = _pair(_opt)
    e = config_error(patch, model, _parse(stack))
    assert e.startswith("long_context.tiled_mlp.enabled: OPTForCausalLM has no MLP") and \
        "set long_context.tiled_mlp.enabled=false" in e
    assert getattr(model, "_ds_longctx_patch", None) is None  # refused before anything stayed installed
    patch(model, _parse({k: v for k, v in stack.items() if k != "tiled_mlp"}))
    batch = _sample()
    _assert_exact(_loss_grads(ref, batch), _loss_grads(model, batch))


def test_router_jitter_fix_is_exact_and_the_other_option_says_what_it_changes():
    from arch_cases import arch_config
    from transformers import AutoModelForCausalLM

    from tiny_models import patch

    cfg = arch_config("mixtral")
    cfg.router_jitter_noise = 0.1

    def build():
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")

    ref, model = _pair(build)
    tiled = copy_of(model)
    patch(tiled, _parse({"tiled_mlp": {"enabled": True, "shards": 2}}))
    e = config_error(lambda: tiled(**_sample()))
    assert "set long_context.tiled_mlp.enabled=false (exact, untiled)" in e
    assert "a different regularisation" in e  # the jitter-off option is not offered as the same training
    patch(model, _parse({"tiled_mlp": {"enabled": False}}))
    batch = _sample()
    torch.manual_seed(1)
    r = _loss_grads(ref, batch)
    torch.manual_seed(1)  # the same jitter draws: the untiled MLP runs the same ops in the same order
    _assert_exact(r, _loss_grads(model, batch))


def copy_of(model):
    import copy

    return copy.deepcopy(model)


def test_custom_4d_mask_fix_is_exact_at_sp1():
    """A prefix-LM mask is refused without advice to drop it; its fix (SP=1, implementation 'none', the full
    batch with its mask) trains exactly what transformers computes with that mask."""
    from arch_cases import build_arch

    from tiny_models import patch

    seq = 16
    mask = torch.ones(seq, seq, dtype=torch.bool).tril()
    mask[:, :6] = True  # prefix of 6 tokens seen by every query
    mask4 = mask[None, None]
    batch = dict(_sample(seq), attention_mask=mask4)
    untied = build_arch("llama")
    patch(untied, _parse({"attention": {"implementation": "untied_ulysses", "heads_per_chunk": 1,
                                              "fuse_projections": False}}))
    e = config_error(lambda: untied(**batch))
    assert "custom 4-D masks are not supported" in e and "drop the mask" not in e
    assert "at sequence_parallel_size 1 with long_context.attention.implementation 'none'" in e
    ref, model = _pair(lambda: build_arch("llama"))
    patch(model, _parse())
    r, g = _loss_grads(ref, batch), _loss_grads(model, batch)
    _assert_exact(r, g)
    causal = _loss_grads(ref, _sample(seq))[0]
    assert abs(float(causal) - float(r[0])) > 1e-4  # the mask matters: dropping it would train something else


def test_packed_use_cache_fix_is_exact():
    """use_cache=True with packed documents -> 'call with use_cache=False' -> per-document attention, exact."""
    from arch_cases import build_arch

    from tiny_models import patch

    ref, model = _pair(lambda: build_arch("llama"))
    patch(model, _parse())
    b = _sample(16)
    pos = torch.cat([torch.arange(7), torch.arange(9)])[None]
    e = config_error(lambda: model(**b, position_ids=pos, use_cache=True))
    assert e.startswith("use_cache: is true for a packed batch") and "use_cache=False" in e
    got = _loss_grads(model, dict(b, position_ids=pos, use_cache=False))
    # reference: each document alone through transformers (attention per document), the labels as given
    # (transformers' packed loss keeps the target across a boundary, as ds_longctx does)
    ids, lab = b["input_ids"], b["labels"]
    ref.zero_grad(set_to_none=True)
    logits = torch.cat([ref(input_ids=ids[:, s:t]).logits for s, t in ((0, 7), (7, 16))], 1)
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], lab[0, 1:], ignore_index=-100)
    loss.backward()
    r = (loss.detach(), {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None})
    with torch.no_grad():
        unpacked = ref(**b).loss
    assert abs(float(unpacked) - loss.item()) > 1e-4  # documents attending across would be another loss
    _assert_exact(r, got)


def test_indivisible_length_fix_pads_into_an_ignored_document():
    """'pad samples at the end ... with attention_mask 0 on the padding' -> the padded tail attends nothing real
    and has no loss: the loss and gradients of the unpadded sample."""
    from arch_cases import build_arch

    from ds_longctx.data import shard_batch
    from tiny_models import patch

    b = _sample(15)
    e = config_error(shard_batch, b, 0, 2)
    assert "pad samples at the end to a multiple of 2 (e.g. 16) with attention_mask 0 on the padding" in e
    padded = {"input_ids": torch.cat([b["input_ids"], torch.zeros(1, 1, dtype=torch.long)], 1),
              "labels": torch.cat([b["labels"], torch.zeros(1, 1, dtype=torch.long)], 1),  # even a real-looking label
              "attention_mask": torch.cat([torch.ones(1, 15, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long)],
                                          1)}
    shards = [shard_batch(padded, r, 2) for r in range(2)]
    assert all(s["input_ids"].shape == (1, 8) for s in shards)
    assert shards[1]["shift_labels"][0, -2:].tolist() == [-100, -100]  # no target into or from the pad
    ref, model = _pair(lambda: build_arch("llama"))
    patch(model, _parse())
    _assert_exact(_loss_grads(ref, b), _loss_grads(model, shard_batch(padded, 0, 1)))


def test_padding_next_to_doc_cu_seqlens_fix_is_exact():
    """A padding mask given next to shard_batch's output (the mask was not sharded with the batch) ->
    'pass the full batch with its attention_mask through shard_batch' -> the loss of the real tokens only
    (the old fix, 'drop the mask', trained on the padding's targets)."""
    from arch_cases import build_arch

    from ds_longctx.data import shard_batch
    from tiny_models import patch

    real = _sample(12)
    full = {"input_ids": torch.cat([real["input_ids"], torch.full((1, 4), 5)], 1),
            "labels": torch.cat([real["labels"], torch.full((1, 4), 5)], 1)}  # collator forgot -100 on the pad
    mask = torch.cat([torch.ones(1, 12, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)], 1)
    ref, model = _pair(lambda: build_arch("llama"))
    patch(model, _parse())
    e = config_error(lambda: model(**shard_batch(full, 0, 1), attention_mask=mask))
    assert e.startswith("batch.attention_mask: has padding next to doc_cu_seqlens") and "drop the mask" not in e
    assert "pass the full batch with its attention_mask through ds_longctx.data.shard_batch" in e
    fixed = shard_batch(dict(full, attention_mask=mask), 0, 1)
    _assert_exact(_loss_grads(ref, real), _loss_grads(model, fixed))
    with torch.no_grad():
        dropped = model(**shard_batch(full, 0, 1)).loss
    assert abs(float(dropped) - float(_loss_grads(ref, real)[0])) > 1e-3  # what the old fix trained


def test_fuse_projections_fix_is_exact():
    """fuse_projections true on an architecture without fused untied attention -> "set it to 'auto' (the default)
    or false" -> exact (SP=1), with each fix."""
    from arch_cases import build_arch

    from tiny_models import patch

    untied = {"attention": {"implementation": "untied_ulysses", "heads_per_chunk": 1, "fuse_projections": True}}
    ref, model = _pair(lambda: build_arch("phi3"))
    e = config_error(patch, model, _parse(untied))
    assert e.split(":")[0] == "long_context.attention.fuse_projections" and "set it to 'auto' (the default) or false" in e
    batch = _sample()
    want = _loss_grads(ref, batch)
    for fix in ("auto", False):
        untied["attention"]["fuse_projections"] = fix
        handle = patch(model, _parse(untied))
        assert handle.spec.fused is False
        _assert_exact(want, _loss_grads(model, batch))
        handle.remove()


def test_config_fixes_parse():
    """The config-level fixes give a config that parses (the training they lead to is the tests above)."""
    from ds_longctx.config import parse

    e = config_error(parse, {"sequence_parallel_size": 2, "long_context": {"attention": {"implementation": "none"}}})
    assert "use 'ulysses' or 'untied_ulysses', or set sequence_parallel_size to 1" in e
    for fixed in ({"sequence_parallel_size": 1, "long_context": {"attention": {"implementation": "none"}}},
                  {"sequence_parallel_size": 2, "long_context": {"attention": {"implementation": "ulysses"}}}):
        parse(fixed)
    off = {"activation_checkpointing": {"offload": "cpu"}}
    e = config_error(parse, {"long_context": off})
    assert "also set activation_checkpointing.enabled=true" in e
    parse({"long_context": {"activation_checkpointing": {"enabled": True, "offload": "cpu"}}})


def test_model_without_heads_fix_leads_past_the_heads_check():
    """A state-space model under SP -> 'train it at sequence_parallel_size 1 with implementation none' -> the
    config check passes there (it used to ask for num_attention_heads at SP=1 too: a fix leading nowhere), and
    patching gives the next clear error (Mamba's loss path is not one ds_longctx reproduces), not a traceback."""
    from transformers import AutoModelForCausalLM, MambaConfig

    from ds_longctx.patching.checks import check_against
    from tiny_models import patch

    cfg = MambaConfig(hidden_size=32, num_hidden_layers=2, vocab_size=VOCAB, state_size=4, expand=2)
    e = config_error(check_against, _parse({"attention": {"implementation": "ulysses"}}, sp=2), cfg, 2)
    assert e.startswith("model.config.num_attention_heads") and "set num_attention_heads" not in e
    assert "train it at sequence_parallel_size 1 with long_context.attention.implementation 'none'" in e
    check_against(_parse(), cfg, 1)
    e = config_error(check_against, _parse({"activation_checkpointing": {"enabled": True, "offload": "cpu",
                                                                          "keep_on_device": 3}}), cfg, 1)
    assert e.startswith("long_context.activation_checkpointing.keep_on_device: 3 is more than")  # still checked
    model = AutoModelForCausalLM.from_config(cfg)
    e = config_error(patch, model, _parse())
    assert e.startswith("model: MambaForCausalLM:") and "train this model without ds_longctx" in e


def test_chunked_attention_at_sp1_is_exact():
    """Attention chunks shorter than the sample (Llama4) are no longer refused under SP (issue 37:
    tests/test_chunked_sp.py); at SP=1 with implementation 'none', transformers' own attention applies the chunks;
    with the memory stack there (checkpointing, tiled loss) the loss and gradients are transformers' own."""
    import os
    import sys

    from transformers import AutoModelForCausalLM

    from ds_longctx.patching.checks import check_against
    from tiny_models import patch

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
    from arch_sweep import tiny_config

    cfg = tiny_config("llama4_text")
    cfg.attention_chunk_size = 4
    assert set(cfg.layer_types) == {"chunked_attention"}
    assert config_error(check_against, _parse({"attention": {"implementation": "ulysses"}}, sp=2), cfg, 2, 16) is None

    def build():
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")

    ref, model = _pair(build)
    stack = {"activation_checkpointing": {"enabled": True, "offload": "none"},
             "tiled_loss": {"enabled": True, "shards": 2}}
    check_against(_parse(stack), cfg, 1, 16)
    patch(model, _parse(stack))
    batch = dict(_sample(), use_cache=False)
    r = _loss_grads(ref, batch)
    _assert_exact(r, _loss_grads(model, batch))
    wide = copy_of(ref)
    wide.config.attention_chunk_size = 64
    assert abs(float(_loss_grads(wide, batch)[0]) - float(r[0])) > 1e-5  # the chunks matter on these 16 tokens


def test_varlen_keys_without_position_ids_fix():
    """TRL's cu_seq_lens_* without position_ids -> 'drop cu_seq_lens_* and give position_ids' -> the same
    document boundaries, read from position_ids."""
    from ds_longctx.data.turns import varlen_checked as _varlen_checked

    ids = torch.arange(16)[None]
    cu = torch.tensor([0, 7, 16])
    e = config_error(_varlen_checked, {"input_ids": ids, "cu_seq_lens_q": cu})
    assert "drop cu_seq_lens_* and give position_ids" in e
    pos = torch.cat([torch.arange(7), torch.arange(9)])[None]
    from ds_longctx.data import shard_batch

    out = shard_batch(_varlen_checked({"input_ids": ids, "position_ids": pos, "labels": ids}), 0, 1)
    assert out["doc_cu_seqlens"].tolist() == [[0, 7, 16]]


@pytest.mark.parametrize("key", ["completion_mask"])
def test_unshardable_collator_key_fix_names_the_loss_mask(key):
    from ds_longctx.data.turns import checked_batch as _checked_batch

    b = {"input_ids": torch.ones(1, 16, dtype=torch.long), key: torch.ones(1, 16, dtype=torch.long)}
    e = config_error(_checked_batch, b, 2)
    assert f"drop '{key}' from the collator's output if the model and loss do not read it" in e
    assert "a loss mask belongs in labels as -100" in e
