"""keep_attention_output on vs off: training step time of the tiny stack at SP=2 (CPU, gloo).

The model is ds_configs/models/tiny-llama.json (hidden 64, 4 heads / 2 kv, head_dim 16, 2 layers), the
config ds_configs/tiny-cpu.json (ZeRO-3, untied attention, checkpointing with CPU offload, tiled
MLP/loss, memory-efficient RMSNorm) at micro batch 1 and --seq tokens. Two engines live in the same two
processes, identical except for the switch, and take steps alternately (off, on, off, on, ...) on the
same batch, so load on the shared box hits both alike. Reported per length: median wall and CPU time per
step of each, the ratio on/off, and the losses (bit-equal: printed as a check).

    python bench/keep_attention.py --seq 8192 16384 --steps 4 [--count]

--count: one more untimed step of each engine under measure/flops.WorkCounter (rank 0's executed FLOPs per
category), next to the planner's counts for the same config.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _worker(rank, world, port, args, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import ds_longctx
    from ds_longctx.dist.comm import sp_group, sp_rank
    from ds_longctx.data import shard_batch
    from transformers import AutoModelForCausalLM, LlamaConfig

    with open(os.path.join(ROOT, "ds_configs", "tiny-cpu.json")) as f:
        base = json.load(f)
    with open(os.path.join(ROOT, "ds_configs", "models", "tiny-llama.json")) as f:
        mc = json.load(f)
    mc.pop("architectures", None), mc.pop("model_type", None)
    impl = mc.pop("attn_implementation")
    rows = []
    for seq in args.seq:
        engines = {}
        for keep in (False, True):
            cfg = copy.deepcopy(base)
            cfg["train_micro_batch_size_per_gpu"] = 1
            cfg["long_context"]["sequence_length"] = seq
            cfg["long_context"]["activation_checkpointing"]["keep_attention_output"] = keep
            conf = LlamaConfig(**dict(mc, max_position_embeddings=max(seq, mc["max_position_embeddings"])))
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(conf, attn_implementation=impl)
            engines[keep], _, _, _ = ds_longctx.initialize(model=model, config=cfg)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, mc["vocab_size"], (1, seq), generator=g)
        shard = shard_batch({"input_ids": ids, "labels": ids}, sp_rank(sp_group()), world)
        times = {False: [], True: []}
        losses = {False: [], True: []}
        for i in range(args.steps + 1):  # step 0: warm-up of both
            for keep in (False, True):
                eng = engines[keep]
                torch.distributed.barrier()
                w0, c0 = time.perf_counter(), time.process_time()
                loss = eng(**shard).loss
                eng.backward(loss)
                eng.step()
                torch.distributed.barrier()
                w, c = time.perf_counter() - w0, time.process_time() - c0
                if i:
                    times[keep].append((w, c))
                losses[keep].append(loss.item())
        counted = {}
        if args.count:  # one more step of each under the FLOP counter (measure/flops.WorkCounter), untimed
            from ds_longctx.measure.flops import WorkCounter, by_category
            from ds_longctx.memory.checkpointing import around_checkpointed_runs

            for keep in (False, True):
                eng = engines[keep]
                wc = WorkCounter()
                with around_checkpointed_runs(wc.layer_run), wc:  # recomputes told apart (WorkCounter's doc)
                    loss = eng(**shard).loss
                    eng.backward(loss)
                    eng.step()
                counted[keep] = by_category(wc.work)["flops"]
        for e in engines.values():
            e.destroy()
        med = {k: (statistics.median(t[0] for t in v), statistics.median(t[1] for t in v)) for k, v in times.items()}
        rows.append({"seq": seq, "off_wall_s": med[False][0], "on_wall_s": med[True][0],
                     "off_cpu_s": med[False][1], "on_cpu_s": med[True][1],
                     "ratio_wall_on_off": med[True][0] / med[False][0],
                     "ratio_cpu_on_off": med[True][1] / med[False][1],
                     "losses_bit_equal": losses[False] == losses[True], "losses_off": losses[False],
                     "losses_on": losses[True], "steps": args.steps})
        if counted:
            rows[-1]["flops_off"], rows[-1]["flops_on"] = counted[False], counted[True]
    if rank == 0:
        with open(os.path.join(out_dir, "rows.json"), "w") as f:
            json.dump(rows, f)
    torch.distributed.destroy_process_group()


def _planned(rows):
    """The planner's FLOP counts (planner.planned_work: its fake step of the same config, world 2) per row."""
    import sys

    sys.path.insert(0, ROOT)
    from ds_longctx.planner import planned_work

    with open(os.path.join(ROOT, "ds_configs", "tiny-cpu.json")) as f:
        base = json.load(f)
    with open(os.path.join(ROOT, "ds_configs", "models", "tiny-llama.json")) as f:
        mc = json.load(f)
    for r in rows:
        for keep in (False, True):
            cfg = copy.deepcopy(base)
            cfg["train_micro_batch_size_per_gpu"] = 1
            cfg["long_context"]["sequence_length"] = r["seq"]
            cfg["long_context"]["activation_checkpointing"]["keep_attention_output"] = keep
            m = dict(mc, max_position_embeddings=max(r["seq"], mc["max_position_embeddings"]))
            r[f"planned_flops_{'on' if keep else 'off'}"] = planned_work(cfg, m, 2, r["seq"])["flops"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--count", action="store_true", help="also count each engine's executed FLOPs per category "
                   "on one more (untimed) step, rank 0, next to the planner's counts for the same config")
    a = p.parse_args()
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_worker, args=(2, port, a, out), nprocs=2, start_method="spawn")
        with open(os.path.join(out, "rows.json")) as f:
            rows = json.load(f)
    print("| seq | off s/step (wall, cpu) | on s/step (wall, cpu) | on/off wall | on/off cpu | losses bit-equal |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['seq']} | {r['off_wall_s']:.3f}, {r['off_cpu_s']:.3f} | {r['on_wall_s']:.3f}, {r['on_cpu_s']:.3f} "
              f"| {r['ratio_wall_on_off']:.3f} | {r['ratio_cpu_on_off']:.3f} | {r['losses_bit_equal']} |")
    if a.count:
        _planned(rows)
        for r in rows:
            for keep in ("off", "on"):
                m, pl = r[f"flops_{keep}"], r[f"planned_flops_{keep}"]
                print(f"{r['seq']} {keep}: executed GFLOP per step (rank 0) {sum(m.values()) / 1e9:.5g}, "
                      f"planned {sum(pl.values()) / 1e9:.5g}; measured/planned " + ", ".join(
                          f"{k} {m.get(k, 0) / 1e9:.5g}/{pl.get(k, 0) / 1e9:.5g}" for k in sorted(set(m) | set(pl))))
            r["flops_ratio_on_off"] = sum(r["flops_on"].values()) / sum(r["flops_off"].values())
            print(f"{r['seq']}: executed FLOPs on/off {r['flops_ratio_on_off']:.3f}")
    if a.json:
        from _results import write_rows  # bench/ is the script's own directory

        write_rows(a.json, rows)


if __name__ == "__main__":
    main()
