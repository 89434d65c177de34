"""Held-out evaluation (ds_longctx/eval/evaluate.py): the token-weighted loss over SP shards and DP replicas equals
one process's HF loss on the same samples, with tiled_loss on (no logits); every rank runs the same number of
batches and no sample counts twice."""
from __future__ import annotations

import json
import math

import pytest
import torch

from ds_longctx.eval.evaluate import EvalLoader
from ds_longctx.loss import IGNORE_INDEX

SEQ = 16
UNTIED = {"attention": {"implementation": "untied_ulysses", "heads_per_chunk": 1, "fuse_projections": False}}
TILED = {"tiled_loss": {"enabled": True, "shards": 2}}


def _dataset(path):
    from test_corpus import char_tokenizer

    from ds_longctx.data.corpus import open_corpus

    return open_corpus(path, char_tokenizer(), SEQ, documents=False, vocab_size=64)


def _write(tmp_path):
    from test_corpus import DOCS

    path = tmp_path / "heldout.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[:6]))  # 7 samples of 16
    return str(path)


def test_loader_splits_replicas_without_repeats_and_pads_with_ignored_samples(tmp_path):
    ds = _dataset(_write(tmp_path))
    assert len(ds) == 7
    seen = []
    lengths = set()
    for dp_rank in range(2):
        batches = list(EvalLoader(ds, batch_size=2, sp_rank=1, sp_size=2, dp_rank=dp_rank, dp_size=2))
        lengths.add(len(batches))
        for b in batches:
            assert b["input_ids"].shape == (2, SEQ // 2) and b["position_ids"][0, 0] == SEQ // 2
            for row in range(2):
                if (b["shift_labels"][row] != IGNORE_INDEX).any():
                    seen.append(b["input_ids"][row])
    assert lengths == {2}  # 4 places per replica (one padded) in batches of 2: the same count on every rank
    want = [ds[i]["input_ids"][SEQ // 2:] for i in range(7)]
    assert len(seen) == 7 and all(any(torch.equal(s, w) for s in seen) for w in want)


def _case(rank, world, path, lc, sp, batch_size):
    import ds_longctx
    from sp_cases import ds_config
    from tiny_models import build, tiny_config

    from ds_longctx.eval.evaluate import eval_loader, evaluate

    ds = _dataset(path)  # every rank opens the corpus; one builds its cache, the other waits on the lock
    model = build(tiny_config(), seed=0)
    engine, *_ = ds_longctx.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                       config=ds_config(3, sp, lc))
    assert engine.training
    out = evaluate(engine, eval_loader(ds, engine, batch_size=batch_size))
    out["training_after"] = engine.training
    try:  # a loader whose length differs between ranks: one error on every rank, not a hang
        evaluate(engine, eval_loader(ds, engine, batch_size=batch_size).indices[:rank + 1])
    except Exception as e:  # noqa: BLE001
        out["uneven"] = str(e)
    engine.module._ds_longctx_patch.remove()
    return out


def _eval_ranks(rank, world, path):
    from eco_cases import ProcessState

    state = ProcessState()
    # SP=1 first: DeepSpeed keeps the SP run's mpu (deepspeed.utils.groups) for every later engine
    res = {"dp2": _case(rank, world, path, {"attention": {"implementation": "none"}, **TILED}, 1, 2)}
    state.reset()
    res["sp2_tiled"] = _case(rank, world, path, {**UNTIED, **TILED}, 2, 1)
    state.reset()
    res["sp2"] = _case(rank, world, path, UNTIED, 2, 1)
    return res


@pytest.mark.distributed
def test_held_out_loss_under_sp_and_dp_equals_one_process(tmp_path):
    from dist_utils import run_distributed
    from tiny_models import build, tiny_config

    path = _write(tmp_path)
    results = run_distributed(_eval_ranks, 2, path)
    ds = _dataset(path)
    model = build(tiny_config(), seed=0).eval()
    total = count = 0
    with torch.no_grad():
        for i in range(len(ds)):
            ids = ds[i]["input_ids"].unsqueeze(0)
            loss = model(input_ids=ids, labels=ids).loss.double().item()
            total += loss * (SEQ - 1)
            count += SEQ - 1
    ref = total / count
    for key in ("sp2_tiled", "sp2", "dp2"):
        for r in results:
            got = r[key]
            assert got["tokens"] == count and got["training_after"], (key, got)
            assert "the ranks hold different numbers of batches ([1, 2], by rank)" in got["uneven"], got["uneven"]
            assert math.isclose(got["loss"], ref, rel_tol=1e-5), (key, got["loss"], ref)
            assert math.isclose(got["perplexity"], math.exp(ref), rel_tol=1e-5)
