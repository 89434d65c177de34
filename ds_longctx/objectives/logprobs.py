"""``ds_longctx.token_logprobs``: the per-token log-probabilities of given tokens under a patched model, on this
rank's sequence shard, for any loop (RL, preference, distillation, scoring), and the reductions over the SP group
that give one process's numbers.

The batch is the full batch every rank of the SP group holds (after generation): ``input_ids`` ``[B, S]``,
``labels`` (the tokens to score, -100 elsewhere) or ``completion_mask`` (1 where a token is scored), optionally an
``attention_mask`` (padding on the left and/or the right) and ``position_ids``. It is packed (objectives/pack.py),
cut with ``shard_batch`` and run through the model's patched forward with ``fused_lm_head=True``: the log-probability
(and the entropy) of each scored token under ``logits * (1 / temperature)`` (TRL's definition), computed over row
tiles through the lm_head (``memory.tiling.TiledTokenFields``: never this shard's ``[tokens, vocab]`` logits). With
gradients for a policy; under ``torch.no_grad()`` for a reference or an old policy.

The result holds this rank's shard (``logprobs``, ``entropy``, ``kl``, ``mask``: ``[1, n]`` in packed order) and
reduces over the group: sums and counts are summed over the ranks before any division (a mean over a rank's tokens
is not a mean over the sequence's), per sequence (a batch row) or over the batch, and ``gather`` puts a per-token
value back in the batch's layout on every rank. The reductions are differentiable for a loss that every rank of the
group computes alike (objectives/reduce.py): build the loss from them, then ``engine.backward(loss)``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..data.loaders import shard_batch
from ..dist.layout import gathered_order, ring_length_multiple, shard_index
from ..errors import BatchError, ConfigError
from ..loss import IGNORE_INDEX
from ..patching.patch import TEMPERATURE_KWARG, get_patch
from .pack import Packing, pack
from .reduce import gather_tokens, sum_over_group


@dataclass
class TokenLogprobs:
    """This rank's shard of a batch's scored tokens (module doc). ``logprobs``/``entropy``/``kl``/``mask`` are
    ``[1, n]`` (0 / False where a token is not scored); the reductions run over ``group``."""
    logprobs: torch.Tensor
    entropy: Optional[torch.Tensor]
    kl: Optional[torch.Tensor]
    mask: torch.Tensor
    packing: Packing
    group: object
    sp: int
    sp_rank: int
    grad_scale: float
    ring: int = 1

    @property
    def shard(self) -> torch.Tensor:
        """This rank's tokens in the packed row (its contiguous shard, or its zigzag chunks under a ring)."""
        return torch.tensor(shard_index(self.packing.length, self.sp, self.ring, self.sp_rank), dtype=torch.long)

    def _rows(self) -> torch.Tensor:
        return self.packing.token_rows()[self.shard].to(self.mask.device)

    def per_token(self, row_values: torch.Tensor) -> torch.Tensor:
        """``[1, n]``: each of this shard's tokens given its batch row's value (``row_values`` ``[B]``: an advantage,
        a sequence-level weight); 0 on the packing's padding."""
        rows = self._rows()
        out = row_values.new_zeros(rows.shape[0])
        keep = rows >= 0
        out[keep] = row_values[rows[keep]]
        return out[None]

    def sequence_sums(self, values: torch.Tensor) -> torch.Tensor:
        """``[B]``: per batch row, the sum of ``values`` (``[1, n]``, this shard's tokens) over its scored tokens,
        summed over the group."""
        rows = self._rows()
        keep = self.mask[0] & (rows >= 0)
        v = values.reshape(-1)
        out = v.new_zeros(self.packing.shape[0]).index_add(0, rows[keep], v[keep])
        return sum_over_group(out, self._group(), self.grad_scale)

    def sequence_counts(self) -> torch.Tensor:
        """``[B]``: scored tokens per batch row (no gradient)."""
        with torch.no_grad():
            return self.sequence_sums(torch.ones_like(self.logprobs, dtype=torch.float32))

    def token_count(self) -> torch.Tensor:
        """Scored tokens in the batch."""
        return self.sequence_counts().sum()

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """The sum of ``values`` over the batch's scored tokens, over the group."""
        return self.sequence_sums(values).sum()

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """``[B, S]``: a per-token value of this shard's tokens, put back in the batch's layout on every rank,
        aligned with the labels (``[i, t]``: the value of token ``t`` given the tokens before it; 0 where none)."""
        order = gathered_order(self.packing.length, self.sp, self.ring) if self.ring > 1 else None
        full = self.packing.unpack(gather_tokens(values, self._group(), self.grad_scale, order), fill=0)
        return torch.nn.functional.pad(full[:, :-1], (1, 0))

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`gather` for a value every rank holds (``[B, S]``, labels-aligned): this shard's
        ``[1, n]`` (0 on the packing's padding)."""
        b, s = self.packing.shape
        shifted = torch.nn.functional.pad(full[:, 1:], (0, 1)).reshape(-1)
        flat = torch.zeros(self.packing.length, dtype=full.dtype, device=full.device)
        flat[: self.packing.n_real] = shifted[self.packing.index.to(full.device)]
        return flat[self.shard][None]

    def _group(self):
        return self.group if self.sp > 1 else None


def token_logprobs(model, batch: dict, temperature: float = 1.0, ref_logprobs=None) -> TokenLogprobs:
    """Per-token log-probabilities, entropy and (with ``ref_logprobs``) the per-token KL to a reference of
    ``batch``'s scored tokens on this rank's shard (module doc). ``model``: a ds_longctx engine or an ``enable()``d HF
    model (a PEFT model too). ``ref_logprobs``: the reference's :class:`TokenLogprobs` of the same batch, or its values
    ``[B, S]`` labels-aligned; the KL is TRL's k3 estimate ``exp(ref - lp) - (ref - lp) - 1``."""
    handle = get_patch(model)
    if handle is None:
        raise ConfigError("model", "is not a ds_longctx model (no patch found on it or inside it)",
                          "pass the engine from ds_longctx.initialize, or a model trained through enable() after "
                          "the Trainer / Accelerator prepared it")
    spec = handle.spec
    sp, group = spec.sp, spec.group
    ids = batch.get("input_ids")
    labels = batch.get("labels")
    if labels is None and batch.get("completion_mask") is not None:
        labels = ids.masked_fill(batch["completion_mask"] == 0, IGNORE_INDEX)
    if labels is None:
        raise BatchError("batch.labels", "missing: nothing says which tokens to score",
                         "give labels (the token ids to score, -100 elsewhere) or completion_mask (1 where scored)")
    extra = sorted(k for k in batch if k not in ("input_ids", "labels", "completion_mask", "attention_mask",
                                                   "position_ids"))
    if extra:
        raise BatchError(f"batch.{extra[0]}", "is not read by token_logprobs", "give input_ids, labels or "
                         "completion_mask, and optionally attention_mask and position_ids")
    ring = spec.ring
    packing = pack(ids, batch.get("attention_mask"), labels=labels, position_ids=batch.get("position_ids"),
                   multiple=ring_length_multiple(sp, ring))
    rank = torch.distributed.get_rank(group) if sp > 1 else 0
    shard = shard_batch(packing.batch, rank, sp, ring=ring)
    out = model(**shard, fused_lm_head=True, **{TEMPERATURE_KWARG: temperature})
    lp, ent, mask = out.log_probs, out.entropy, out.label_mask
    result = TokenLogprobs(lp, ent, None, mask, packing, group, sp, rank, spec.grad_scale, ring)
    if ref_logprobs is not None:
        ref = ref_logprobs.logprobs if isinstance(ref_logprobs, TokenLogprobs) else result.local(ref_logprobs)
        d = ref.detach().to(lp.dtype) - lp
        result.kl = (torch.exp(d) - d - 1).masked_fill(~mask, 0.0)
    return result


__all__ = ["TokenLogprobs", "token_logprobs"]
