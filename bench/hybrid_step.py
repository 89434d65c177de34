"""CPU step time of a hybrid model (Gated DeltaNet + full attention) at SP=2 vs SP=1 (issue 36).

    python bench/hybrid_step.py                        # Qwen3.5 shape, 2048 tokens, 2 rounds of A B
    python bench/hybrid_step.py --seq 4096 --rounds 3 --impl untied_ulysses

A tiny Qwen3.5-style text model (random init, fp32: hidden 256, 4 layers in Qwen3.5's 3:1 pattern, three Gated
DeltaNet layers of 4 key / 8 value heads and one full-attention layer of 8 query / 2 KV heads) trained through
ds_longctx.initialize (ZeRO-3, SGD) on one sample of --seq tokens: A = one process (SP=1), B = two processes
(SP=2, each rank half the sequence; the mixers' all-to-alls move q|k|v, gates and decays by heads). Rounds
alternate A B A B in one run, each in fresh spawned gloo processes with one torch thread per rank; per round the
median over --steps timed steps (forward + backward + optimizer step) after one warm-up step, rank 0's wall time
and process CPU time. The ratio is SP=2 / SP=1 per round and over the rounds' medians. On the 2-core box SP=2 runs
one rank per core, so the ratio shows how much of the split work the all-to-alls and the per-rank fixed costs eat.

Writes bench/results/hybrid_step_cpu.json (command, machine, date, rows).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from dist_utils import run_distributed  # noqa: E402


def hybrid_config(vocab: int = 1024):
    import transformers as tf

    return tf.Qwen3_5TextConfig(
        hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=32, num_hidden_layers=4,
        intermediate_size=512, vocab_size=vocab, max_position_embeddings=1 << 16, tie_word_embeddings=False,
        layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=4, linear_num_value_heads=8,
        linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)


def _measure(rank, world, seq, steps, impl):
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import ds_longctx
    from ds_longctx.dist.comm import sp_group, sp_rank
    from ds_longctx.data import shard_batch

    cfg = hybrid_config()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    lc = {"attention": {"implementation": impl}}
    ds_cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": 3}, "sequence_parallel_size": world, "steps_per_print": 10 ** 9,
              "zero_allow_untested_optimizer": True, "long_context": lc}
    engine, *_ = ds_longctx.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3),
                                       config=ds_cfg)
    assert engine.module._ds_longctx_patch.mixers is not None  # the Gated DeltaNet layers run split by heads
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, cfg.vocab_size, (1, seq), generator=g)
    b = shard_batch({"input_ids": ids, "labels": ids.clone()}, sp_rank(sp_group()), world)
    walls, cpus, losses = [], [], []
    for i in range(steps + 1):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        loss = engine(**b).loss
        engine.backward(loss)
        engine.step()
        dist.barrier()
        if i:  # the first step warms up (allocations, ZeRO-3's parameter trace)
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
        losses.append(loss.item())
    engine.module._ds_longctx_patch.remove()
    return {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus), "losses": losses}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--impl", default="ulysses", choices=["ulysses", "untied_ulysses"])
    p.add_argument("--json", default=os.path.join(ROOT, "bench", "results", "hybrid_step_cpu.json"))
    p.add_argument("--machine", default="2-core AMD EPYC CPU box, shared")
    a = p.parse_args()
    rows = []
    for r in range(a.rounds):
        for sp in (1, 2):  # A B
            res = run_distributed(_measure, sp, a.seq, a.steps, a.impl, timeout=1800)[0]
            rows.append({"round": r, "sp": sp, "seq": a.seq, "impl": a.impl, **res})
            print(rows[-1], flush=True)
    by = {sp: [x for x in rows if x["sp"] == sp] for sp in (1, 2)}
    summary = {"wall_ratio_sp2_over_sp1_per_round": [round(b["wall_s"] / a_["wall_s"], 3)
                                                      for a_, b in zip(by[1], by[2])],
               "wall_ratio_sp2_over_sp1": round(statistics.median(x["wall_s"] for x in by[2]) /
                                                statistics.median(x["wall_s"] for x in by[1]), 3),
               "cpu_ratio_sp2_over_sp1": round(statistics.median(x["cpu_s"] for x in by[2]) /
                                               statistics.median(x["cpu_s"] for x in by[1]), 3)}
    # the same model and sample: SP=2's first loss is SP=1's (a cheap check that the two runs train the same thing)
    summary["first_loss_rel_diff"] = abs(by[2][0]["losses"][0] - by[1][0]["losses"][0]) / abs(by[1][0]["losses"][0])
    print(summary)
    from _results import write_rows

    write_rows(a.json, {"rounds": rows, "summary": summary}, machine=a.machine)


if __name__ == "__main__":
    main()
