"""Untied attention over packed documents vs one dense sample of the same total length (CPU).

The stage: ds_longctx.attention.untied.untied_attention_fused (q/k/v projection + RoPE + attention,
forward and backward), single process, one sample of --seq tokens. Dense: one document. Packed:
the same tokens split into documents (docs=Documents(...)): the kernel runs per document (on CPU a
loop over the dense kernel), so causal attention work falls with the documents' lengths.

Time: wall and CPU (process) time of forward+backward, median over --steps after one warm-up; on a
shared box the CPU time is the figure to read (wall time includes waiting for cores). Memory: peak live bytes
of storages newly allocated during the step (bench/attention.py's tracker), in a separate step.

    python bench/documents.py --seq 4096 --steps 3

``--cores``: the attention core alone, as one rank runs it after the all-to-all (head-sharded q/k/v
[1, S, heads/SP, d] over the whole sequence), forward + backward, for --docs equal documents: untied's
DocumentBackend (the CPU flash op per document, LSE kept) vs "ulysses"' document_core around HF's sdpa
attention function. The all-to-alls do not depend on the documents and are left out.

    python bench/documents.py --cores --seq 16384 --sp 2 --docs 1 8 64 512 2048 --steps 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--cores", action="store_true", help="time the document cores (untied vs ulysses)")
    p.add_argument("--sp", type=int, default=2, help="--cores: the SP degree whose head share one rank runs")
    p.add_argument("--docs", type=int, nargs="+", default=[1, 8, 64, 512, 2048])
    a = p.parse_args()
    torch.manual_seed(0)
    if a.cores:
        return cores(a)
    from attention import _alloc_tracker

    from ds_longctx.attention.documents import Documents
    from ds_longctx.attention.kernels import get_backend
    from ds_longctx.attention.untied import ProjectionSpec, Schedule, untied_attention_fused
    from ds_longctx.models import rope_bshd

    S, D, H, G, d = a.seq, a.hidden, a.heads, a.kv_heads, a.head_dim
    x = torch.randn(1, S, D, requires_grad=True)
    w = {k: (torch.randn(n * d, D) * D ** -0.5).requires_grad_(True) for k, n in (("q", H), ("k", G), ("v", G))}
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    dout = torch.randn(1, S, H, d)

    g = torch.Generator().manual_seed(1)
    mixed, left = [], S
    while left > 0:  # a long-tailed mix of document lengths, like a real packed corpus
        n = min(left, int(torch.randint(16, S // 8, (1,), generator=g)))
        mixed.append(n)
        left -= n
    layouts = {"dense (1 doc)": [S], f"4 docs of {S // 4}": [S // 4] * 4, f"32 docs of {S // 32}": [S // 32] * 32,
               f"mixed ({len(mixed)} docs)": mixed}

    def step(lens):
        docs = Documents(torch.tensor([[0] + torch.tensor(lens).cumsum(0).tolist()])) if len(lens) > 1 else None
        pos = torch.cat([torch.arange(n) for n in lens]).float()
        ang = torch.outer(pos, inv)
        cos = torch.cat([ang, ang], -1).cos().unsqueeze(0)
        sin = torch.cat([ang, ang], -1).sin().unsqueeze(0)
        out, _ = untied_attention_fused(x, cos, sin, w["q"], w["k"], w["v"], schedule=Schedule(H, G, 1, 1),
                                        spec=ProjectionSpec(d, rope_bshd),
                                        backend=get_backend("sdpa", "cpu"), docs=docs)
        out.backward(dout)
        x.grad = None
        for t in w.values():
            t.grad = None
        return out

    rows = []
    for name, lens in layouts.items():
        step(lens)  # warm-up
        times, cpu = [], []
        for _ in range(a.steps):
            t0, c0 = time.perf_counter(), time.process_time()
            step(lens)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        tracker = _alloc_tracker()
        with tracker:
            out = step(lens)
            del out
        rows.append(dict(layout=name, docs=len(lens), step_s=statistics.median(times), cpu_s=statistics.median(cpu),
                         peak_bytes=int(tracker.peak)))
    base = rows[0]
    print(f"seq {S}, hidden {D}, heads {H}/{G}, head_dim {d}, heads_per_chunk 1, sdpa_cpu_flash, "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'layout':<22}{'wall s':>9}{'x dense':>9}{'cpu s':>9}{'x dense':>9}{'peak MiB':>10}{'x dense':>9}")
    for r in rows:
        print(f"{r['layout']:<22}{r['step_s']:>9.3f}{r['step_s'] / base['step_s']:>9.2f}"
              f"{r['cpu_s']:>9.3f}{r['cpu_s'] / base['cpu_s']:>9.2f}"
              f"{r['peak_bytes'] / 2**20:>10.1f}{r['peak_bytes'] / base['peak_bytes']:>9.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


def cores(a):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from ds_longctx.attention.documents import DOCS_KWARG, Documents, DocumentBackend, document_core
    from ds_longctx.attention.kernels import get_backend

    S, d = a.seq, a.head_dim
    h, hk = a.heads // a.sp, max(1, a.kv_heads // a.sp)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, S, n, d, generator=g) for n in (h, hk, hk))  # [b, S, heads, d], head-sharded
    dout = torch.randn(1, S, h, d, generator=g)
    kernel = get_backend("sdpa", "cpu")
    ulysses = document_core(sdpa_attention_forward, "sdpa")

    class _Module:  # what HF's attention function reads from its module
        is_causal = True
        num_key_value_groups = h // hk
        training = True

    def docs_of(n):
        lens = [S // n] * n
        return Documents(torch.tensor([[0] + torch.tensor(lens).cumsum(0).tolist()]))

    def untied_step(docs):
        be = DocumentBackend(kernel, docs) if docs is not None else kernel
        with torch.no_grad():
            out, lse = be.forward(q, k, v, True, d ** -0.5)
            be.backward(dout, q, k, v, out, lse, True, d ** -0.5)

    def ulysses_step(docs):
        qq, kk, vv = (t.transpose(1, 2).detach().requires_grad_(True) for t in (q, k, v))  # HF's [b, h, S, d]
        kw = {DOCS_KWARG: docs} if docs is not None else {}
        out, _ = ulysses(_Module(), qq, kk, vv, None, dropout=0.0, scaling=d ** -0.5, is_causal=True, **kw)
        out.backward(dout)

    rows = []
    for name, fn in (("untied", untied_step), ("ulysses", ulysses_step)):
        for n in a.docs:
            docs = docs_of(n) if n > 1 else None
            fn(docs)  # warm-up
            times, cpu = [], []
            for _ in range(a.steps):
                t0, c0 = time.perf_counter(), time.process_time()
                fn(docs)
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
            rows.append(dict(core=name, docs=n, step_s=statistics.median(times), cpu_s=statistics.median(cpu)))
    print(f"seq {S}, heads per rank {h}/{hk} (SP {a.sp}), head_dim {d}, torch threads {torch.get_num_threads()}; "
          "forward + backward of the core, median of", a.steps)
    print(f"{'core':<9}{'docs':>6}{'wall s':>9}{'cpu s':>9}{'cpu x dense':>12}{'cpu x 8 docs':>13}")
    for r in rows:
        base = next(x for x in rows if x["core"] == r["core"] and x["docs"] == a.docs[0])
        eight = next((x for x in rows if x["core"] == r["core"] and x["docs"] == 8), None)
        print(f"{r['core']:<9}{r['docs']:>6}{r['step_s']:>9.3f}{r['cpu_s']:>9.3f}{r['cpu_s'] / base['cpu_s']:>12.2f}"
              f"{(r['cpu_s'] / eight['cpu_s']) if eight else float('nan'):>13.2f}")
    if a.json:
        from _results import write_rows  # bench/ is the script's own directory

        write_rows(a.json, rows)


if __name__ == "__main__":
    main()
