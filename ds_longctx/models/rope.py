"""RoPE whose frequencies depend on the sequence: computed from the SP group's sequence, not the shard's.

transformers' ``dynamic`` (NTK) and ``longrope`` rotary embeddings pick their frequencies from the highest position
the forward sees (``modeling_rope_utils.dynamic_rope_update``: ``seq_len = max(position_ids) + 1``; dynamic rescales
past ``max_position_embeddings``, LongRoPE switches to its long factors past ``original_max_position_embeddings``).
Under SP each rank sees only its shard's positions, so rank 0 (positions 0 .. S/C - 1) kept the unscaled
frequencies while one process, and the last rank, scaled them: attention trained on two RoPEs at once, silently
(issue 35). Every other rope type (default, linear, yarn, llama3, ...) is a function of the config alone.

Under SP the forward wrapper (sp_batch.py) agrees on the group's highest position in the header it already
all-gathers and runs the rotary forward inside :func:`group_positions`; :func:`install` makes each sequence-
dependent rotary embedding first run transformers' own update on that global length (its decorated forward on one
position), then its undecorated forward on the shard's positions. Same frequencies, same state changes (dynamic's
growth and reset) as one process: exact. A sequence-dependent rotary embedding whose forward is not transformers'
decorator (a model's own update code) is refused, naming it: its update cannot be given the global length.
"""
from __future__ import annotations

import contextlib
import contextvars
import types
from typing import List, Optional

import torch

from ..errors import ConfigError
from ..measure.simulation import holds_values

# the global sequence length (max position + 1 over the SP group) of the forward running now; None: the shard's own
_GLOBAL_LEN: contextvars.ContextVar[Optional[int]] = contextvars.ContextVar("ds_longctx_global_len", default=None)


def _rope_types(module) -> List[str]:
    rt = getattr(module, "rope_type", None)
    if isinstance(rt, dict):
        return [str(v) for v in rt.values()]
    return [str(rt)] if rt is not None else []


def _sequence_dependent(rope_types) -> bool:
    return any(("dynamic" in t) or t == "longrope" for t in rope_types)


def _is_transformers_update(forward) -> bool:
    """``forward`` is transformers' ``dynamic_rope_update`` wrapper (its closure names both update functions)."""
    code = getattr(forward, "__code__", None)
    free = getattr(code, "co_freevars", ())
    return (hasattr(forward, "__wrapped__") and "dynamic_frequency_update" in free
            and "longrope_frequency_update" in free)


def _reads_max_position(fn) -> bool:
    import inspect
    import re

    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):
        return True  # cannot tell: refuse
    return re.search(r"max\(\s*position_ids|position_ids\.max\(", src) is not None


def sequence_dependent_rotaries(model) -> list:
    """(name, module) of every rotary embedding whose frequencies depend on the positions it is called with."""
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "inv_freq") and _sequence_dependent(_rope_types(m))]


class RopeInstall:
    """The rotary embeddings :func:`install` wrapped; ``remove()`` restores their forward."""

    def __init__(self, modules):
        self.modules = modules

    def remove(self) -> None:
        for m in self.modules:
            m.__dict__.pop("forward", None)
        self.modules = []


def install(model) -> Optional[RopeInstall]:
    """Make the model's sequence-dependent rotary embeddings (if any) use :func:`group_positions`' global length.
    Returns the undo handle, or None when the model has none. Raises ConfigError for one it cannot fix."""
    found = sequence_dependent_rotaries(model)
    if not found:
        return None
    for name, m in found:
        if _is_transformers_update(type(m).forward) and _reads_max_position(type(m).forward.__wrapped__):
            # PhiMoE's LongRoPE: its forward picks its mscale from max(position_ids) itself (tools/position_audit.py)
            raise ConfigError("model.config.rope_parameters", f"{name} ({type(m).__name__}) uses rope type "
                              f"{'/'.join(_rope_types(m))} and its forward reads the highest position of the "
                              "positions it is given: under sequence parallelism each rank would scale by its shard",
                              "use a rope type that depends on the config only (yarn, linear, llama3, or a larger "
                              "rope_theta), or train at sequence_parallel_size 1")
        if not _is_transformers_update(type(m).forward):
            raise ConfigError("model.config.rope_parameters", f"{name} ({type(m).__name__}) uses rope type "
                              f"{'/'.join(_rope_types(m))}, whose frequencies depend on the sequence length, with "
                              "its own update code: under sequence parallelism each rank would scale by its shard",
                              "use a rope type that depends on the config only (yarn, linear, llama3, or a larger "
                              "rope_theta), or train at sequence_parallel_size 1")
    for _, m in found:
        m.forward = types.MethodType(_global_length_forward, m)
    return RopeInstall([m for _, m in found])


def _global_length_forward(self, x, position_ids, layer_type=None):
    decorated = type(self).forward
    kw = {} if layer_type is None else {"layer_type": layer_type}
    n = _GLOBAL_LEN.get()
    if n is None:
        return decorated(self, x, position_ids, **kw)
    # transformers' own update on the group's length (max position n - 1), then the plain forward on this shard
    decorated(self, x[..., :0], torch.full((1, 1), n - 1, dtype=position_ids.dtype, device=position_ids.device), **kw)
    return decorated.__wrapped__(self, x, position_ids, **kw)


@contextlib.contextmanager
def group_positions(global_len: Optional[int]):
    """Run the forward inside with the SP group's sequence length (max position + 1 over the group)."""
    token = _GLOBAL_LEN.set(global_len)
    try:
        yield
    finally:
        _GLOBAL_LEN.reset(token)


def local_max_position(position_ids) -> int:
    """max(position_ids) + 1 of this rank's shard, for the header (0 with none). In the planner's step the
    positions hold no values (they are 0 .. S-1 on every rank there): 0 (the header takes the MAX over the group,
    and the planner's fake group hands every rank rank 0's)."""
    if position_ids is None or position_ids.numel() == 0 or not holds_values(position_ids):
        return 0
    return int(position_ids.max()) + 1


__all__ = ["install", "group_positions", "local_max_position", "sequence_dependent_rotaries", "RopeInstall"]
