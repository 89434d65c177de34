"""The planner against real CPU measurements (at full depth and extrapolated from two shallow steps, with a
vocabulary whose logits dominate the step), its extrapolation against its own full-depth simulation at a GPU
model's shapes, and resolve_auto."""
import copy
import gc

import pytest
import torch

from dist_utils import run_distributed

SEQ, VOCAB = 2048, 64
MODEL = dict(heads=4, kv_heads=2, vocab=VOCAB, layers=2, intermediate=48)
UNTIED_ALL = {"attention": {"implementation": "untied_ulysses", "heads_per_chunk": 1},
              "activation_checkpointing": {"enabled": True, "offload": "cpu"},
              "tiled_mlp": {"enabled": True, "shards": "auto"}, "tiled_loss": {"enabled": True, "shards": "auto"}}
# name -> (long_context section, model overrides): 2 layers are simulated at full depth, 6 are extrapolated from
# the steps at 2 and 3 layers (planner/core.py); a vocabulary of 8192 makes the fp32 logits ([1024, 8192] per rank,
# 32 MiB) the step's largest tensor, where the 64-token vocabulary's are negligible
CASES = {
    "ulysses": ({"attention": {"implementation": "ulysses"}}, {}),
    "ckpt": ({"attention": {"implementation": "ulysses"}, "activation_checkpointing": {"enabled": True}}, {}),
    "offload": ({"attention": {"implementation": "ulysses"},
                 "activation_checkpointing": {"enabled": True, "offload": "cpu"}}, {}),
    "tiled": ({"attention": {"implementation": "ulysses"}, "tiled_mlp": {"enabled": True, "shards": 4},
               "tiled_loss": {"enabled": True, "shards": 4}}, {}),
    "untied_all": (UNTIED_ALL, {}),
    # 6 layers without offload: the restored inputs' prefetch (a side thread on CPU) would make the peak vary by a
    # layer input from run to run (measured -9.4% and -16.6% on two runs with offload)
    "untied_6_layers": (dict(UNTIED_ALL, activation_checkpointing={"enabled": True}), {"layers": 6}),
    "vocab_8k": ({"attention": {"implementation": "ulysses"}, "activation_checkpointing": {"enabled": True}},
                 {"vocab": 8192}),
    "vocab_8k_tiled_loss": (dict(UNTIED_ALL, tiled_loss={"enabled": True, "shards": 8}), {"vocab": 8192}),
}
# planned / measured - 1 per case, as measured on the 2-core CPU box (the same bytes on every run observed: 5 runs,
# 2026-11-27). Each case must stay within 1 percentage point of its figure, so a change of the planner's or the
# runtime's memory by more than 1% fails here. Open: the untied stack with offload is under-counted (untied_all
# -5.5%; at 6 layers -9.4% and -16.6% on two runs: 15.5 KB per layer, the size of one layer's fp32 parameters over
# the ranks, which names no holder yet, plus a prefetched input or not), and the tiled loss's 8 tiles at 8K
# vocabulary by 7.1%.
# measured with the garbage collector off during the step (_measure_worker): the same bytes in every run
OBSERVED = {"ulysses": +0.004, "ckpt": -0.014, "offload": -0.028, "tiled": -0.004, "untied_all": (-0.096, -0.055),
            "untied_6_layers": (-0.050, -0.020), "vocab_8k": +0.000, "vocab_8k_tiled_loss": -0.071}
# untied_6_layers: -2.0% run alone (here, and at 03d311a's code), -3.6% inside one full-suite run (2026-11-27, an AMD
# EPYC 2-core box): its figure is their middle, as untied_all's was (4911453); why the full suite moves it is not known
# untied_all (offloaded, so the restored inputs' prefetch runs on a side thread, as noted above for 6 layers): a range,
# the measured peak with the garbage collector off depends on which process ran before in the session (2026-11-28,
# idle box, same code): 1,447,569 bytes alone (-5.5%), 1,473,873 (-7.2%) after test_accelerate_loop's spawns,
# 1,513,105 (-9.6%) after them with the previous tests/dist_utils.py and inside the full suite, 26,304 and 65,536
# bytes apart; the planner plans 1,368,073 every time. untied_6_layers the same: -2.0% alone, -3.6% and -5.0% inside
# two full-suite runs (2026-11-27, 2026-11-28)
TOLERANCE = 0.01


def _off_observed(error: float, observed) -> bool:
    """Whether ``error`` is more than TOLERANCE outside ``observed`` (a figure, or a (low, high) range)."""
    lo, hi = observed if isinstance(observed, tuple) else (observed, observed)
    return not lo - TOLERANCE <= error <= hi + TOLERANCE


def _config(name, lc):
    from sp_cases import ds_config

    cfg = ds_config(3, 2, copy.deepcopy(lc))
    # a small IPG bucket: DeepSpeed allocates it lazily inside the first backward on CPU, where the
    # tracker would see it; the planner counts it with the model states
    cfg["zero_optimization"]["reduce_bucket_size"] = 10000
    return cfg


def _measure_worker(rank, world):
    import ds_longctx
    from ds_longctx.dist.comm import sp_group, sp_rank
    from ds_longctx.data import shard_batch
    from ds_longctx.measure.live_bytes import LiveBytesTracker
    from sp_cases import sample
    from tiny_models import build, tiny_config

    out = {}
    for name, (lc, over) in CASES.items():
        kw = dict(MODEL, **over)
        model = build(tiny_config(**kw), seed=0)
        engine, _, _, _ = ds_longctx.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                                config=_config(name, lc))
        shard = shard_batch(sample(SEQ, kw["vocab"]), sp_rank(sp_group()), 2)
        tracker = LiveBytesTracker()
        # the garbage collector off while measuring: when it ran inside the step, the untied cases' peaks varied
        # from run to run (untied_all: 1,447,569 / 1,473,873 / 1,513,105 bytes in three runs; with it off, 1,447,569
        # in three of three), and the planner models no cyclic garbage
        gc.collect()
        gc.disable()
        try:
            # one tracker, entered twice: it keeps counting forward's live storages through backward
            with tracker:
                loss = engine(**shard).loss
            with tracker:
                engine.backward(loss)
        finally:
            gc.enable()
        engine.step()
        out[name] = tracker.peak
        engine.destroy() if hasattr(engine, "destroy") else None
    return out


@pytest.mark.distributed
def test_planner_peak_near_measured_cpu_zero3_sp2():
    from tiny_models import tiny_config

    from ds_longctx.planner import Planner

    measured = run_distributed(_measure_worker, 2, timeout=600)[0]
    errors = {}
    for name, (lc, over) in CASES.items():
        mc = tiny_config(**dict(MODEL, **over))
        # device="cpu": simulate the CPU run being measured (on CPU the offloaded copies are host memory
        # that the tracker does not see, and the planner reports them as host bytes too)
        # reserve 0: the reserve stands for CUDA context/NCCL/fragmentation, none of which a CPU run has
        r = Planner(_config(name, lc), mc, 2, "1GiB", reserve="0", device="cpu").run(SEQ)
        assert r.extrapolated == (over.get("layers", 2) > 4), (name, r.layers_simulated)
        planned = sum(v for k, v in r.breakdown.items() if k != "model_states")
        errors[name] = planned / measured[name] - 1
        print(f"{name}: planned {planned} measured {measured[name]} ({errors[name]:+.1%})")
    off = {k: (round(errors[k], 4), OBSERVED[k]) for k in CASES if _off_observed(errors[k], OBSERVED[k])}
    assert not off, off


def test_extrapolated_depth_matches_the_full_depth_simulation():
    """The planner with itself, at Llama-3-8B's layer shapes on the GPU stand-in (a step no CPU can measure): the
    step extrapolated from two shallow simulations equals the full-depth simulation within 1% (device) and exactly
    (host). Extrapolation against a measured run is test_planner_peak_near_measured_cpu_zero3_sp2's 6-layer case."""
    from ds_longctx.planner import Planner, load_model_config

    mc = load_model_config("ds_configs/models/llama3-8b.json")
    mc.num_hidden_layers = 8  # Llama-3-8B's layer shapes; extrapolating to 8 layers is the same rule as to 32
    ds = {"bf16": {"enabled": True}, "sequence_parallel_size": 8, "zero_optimization": {"stage": 3},
          "long_context": {"attention": {"implementation": "untied_ulysses", "heads_per_chunk": 2},
                           "activation_checkpointing": {"enabled": True, "offload": "cpu"},
                           "tiled_mlp": {"enabled": True}, "tiled_loss": {"enabled": True}}}
    p = Planner(ds, mc, 8, "80GiB")
    ext, full = p.run(65536), p.run(65536, full_depth=True)
    assert ext.extrapolated and not full.extrapolated
    assert abs(ext.peak_device_bytes - full.peak_device_bytes) <= 0.01 * full.peak_device_bytes
    assert ext.host_bytes == full.host_bytes
    # the allocator's slack, the largest of the shallow steps' (planner/core._slack): reserved and floor within 1%
    for key in ("reserved_by_mode", "floor_bytes"):
        a, b = ext.allocator[key], full.allocator[key]
        for x, y in (zip(a.values(), b.values()) if isinstance(a, dict) else [(a, b)]):
            assert abs(x - y) <= 0.01 * y, (key, x, y)


def test_first_layers_keeping_attention_extrapolate_like_full_depth():
    """keep_attention_output N (the first N layers) is not affine in depth; the planner blends the step with
    none and with every offloaded layer keeping: host bytes and predicted time as the full-depth simulation
    (the runtime's own per-layer choice), the device peak no lower."""
    from ds_longctx.planner import Planner, load_model_config

    mc = load_model_config("ds_configs/models/llama3-8b.json")
    mc.num_hidden_layers = 6  # simulated at 3 and 4 (keep_on_device 1), extrapolated to 6
    ds = {"bf16": {"enabled": True}, "sequence_parallel_size": 8, "zero_optimization": {"stage": 3},
          "long_context": {"attention": {"implementation": "untied_ulysses", "heads_per_chunk": 2},
                           "activation_checkpointing": {"enabled": True, "offload": "cpu", "keep_on_device": 1,
                                                        "keep_attention_output": 3},
                           "tiled_mlp": {"enabled": True}, "tiled_loss": {"enabled": True}}}
    p = Planner(ds, mc, 8, "80GiB")
    ext, full = p.run(32768), p.run(32768, full_depth=True)
    assert ext.extrapolated and not full.extrapolated
    assert ext.host_bytes == full.host_bytes
    assert abs(ext.time["seconds"] - full.time["seconds"]) <= 1e-6 * full.time["seconds"]
    assert full.peak_device_bytes <= ext.peak_device_bytes <= 1.01 * full.peak_device_bytes


def test_resolve_auto_picks_fastest_fitting_and_logs():
    from ds_longctx.planner import resolve_auto

    ds = {"bf16": {"enabled": True}, "sequence_parallel_size": 8, "zero_optimization": {"stage": 3},
          # 64K: 8K tokens per rank, two tiled-MLP shard candidates (DeepSpeed's ceil(local / hidden)) to time
          "long_context": {"sequence_length": 65536,
                           "attention": {"implementation": "untied_ulysses", "heads_per_chunk": "auto"},
                           "activation_checkpointing": {"enabled": True, "offload": "cpu"},
                           "tiled_mlp": {"enabled": True, "shards": "auto"}, "tiled_loss": {"enabled": True}}}
    logs = []
    big = resolve_auto(ds, "ds_configs/models/llama3-8b.json", 8, 80 * 2**30, log=logs.append)
    assert big["attention.heads_per_chunk"] == 4  # 32 heads / SP 8: everything fits, fastest is all 4
    assert isinstance(big["tiled_mlp.shards"], int) and isinstance(big["tiled_loss.shards"], int)
    assert any("heads_per_chunk=4" in m for m in logs)
    assert ds["long_context"]["attention"]["heads_per_chunk"] == "auto"  # the input is not modified


def _no_offload_8b():
    return {"bf16": {"enabled": True}, "sequence_parallel_size": 8,
            "zero_optimization": {"stage": 3, "reduce_bucket_size": 5e8, "overlap_comm": True},
            "long_context": {"attention": {"implementation": "untied_ulysses", "heads_per_chunk": 1},
                             "activation_checkpointing": {"enabled": True, "offload": "cpu"},
                             "tiled_mlp": {"enabled": True}, "tiled_loss": {"enabled": True}}}


def test_budget_defaults_to_h100_usable_and_a_stated_reserve(monkeypatch):
    import torch

    from ds_longctx.planner import Planner, load_model_config
    from ds_longctx.planner.core import device_budget

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    mc = load_model_config("ds_configs/models/llama3-8b.json")
    p = Planner(_no_offload_8b(), mc, 8)
    assert p.budget == int(79.1 * 2**30) and p.reserve == 2 * 2**30
    assert "H100" in p.budget_source
    assert device_budget("h100")[0] == p.budget and device_budget("80GiB")[0] == 80 * 2**30


def test_step_only_fp32_grad_and_reduce_scatter_transients():
    """ZeRO-3 without optimizer offload: the fp32 sub-group grad exists only inside step() (after the
    activations are freed), so it is in the step peak, not in the activation peak; backward carries the
    reduce-scatter flat copy of one IPG bucket + the full-size grads of the largest layer block."""
    from ds_longctx.planner import Planner, load_model_config

    mc = load_model_config("ds_configs/models/llama3-8b.json")
    p = Planner(_no_offload_8b(), mc, 8, "80GiB")
    part = -(-p.params.total // 8)
    assert p.states.step_transient_device == min(int(1e9), part) * 4
    assert "grads" in p.states.device and p.states.device["grads"] == part * 2  # bf16 partition only
    mlp = 3 * 4096 * 14336
    assert p.params.largest_layer_block == mlp
    assert p.states.device["zero transients"] == (int(5e8) + mlp) * 2
    r = p.run(65536)
    assert r.activation_peak_bytes == sum(r.breakdown.values())
    assert r.step_peak_bytes == p.states.device_total + p.states.step_transient_device
    assert r.peak_device_bytes == max(r.activation_peak_bytes, r.step_peak_bytes)
    assert any("optimizer step" in n for n in r.notes)


def _zero12_buffers_worker(rank, world, cases):
    """Real DeepSpeed ZeRO-1/2 engines after one backward: the IPG bucket buffers and the full grads."""
    import deepspeed

    from tiny_models import build, tiny_config

    out = []
    for zero in cases:
        model = build(tiny_config(heads=4, kv_heads=2, vocab=64, layers=2, intermediate=48), seed=0)
        cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": dict(zero),
               "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_allow_untested_optimizer": True}
        engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        seen = {"bufs": 0, "grads": 0}
        setup, reduce = opt.setup_buckets, opt.reduce_gradients

        def setup_buckets():  # observe (not replace) DeepSpeed's own allocation: it frees them after backward
            setup()
            seen["bufs"] = max(seen["bufs"], sum(b.numel() * b.element_size() for bk in opt.ipg_buckets.values()
                                                 for b in bk.buffer))

        def reduce_gradients(*a, **k):  # ZeRO-1: the full grads, just before their reduction
            seen["grads"] = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()
                                if p.grad is not None)
            return reduce(*a, **k)

        opt.setup_buckets, opt.reduce_gradients = setup_buckets, reduce_gradients
        ids = torch.randint(0, 64, (1, 32))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        out.append((seen["bufs"], seen["grads"], sum(p.numel() for p in model.parameters())))
        engine.destroy() if hasattr(engine, "destroy") else None
    return out


@pytest.mark.distributed
def test_zero12_bucket_buffers_and_grads_equal_a_real_engines():
    """ZeRO-1/2 model states against DeepSpeed's own engines (2 ranks, gloo, fp32): the contiguous-gradients
    bucket buffers (two with overlap_comm) and ZeRO-1's full gradients, byte for byte."""
    from ds_longctx.planner.model_states import ParamInfo, compute

    cases = [{"stage": 1, "reduce_bucket_size": 3000}, {"stage": 1, "reduce_bucket_size": 3000, "overlap_comm": True},
             {"stage": 2, "reduce_bucket_size": 3000}, {"stage": 2, "reduce_bucket_size": 3000, "overlap_comm": True}]
    measured = run_distributed(_zero12_buffers_worker, 2, cases, timeout=300)[0]
    for zero, (bufs, grads, P) in zip(cases, measured):
        st = compute({"zero_optimization": zero}, ParamInfo(total=P, largest_module=0), 2)
        assert st.device["zero buffers"] == bufs, (zero, st.device, bufs)
        if zero["stage"] == 1:  # "grads" = the full grads + the fp32 grad partition (P/N, counted apart)
            assert st.device["grads"] - -(-P // 2) * 4 == grads, (zero, st.device, grads)
