"""Helpers for the ecosystem tests (importable by spawned workers): several Trainer / ALST runs in one
spawned world, with the once-per-process state they leave behind put back in between."""
from __future__ import annotations

import os
import sys

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)


class ProcessState:
    """Snapshot of the process-global state an SP run changes; ``reset()`` restores it so the next
    Trainer / engine in the same process starts as in a fresh one (test-only: saves a spawn per run)."""

    def __init__(self):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        from ds_longctx.attention import registry

        self.attention = dict(ALL_ATTENTION_FUNCTIONS._local_mapping)
        # our installs are undone through the registry (its slots must agree with the table)
        self._restored = registry.restored()
        self._restored.__enter__()

    def reset(self):
        from accelerate.state import AcceleratorState
        from deepspeed.runtime.sequence_parallel import parallel_state_sp as pss
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        import ds_longctx
        from ds_longctx.attention import registry

        ds_longctx.disable()
        self._restored.__exit__(None, None, None)
        self._restored = registry.restored()  # a fresh one: a generator context is entered once
        self._restored.__enter__()
        pss._SEQUENCE_PARALLEL_GROUP = None
        pss._SEQUENCE_DATA_PARALLEL_GROUP = None
        # DeepSpeed's register_with_transformers (the HF ALST reference) writes the table itself
        ALL_ATTENTION_FUNCTIONS._local_mapping.clear()  # __setitem__ writes the instance's local mapping
        ALL_ATTENTION_FUNCTIONS._local_mapping.update(self.attention)
        AcceleratorState._reset_state(reset_partial_state=True)


def deltas(result):
    return {n: result["after"][n] - result["before"][n] for n in result["after"]}


def _ulp(x):
    x = x.abs()
    return __import__("torch").nextafter(x, x.new_full((), float("inf"))) - x


def delta_deviation(ref, got, rel: float = 1e-5):
    """Worst per-element distance between two runs' final parameters, in units of what fp32 can
    resolve there: ulp(before) + ulp(after) + rel * |reference delta|.

    Why not a relative norm of the deltas: the SGD delta of a weight near 1 (RMSNorm) is a few ulps of
    the weight per step, so rounding the update alone moves ``after - before`` by ~1e-2 of itself and a
    relative norm measures the fp32 grid, not the training. Measured (tests/test_ecosystem.py, 2-core CPU
    box, 2026-11-26, tiny Llama, 3 SGD steps, lr 0.05): SP=2 ulysses 4.1 (HF's own ALST: the same),
    + memory stack 9.0, untied + memory stack 5.2; a gradient counted twice 3.0e6."""
    out = {}
    for n, a_ref in ref["after"].items():
        d_ref = a_ref - ref["before"][n]
        scale = _ulp(ref["before"][n]) + _ulp(a_ref) + rel * d_ref.abs()
        out[n] = float(((got["after"][n] - a_ref).abs() / scale).max())
    return out
