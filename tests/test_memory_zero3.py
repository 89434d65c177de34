"""Memory-stack switches through real DeepSpeed ZeRO-3 engines on 2 gloo ranks: each switch alone and
all together equal all-off (loss and SGD lr=1 parameter deltas); shard-count agreement when ranks hold
different local lengths (the case that deadlocks ZeRO-3 when ranks disagree)."""
import math

import torch

from dist_utils import result_or_raise, run_distributed_side_by_side
import pytest

pytestmark = pytest.mark.distributed  # every test here spawns processes

SEQ, VOCAB = 80, 64  # local 40 tokens per rank > hidden 32, so "auto" tiles into 2
MODEL = dict(heads=4, kv_heads=2, vocab=VOCAB, layers=2)

CASES = {
    "off": {},
    "ckpt": {"activation_checkpointing": {"enabled": True}},
    "ckpt_reentrant": {"activation_checkpointing": {"enabled": True, "use_reentrant": True}},
    "offload": {"activation_checkpointing": {"enabled": True, "offload": "cpu"}},
    "offload_reentrant": {"activation_checkpointing": {"enabled": True, "offload": "cpu", "use_reentrant": True}},
    "mlp_auto": {"tiled_mlp": {"enabled": True, "shards": "auto"}},
    "mlp_3": {"tiled_mlp": {"enabled": True, "shards": 3}},
    "loss_auto": {"tiled_loss": {"enabled": True, "shards": "auto"}},
    "loss_3": {"tiled_loss": {"enabled": True, "shards": 3}},
    "rms_norm": {"rms_norm": {"enabled": True}},
    "all": {"activation_checkpointing": {"enabled": True, "offload": "cpu"},
            "tiled_mlp": {"enabled": True, "shards": "auto"}, "tiled_loss": {"enabled": True, "shards": 3},
            "rms_norm": {"enabled": True}},
    "all_reentrant": {"activation_checkpointing": {"enabled": True, "offload": "cpu", "use_reentrant": True},
                      "tiled_mlp": {"enabled": True, "shards": 3}, "tiled_loss": {"enabled": True, "shards": "auto"}},
}


def _engine_step(lc: dict, tied: bool = False):
    import ds_longctx
    from ds_longctx.dist.comm import sp_group, sp_rank
    from ds_longctx.data import shard_batch
    from ds_longctx.memory import get_memory_handle
    from sp_cases import ds_config, full_params, sample
    from tiny_models import build, tiny_config

    config = ds_config(3, 2, dict(lc, attention={"implementation": "ulysses"}))
    model = build(tiny_config(**MODEL, tie_word_embeddings=tied), seed=0)
    engine, _, _, _ = ds_longctx.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                            config=config)
    before = full_params(engine.module)
    shard = shard_batch(sample(SEQ, VOCAB), sp_rank(sp_group()), 2)
    loss = engine(**shard).loss  # forward and backward are separate calls: no context manager in between
    engine.backward(loss)
    engine.step()
    after = full_params(engine.module)
    handle = get_memory_handle(engine)
    stats = handle.stats() if handle is not None else {}
    engine.destroy() if hasattr(engine, "destroy") else None
    return loss.item(), {n: after[n] - before[n] for n in after}, stats


TIED_CASES = ("off", "loss_3", "all")  # lm_head's weight is the input embedding's (Llama-3.2, Gemma, small Qwen)


def _switches_worker(rank, world):
    out = {name: _engine_step(lc) for name, lc in CASES.items()}
    out.update({f"tied_{name}": _engine_step(CASES[name], tied=True) for name in TIED_CASES})
    return out


@pytest.fixture(scope="module")
def spawns():
    """The two SP=2 spawns of this file (_switches_worker, _uneven_worker), independent, started side by side
    once (400 s: the longer of the two limits they had); each test re-raises its own spawn's failure."""
    runs = run_distributed_side_by_side((_switches_worker, 2), (_uneven_worker, 2), timeout=400,
                                        return_exceptions=True)
    return dict(zip(("switches", "uneven"), runs))


def test_each_switch_and_all_match_all_off_under_zero3_sp2(spawns):
    results = result_or_raise(spawns["switches"])
    for rank, out in enumerate(results):
        # tied embeddings: the tiled loss's lm_head gradient and the embedding's are reduced once, summed
        # (reduced after the last tile as well, ZeRO-3 asserted on the parameter twice in one bucket)
        ref_loss, ref_deltas, _ = out["tied_off"]
        emb = [n for n in ref_deltas if "embed_tokens" in n]
        assert emb and "lm_head.weight" not in ref_deltas and ref_deltas[emb[0]].abs().max() > 0
        for name in TIED_CASES[1:]:
            loss, deltas, _ = out[f"tied_{name}"]
            assert math.isclose(loss, ref_loss, rel_tol=1e-6), (rank, name, loss, ref_loss)
            for n, ref in ref_deltas.items():
                torch.testing.assert_close(deltas[n], ref, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"rank {rank} tied {name} {n}: {m}")
    layer_bytes = 1 * (SEQ // 2) * 32 * 4
    for rank, out in enumerate(results):
        ref_loss, ref_deltas, _ = out["off"]
        assert any(d.abs().max() > 0 for d in ref_deltas.values())
        for name in CASES:
            loss, deltas, stats = out[name]
            assert math.isclose(loss, ref_loss, rel_tol=1e-6), (rank, name, loss, ref_loss)
            for n, ref in ref_deltas.items():
                torch.testing.assert_close(deltas[n], ref, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"rank {rank} {name} {n}: {m}")
            if "rms_norm" in CASES[name]:
                # every layer's two norms and the final norm went through the Function, weights
                # gathered by ZeRO-3's module hooks (the deltas above prove their grads arrived)
                assert stats["rms_norms"] == 2 * MODEL["layers"] + 1, (name, stats)
            if "offload" in name or name.startswith("all"):
                # the offload really ran inside the engine: every layer's input went out and came back
                assert stats["offloaded_tensors"] == MODEL["layers"], (name, stats)
                assert stats["restored_tensors"] == MODEL["layers"], (name, stats)
                assert stats["host_bytes_peak"] == MODEL["layers"] * layer_bytes, (name, stats)
                assert stats["host_bytes"] == 0, (name, stats)


# ---------------------------------------------------------------------------------------------
# agreement with different local lengths per rank (plain ZeRO-3 data parallel, no SP)
# ---------------------------------------------------------------------------------------------


def _uneven_worker(rank, world):
    import deepspeed

    from ds_longctx.config import parse
    from ds_longctx.loss import causal_lm_loss_sum
    from ds_longctx.memory import agree_max, tiled_causal_lm_loss_sum
    from sp_cases import full_params
    from tiny_models import build, memory_stack, tiny_config

    out = {"agree": agree_max(3 + 4 * rank), "agree_fixed": agree_max(7)}
    # rank 0 holds 10 tokens, rank 1 12: torch.chunk(., 6) gives them 5 and 6 tiles (mismatched
    # all-gather counts); "auto" on 40 vs 70 tokens gives 2 vs 3 before the MAX agreement
    for label, lengths, shards in (("fixed6", (10, 12), 6), ("auto", (40, 70), None)):
        seq = lengths[rank]
        g = torch.Generator().manual_seed(100 + rank)
        ids = torch.randint(0, VOCAB, (1, seq), generator=g)
        labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], 1)
        res = {}
        for mode in ("off", "tiled"):
            model = build(tiny_config(**MODEL), seed=0)
            if mode == "tiled":
                memory_stack(model, parse({"long_context": {"tiled_mlp": {"enabled": True,
                                                                          "shards": shards or "auto"}}}))
            cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0, "zero_optimization": {"stage": 3},
                   "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
            engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                                   config=cfg)
            before = full_params(engine.module)
            hidden = engine.module.model(input_ids=ids).last_hidden_state
            if mode == "tiled":
                loss_sum, count = tiled_causal_lm_loss_sum(hidden, engine.module.lm_head, labels, shards)
            else:
                loss_sum, count, _ = causal_lm_loss_sum(hidden, engine.module.lm_head, labels)
            loss = loss_sum / count
            engine.backward(loss)
            engine.step()
            after = full_params(engine.module)
            res[mode] = (loss.item(), {n: after[n] - before[n] for n in after})
            engine.destroy() if hasattr(engine, "destroy") else None
        out[label] = res
    return out


def test_shard_agreement_with_different_local_lengths_zero3(spawns):
    results = result_or_raise(spawns["uneven"])  # a disagreement would hang: the spawns' timeout fails it
    assert [r["agree"] for r in results] == [7, 7]
    assert [r["agree_fixed"] for r in results] == [7, 7]
    for rank, r in enumerate(results):
        for label in ("fixed6", "auto"):
            (ref_loss, ref), (loss, deltas) = r[label]["off"], r[label]["tiled"]
            assert math.isclose(loss, ref_loss, rel_tol=1e-6), (rank, label, loss, ref_loss)
            for n in ref:
                torch.testing.assert_close(deltas[n], ref[n], rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"rank {rank} {label} {n}: {m}")
