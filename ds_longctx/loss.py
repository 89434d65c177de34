"""Causal-LM loss on sequence shards: the CE *sum* over valid local tokens and their count.

Shards carry pre-shifted labels (``shift_labels``), so a token's target is right even when it lives on
the next rank. The SP-global mean and its gradient scale are applied by :class:`comm.SPLoss`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def lm_logits(lm_head: torch.nn.Module, hidden: torch.Tensor, logit_fn=None) -> torch.Tensor:
    """fp32 logits as the model's forward makes them: ``lm_head``, then the model's own logit transform
    (``models.logits.logit_transform``: soft-capping, scaling; None = identity) in lm_head's dtype, as HF
    applies it, then the upcast its loss makes."""
    logits = lm_head(hidden)
    if logit_fn is not None:
        logits = logit_fn(logits)
    return logits.float()


def causal_lm_loss_sum(hidden: torch.Tensor, lm_head: torch.nn.Module, shift_labels: torch.Tensor, logit_fn=None):
    """Untiled reference: materialises [b, s_local, vocab] logits."""
    logits = lm_logits(lm_head, hidden, logit_fn)
    labels = shift_labels.to(logits.device)
    loss_sum = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction="sum")
    count = (labels != IGNORE_INDEX).sum()
    return loss_sum, count, logits


def shift_labels_of(labels: torch.Tensor) -> torch.Tensor:
    """labels[:, 1:] followed by one ignored position: the target of token t is labels[t + 1]."""
    pad = torch.full_like(labels[:, :1], IGNORE_INDEX)
    return torch.cat([labels[:, 1:], pad], dim=1)
