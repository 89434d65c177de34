"""Issue 37, item 2: Gemma 4 (``gemma4_text``, and ``gemma4``'s multimodal causal LM on text) with per-layer attention shapes under 'ulysses' and 'untied_ulysses'
(function level), whole memory stack, ZeRO-3, equal to one process, plain and packed, at SP=2 and SP=4.

The tiny model has everything that makes Gemma 4 per-layer: sliding layers (head_dim 8, 2 key/value heads, a window
of 4 tokens < the 16-token sample) and global layers (their own global_head_dim 16; attention_k_eq_v: keys reused as
values, 1 key/value head, so replicated over the SP ranks), per-layer inputs (PLE: computed per token from the rank's
own input_ids, sharded like the hidden states), the KV-shared last layers (num_kv_shared_layers: layers 2 and 3 reuse
the keys/values of layers 0 and 1, across activation checkpointing) and final-logit soft-capping. The spec and the
checks read each layer's shape (models.AttentionShape.layers), 'ulysses' builds DeepSpeed's wrapper per shape, the
untied function level a head schedule per call.

Tolerance: SGD deltas within 1e-5 (arch_cases.max_delta_error's measure) per tensor, or, for a tensor whose one-process
gradient itself moves more between two kernels (transformers' eager vs sdpa attention: the q-norm weights of this model,
4e-5), within 3x that one-process spread: summation order, nothing else."""
import math

import pytest

from dist_utils import result_or_raise, runs_per_degree
from gemma4_cases import batch, build_gemma4, reference, sp_step, tensor_errors

CFG = dict(k_eq_v=True, kv_shared=2)
STACK = {"activation_checkpointing": {"enabled": True, "offload": "cpu", "pin_memory": False},
         "tiled_loss": {"enabled": True, "shards": 2}, "tiled_mlp": {"enabled": True, "shards": 2}}
LC = {"ulysses": {"attention": {"implementation": "ulysses"}, **STACK},
      "untied": {"attention": {"implementation": "untied_ulysses", "heads_per_chunk": 1, "fuse_projections": False},
                 **STACK}}
# shards of 8 (SP=2) and 4 (SP=4) tokens; documents at 5 and 12 cross the shard edges. Each degree runs both
# implementations, each implementation both kinds (a Latin square: the suite's wall-time budget). "gemma4": the
# multimodal Gemma4ForConditionalGeneration (text-only batches) around the same text model, the whole stack (tiled_mlp
# tiles its language model's MLPs; the vision tower runs on image features, not on the sequence, and is not tiled)
CASES = {2: [("gemma4_text", "ulysses", "plain"), ("gemma4_text", "untied", "packed"), ("gemma4", "ulysses", "packed")],
         4: [("gemma4_text", "ulysses", "packed"), ("gemma4_text", "untied", "plain")]}


def test_per_layer_shapes_are_read_per_layer():
    import transformers as tf

    from ds_longctx.models import attention_shape
    from gemma4_cases import gemma4_config

    shape = attention_shape(gemma4_config(**CFG))
    assert [(s.heads, s.kv_heads, s.head_dim) for s in shape.layers] == [(4, 2, 8), (4, 1, 16)] * 2
    assert (shape.heads, shape.kv_heads, shape.head_dim) == (4, 2, 16)  # the largest: upper bounds for sizing
    assert attention_shape(tf.LlamaConfig(hidden_size=32, num_attention_heads=4)).layers == ()


def test_sp_degree_checked_against_every_layer_shape():
    """The spec has each shape; heads_per_chunk is checked against every layer shape."""
    from ds_longctx.config import parse
    from ds_longctx.errors import ConfigError
    from ds_longctx.patching.spec import build_spec
    from gemma4_cases import gemma4_config

    cfg = gemma4_config(**CFG)
    cfg._attn_implementation = "sdpa"
    spec = build_spec(parse({"sequence_parallel_size": 2, "long_context": LC["untied"]}), cfg)
    assert [s.head_dim for s in spec.model.distinct_shapes()] == [8, 16]
    with pytest.raises(ConfigError, match="heads_per_chunk"):
        bad = {**LC["untied"], "attention": {**LC["untied"]["attention"], "heads_per_chunk": 3}}
        build_spec(parse({"sequence_parallel_size": 2, "long_context": bad}), cfg)


def test_the_trainer_route_takes_gemma4_and_refuses_an_open_family(monkeypatch):
    """Gemma 4 through Accelerate's route (HF Trainer / TRL) at SP > 1 is taken (exact: tests/test_trainer_families.py),
    the text model and the multimodal one alike; a family listed in integration.TRAINER_OPEN is refused by name at
    SP > 1 (and not at SP 1)."""
    from ds_longctx.hf import integration
    from ds_longctx.errors import ConfigError
    from ds_longctx.hf.integration import check_trainer_family

    for multimodal in (False, True):
        model = build_gemma4(multimodal=multimodal)
        check_trainer_family(model, {"sequence_parallel_size": 2})
        monkeypatch.setitem(integration.TRAINER_OPEN, "gemma4_text", "why")
        with pytest.raises(ConfigError, match="'gemma4_text' model through the HF Trainer.*why.*ds_longctx.initialize"):
            check_trainer_family(model, {"sequence_parallel_size": 2})
        check_trainer_family(model, {"sequence_parallel_size": 1})
        monkeypatch.delitem(integration.TRAINER_OPEN, "gemma4_text")


def test_the_features_change_the_one_process_loss():
    """The test can fail: the window, the global layers' own head dim and the key/value sharing each move the loss."""
    base = reference(batch("plain"), **CFG)[0]
    for other in (dict(CFG, window=16), dict(CFG, global_head_dim=8), dict(CFG, kv_shared=0), dict(CFG, k_eq_v=False)):
        assert abs(reference(batch("plain"), **other)[0] - base) > 2e-4, other  # the SP loss must match to 4e-5


def _worker(rank, world, cases):
    return {case: sp_step(LC[case[1]], batch(case[2]), world, multimodal=case[0] == "gemma4", **CFG)
            for case in cases}


@pytest.fixture(scope="module")
def sp_results():
    return runs_per_degree(_worker, CASES)


@pytest.mark.distributed
@pytest.mark.parametrize("sp", sorted(CASES))
def test_gemma4_under_sp_equals_one_process(sp, sp_results):
    results = result_or_raise(sp_results[sp])
    for model, kind in sorted({(m, k) for m, _, k in CASES[sp]}):
        mm = dict(CFG, multimodal=model == "gemma4")
        ref_loss, ref_deltas, params = reference(batch(kind), **mm)
        spread = tensor_errors(ref_deltas, reference(batch(kind), attn="eager", **mm)[1], params)
        for case in CASES[sp]:
            if (case[0], case[2]) != (model, kind):
                continue
            impl = case[1]
            for rank, r in enumerate(results):
                loss, deltas = r[case]
                errs = tensor_errors(ref_deltas, deltas, params)
                bad = {n: (e, spread[n]) for n, e in errs.items() if e >= max(1e-5, 3 * spread[n])}
                print(sp, rank, model, impl, kind, ref_loss, loss, max(errs.values()))
                assert math.isclose(loss, ref_loss, rel_tol=1e-5), (impl, kind, loss, ref_loss)
                assert not bad, (impl, kind, bad)
