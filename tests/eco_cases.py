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



def delta_errors(ref, got):
    """Per tensor, the relative Frobenius error of got's SGD delta against ref's, beyond one ulp of the
    parameter per element; and the raw relative error (no allowance).

    A delta is after - before of an fp32 parameter, so an update that rounds the other way moves it by
    one unit in the last place of the parameter: tiny next to the deltas of the matrices, but 2e-4 of
    the (small) deltas of RMSNorm weights near 1.0, where it was all the deviation measured (one
    element, 1 ulp). So each element may differ by eps * |param| (>= 1 ulp), and the rest is the
    relative error. Measured (2-core CPU box, 2026-11-26): < 1e-6 for every Trainer and TRL case,
    memory stack included (2.1e-4 without the allowance); a double-counted gradient > 1e-2."""
    import torch

    d_ref, d_got = deltas(ref), deltas(got)
    errs, raw = {}, {}
    for n in d_ref:
        ulp = torch.finfo(torch.float32).eps * ref["after"][n].abs()
        beyond = ((d_got[n] - d_ref[n]).abs() - ulp).clamp(min=0)
        errs[n] = float(beyond.norm() / d_ref[n].norm())
        raw[n] = float((d_got[n] - d_ref[n]).norm() / d_ref[n].norm())
    return errs, raw


BATCH_KEYS = ("batch", "use_cache", "train data loader")  # the keys of BatchError (a bad batch, not a config)


def config_error(call, *args, **kwargs):
    """The message of the ConfigError ``call(*args, **kwargs)`` raises (a BatchError where the key names the
    batch), or None when it returns."""
    from ds_longctx.errors import BatchError, ConfigError

    try:
        call(*args, **kwargs)
    except (ConfigError, BatchError) as e:
        assert isinstance(e, BatchError) == e.key.startswith(BATCH_KEYS), (type(e).__name__, str(e))
        return str(e)
    return None


def shared_tmpdir(rank: int) -> str:
    """A fresh directory made by rank 0 and named to every rank (checkpoints all ranks write and read; a fixed
    path could meet another run of the same test on a shared machine). The caller removes it."""
    import tempfile

    import torch.distributed as dist

    name = [tempfile.mkdtemp(prefix="ds_longctx_resume_") if rank == 0 else None]
    dist.broadcast_object_list(name, src=0)
    return name[0]


def assert_resumed_equal(full, resumed, micro_after, what, epoch_items=None):
    """Every micro-batch after the checkpoint (its losses, the tokens this rank trained, the learning rate) and the
    final weights: equal, bit for bit. ``full``/``resumed``: the examples' train() results (losses, inputs, lrs,
    before/after); ``micro_after``: micro-batches trained before the checkpoint; ``epoch_items``: micro-batches per
    epoch (no sample twice within one)."""
    import torch

    n = len(full["losses"])
    epoch_items = epoch_items or n
    for i in range(0, n, epoch_items):
        epoch = full["inputs"][i:i + epoch_items]
        assert len(set(epoch)) == len(epoch), (what, full["inputs"])
    assert len(resumed["losses"]) == n - micro_after, (what, resumed["losses"], full["losses"])
    assert resumed["inputs"] == full["inputs"][micro_after:], (what, resumed["inputs"], full["inputs"])
    assert resumed["losses"] == full["losses"][micro_after:], (what, resumed["losses"], full["losses"])
    # the Trainer's log history comes back with its state: every step's rate; the loop records its own steps
    lrs = full["lrs"][-len(resumed["lrs"]):] if len(resumed["lrs"]) < len(full["lrs"]) else full["lrs"]
    assert resumed["lrs"] == lrs and len(set(lrs)) > 1, (what, resumed["lrs"], full["lrs"])
    for name, p in full["after"].items():
        assert torch.equal(resumed["after"][name], p), (what, name, (resumed["after"][name] - p).abs().max())
        assert not torch.equal(p, full["before"][name]), (what, name)  # every parameter trained
