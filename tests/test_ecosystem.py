"""HF Trainer / Accelerate / DeepSpeed ALST users: ds_longctx.enable() + keys (or the one-line swap)
train exactly like a single process, and every silent case is a clear error.

Trainer startup is slow on CPU, so each spawned world runs several cases (process state reset in
between, tests/eco_cases.py)."""
import math

import pytest
import torch

from dist_utils import run_distributed
from eco_cases import ProcessState, delta_deviation, deltas

STEPS = 3
# SGD deltas: per-element deviation from the one-process run in units of what fp32 resolves there
# (eco_cases.delta_deviation); measured worst 9.0 for SP=2 + memory stack, 3.0e6 for a double count
ULP_TOL = 32


def _assert_same_training(ref, got, what, rel=1e-5, tol=ULP_TOL):
    assert len(got["losses"]) == STEPS == len(ref["losses"]), (what, got["losses"])
    for i, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
        assert math.isclose(a, b, rel_tol=rel), (what, i + 1, got["losses"], ref["losses"])
    for n in ref["before"]:
        assert torch.equal(got["before"][n], ref["before"][n]), (what, n)
    d_ref = deltas(ref)
    for n in d_ref:
        assert d_ref[n].abs().max() > 0, (what, n)  # the test can fail: every parameter moved
    # fp32, 3 SGD steps, summation order differs (sharded sequence, ZeRO reduce-scatter, tiles)
    errs = delta_deviation(ref, got)
    worst = max(errs, key=errs.get)
    print(what, "worst delta deviation (fp32 resolution units)", worst, errs[worst])
    assert errs[worst] < tol, (what, worst, errs[worst], errs)


def _reference(rank, world):
    import hf_trainer
    import trl_sft

    state = ProcessState()
    out = {"trainer": hf_trainer.train(sp=1, use_ds_longctx=False, record_params=True, steps=STEPS,
                                       output_dir="/tmp/ds_longctx_test_ref")}
    state.reset()
    out["trl"] = trl_sft.train(sp=1, use_ds_longctx=False, packing=False, steps=STEPS,
                               output_dir="/tmp/ds_longctx_test_trl_ref")
    return out


@pytest.fixture(scope="module")
def reference():
    return run_distributed(_reference, 1)[0]


def _trainer_sp2(rank, world):
    import hf_trainer
    import transformers.trainer as hf_trainer_mod

    from ds_longctx.config import ConfigError

    state = ProcessState()
    out = {}
    kw = dict(sp=2, record_params=True, steps=STEPS, output_dir=f"/tmp/ds_longctx_test_sp{rank}")
    out["untied"] = hf_trainer.train(attention="untied_ulysses", memory_stack=True, **kw)
    state.reset()
    out["ulysses"] = hf_trainer.train(attention="ulysses", memory_stack=True, **kw)
    state.reset()
    out["hf_alst"] = hf_trainer.train(use_ds_longctx=False, **kw)  # HF's own path, same data
    state.reset()
    out["ulysses_plain"] = hf_trainer.train(attention="ulysses", memory_stack=False, **kw)
    state.reset()
    # negative control: without the SP-loss patch the Trainer aggregates our SP-global loss again
    import ds_longctx.integration as integration

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
    try:
        hf_trainer.train(attention="ulysses", parallelism_config=False, **kw)
        out["no_pc"] = None
    except ConfigError as e:
        out["no_pc"] = str(e)
    state.reset()
    return out


@pytest.mark.distributed
def test_trainer_with_parallelism_config_equals_single_process(reference):
    ref = reference["trainer"]
    res = run_distributed(_trainer_sp2, 2)
    failures = []
    for r in res:
        for key, what, tol in (("hf_alst", "HF's own ALST", ULP_TOL), ("ulysses_plain", "ulysses", ULP_TOL),
                               ("ulysses", "ulysses + memory stack", ULP_TOL),
                               ("untied", "untied_ulysses + memory stack", ULP_TOL)):
            try:
                _assert_same_training(ref, r[key], what, tol=tol)
            except AssertionError as e:
                failures.append(str(e)[:300])
    assert not failures, failures
    for r in res:
        # the double-counted gradient is visibly wrong (losses at step 1 still agree). Its error scales
        # each rank's gradient by SP x (its share of valid tokens), so it shows only when the shards
        # hold different numbers of valid targets: the samples mask their first 5 labels for that
        worst = max(delta_deviation(ref, r["double_counted"]).values())
        print("double-counted worst delta deviation", worst)
        assert worst > 100 * ULP_TOL, worst
        assert r["no_pc"] is not None and "ParallelismConfig(sp_backend='deepspeed', sp_size=2)" in r["no_pc"], \
            r["no_pc"]


def _alst_trl_mpu(rank, world):
    import alst_tutorial
    import trl_sft

    from ds_longctx.config import ConfigError

    state = ProcessState()
    out = {"alst_deepspeed": alst_tutorial.run(use_ds_longctx=False)}
    state.reset()
    out["alst_swap"] = alst_tutorial.run(use_ds_longctx=True)  # register_with_transformers + mpu kept
    state.reset()
    out["alst_swap_tiled"] = alst_tutorial.run(use_ds_longctx=True, tiled_loss=True)  # outputs.loss
    state.reset()
    kw = dict(sp=2, packing=False, steps=STEPS, output_dir=f"/tmp/ds_longctx_test_trl{rank}")
    out["trl_hf"] = trl_sft.train(use_ds_longctx=False, **kw)
    state.reset()
    out["trl"] = trl_sft.train(use_ds_longctx=True, **kw)
    state.reset()
    # an mpu whose SP degree contradicts the config
    import ds_longctx
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as pss
    from tiny_models import build, tiny_config

    pss.initialize_sequence_parallel(2)
    try:
        ds_longctx.initialize(model=build(tiny_config()), mpu=pss, config={
            "train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 1, "long_context": {}})
        out["mpu_mismatch"] = None
    except ConfigError as e:
        out["mpu_mismatch"] = str(e)
    state.reset()
    return out


@pytest.mark.distributed
def test_alst_tutorial_swap_trl_and_mpu_errors(reference):
    res = run_distributed(_alst_trl_mpu, 2)
    for r in res:
        ds = r["alst_deepspeed"]
        assert len(ds) == 4 and ds[0] != ds[1]  # 2 samples x 2 SP turns, trained in between
        for key in ("alst_swap", "alst_swap_tiled"):
            for a, b in zip(r[key], ds):
                assert math.isclose(a, b, rel_tol=1e-5), (key, r[key], ds)
        # TRL SFTTrainer (fixed-length samples) under SP: ds_longctx equals TRL on HF's own ALST path;
        # step 1 equals the single-process TRL run (later steps: see examples/trl_sft.py, upstream)
        for a, b in zip(r["trl"]["losses"], r["trl_hf"]["losses"]):
            assert math.isclose(a, b, rel_tol=1e-5), (r["trl"], r["trl_hf"])
        assert math.isclose(r["trl"]["losses"][0], reference["trl"]["losses"][0], rel_tol=1e-5)
        assert r["mpu_mismatch"] and "config says 1" in r["mpu_mismatch"] and "size 2" in r["mpu_mismatch"], \
            r["mpu_mismatch"]
