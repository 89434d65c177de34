"""HF Trainer / Accelerate / DeepSpeed ALST users: ds_longctx.enable() + keys (or the one-line swap)
train exactly like a single process, and every silent case is a clear error.

Trainer startup is slow on CPU, so each spawned world runs several cases (process state reset in
between, tests/eco_cases.py)."""
import math

import pytest
import torch

from dist_utils import result_or_raise, run_distributed_side_by_side
from eco_cases import ProcessState, config_error, delta_errors, deltas

STEPS = 3
# the Trainer cases: 4 samples = 4 SP turns per epoch at SP=2 (4 steps at one process), 6 steps: the SP loader's
# second pass must be the one-process run's second epoch (hf_loader's module doc, "Passes")
TRAINER = dict(steps=6, samples=4)
TOL = 1e-5  # see _assert_same_training


def _assert_same_training(ref, got, what, rel=1e-5, tol=TOL):
    assert len(got["losses"]) == len(ref["losses"]) in (STEPS, TRAINER["steps"]), (what, got["losses"])
    for i, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
        assert math.isclose(a, b, rel_tol=rel), (what, i + 1, got["losses"], ref["losses"])
    for n in ref["before"]:
        assert torch.equal(got["before"][n], ref["before"][n]), (what, n)
    for n, d in deltas(ref).items():
        assert d.abs().max() > 0, (what, n)  # the test can fail: every parameter moved
    # fp32 SGD, 3 steps, summation order differs (sharded sequence, ZeRO reduce-scatter, tiles): the
    # relative error beyond one ulp of the parameter per element (eco_cases.delta_errors)
    errs, raw = delta_errors(ref, got)
    worst = max(errs, key=errs.get)
    print(what, "worst delta deviation", worst, errs[worst], "without the ulp allowance", max(raw.values()))
    assert errs[worst] < tol, (what, worst, errs[worst], errs)


# TRL SFTTrainer data: fixed-length samples, and packed padding-free rows (position_ids restarting per
# document). 25 samples of 5/10/16 tokens packed into rows of at most 31: the first SP turn pairs a
# 5-token row (padded to 6) with a 31-token row (padded to 32), and a document boundary falls on the
# shard edge (16).
TRL_CASES = {"trl_fixed": dict(packing=False), "trl_packed": dict(packing=True, seq_len=31, samples=25)}


def _reference(rank, world):
    import hf_trainer
    import trl_sft

    state = ProcessState()
    out = {"trainer": hf_trainer.train(sp=1, use_ds_longctx=False, record_params=True, **TRAINER,
                                       output_dir="/tmp/ds_longctx_test_ref")}
    for key, kw in TRL_CASES.items():
        state.reset()
        out[key] = trl_sft.train(sp=1, use_ds_longctx=False, record_params=True, steps=STEPS,
                                 output_dir="/tmp/ds_longctx_test_trl_ref", **kw)
    return out


@pytest.fixture(scope="module")
def spawns():
    """The one-process reference and the two SP=2 runs (independent spawns, own output dirs) started side by
    side, once; each test re-raises its own run's failure."""
    ref, trainer, alst = run_distributed_side_by_side((_reference, 1), (_trainer_sp2, 2), (_alst_trl_mpu, 2),
                                                      return_exceptions=True)
    return {"reference": ref, "trainer_sp2": trainer, "alst_trl_mpu": alst}


@pytest.fixture(scope="module")
def reference(spawns):
    return result_or_raise(spawns["reference"])[0]


def _trainer_sp2(rank, world):
    import hf_trainer
    import transformers.trainer as hf_trainer_mod

    state = ProcessState()
    out = {}
    kw = dict(sp=2, record_params=True, output_dir=f"/tmp/ds_longctx_test_sp{rank}", **TRAINER)
    out["untied"] = hf_trainer.train(attention="untied_ulysses", memory_stack=True, **kw)
    state.reset()
    out["ulysses"] = hf_trainer.train(attention="ulysses", memory_stack=True, **kw)
    state.reset()
    out["hf_alst"] = hf_trainer.train(use_ds_longctx=False, **kw)  # HF's own path, same data
    state.reset()
    out["ulysses_plain"] = hf_trainer.train(attention="ulysses", memory_stack=False, **kw)
    state.reset()
    # negative control: without the SP-loss patch the Trainer aggregates our SP-global loss again
    import ds_longctx.hf.integration as integration

    real_enable = integration.enable

    def enable_without_loss_patch():
        real_enable()
        hf_trainer_mod.deepspeed_sp_compute_loss = integration._ORIGINALS["sp_loss"]

    integration.enable = enable_without_loss_patch  # ds_longctx.enable() looks it up at call time
    try:
        out["double_counted"] = hf_trainer.train(attention="ulysses", memory_stack=False, **kw)
    finally:
        integration.enable = real_enable
    state.reset()
    # silent case: SP keys + enable() but no ParallelismConfig -> the Trainer would run plain DP
    out["no_pc"] = config_error(hf_trainer.train, attention="ulysses", parallelism_config=False, **kw)
    state.reset()
    return out


@pytest.mark.distributed
def test_trainer_with_parallelism_config_equals_single_process(reference, spawns):
    ref = reference["trainer"]
    res = result_or_raise(spawns["trainer_sp2"])
    failures = []
    for r in res:
        for key, what, tol in (("hf_alst", "HF's own ALST", TOL), ("ulysses_plain", "ulysses", TOL),
                               ("ulysses", "ulysses + memory stack", TOL),
                               ("untied", "untied_ulysses + memory stack", TOL)):
            try:
                _assert_same_training(ref, r[key], what, tol=tol)
            except AssertionError as e:
                failures.append(str(e)[:300])
    assert not failures, failures
    for r in res:
        # the double-counted gradient is visibly wrong (losses at step 1 still agree). Its error scales
        # each rank's gradient by SP x (its share of valid tokens), so it shows only when the shards
        # hold different numbers of valid targets: the samples mask their first 5 labels for that
        d_ref, d_bad = deltas(ref), deltas(r["double_counted"])
        worst = max(float((d_bad[n] - d_ref[n]).norm() / d_ref[n].norm()) for n in d_ref)
        print("double-counted worst delta deviation", worst)
        assert worst > 1e-2, worst
        assert r["no_pc"] is not None and "ParallelismConfig(sp_backend='deepspeed', sp_size=2)" in r["no_pc"], \
            r["no_pc"]


def _adapter_errors(rank):
    """ds_longctx's SP loader adapter on hand-made batches: a bad batch on one rank, and one rank out of
    batches first, are errors on BOTH ranks (no hang); rows of different lengths are fine; a loader
    replicated over the SP group gives each batch once."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as pss

    from ds_longctx.hf.loader import SPTurnsAdapter

    pss.initialize_sequence_parallel(2)
    group = pss.get_sequence_parallel_group()

    def row(n):
        return {"input_ids": torch.arange(n).view(1, n) + 10 * rank, "position_ids": torch.arange(n).view(1, n)}

    out = {}
    ok = SPTurnsAdapter([row(5 if rank == 0 else 8)], rank, group, 2, "cpu")
    out["lengths"] = [tuple(b["input_ids"].shape) for b in ok]  # 2 turns: rank 0's row (padded to 6), rank 1's
    bad = dict(row(8), token_type_ids=torch.zeros(1, 8, dtype=torch.long)) if rank == 1 else row(8)
    # a loader replicated over the SP group (a plain Accelerate loop's): each step's batch once, sharded
    same = {"input_ids": torch.arange(8).view(1, 8), "position_ids": torch.arange(8).view(1, 8)}
    rep = SPTurnsAdapter([same, dict(same, input_ids=same["input_ids"] + 1)], rank, group, 2, "cpu")
    out["replicated"] = [b["input_ids"].tolist() for b in rep]
    for key, batches in (("bad_key", [bad]), ("ran_out", [row(8)] * (2 if rank == 0 else 1)),
                         ("replicated_then_not", [same, row(8)])):
        out[key] = config_error(lambda: list(SPTurnsAdapter(batches, rank, group, 2, "cpu")))
    out.update(_adapter_skips(rank, group))
    return out


def _adapter_skips(rank, group):
    """skip_first_batches on the SP adapters (what a resume calls), with hand-made loaders: a list skipped by
    slicing stands in for Accelerate's skip of the wrapped loader. Each item is named by its first token."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

    from ds_longctx.hf.loader import RoutedSPAdapter, SPTurnsAdapter, skip_first_items

    def cut(dl, k):
        return dl[k:]

    def row(first):  # 8 tokens from `first`
        ids = torch.arange(first, first + 8).view(1, 8)
        return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(8).view(1, 8)}

    def firsts(items):  # the sample each item is a shard of (shard r starts 4 r tokens in)
        return [int(b["input_ids"][0, 0]) - 4 * rank for b in items]

    own = [row(100 * b + 10 * rank) for b in range(3)]  # batch b of this rank: 100 b + 10 rank
    out = {}
    turns = SPTurnsAdapter(own, rank, group, 2, "cpu")
    out["turns_all"] = firsts(turns)
    out["turns_all_again"] = firsts(turns)  # a fresh pass at each iter()
    skipped = turns.skip_first_batches(3, cut)  # 1 whole batch of each rank + rank 0's turn of batch 1
    out["turns_skip3"] = (len(skipped), firsts(skipped), firsts(skipped))  # skips again on a second pass
    shared = [row(100 * b) for b in range(4)]  # every rank the same batches: one item per batch
    out["replicated_skip3"] = firsts(SPTurnsAdapter(shared, rank, group, 2, "cpu").skip_first_batches(3, cut))
    out["replicated_skip5"] = firsts(SPTurnsAdapter(shared, rank, group, 2, "cpu").skip_first_batches(5, cut))
    known = SPTurnsAdapter(shared, rank, group, 2, "cpu")
    out["replicated_known_skip1"] = (firsts(known), firsts(known.skip_first_batches(1, cut)))
    # DeepSpeed's adapter (HF's own ALST path while enabled; also built directly): always turns
    routed = RoutedSPAdapter(own, rank, group, 2, "cpu", _deepspeed_cls=UlyssesSPDataLoaderAdapter,
                             _is_ours=lambda: False)
    out["deepspeed_all"] = (firsts(routed), firsts(routed))
    out["deepspeed_skip3"] = firsts(routed.skip_first_batches(3, cut))
    direct = UlyssesSPDataLoaderAdapter(own, sp_rank=rank, sp_group=group, sp_world_size=2, device="cpu")
    out["deepspeed_direct_skip2"] = firsts(skip_first_items(direct, 2, cut))
    try:
        turns.dataset
    except AttributeError as e:  # Accelerate's own skip_first_batches reads it: a clear no
        out["no_dataset"] = str(e)
    return out


def _alst_trl_mpu(rank, world):
    import alst_tutorial
    import trl_sft


    state = ProcessState()
    out = {"alst_deepspeed": alst_tutorial.run(use_ds_longctx=False)}
    state.reset()
    out["alst_swap"] = alst_tutorial.run(use_ds_longctx=True)  # register_with_transformers + mpu kept
    state.reset()
    out["alst_swap_tiled"] = alst_tutorial.run(use_ds_longctx=True, tiled_loss=True)  # outputs.loss
    state.reset()
    kw = dict(sp=2, steps=STEPS, record_params=True, output_dir=f"/tmp/ds_longctx_test_trl{rank}")
    out["trl_fixed_hf"] = trl_sft.train(use_ds_longctx=False, **kw, **TRL_CASES["trl_fixed"])  # HF's own ALST
    state.reset()
    out["trl_fixed"] = trl_sft.train(**kw, **TRL_CASES["trl_fixed"])
    state.reset()
    out["trl_packed"] = trl_sft.train(**kw, **TRL_CASES["trl_packed"])
    state.reset()
    out["trl_packed_untied"] = trl_sft.train(attention="untied_ulysses", memory_stack=True, **kw,
                                             **TRL_CASES["trl_packed"])
    state.reset()
    # negative control: the same rows with the documents erased (position_ids 0..S-1) train differently,
    # so the packed equality above depends on the document structure reaching attention
    from ds_longctx.data import turns

    real_varlen = turns.varlen_checked

    def one_document(batch):
        batch = real_varlen(batch)
        return dict(batch, position_ids=torch.arange(batch["input_ids"].shape[1]).expand_as(batch["input_ids"]))

    turns.varlen_checked = one_document
    try:
        out["trl_packed_one_document"] = trl_sft.train(**dict(kw, record_params=False), **TRL_CASES["trl_packed"])
    finally:
        turns.varlen_checked = real_varlen
    state.reset()
    out["adapter_errors"] = _adapter_errors(rank)
    state.reset()
    # an mpu whose SP degree contradicts the config
    import ds_longctx
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as pss
    from tiny_models import build, tiny_config

    pss.initialize_sequence_parallel(2)
    out["mpu_mismatch"] = config_error(ds_longctx.initialize, model=build(tiny_config()), mpu=pss, config={
        "train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 1, "long_context": {}})
    state.reset()
    return out


@pytest.mark.distributed
def test_alst_tutorial_swap_trl_and_mpu_errors(reference, spawns):
    res = result_or_raise(spawns["alst_trl_mpu"])
    for r in res:
        ds = r["alst_deepspeed"]
        assert len(ds) == 4 and ds[0] != ds[1]  # 2 samples x 2 SP turns, trained in between
        for key in ("alst_swap", "alst_swap_tiled"):
            for a, b in zip(r[key], ds):
                assert math.isclose(a, b, rel_tol=1e-5), (key, r[key], ds)
    # TRL SFTTrainer under SP=2 trains like its one-process run: fixed-length samples (ds_longctx and
    # HF's own ALST path), packed padding-free rows through ds_longctx's SP loader (per-document attention)
    failures = []
    for r in res:
        for key, ref_key, what, tol in (
                ("trl_fixed_hf", "trl_fixed", "TRL fixed-length, HF's own ALST", TOL),
                ("trl_fixed", "trl_fixed", "TRL fixed-length, ulysses", TOL),
                ("trl_packed", "trl_packed", "TRL packed, ulysses", TOL),
                ("trl_packed_untied", "trl_packed", "TRL packed, untied_ulysses + memory stack", TOL)):
            try:
                _assert_same_training(reference[ref_key], r[key], what, tol=tol)
            except AssertionError as e:
                failures.append(str(e)[:300])
    assert not failures, failures
    for rank, r in enumerate(res):
        erased, ref = r["trl_packed_one_document"]["losses"], reference["trl_packed"]["losses"]
        print("packed rows with the documents erased", erased, "one-process", ref)
        # step 1's row is one document; step 2's differs by 1.3e-3 (measured), 100x the tolerance above
        assert abs(erased[1] - ref[1]) > 1e-4 * abs(ref[1]), (erased, ref)
        errs = r["adapter_errors"]
        assert errs["lengths"] == [(1, 3), (1, 4)], errs
        assert errs["bad_key"] and "batch.token_type_ids: (SP rank 1's batch) has the sequence dimension" in \
            errs["bad_key"], errs
        assert errs["ran_out"] and "ran out on SP ranks [1]" in errs["ran_out"], errs
        assert errs["replicated"] == [[list(range(4 * rank, 4 * rank + 4))],
                                      [list(range(4 * rank + 1, 4 * rank + 5))]], errs  # 2 steps, not 4 turns
        assert errs["replicated_then_not"] and "same batches at first" in errs["replicated_then_not"], errs
        # skip_first_batches counts SP turns (rank 0's batch b, rank 1's batch b, ...): 3 turns are batch 0 of both
        # ranks and rank 0's batch 1; a loader replicated over the group yields one item per batch
        everything = [0, 10, 100, 110, 200, 210]
        assert errs["turns_all"] == errs["turns_all_again"] == everything, errs
        assert errs["turns_skip3"] == (3, everything[3:], everything[3:]), errs
        assert errs["replicated_skip3"] == [300] and errs["replicated_skip5"] == [], errs
        assert errs["replicated_known_skip1"] == ([0, 100, 200, 300], [100, 200, 300]), errs
        assert errs["deepspeed_all"] == (everything, everything), errs
        assert errs["deepspeed_skip3"] == everything[3:] and errs["deepspeed_direct_skip2"] == everything[2:], errs
        assert "skip_first_batches after ds_longctx.enable()" in errs["no_dataset"], errs
        assert r["mpu_mismatch"] and "config says 1" in r["mpu_mismatch"] and "size 2" in r["mpu_mismatch"], \
            r["mpu_mismatch"]
