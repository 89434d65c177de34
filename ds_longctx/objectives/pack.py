"""A full batch that every rank of the SP group holds (after generation: prompts padded on the left, completions on
the right) as one packed row of its real tokens, ready for ``data.shard_batch``; and the per-token values of that
row back in the batch's ``[B, S]`` layout.

What one process does with such a batch (transformers' forward without ``position_ids``): each row runs with the
positions ``arange(S)`` of the padded row, the padding keys masked out, so each real token attends to the real
tokens before it in its row; the target of the token at ``t`` is ``labels[t + 1]`` of the padded row. So a row's
span of real tokens ``[l, r)`` is one document whose positions are ``l .. r - 1`` (or the given ``position_ids``,
a new document at each restart), and packing the rows' real tokens one after the other (documents restarting
attention, their positions kept) gives every real token the same keys and the same rotary angles: padding costs no
compute, and documents cross the SP shard edges like any packed batch. The row is padded to a multiple of the SP
degree with one ignored document (``attention_mask`` zeros at its end: ``shard_batch``'s right padding).

Refused by name (``BatchError``): zeros between ones in a row's mask (one process would let the tokens after the gap
attend across it while a recurrent layer decays its state over it: no packed form is the same); a valid target
predicted by a padding token (one process scores it from a masked query); a mask that is not ``[batch, seq]``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from ..data.batch import LENS_KEY, custom_mask_error
from ..errors import BatchError
from ..loss import IGNORE_INDEX, shift_labels_of


@dataclass
class Packing:
    """``batch``: the packed full row (input_ids, position_ids, shift_labels, attention_mask, doc_lens: what
    ``shard_batch`` cuts); ``index``: for each real packed token, its flat index into ``[B * S]``; ``shape``: (B, S);
    ``n_real``: the real tokens (the row is ``length`` long, padded to a multiple of the SP degree);
    ``doc_lens``: the documents' lengths, in packed order; ``rows``: each document's batch row."""
    batch: dict
    index: torch.Tensor
    shape: tuple
    n_real: int
    doc_lens: List[int]
    rows: List[int]

    @property
    def length(self) -> int:
        return int(self.batch["input_ids"].shape[1])

    def unpack(self, packed: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Per-token values of the packed row (``[1, length, ...]`` or ``[length, ...]``) in the batch's layout
        ``[B, S, ...]``, ``fill`` where no real token is; differentiable (a gather of the packed values)."""
        b, s = self.shape
        flat = packed.reshape(-1, *packed.shape[2:]) if packed.dim() >= 2 and packed.shape[0] == 1 else packed
        flat = flat[: self.n_real]
        out = flat.new_full((b * s,) + tuple(flat.shape[1:]), fill)
        return out.index_copy(0, self.index.to(flat.device), flat).view(b, s, *flat.shape[1:])

    def token_rows(self) -> torch.Tensor:
        """[length] long: the batch row of each packed token (-1 for the padding document)."""
        out = torch.full((self.length,), -1, dtype=torch.long)
        out[: self.n_real] = torch.div(self.index, self.shape[1], rounding_mode="floor")
        return out


def real_spans(mask: torch.Tensor) -> List[tuple]:
    """(l, r) of each row's ones in a ``[B, S]`` 0/1 mask; a BatchError naming the row for zeros between ones."""
    out = []
    for i, row in enumerate(mask.detach().to("cpu").bool()):
        n = int(row.sum())
        if n == 0:
            out.append((0, 0))
            continue
        first = int(row.nonzero()[0])
        if not bool(row[first:first + n].all()):
            raise BatchError("batch.attention_mask", f"row {i} has padding between real tokens (zeros between ones), "
                             "which has no packed form equal to one process (the tokens after the gap attend across "
                             "it; a recurrent layer decays its state over it)",
                             "pad each row on the left and/or the right only (one span of real tokens per row)")
        out.append((first, first + n))
    return out


def has_left_padding(mask) -> bool:
    """Whether a ``[B, S]`` padding mask has a zero before a one in some row (not plain right padding)."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[1] < 2:
        return False
    m = mask.detach().bool()
    return bool((~m[:, :-1] & m[:, 1:]).any())


def pack(input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
         labels: Optional[torch.Tensor] = None, shift_labels: Optional[torch.Tensor] = None,
         position_ids: Optional[torch.Tensor] = None, multiple: int = 1) -> Packing:
    """Pack a full ``[B, S]`` batch (module doc). ``labels`` (unshifted, -100: no target) or ``shift_labels``;
    ``multiple``: the SP degree (the packed row's length is a multiple of it, at least one token per rank)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise BatchError("batch.input_ids", f"expected a [batch, seq] tensor, got "
                         f"{tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__}",
                         "collate samples into a 2-D tensor")
    b, s = input_ids.shape
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2):
        raise custom_mask_error(attention_mask)
    if attention_mask is not None and tuple(attention_mask.shape) != (b, s):
        raise BatchError("batch.attention_mask", f"has shape {tuple(attention_mask.shape)}, input_ids {(b, s)}",
                         "give one mask value per token")
    if shift_labels is None:
        if labels is None:
            raise BatchError("batch.labels", "missing", "give labels (-100 where a token has no target)")
        if tuple(labels.shape) != (b, s):
            raise BatchError("batch.labels", f"has shape {tuple(labels.shape)}, input_ids {(b, s)}",
                             "give one label per token")
        shift_labels = shift_labels_of(labels)
    spans = real_spans(attention_mask) if attention_mask is not None else [(0, s)] * b
    given = None
    if position_ids is not None:
        given = position_ids.detach().to("cpu", torch.long)
        given = given.expand(b, s) if given.dim() == 1 else given
        if tuple(given.shape) != (b, s):
            raise BatchError("batch.position_ids", f"has shape {tuple(position_ids.shape)}, input_ids {(b, s)}",
                             "give one position per token")
    targets = shift_labels.detach().to("cpu")
    dev = input_ids.device
    ids, pos, sl, index, doc_lens, rows = [], [], [], [], [], []
    for i, (l, r) in enumerate(spans):
        outside = torch.ones(s, dtype=torch.bool)
        outside[l:r] = False
        bad = (targets[i] != IGNORE_INDEX) & outside
        if bool(bad.any()):
            t = int(bad.nonzero()[0])
            raise BatchError("batch.labels", f"row {i}: the target of position {t} (labels[{i}, {t + 1}]) is predicted "
                             "by a padding token", "set labels to -100 where the token before is padding (the first "
                             "real token after left padding, and the padding itself)")
        if r == l:
            continue
        p = given[i, l:r] if given is not None else torch.arange(l, r)
        starts = [0]
        if given is not None:
            starts += (((p[1:] - p[:-1]) != 1).nonzero().flatten() + 1).tolist()
        bounds = starts + [r - l]
        lens = [e - a for a, e in zip(bounds, bounds[1:])]
        doc_lens += lens
        rows += [i] * len(lens)
        ids.append(input_ids[i, l:r])
        pos.append(p)
        sl.append(shift_labels[i, l:r])
        index.append(torch.arange(i * s + l, i * s + r))
    n_real = sum(doc_lens)
    total = max(multiple, -(-n_real // multiple) * multiple)
    extra = total - n_real
    packed_ids = torch.cat(ids + [input_ids.new_zeros(extra)])
    packed_pos = torch.cat(pos + [torch.arange(extra)]).to(dev)
    packed_sl = torch.cat(sl + [shift_labels.new_full((extra,), IGNORE_INDEX)])
    mask = torch.cat([torch.ones(n_real, dtype=torch.long), torch.zeros(extra, dtype=torch.long)]).to(dev)
    batch = {"input_ids": packed_ids[None], "position_ids": packed_pos[None], "shift_labels": packed_sl[None],
             "attention_mask": mask[None], LENS_KEY: [doc_lens]}
    return Packing(batch=batch, index=torch.cat(index) if index else torch.zeros(0, dtype=torch.long), shape=(b, s),
                   n_real=n_real, doc_lens=doc_lens, rows=rows)


__all__ = ["Packing", "has_left_padding", "pack", "real_spans"]
