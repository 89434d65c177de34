"""Held-out evaluation under SP and DP: the token-weighted loss over every rank's shards, equal to one process's.

    loader = eval_loader(open_corpus("heldout.jsonl", tok, seq_len), engine)
    stats = evaluate(engine, loader)       # every rank calls it: {"loss", "perplexity", "tokens"}

``evaluate`` reads only ``engine(**batch).loss``, so it works with ``long_context.tiled_loss`` on (no logits are
built). The loss of a batch is the mean over the scored tokens of its SP group (ds_longctx's SP loss; a plain
model's own mean at SP=1); times this rank's scored tokens and summed over every rank, that is the sum over all
scored tokens, so the result is sum / count over every sample of the loader, as one process computes it.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Iterator, Optional

import torch
import torch.distributed as dist

from ..dist.comm import all_gather_ints, control_device
from ..data import shard_batch
from ..errors import BatchError
from ..loss import IGNORE_INDEX


class EvalLoader:
    """Replica ``dp_rank``'s share of ``dataset`` (sample i goes to replica i % dp_size), sharded for
    ``sp_rank``. Every rank yields the same number of batches of ``batch_size`` samples: ZeRO-3 gathers
    parameters in every forward and SP ranks exchange activations, so a rank with one batch fewer would leave
    the others waiting. Places past a replica's last sample are filled with sample 0 with every label ignored:
    it adds no token to the loss. Unlike a ``DistributedSampler`` (which repeats samples to even the replicas
    out), no sample is counted twice."""

    def __init__(self, dataset, batch_size: int = 1, sp_rank: int = 0, sp_size: int = 1, dp_rank: int = 0,
                 dp_size: int = 1, collate_fn: Optional[Callable] = None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.dataset, self.batch_size = dataset, batch_size
        self.sp_rank, self.sp_size, self.dp_rank, self.dp_size = sp_rank, sp_size, dp_rank, dp_size
        self.collate_fn = collate_fn or torch.utils.data.default_collate
        n = len(dataset)
        self.indices = list(range(dp_rank, n, dp_size))
        self.per_replica = -(-n // dp_size)

    def __len__(self):
        return -(-self.per_replica // self.batch_size)

    @staticmethod
    def _ignored(item: dict) -> dict:
        item = dict(item)
        item["labels"] = torch.full_like(item.get("labels", item["input_ids"]), IGNORE_INDEX)
        if "shift_labels" in item:
            item["shift_labels"] = torch.full_like(item["shift_labels"], IGNORE_INDEX)
        return item

    def __iter__(self) -> Iterator[Dict[str, torch.Tensor]]:
        for b in range(len(self)):
            rows = [self.dataset[i] for i in self.indices[b * self.batch_size:(b + 1) * self.batch_size]]
            if len(rows) < self.batch_size:
                filler = self._ignored(self.dataset[0])
                rows += [filler] * (self.batch_size - len(rows))
            yield shard_batch(self.collate_fn(rows), self.sp_rank, self.sp_size)


def eval_loader(dataset, engine, batch_size: Optional[int] = None, collate_fn: Optional[Callable] = None
                ) -> EvalLoader:
    """An :class:`EvalLoader` placed by the engine's layout (``ds_longctx.initialize`` sets it; a plain DeepSpeed
    engine: SP 1 over the default group). ``batch_size``: the engine's micro batch by default."""
    layout = getattr(engine, "long_context_layout", None)
    if layout is not None:
        sp, sp_rank, dp, dp_rank = layout.sp, layout.sp_rank, layout.dp, layout.dp_rank
    else:
        live = dist.is_available() and dist.is_initialized()
        sp, sp_rank = 1, 0
        dp, dp_rank = (dist.get_world_size(), dist.get_rank()) if live else (1, 0)
    if batch_size is None:
        batch_size = engine.train_micro_batch_size_per_gpu()
    return EvalLoader(dataset, batch_size, sp_rank=sp_rank, sp_size=sp, dp_rank=dp_rank, dp_size=dp,
                      collate_fn=collate_fn)


@torch.no_grad()
def evaluate(engine, loader) -> Dict[str, float]:
    """The held-out loss over every batch of ``loader`` on every rank: ``{"loss", "perplexity", "tokens"}``
    (loss: mean cross entropy per scored token, in nats; tokens: scored tokens over the whole job).

    A collective: every rank calls it with its own loader (same number of batches everywhere, as
    :class:`EvalLoader` gives). Batches are sharded ones (``shift_labels``, ``position_ids``). The engine is put
    in eval mode for the loop and back in train mode after it if it was."""
    live = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if live and hasattr(loader, "__len__"):  # a rank with fewer batches would leave the others in a collective
        lens = [row[0] for row in all_gather_ints([len(loader)])]
        if len(set(lens)) > 1:
            raise BatchError("evaluate.loader", f"the ranks hold different numbers of batches ({lens}, by rank): "
                             "ZeRO-3 and SP run collectives in every forward", "give every rank the same number "
                             "of batches (ds_longctx.eval.evaluate.eval_loader does)")
    training = engine.training
    engine.eval()
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    try:
        for batch in loader:
            labels = batch.get("shift_labels")
            if labels is None:
                raise BatchError("batch.shift_labels", "is missing: evaluate scores sharded batches",
                                 "iterate an EvalLoader (ds_longctx.eval.evaluate.eval_loader) or shard with "
                                 "ds_longctx.data.shard_batch")
            n = int((labels != IGNORE_INDEX).sum())
            batch = {k: v.to(engine.device) if torch.is_tensor(v) else v for k, v in batch.items()}
            loss = engine(**batch).loss
            if n:  # a shard with no scored token adds nothing (a plain model's mean over none is NaN)
                total += loss.detach().double().cpu() * n
                count += n
    finally:
        if training:
            engine.train()
    stats = torch.stack([total, torch.tensor(float(count), dtype=torch.float64)])
    if live:
        stats = stats.to(control_device())
        dist.all_reduce(stats)  # over every rank: the SP shards of a sample and the DP replicas
        stats = stats.cpu()
    tokens = int(round(float(stats[1])))
    loss = float(stats[0]) / tokens if tokens else float("nan")
    perplexity = (math.exp(loss) if loss < 709 else float("inf")) if math.isfinite(loss) else loss
    return {"loss": loss, "perplexity": perplexity, "tokens": tokens}


__all__ = ["evaluate", "eval_loader", "EvalLoader"]
