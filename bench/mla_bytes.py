"""Bytes moved per layer and token by multi-head latent attention under SP, two ways (issue 37, item 1):

* heads (what 'ulysses' and untied do today): all-to-all q, k, v after the up-projections (q/k head dim nope + rope,
  v head dim; ds_longctx zero-pads v to the q/k dim in the buffers), then the output back;
* latent (not implemented): all-to-all q, all-gather the compressed KV latent (kv_lora_rank + the shared rope key) and
  up-project k/v per rank for its heads over the whole sequence, then the output back.

Arithmetic from the shapes (DeepSeek-V3: 128 heads, nope 128, rope 64, v 128, kv_lora_rank 512) and a CPU timing of
the forward collectives of both (gloo, 2 processes, bf16) for ``--tokens`` tokens per rank with ``--heads`` heads.

    python bench/mla_bytes.py [--sp 2] [--tokens 512] [--heads 128]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

NOPE, ROPE, V, RANK = 128, 64, 128, 512


def per_token_elements(heads: int, sp: int):
    """Elements each token sends off its rank per layer forward: (heads way, heads way with v padded, latent way)."""
    f = (sp - 1) / sp  # an all-to-all keeps 1/sp of each tensor on its rank
    q, k, v, o = heads * (NOPE + ROPE), heads * (NOPE + ROPE), heads * V, heads * V
    heads_way = f * (q + k + v + o)
    padded = f * (q + k + heads * (NOPE + ROPE) + o)
    latent = f * (q + o) + (sp - 1) * (RANK + ROPE)  # an all-gather sends each token's latent to every other rank
    return heads_way, padded, latent


def _time(rank, world, tokens, heads, reps):
    import torch.distributed as dist

    dt = torch.float32  # gloo on CPU: fp32 (bytes below are bf16 arithmetic; the timing compares the two ways)
    s = tokens
    def a2a(t):  # [s, H, d] -> head-sharded, as Ulysses' all-to-all (one call)
        out = torch.empty_like(t)
        dist.all_to_all_single(out, t.contiguous())
        return out
    q = torch.randn(s, heads, NOPE + ROPE, dtype=dt)
    k = torch.randn(s, heads, NOPE + ROPE, dtype=dt)
    v = torch.randn(s, heads, NOPE + ROPE, dtype=dt)  # padded, as ds_longctx runs it
    o = torch.randn(s, heads, V, dtype=dt)
    lat = torch.randn(s, RANK + ROPE, dtype=dt)
    wkv = torch.randn(RANK, heads // world * (NOPE + V), dtype=dt)  # this rank's heads of kv_b_proj
    res = {}
    for name in ("heads", "latent"):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            if name == "heads":
                a2a(q), a2a(k), a2a(v), a2a(o)
            else:
                a2a(q), a2a(o)
                full = [torch.empty_like(lat) for _ in range(world)]
                dist.all_gather(full, lat)
                torch.cat(full)[:, :RANK] @ wkv  # the per-rank up-projection the latent way adds
        dist.barrier()
        res[name] = (time.perf_counter() - t0) / reps
    return res


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--sp", type=int, default=2)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args(argv)
    for sp in (2, 8, 32):
        h, padded, lat = per_token_elements(128, sp)
        print(f"DeepSeek-V3 layer, SP={sp}: per token forward, bf16 bytes sent: heads {2 * h:,.0f} (v padded: "
              f"{2 * padded:,.0f}), latent {2 * lat:,.0f} -> heads/latent {padded / lat:.2f}x")
    from dist_utils import run_distributed

    r = run_distributed(_time, a.sp, a.tokens, a.heads, a.reps)[0]
    print(f"CPU gloo, SP={a.sp}, {a.tokens} tokens/rank, {a.heads} heads: heads {r['heads'] * 1e3:.1f} ms, "
          f"latent (incl. its up-projection) {r['latent'] * 1e3:.1f} ms per layer forward")


if __name__ == "__main__":
    main()
