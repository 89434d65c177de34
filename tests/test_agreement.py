"""Issue 30, items 1 and 3: ranks that disagree (a long_context key, a DeepSpeed key, the learning rate, the SP
degree, a CLI value, the data file) are one clear ConfigError on every rank at the first collective; the host
memory a run needs on a node is checked against the node's budget before anything is allocated, and equals what
the arena then holds. One 2-rank gloo spawn for every distributed case (real collectives, real ZeRO-3 engines);
the launched MPMD case (two nodes' different data files) is in tests/test_fail_fast_launched.py."""
import json
import os

import pytest

from ds_longctx.dist.verdicts import ranks_text as _ranks_text
from ds_longctx.job.agreement import Member, disagreement, fingerprint
from dist_utils import run_distributed
from sp_cases import ds_config
from tiny_models import build, tiny_config

LC = {"sequence_length": 512, "attention": {"implementation": "untied_ulysses", "heads_per_chunk": 1},
      "activation_checkpointing": {"enabled": True, "offload": "cpu"}, "tiled_mlp": {"enabled": True}}


def _base():
    return ds_config(3, 2, json.loads(json.dumps(LC)),
                     optimizer={"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}})


# ------------------------------------------------------------------ units ------------------------------------------
def test_fingerprint_and_the_message():
    a, b = _base(), _base()
    b["optimizer"]["params"]["lr"] = 2e-3
    b["long_context"]["tiled_mlp"]["enabled"] = False
    cli = {"--seq-len": 64, "--seed": 0}
    fa, fb = fingerprint(a, {"cli": cli}), fingerprint(b, {"cli": dict(cli, **{"--seed": 1})})
    assert fa["optimizer.params.lr"] == "0.001" and fa["cli\0--seed"] == "0"
    roster = [Member(0, "node-a", 10, 1), Member(1, "node-b", 11, 1), Member(2, "node-b", 12, 1)]
    e = disagreement([fa, fb, fb], roster)
    text = str(e)
    # ds_config keys in file order, then the CLI; every value with its ranks and hosts
    assert e.key == "long_context.tiled_mlp.enabled"
    assert text.startswith("long_context.tiled_mlp.enabled: differs between the ranks of this job: true on rank 0 (host "
                           "node-a); false on ranks 1-2 (host node-b) | also differing: optimizer.params.lr: 0.001 on "
                           "rank 0 (host node-a); 0.002 on ranks 1-2 (host node-b) | --seed: 0 on rank 0 (host node-a); "
                           "1 on ranks 1-2 (host node-b). Fix: "), text
    assert "Fix: give every rank the same ds_config" in text and "launch every rank with the same arguments" in text
    # a key present on one rank only
    c = _base()
    c["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    text = str(disagreement([fingerprint(a), fingerprint(c)], roster[:2]))
    assert text.startswith("zero_optimization.offload_optimizer.device: differs between the ranks of this job: (absent) "
                           "on rank 0 (host node-a); \"cpu\" on rank 1 (host node-b)"), text
    assert _ranks_text([0, 1, 2, 5, 7, 8]) == "ranks 0-2, 5, 7-8" and _ranks_text([3]) == "rank 3"
    # a data identity is compared without its path (the same file mounted elsewhere), shown with it
    d1 = {"path": "/mnt/a/d.jsonl", "kind": "jsonl", "size": 10, "sha256": "ab" * 32}
    d2 = dict(d1, path="/data/d.jsonl")
    from ds_longctx.job.agreement import _digest

    assert _digest(fingerprint(a, {"data": d1})) == _digest(fingerprint(a, {"data": d2}))
    d3 = dict(d1, sha256="cd" * 32, size=12)
    text = str(disagreement([fingerprint(a, {"data": d1}), fingerprint(a, {"data": d3})], roster[:2]))
    assert text.startswith("data (the data this rank reads): differs between the ranks of this job: '/mnt/a/d.jsonl' "
                           "(10 bytes, sha256 abababababababab...) on rank 0"), text
    assert "Fix: let every rank read the same data" in text


# ------------------------------------------------------------------ one spawn --------------------------------------
def _cases(rank, world, tmp):
    import time

    import torch

    import ds_longctx
    from ds_longctx.job.agreement import check_agreement
    from ds_longctx.data.token_cache import data_identity
    from ds_longctx.errors import ConfigError
    from ds_longctx.job.hostmem import host_need
    from ds_longctx.memory import get_memory_handle

    out = {}
    base = _base()

    def case(name, cfg, values=None):
        try:
            check_agreement(cfg, values, start_watchdog=False)
            out[name] = None
        except ConfigError as e:
            out[name] = str(e)

    # the cost: one all-gather of 128 bytes per rank (median of 20, after a warm-up)
    check_agreement(base, None, start_watchdog=False)
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        check_agreement(base, {"cli": {"--seq-len": 512}}, start_watchdog=False)
        times.append(time.perf_counter() - t0)
    out["cost_s"] = sorted(times)[10]

    def changed(fn):
        cfg = _base()
        if rank == 1:
            fn(cfg)
        return cfg
    case("long_context", changed(lambda c: c["long_context"]["tiled_mlp"].update(enabled=False)))
    case("deepspeed", changed(lambda c: c["zero_optimization"].update(stage=2)))
    case("lr", changed(lambda c: c["optimizer"]["params"].update(lr=3e-4)))
    case("sp", changed(lambda c: c.update(sequence_parallel_size=1)))
    case("cli", base, {"cli": {"--seq-len": 512 if rank == 0 else 1024}})
    same = os.path.join(tmp, f"same{rank}", "d.jsonl")  # the same content at two paths: they agree
    os.makedirs(os.path.dirname(same), exist_ok=True)
    with open(same, "w") as f:
        f.write('{"text": "w1 w2 w3"}\n')
    case("data_same_content", base, {"data": data_identity(same)})
    other = os.path.join(tmp, f"d{rank}.jsonl")
    with open(other, "w") as f:
        f.write('{"text": "w1 w2 w3"}\n' * (rank + 1))
    case("data", base, {"data": data_identity(other)})
    case("agree_after_errors", base, {"cli": {"--seq-len": 512}})  # the group is still usable after a refusal

    # host memory: the arena (2 layers x 1 x 256 tokens x 32 hidden x 4 bytes per rank, 2 ranks on this node) over
    # DS_LONGCTX_HOST_MEM: refused by initialize before the model is patched (no arena, no engine)
    cfg = _base()
    cfg["train_micro_batch_size_per_gpu"] = 1
    model = build(tiny_config(), seed=0)
    os.environ["DS_LONGCTX_HOST_MEM"] = "100KiB"
    try:
        ds_longctx.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        out["host_refused"] = None
    except ConfigError as e:
        out["host_refused"] = str(e)
    out["patched_after_refusal"] = get_memory_handle(model) is not None
    del os.environ["DS_LONGCTX_HOST_MEM"]
    # the same run fits this machine: the arena after one step holds exactly what the check counted
    engine, *_ = ds_longctx.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    from ds_longctx.dist.comm import sp_group, sp_rank
    from ds_longctx.data import shard_batch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (1, 512), generator=g)
    batch = shard_batch({"input_ids": ids, "labels": ids.clone()}, sp_rank(sp_group()), 2)
    loss = engine(**batch).loss
    engine.backward(loss)
    engine.step()
    from ds_longctx.initialize import _host_budget, _local_ranks

    need = host_need(cfg, engine.long_context_spec, engine.module, world, _host_budget(), _local_ranks(world))
    arena = get_memory_handle(engine).offloader.target.arena
    out["arena"] = (arena.allocated_bytes, need.per_rank.get("offloaded activations"), need.local_ranks)
    from ds_longctx.job.hostmem import DEVICE_AS_HOST
    from ds_longctx.planner.units import fmt_bytes

    out["device_side"] = fmt_bytes(need.per_rank[DEVICE_AS_HOST])
    return out


@pytest.mark.distributed
def test_disagreements_are_one_error_on_every_rank_and_host_memory_is_checked_first(tmp_path):
    results = run_distributed(_cases, 2, str(tmp_path), timeout=400)
    for rank, out in enumerate(results):
        expect = {
            "long_context": "long_context.tiled_mlp.enabled: differs between the ranks of this job: true on rank 0 "
                            "(host ",
            "deepspeed": "zero_optimization.stage: differs between the ranks of this job: 3 on rank 0 (host ",
            "lr": "optimizer.params.lr: differs between the ranks of this job: 0.001 on rank 0 (host ",
            "sp": "sequence_parallel_size: differs between the ranks of this job: 2 on rank 0 (host ",
            "cli": "--seq-len: differs between the ranks of this job: 512 on rank 0 (host ",
            "data": "data (the data this rank reads): differs between the ranks of this job: "
                    f"{str(tmp_path / 'd0.jsonl')!r} (21 bytes, sha256 ",
        }
        for name, start in expect.items():
            text = out[name]
            assert text is not None and text.startswith(start), (rank, name, text)
            assert " on rank 1 (host " in text and ". Fix: " in text, (rank, name, text)
        assert results[0][name] == results[1][name]  # the same words on every rank
        assert f"{str(tmp_path / 'd1.jsonl')!r} (42 bytes" in out["data"]
        assert out["data_same_content"] is None and out["agree_after_errors"] is None
        assert out["cost_s"] < 1.0, out["cost_s"]  # a sanity bound (milliseconds measured), not a timing claim
        # 2 local ranks x 2 offloaded layers x 256 tokens x 32 hidden x 4 bytes = 128 KiB over 100 KiB
        text = out["host_refused"]
        assert text is not None and text.startswith(
            "long_context.activation_checkpointing.offload: rank 0 on host "), text
        # on this CPU machine the device side (the model states ZeRO keeps "on the device") is host RAM too
        import re

        m = re.search(r"this node's ranks need (.+?) of host memory at sequence_length 512 \(2 local rank\(s\) x "
                      r"(.+?): (.+?)\), over the node's 100\.00 KiB \(DS_LONGCTX_HOST_MEM=100KiB\); refused before "
                      "anything is allocated", text)
        assert m, text
        assert sorted(m.group(3).split(", ")) == sorted(["offloaded activations 64.00 KiB",
                                                         f"device side (host RAM: no CUDA device) {out['device_side']}"]
                                                        ), text
        assert "Fix: offload the layer inputs to NVMe" in text
        assert out["patched_after_refusal"] is False
        held, counted, local = out["arena"]
        assert held == counted == 2 * 256 * 32 * 4 and local == 2, out["arena"]
