"""FLOPs and bytes of one dispatched op: what the planner's accountant adds up into a step's work.

FLOPs come from torch's own formula table (``torch.utils.flop_counter.flop_registry``, the table
``FlopCounterMode`` reads; our custom ops register theirs with ``register_flop_formula``), so a fake
step is counted exactly as ``FlopCounterMode`` would count the real one. Bytes are the logical sizes
of an op's tensor inputs and outputs (each read or written once): the traffic a memory-bound op
cannot avoid. Nothing here knows rates; planner/rates.py turns the work into seconds.

Kinds: ``attention`` (attention kernels, keyed by head_dim: their speed depends on it), ``gemm``
(mm/addmm/bmm/baddbmm, keyed by arithmetic intensity rounded to a power of two, so a time model can
tell compute-bound from memory-bound GEMMs), ``other`` (every other op that reads or writes tensors:
norms, RoPE, softmax-free elementwise work, copies; bytes only), ``a2a`` (all-to-all bytes sent) and ``p2p`` (point-to-point
bytes sent: the ring's blocks).
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten

GEMMS = frozenset({aten.mm, aten.addmm, aten.bmm, aten.baddbmm})
# torch's fused attention ops (their registered formulas count the full S x S square: torch ignores the
# causal mask, see flop_counter.sdpa_flop), ours register causal-aware formulas (attention/kernels.py)
_TORCH_ATTENTION = tuple(getattr(aten, n) for n in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_flash_attention_forward", "_flash_attention_backward") if hasattr(aten, n))
ATTENTION = set(_TORCH_ATTENTION)
_BACKWARD_ATTENTION = {p for p in _TORCH_ATTENTION if str(p).endswith("backward")}
_A2A = ("alltoall_base_", "alltoall_")
_P2P = ("send",)  # c10d.send(tensors, group, dst, tag): ring attention's k/v blocks and dk|dv (attention/ring.py)
_SKIP = frozenset({aten.size, aten.stride, aten.numel, aten.dim, aten.sym_size, aten.sym_stride, aten.sym_numel,
                   aten.is_contiguous, aten.storage_offset, aten.sym_storage_offset, aten.empty, aten.empty_like,
                   aten.empty_strided, aten.new_empty, aten.new_empty_strided, aten.detach, aten.alias,
                   aten._local_scalar_dense})

_SCALE = contextvars.ContextVar("ds_longctx_work_scale", default=1.0)


def register_attention(packet, backward: bool) -> None:
    """Mark a custom attention op's packet (forward or backward) for the ``attention`` kind."""
    ATTENTION.add(packet)
    if backward:
        _BACKWARD_ATTENTION.add(packet)


def is_backward_attention(packet) -> bool:
    return packet in _BACKWARD_ATTENTION


@contextlib.contextmanager
def representing(factor: float):
    """The ops inside stand for ``factor`` times their work (one row tile run in place of all of them on
    the planner's fake tensors: the FLOPs and bytes of row-pointwise work scale with the rows)."""
    tok = _SCALE.set(_SCALE.get() * float(factor))
    try:
        yield
    finally:
        _SCALE.reset(tok)


def current_scale() -> float:
    return _SCALE.get()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _tensor_bytes(obj) -> int:
    return sum(_nbytes(t) for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor))


def intensity_bucket(flops: float, nbytes: int) -> int:
    """FLOPs per byte rounded down to a power of two (a GEMM's place on the roofline)."""
    if nbytes <= 0 or flops <= 0:
        return 0
    return 1 << max(0, int(math.log2(flops / nbytes)))


def op_cost(func, args, kwargs, out) -> Optional[Tuple[str, object, float, float]]:
    """(kind, key, flops, bytes) of one op (before any ``representing`` scale), or None for ops that move no
    data (metadata queries, views, allocations)."""
    packet = func._overloadpacket
    name = packet.__name__
    if name in _A2A:
        # c10d.alltoall_base_(output, input, group, ...): what this rank sends
        return "a2a", "all_to_all", 0.0, float(_nbytes(args[1])) if isinstance(args[1], torch.Tensor) else 0.0
    if name in _P2P and packet.__module__.endswith("c10d"):
        sent = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
        return "p2p", "ring", 0.0, float(sum(_nbytes(t) for t in sent if isinstance(t, torch.Tensor)))
    if packet in _SKIP or getattr(func, "is_view", False) or packet.__module__ == "c10d":
        return None
    nbytes = _tensor_bytes((args, kwargs)) + _tensor_bytes(out)
    formula = flop_registry.get(packet)
    if packet in ATTENTION:
        flops = float(formula(*args, **kwargs, out_val=out)) if formula is not None else 0.0
        q = args[1] if packet in _BACKWARD_ATTENTION else args[0]  # backward ops take grad_out first
        return "attention", int(q.shape[-1]), flops, float(nbytes)
    if packet in GEMMS and formula is not None:
        flops = float(formula(*args, **kwargs, out_val=out))
        return "gemm", intensity_bucket(flops, nbytes), flops, float(nbytes)
    if nbytes == 0:
        return None
    flops = float(formula(*args, **kwargs, out_val=out)) if formula is not None else 0.0
    return "other", "", flops, float(nbytes)


def phase(packet, in_backward: bool, recomputing: bool = False) -> str:
    """Which part of the step an op belongs to: ``forward``; ``backward``; ``recompute`` (a forward op run
    inside backward: checkpoint recompute, a tiled op's per-tile recompute, an attention forward). One rule
    for the planner's fake step and a real one (inside backward, forward work runs with grad enabled)."""
    if not in_backward:
        return "forward"
    if packet in _BACKWARD_ATTENTION:
        return "backward"
    if packet in ATTENTION or recomputing or torch.is_grad_enabled():
        return "recompute"
    return "backward"


def add_work(work: dict, func, args, kwargs, out, in_backward: bool, recomputing: bool = False) -> None:
    """Add one op's (flops, bytes, calls) to ``work[(kind, phase, key)]`` (the ``representing`` scale applied)."""
    cost = op_cost(func, args, kwargs, out)
    if cost is None:
        return
    kind, key, flops, nbytes = cost
    scale = _SCALE.get()
    slot = work.setdefault((kind, phase(func._overloadpacket, in_backward, recomputing), key), [0.0, 0.0, 0.0])
    slot[0] += flops * scale
    slot[1] += nbytes * scale
    slot[2] += scale  # ops dispatched (one tile stands for ``scale`` tiles: as many calls)


def by_category(work: dict) -> dict:
    """``work`` summed per ``{kind}_{phase}``: {"flops": {...}, "bytes": {...}, "calls": {...}} (the keys of
    the planner's StepTime.flops)."""
    out = {"flops": {}, "bytes": {}, "calls": {}}
    for (kind, ph, _), v in work.items():
        for i, name in enumerate(("flops", "bytes", "calls")):
            if v[i]:
                out[name][f"{kind}_{ph}"] = out[name].get(f"{kind}_{ph}", 0.0) + v[i]
    return out


class WorkCounter(TorchDispatchMode):
    """The planner's counting on a real step: every dispatched op's FLOPs, bytes and calls by (kind, phase,
    key), phase by :func:`phase` (backward = inside the autograd engine). ``with WorkCounter() as c: step()``;
    then ``c.work`` / ``by_category(c.work)``. Counts every op while active (an optimizer step's too: "other").

    A checkpointed layer's recompute is told apart only when :meth:`layer_run` wraps each run of a checkpointed
    layer's function: ``with around_checkpointed_runs(c.layer_run), c: step()`` (memory.checkpointing's seam; the
    planner's simulation marks its step the same way). measure/ sits below memory/, so the counter does not join
    the seam itself."""

    def __init__(self):
        super().__init__()
        self.work: dict = {}
        self.recomputing = 0

    @contextlib.contextmanager
    def layer_run(self):
        # a checkpointed layer's run inside backward is its recompute, no_grad parts (a tiled MLP's forward)
        # included: the planner's simulation marks it the same way (the same seam)
        inside = torch._C._current_graph_task_id() != -1
        self.recomputing += inside
        try:
            yield
        finally:
            self.recomputing -= inside

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        add_work(self.work, func, args, kwargs, out, torch._C._current_graph_task_id() != -1, bool(self.recomputing))
        return out


def _clamped_sum(c: int, n: int, cap: int) -> int:
    """sum over x = c .. c+n-1 of min(max(x, 0), cap)."""
    if n <= 0:
        return 0
    lo, hi = c, c + n - 1
    total = 0
    a, b = max(lo, 1), min(hi, cap - 1)  # the rising part: x itself
    if a <= b:
        total += (a + b) * (b - a + 1) // 2
    a = max(lo, cap)  # the capped part
    if a <= hi:
        total += (hi - a + 1) * cap
    return total


def causal_pairs(s_q: int, s_k: int, causal: bool, window: Optional[int] = None) -> int:
    """Query-key pairs an attention kernel computes: all of them, or under a causal mask aligned to the
    bottom right (query i sees keys up to i + s_k - s_q) only those not masked. ``window`` (causal only):
    transformers' sliding window, query at position p sees keys in (p - window, p]."""
    if not causal:
        return s_q * s_k
    if window is not None and window > 0:
        off = s_k - s_q  # keys <= i + off, minus those <= i + off - window
        return _clamped_sum(off + 1, s_q, s_k) - _clamped_sum(off + 1 - window, s_q, s_k)
    off = s_k - s_q
    full = max(0, min(s_q, -off))  # leading rows with no key (s_q > s_k): nothing
    rows = s_q - full
    first = off + full + 1  # keys seen by the first row that sees any
    last = off + s_q
    if rows <= 0 or last <= 0:
        return 0
    # rows see first, first+1, ..., capped at s_k
    capped_from = max(0, s_k - first + 1)  # rows before the cap
    n_lin = min(rows, capped_from)
    lin = n_lin * first + n_lin * (n_lin - 1) // 2
    return lin + (rows - n_lin) * s_k


def attention_flops(b: int, h_q: int, s_q: int, s_k: int, d: int, causal: bool, backward: bool,
                    window: Optional[int] = None) -> int:
    """QK^T and PV (2 GEMMs, 2 FLOPs per multiply-add) over the unmasked pairs (inside the sliding
    ``window`` when one is given); backward 5 GEMMs (scores recomputed, dV, dP, dQ, dK) = 2.5x forward,
    torch's convention (flop_counter.sdpa_backward_flop_count)."""
    fwd = 4 * b * h_q * d * causal_pairs(s_q, s_k, causal, window)
    return fwd * 5 // 2 if backward else fwd


__all__ = ["ATTENTION", "GEMMS", "WorkCounter", "add_work", "attention_flops", "by_category", "causal_pairs",
           "current_scale", "intensity_bucket", "op_cost", "phase", "register_attention", "representing"]
