"""Distillation under SP: TRL's DistillationTrainer with the student and the teacher sharded along the sequence.

TRL's ``_compute_loss`` runs each model's backbone itself (``_get_last_hidden_state``) on the whole prompt +
completion batch and projects the hidden states of the completion positions through both lm_heads in vocabulary tiles
(``_chunked_divergence_loss``: TRL's ``ChunkedDivergenceFunction``, the generalised JSD with temperature, soft-caps and
logit scales). Under SP each rank runs both patched models on its shard of the packed batch (objectives/pack.py: the
positions whose next token is a scored completion token are this shard's targets), applies TRL's own
``_chunked_divergence_loss`` to those rows (reused: ours is only the shard and the reduction), with the group's token
count as ``num_items_in_batch`` (the divergence summed, then divided: a sum over the group's shards of each shard's
share), and sums the shards' losses, entropies and counts over the group (objectives/reduce.py). Every rank returns
the one-process numbers; each keeps the gradient of its own tokens (times ``grad_scale``)."""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ..data.loaders import shard_batch
from ..dist.comm import ring_degree
from ..dist.layout import ring_length_multiple
from ..errors import BatchError
from ..loss import IGNORE_INDEX
from .pack import pack
from .reduce import sum_over_group

HIDDEN_KWARG = "ds_longctx_hidden"  # patching.patch.HIDDEN_KWARG (the loss forward returns the shard's hidden states)


def sharded_compute_loss(original, layout_of):
    """``DistillationTrainer._compute_loss`` run on sequence shards when ``layout_of(trainer)`` gives (sp, group,
    grad_scale) (the trainer runs under the SP view), TRL's own otherwise."""

    @functools.wraps(original)
    def _compute_loss(self, unwrapped_student, inputs, num_items_in_batch):
        layout = layout_of(self)
        if layout is None:
            return original(self, unwrapped_student, inputs, num_items_in_batch)
        from trl.trainer import distillation_trainer as td

        sp, group, grad_scale = layout
        multimodal = [k for k in ("pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes",
                                  "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")
                      if k in inputs]
        if multimodal:
            raise BatchError(f"batch.{multimodal[0]}", "reaches DistillationTrainer under sequence parallelism, which "
                             "ds_longctx runs on text only", "distil a text model, or train with sp_size=1")
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        loss_mask = inputs["completion_mask"] if "tool_mask" not in inputs else \
            inputs["completion_mask"] * inputs["tool_mask"]
        scored = torch.cat([torch.zeros_like(inputs["prompt_mask"]), loss_mask], dim=1)
        labels = ids.masked_fill(scored == 0, IGNORE_INDEX)
        ring = ring_degree()
        packing = pack(ids, mask, labels=labels, multiple=ring_length_multiple(sp, ring))
        shard = shard_batch(packing.batch, dist.get_rank(group), sp, ring=ring)
        rows = shard["shift_labels"] != IGNORE_INDEX  # this shard's positions whose next token is scored
        student_hidden = unwrapped_student(**shard, **{HIDDEN_KWARG: True}).last_hidden_state
        self.teacher_model.eval()
        with torch.no_grad():
            teacher_hidden = self.teacher_model(**shard, **{HIDDEN_KWARG: True}).last_hidden_state
        unwrapped_teacher = self.accelerator.unwrap_model(self.teacher_model)
        count = sum_over_group(rows.sum().to(torch.float32), group)  # the group's scored tokens
        total = count.clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        s_head, t_head = unwrapped_student.get_output_embeddings(), unwrapped_teacher.get_output_embeddings()
        s_cfg, t_cfg = unwrapped_student.config.get_text_config(), unwrapped_teacher.config.get_text_config()
        loss, entropy_sum, n_valid = td._chunked_divergence_loss(
            student_hidden, teacher_hidden, s_head.weight, t_head.weight, rows.long(), self.beta,
            num_items_in_batch=total, student_lm_head_bias=s_head.bias, teacher_lm_head_bias=t_head.bias,
            student_logit_scale=_logit_scale(s_cfg), teacher_logit_scale=_logit_scale(t_cfg),
            student_final_logit_softcapping=getattr(s_cfg, "final_logit_softcapping", None),
            teacher_final_logit_softcapping=getattr(t_cfg, "final_logit_softcapping", None),
            temperature=self.temperature)
        loss = sum_over_group(loss, group, grad_scale)
        return loss, sum_over_group(entropy_sum.detach(), group), sum_over_group(n_valid, group)

    return _compute_loss


def _logit_scale(config) -> float:
    """TRL's reading of a model's logit multiplier (DistillationTrainer._compute_loss)."""
    scale = getattr(config, "logit_scale", None)
    if scale is None:
        scale = getattr(config, "output_multiplier", None)
    if scale is None:
        scale = getattr(config, "lm_head_multiplier", None)
    if scale is None and getattr(config, "logits_scaling", None) is not None:
        s = config.logits_scaling
        scale = s if config.model_type == "hyperclovax" else 1 / s
    return 1.0 if scale is None else scale


__all__ = ["sharded_compute_loss"]
