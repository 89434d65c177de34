"""Ring attention's hidden communication on CPU (issue 47 item 3): the next k/v block's async P2P overlapping the
current block's kernels, measured A B A B with the overlap on (A) and off (B).

Two gloo processes (a ring of 2, one per core of the box), each runs ``RingBackend`` forward + backward (the op the
untied stages and DeepSpeed's core call) on its zigzag half of one sample, head-sharded ([1, S/2, heads, d], fp32,
causal, the CPU flash kernel). A step with the overlap on posts each block's send/receive before the block's kernels
and waits after them; off, it waits right after posting (the whole transfer exposed). ``waited`` is the seconds a rank
spends in those waits (RingComm.waited). Per size, medians over --reps of each mode, A and B interleaved so that the
box's load drifts over both:

    hidden fraction = 1 - waited(on) / waited(off)        (the share of the communication the kernels cover)
    saving          = step(off) - step(on)

On a 2-core box two ranks have one core each and gloo's transfer threads share them: what this measures is the
structure (the send is in flight during the kernels), not a network's numbers. Writes bench/results/ring_overlap.json.

    python bench/ring_overlap.py --seq 1024 4096 --heads 8 --head-dim 64 --reps 8
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _worker(rank, world, port, sizes, heads, head_dim, reps, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from ds_longctx.attention.kernels import get_backend
    from ds_longctx.attention.ring import RingBackend
    from ds_longctx.dist.layout import shard_index

    group = dist.new_group(list(range(world)))  # the ring group (its own communicator, as dist.comm builds it)
    kernel = get_backend("auto", "cpu")
    rows = []
    for seq in sizes:
        g = torch.Generator().manual_seed(0)
        idx = torch.tensor(shard_index(seq, world, world, rank))
        q, k, v, do = (torch.randn(1, seq, heads, head_dim, generator=g)[:, idx].contiguous() for _ in range(4))
        rec = {True: [], False: []}
        for i in range(2 * reps + 2):  # A B A B ..., the first pair a warm-up
            overlap = i % 2 == 0
            ring = RingBackend(kernel, group, seq, overlap=overlap)
            dist.barrier(group)
            t = time.perf_counter()
            o, lse = ring.forward(q, k, v, True, head_dim ** -0.5)
            ring.backward(do, q, k, v, o, lse, True, head_dim ** -0.5)
            step = time.perf_counter() - t
            if i >= 2:
                rec[overlap].append((step, ring.comm.waited))
        med = {m: (statistics.median(s for s, _ in rec[m]), statistics.median(w for _, w in rec[m])) for m in rec}
        block = 2 * (seq // world) * heads * head_dim * 4  # one k|v block, fp32
        rows.append(dict(rank=rank, seq=seq, heads=heads, head_dim=head_dim, reps=reps, kv_block_bytes=block,
                         step_on_s=med[True][0], step_off_s=med[False][0], waited_on_s=med[True][1],
                         waited_off_s=med[False][1], hidden_fraction=1 - med[True][1] / med[False][1],
                         saving_s=med[False][0] - med[True][0]))
    out[rank] = rows
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--port", type=int, default=int(os.environ.get("MASTER_PORT", 32100)))
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                 "ring_overlap.json"))
    a = p.parse_args()
    with mp.Manager() as m:
        out = m.dict()
        mp.spawn(_worker, args=(2, a.port, a.seq, a.heads, a.head_dim, a.reps, out), nprocs=2)
        rows = [r for rank in sorted(out.keys()) for r in out[rank]]
    for r in rows:
        print(f"rank {r['rank']} seq {r['seq']}: step on {r['step_on_s'] * 1e3:.1f} ms, off {r['step_off_s'] * 1e3:.1f} "
              f"ms; waited on {r['waited_on_s'] * 1e3:.2f} ms, off {r['waited_off_s'] * 1e3:.2f} ms; hidden "
              f"{r['hidden_fraction']:.0%}, saving {r['saving_s'] * 1e3:.1f} ms")
    from _results import write_rows

    write_rows(a.out, rows)


if __name__ == "__main__":
    main()
