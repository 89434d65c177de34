"""Issue 20 item 2 / issue 23 item 2: the attention ops' FLOP formulas, and the planner's counted work."""
import torch
from torch.utils.flop_counter import FlopCounterMode

from ds_longctx.attention import kernels
from ds_longctx.measure.flops import causal_pairs


def test_causal_pairs_brute_force():
    for sq, sk in [(5, 5), (3, 7), (1, 4), (7, 3), (6, 6)]:
        brute = sum(min(sk, max(0, i + sk - sq + 1)) for i in range(sq))
        assert causal_pairs(sq, sk, True) == brute and causal_pairs(sq, sk, False) == sq * sk


def test_flop_counter_sees_the_attention_ops_causal_half():
    """FlopCounterMode around a real CPU kernel call: forward 4*h*d*S(S+1)/2, backward 2.5x (torch's convention)."""
    be = kernels.get_backend("sdpa", "cpu")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 64, n, 16, generator=g) for n in (4, 2, 2))
    with FlopCounterMode(display=False) as fc:
        out, lse = be.forward(q, k, v, True, 0.25)
    fwd = 4 * 4 * 16 * (64 * 65 // 2)
    assert fc.get_total_flops() == fwd
    with FlopCounterMode(display=False) as fc:
        be.backward(out, q, k, v, out, lse, True, 0.25)
    assert fc.get_total_flops() == fwd * 5 // 2
    ref, _ = kernels.reference_attention(q.double(), k.double(), v.double(), True, 0.25)
    assert torch.allclose(out.double(), ref, atol=1e-5)


def test_planner_counts_the_whole_step():
    """The simulated 1-GPU step's counted FLOPs: attention by formula (forward, recompute, backward), the GEMMs
    6*N*S + the checkpoint recompute's 2*N*S (tiled MLP and loss run one representative tile on fake tensors:
    its work must stand for every tile), and a step time with the measured rates."""
    from ds_longctx.planner import Planner, load_model_config

    mc = load_model_config({"model_type": "llama", "hidden_size": 256, "num_attention_heads": 4,
                            "num_key_value_heads": 2, "head_dim": 64, "num_hidden_layers": 2, "vocab_size": 512,
                            "intermediate_size": 1024, "tie_word_embeddings": False})
    S = 8192
    lc = {"sequence_length": S, "attention": {"implementation": "untied_ulysses", "heads_per_chunk": 1},
          "activation_checkpointing": {"enabled": True, "offload": "none"},
          "tiled_mlp": {"enabled": True, "shards": "auto"}, "tiled_loss": {"enabled": True, "shards": "auto"},
          "rms_norm": {"enabled": True}}
    ds = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
          "sequence_parallel_size": 1, "long_context": lc}
    r = Planner(ds, mc, 1, gpu_mem="80GiB", full_depth=True).run(S)
    f = r.time["flops"]
    attn = 2 * 4 * 4 * 64 * (S * (S + 1) // 2)  # 2 layers x 4*h*d*pairs
    assert f["attention_forward"] == attn and f["attention_recompute"] == attn
    assert f["attention_backward"] == attn * 5 // 2
    layer = 256 * (256 + 2 * 128) + 256 * 256 + 3 * 256 * 1024  # q, k, v, o, gate/up/down
    gemm_fwd = 2 * S * (2 * layer + 256 * 512)
    assert abs(f["gemm_forward"] / gemm_fwd - 1) < 0.01
    # backward: 2x forward, plus the untied backward's q/k/v re-projection per stage (design: re-project, do
    # not keep), here counted for one of the two layers (the other's come from its recompute)
    qkv = 2 * S * 256 * (256 + 2 * 128)
    assert abs(f["gemm_backward"] / (2 * gemm_fwd + qkv) - 1) < 0.01
    # recompute: the checkpointed layers' forward, the tiled MLP's own per-tile recompute in its backward (so
    # the MLP's forward runs 3 times per step under checkpointing), and the tiled loss's per-tile recompute
    mlp = 3 * 256 * 1024
    assert abs(f["gemm_recompute"] / (2 * S * (2 * layer + 2 * mlp + 256 * 512)) - 1) < 0.01
    t = r.time
    assert t["seconds"] > 0 and 0 < t["mfu"] < 1 and t["target"] == "h100"
    assert abs(t["seconds"] - max(t["compute_s"], t["overlapped_s"]) - t["serial_s"]) < 1e-9


def test_step_time_fixed_costs_per_op_and_per_all_to_all():
    """The host term (ops dispatched x op_overhead_us) adds to the kernels on a CPU target (the host runs them)
    and hides under them on a GPU target (async issue) unless it is longer; each all-to-all call adds its
    latency to the serial part."""
    import dataclasses

    from ds_longctx.planner.rates import H100, step_time

    work = {("gemm", "forward", 1024): (7.66e13, 1e9, 1000.0), ("other", "forward", ""): (0.0, 2.93e9, 3000.0),
            ("a2a", "forward", "all_to_all"): (0.0, 3.5e9, 20.0)}
    r = dataclasses.replace(H100, op_overhead_us=10.0, collective_latency_us=30.0)
    kernels = 7.66e13 / (r.gemm_tflops * 1e12) + 2.93e9 / (r.hbm_gbps * 1e9)
    t = step_time(work, {}, r, 1e12, 1000, a2a_internode=False)
    assert t.calls == {"ops": 4000, "a2a": 20}
    assert t.compute_s == kernels  # 4000 x 10 us = 0.04 s < kernels: hidden
    assert t.parts["host_overhead"] == 4000 * 10e-6
    assert t.serial_s == 3.5e9 / (r.a2a_intra_gbps * 1e9) + 20 * 30e-6
    cpu = step_time(work, {}, dataclasses.replace(r, host_async=False), 1e12, 1000, a2a_internode=False)
    assert cpu.compute_s == kernels + 4000 * 10e-6
    slow = step_time(work, {}, dataclasses.replace(r, op_overhead_us=1000.0), 1e12, 1000, a2a_internode=False)
    assert slow.compute_s == 4000 * 1000e-6  # host-bound: the device waits for the issue
    # the old (flops, bytes) work records still read, with no calls
    old = step_time({k: v[:2] for k, v in work.items()}, {}, r, 1e12, 1000, a2a_internode=False)
    assert old.calls == {"ops": 0, "a2a": 0} and old.compute_s == kernels


def test_counted_calls_match_a_real_cpu_step():
    """The planner's op counts (Accountant.work's calls) are the ops a real step dispatches: GEMM and attention
    calls exactly (u=1 against u=2: the per-stage calls the fixed-cost term charges), the other ops within 5%
    (the fake step's shortcuts for in-place ops are counted alike; a few input set-up ops differ)."""
    import os
    import sys

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import planner_time as pt

    from ds_longctx.config import parse
    from ds_longctx.measure.flops import op_cost
    from tiny_models import patch
    from ds_longctx.planner import load_model_config
    from ds_longctx.planner.simulate import simulate_step

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            c = op_cost(func, args, kwargs or {}, out)
            if c is not None:
                self.n[c[0]] = self.n.get(c[0], 0) + 1
            return out

    seq, counts = 512, {}
    for variant in ("full", "untied-u2"):
        ds = pt.ds_config(seq, variant)
        model = pt._build(seq, variant)
        patched = patch(model, parse(ds), None, 1.0)
        ids = torch.randint(0, pt.MODEL["vocab_size"], (1, seq))
        try:
            with Count() as real:
                model(input_ids=ids, position_ids=torch.arange(seq).unsqueeze(0), shift_labels=ids).loss.backward()
        finally:
            patched.remove()
        sim = {}
        r = simulate_step(load_model_config(dict(pt.MODEL)), ds, parse(ds), 1, seq, pt.MODEL["num_hidden_layers"],
                          device="cpu")
        for (kind, _, _), (_, _, calls) in r.work.items():
            sim[kind] = sim.get(kind, 0) + calls
        assert sim["gemm"] == real.n["gemm"] and sim["attention"] == real.n["attention"], (variant, sim, real.n)
        assert abs(sim["other"] / real.n["other"] - 1) < 0.05, (variant, sim, real.n)
        counts[variant] = sim
    # u=1 runs twice the stages of u=2 (4 heads): twice the attention calls, more GEMMs
    assert counts["full"]["attention"] == 2 * counts["untied-u2"]["attention"]
    assert counts["full"]["gemm"] > counts["untied-u2"]["gemm"]
