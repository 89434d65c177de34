"""A full-length batch that every rank of the SP group holds, through the patched model: what the patched forward
(patching/sp_batch.py) does with it, for training and for the reference / old-policy forwards alike.

This is the batch of every RL and preference trainer: TRL builds ``prompt + completion`` after generation, on every
rank of the group alike (hf/rl.py makes the group one TRL process), and calls ``model(input_ids, attention_mask,
labels, fused_lm_head=True)``. Here it is packed (objectives/pack.py: left and right padding dropped, one document
per row), cut with ``shard_batch``, run through the patched forward on this rank's shard (SP attention, memory stack,
tiled per-token fields: no ``[tokens, vocab]`` logits), and the per-token outputs are gathered over the group
(objectives/reduce.py: differentiable, ``grad_scale``) and put back in the batch's layout: TRL's fused-head fields
``[B, S - 1]`` (log_probs, entropy, is_top1, label_mask), or the loss (and logits, where the loss is not tiled).
Every rank returns the same values, so the caller's loss is the same on every rank, which is what the gathers'
gradient assumes; the group checks that it holds one batch (:func:`group_differs`) before it runs it."""
from __future__ import annotations

import hashlib
from typing import List

import torch
import torch.distributed as dist

from ..data.loaders import shard_batch
from ..dist.comm import control_plane, sp_rank
from ..dist.layout import gathered_order, ring_length_multiple
from ..patching.compat import FUSED_FIELDS, causal_lm_output, fused_lm_head_output
from .pack import pack
from .reduce import gather_tokens


def batch_digest(*tensors) -> str:
    """A digest of the batch's tensors (None allowed): equal on two ranks iff they hold the same batch."""
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        if t is None:
            h.update(b"-")
            continue
        t = t.detach().to("cpu").contiguous()
        h.update(str((tuple(t.shape), t.dtype)).encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def group_differs(digest: str, group, sp: int) -> List[int]:
    """The SP ranks whose batch differs from SP rank 0's (empty: the group holds one batch). One small
    all-gather; control data (real under the planner's fake tensors)."""
    if sp == 1 or group is None:
        return []
    got = [None] * sp
    with control_plane():
        dist.all_gather_object(got, digest, group=group)
    return [r for r, d in enumerate(got) if d != got[0]]


def replicated_forward(forward, group, sp: int, grad_scale: float, input_ids, attention_mask, position_ids, labels,
                       kwargs: dict, evaluating: bool = False, ring: int = 1):
    """The output of ``model(input_ids, attention_mask, position_ids, labels, **kwargs)`` for a batch every rank of
    the group holds (module doc); ``forward``: the patched forward, called on this rank's shard."""
    extra = dict(kwargs)
    fused = bool(extra.get("fused_lm_head"))
    num_items = extra.pop("num_items_in_batch", None)
    packing = pack(input_ids, attention_mask, labels=labels, position_ids=position_ids,
                   multiple=ring_length_multiple(sp, ring))
    shard = shard_batch(packing.batch, sp_rank(group) if sp > 1 else 0, sp, ring=ring)
    order = gathered_order(packing.length, sp, ring) if ring > 1 else None  # the zigzag shards put back
    out = forward(**shard, **extra)
    b, s = input_ids.shape
    if fused:
        fields = {}
        for k in FUSED_FIELDS:
            v = out.get(k)
            if isinstance(v, torch.Tensor):
                full = gather_tokens(v, group if sp > 1 else None, grad_scale, order)
                fields[k] = packing.unpack(full, fill=0)[:, : s - 1]  # TRL's layout for unshifted labels
        loss = out.loss
        if num_items is not None:  # TRL's fused head: the sum over the batch's tokens over num_items_in_batch
            loss = -fields["log_probs"].sum() / num_items
        return fused_lm_head_output(loss, fields)
    logits = out.get("logits")  # (the tiled loss's output holds none, or a stand-in that refuses use)
    if not isinstance(logits, torch.Tensor):
        return causal_lm_output(out.loss, None, True, evaluating=evaluating)
    logits = packing.unpack(gather_tokens(logits, group if sp > 1 else None, grad_scale, order), fill=0)
    return causal_lm_output(out.loss, logits, False, evaluating=evaluating)


__all__ = ["batch_digest", "group_differs", "replicated_forward"]
