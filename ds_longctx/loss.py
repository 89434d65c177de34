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
    """Untiled reference: materialises [b, s_local, vocab] logits. Returns them as the model's forward does:
    after its logit transform, in lm_head's dtype (the cross entropy runs on an fp32 copy, as HF's loss does)."""
    logits = lm_head(hidden)
    if logit_fn is not None:
        logits = logit_fn(logits)
    fp32 = logits.float()
    labels = shift_labels.to(logits.device)
    loss_sum = F.cross_entropy(fp32.reshape(-1, fp32.shape[-1]), labels.reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction="sum")
    count = (labels != IGNORE_INDEX).sum()
    return loss_sum, count, logits


def shift_labels_of(labels: torch.Tensor) -> torch.Tensor:
    """labels[:, 1:] followed by one ignored position: the target of token t is labels[t + 1]."""
    pad = torch.full_like(labels[:, :1], IGNORE_INDEX)
    return torch.cat([labels[:, 1:], pad], dim=1)


def fused_token_fields(logits: torch.Tensor, shift_labels: torch.Tensor, metrics: bool = True) -> dict:
    """TRL's fused LM head's per-token fields (``trl.trainer.utils.add_fused_lm_head``) from fp32 logits
    [b, s, vocab] and pre-shifted labels [b, s]: the label's log-probability, the entropy of the next-token
    distribution, whether the label is its first arg-max, and the label mask; with ``metrics`` also the mean logit
    over the vocabulary and ``log(sum_v p_v^2)`` (DPO's logit metrics and WPO weights), without gradient; zero where
    the label is ignored."""
    labels = shift_labels.to(logits.device)
    mask = labels != IGNORE_INDEX
    logp = torch.log_softmax(logits, dim=-1)
    safe = labels.clamp(min=0).unsqueeze(-1)
    log_probs = logp.gather(-1, safe).squeeze(-1).masked_fill(~mask, 0.0)
    entropy = -(logp.exp() * logp).sum(-1).masked_fill(~mask, 0.0)
    is_top1 = (logits.detach().argmax(-1) == labels) & mask
    out = {"log_probs": log_probs, "entropy": entropy, "is_top1": is_top1, "label_mask": mask}
    if metrics:
        with torch.no_grad():
            out["mean_logits"] = logits.detach().mean(-1).masked_fill(~mask, 0.0)
            out["log_sum_sq_probs"] = torch.logsumexp(2 * logp.detach(), dim=-1).masked_fill(~mask, 0.0)
    return out
