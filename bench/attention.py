"""Tied (DeepSpeed Ulysses) vs untied (UPipe) attention stage on CPU, side by side in one run.

The stage is what differs between the two: q/k/v projection + RoPE + sequence-parallel attention,
forward and backward, for Llama3-8B attention shapes (hidden 4096, 32 heads, 8 kv heads, head_dim
128). o_proj is the same in both and left out.

tied:   HF LlamaAttention's projection/RoPE code, then deepspeed's UlyssesSPAttentionHF (built on the
        SP group, HF sdpa as core attention: the CPU flash kernel).
untied: ds_longctx.attention.untied.untied_attention_fused for every heads_per_chunk dividing H/SP.

Time: wall time of forward+backward (slowest rank), median over --steps after one warm-up.
Memory: peak live bytes of storages allocated during the stage (LiveBytesTracker, charging only ops
whose output does not alias an input, see _alloc_tracker), max over ranks,
measured in a separate step so the tracker does not slow the timed ones. Inputs, weights and their
.grad buffers exist before the step (model state) and are not counted; the output, saved
activations, dx and every transient (weight-grad GEMM outputs included) are.

    python bench/attention.py --seq 4096 --sp 2
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 4096, 32, 8, 128


def _stage_tied(x, w, cos, sin, group, dout):
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    b, s, _ = x.shape

    class _Mod(torch.nn.Module):
        num_key_value_groups = HEADS // KV_HEADS
        is_causal = True

    # as LlamaAttention.forward does it
    shape = (b, s, -1, HEAD_DIM)
    q = torch.nn.functional.linear(x, w["q"]).view(shape).transpose(1, 2)
    k = torch.nn.functional.linear(x, w["k"]).view(shape).transpose(1, 2)
    v = torch.nn.functional.linear(x, w["v"]).view(shape).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    if group is None:
        out, _ = sdpa_attention_forward(_Mod(), q, k, v, None, scaling=HEAD_DIM ** -0.5, dropout=0.0)
    else:
        uly = UlyssesSPAttentionHF(attn=sdpa_attention_forward, batch_size=b, attn_head_count=HEADS,
                                   attn_head_size=HEAD_DIM, kv_head_count=KV_HEADS, num_hidden_layers=1,
                                   process_group=group, seq_length_is_variable=True)
        rank = torch.distributed.get_rank(group)
        pos = torch.arange(rank * s, (rank + 1) * s).unsqueeze(0).expand(b, -1)
        out, _ = uly(_Mod(), q, k, v, None, position_ids=pos, scaling=HEAD_DIM ** -0.5, dropout=0.0)
    out = out.reshape(b, s, HEADS * HEAD_DIM)
    out.backward(dout)
    return out


def _stage_untied(x, w, cos, sin, group, dout, hpc):
    from ds_longctx.attention.kernels import get_backend
    from ds_longctx.attention.untied import ProjectionSpec, Schedule, untied_attention_fused
    from ds_longctx.models import rope_bshd

    b, s, _ = x.shape
    sp = 1 if group is None else torch.distributed.get_world_size(group)
    out, _ = untied_attention_fused(x, cos, sin, w["q"], w["k"], w["v"], schedule=Schedule(HEADS, KV_HEADS, sp, hpc),
                                    spec=ProjectionSpec(HEAD_DIM, rope_bshd), group=group,
                                    backend=get_backend("auto", x.device), causal=True, scale=HEAD_DIM ** -0.5)
    out = out.reshape(b, s, HEADS * HEAD_DIM)
    out.backward(dout)
    return out


def _alloc_tracker():
    """LiveBytesTracker that charges only new allocations.

    The shared tracker charges any output storage it has not seen, so a view or an in-place result
    of a tensor created before the step (w[rows], weight.t(), param.grad += g) is counted as if
    newly allocated: whole weight-sized storages that neither path allocates. An op's output that
    aliases one of its inputs is never an allocation, so skip those.
    """
    from torch.utils._pytree import tree_flatten

    from ds_longctx.measure.live_bytes import LiveBytesTracker

    class AllocTracker(LiveBytesTracker):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ins = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs or {}))[0]
                   if isinstance(t, torch.Tensor) and t.device.type != "meta"}
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in ins:
                    self._track(t)
            return out

    return AllocTracker()


def _worker(rank, world, port, args, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_SIZE=str(world))
    torch.set_num_threads(args.threads)
    import deepspeed
    import torch.distributed as dist

    group = None
    if world > 1:
        from ds_longctx.dist.comm import disable_cpu_shm_allreduce

        disable_cpu_shm_allreduce()
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
        group = dist.new_group(list(range(world)))
    dtype = getattr(torch, args.dtype)
    s = args.seq // world
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(1, s, HIDDEN, generator=g) * 0.5).to(dtype).requires_grad_(True)
    w = {n: (torch.randn(rows * HEAD_DIM, HIDDEN, generator=g) * HIDDEN ** -0.5).to(dtype).requires_grad_(True)
         for n, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS))}
    pos = torch.arange(rank * s, (rank + 1) * s, dtype=torch.float32)
    inv = 1.0 / (500000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    ang = torch.cat([pos[:, None] * inv] * 2, -1)[None]
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    dout = (torch.randn(1, s, HEADS * HEAD_DIM, generator=g) * 0.1).to(dtype)

    hpcs = [u for u in range(1, HEADS // world + 1) if (HEADS // world) % u == 0]
    if args.hpc:
        hpcs = [u for u in hpcs if u in args.hpc]
    modes = [("tied", None)] + [(f"untied u={u}", u) for u in hpcs]
    rows = []
    ref_out = ref_dx = None
    for name, hpc in modes:
        def step():
            for t in [x] + list(w.values()):  # grads persist (model state), only refilled
                if t.grad is not None:
                    t.grad.zero_()
            if hpc is None:
                return _stage_tied(x, w, cos, sin, group, dout)
            return _stage_untied(x, w, cos, sin, group, dout, hpc)

        times = []
        for i in range(args.steps + 1):
            if group is not None:
                dist.barrier(group)
            t0 = time.perf_counter()
            out = step()
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            if group is not None:
                dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=group)
            if i:
                times.append(dt.item())
        # results must agree before a timing means anything
        if ref_out is None:
            ref_out, ref_dx = out.detach().clone(), x.grad.clone()
            ref_dw = {n: t.grad.clone() for n, t in w.items()}
        pairs = [(out.detach(), ref_out), (x.grad, ref_dx)] + [(t.grad, ref_dw[n]) for n, t in w.items()]
        err = max(((a - b).abs().max() / b.abs().max()).item() for a, b in pairs)
        del out
        tracker = _alloc_tracker()
        with tracker:
            out = step()
            del out
        peak = torch.tensor([tracker.peak], dtype=torch.float64)
        if group is not None:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        rows.append(dict(mode=name, heads_per_chunk=hpc, step_s=statistics.median(times), step_s_all=times,
                         peak_bytes=int(peak.item()), max_rel_diff_vs_tied=err))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)
    if group is not None:
        dist.barrier()


def _free_port():
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        return so.getsockname()[1]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=4096, help="global sequence length")
    p.add_argument("--sp", type=int, default=2, help="gloo ranks (sequence-parallel degree)")
    p.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--hpc", type=int, nargs="*", help="only these heads_per_chunk values")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "rows.json")
        mp.start_processes(_worker, args=(args.sp, _free_port(), args, path), nprocs=args.sp, join=True,
                           start_method="spawn")
        with open(path) as f:
            rows = json.load(f)
    tied = rows[0]
    print(f"\nseq {args.seq} (local {args.seq // args.sp}), SP {args.sp}, {args.dtype}, hidden {HIDDEN}, "
          f"heads {HEADS}/{KV_HEADS} kv, head_dim {HEAD_DIM}, {args.steps} timed steps\n")
    print("| mode | step s (fwd+bwd) | speed vs tied (tied s / s) | peak live MiB | peak vs tied | max rel diff vs tied |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['step_s']:.3f} | {tied['step_s'] / r['step_s']:.2f}x | "
              f"{r['peak_bytes'] / 2**20:.1f} | {r['peak_bytes'] / tied['peak_bytes']:.2f}x | "
              f"{r['max_rel_diff_vs_tied']:.1e} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
