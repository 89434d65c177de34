"""Per-architecture knowledge, in one place: where attention keeps q/k/v/o, q/k-norm and its sliding
window (fused untied attention), which MLP is pointwise over tokens (tiled MLP), which RMSNorms have
Llama's formula (memory-efficient RMSNorm), what a decoder layer's children are (the planner's tags).
What every causal LM does to its logits between lm_head and the loss is read in ``logits.py``; which
layers attend other than full causal (sliding windows, chunks) in ``windows.py``.

Adding an architecture = one file defining an ``Architecture`` + one line in ``ARCHITECTURES`` + a
tiny config in tests/tiny_models.py (tests/test_models.py checks that the three agree).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

from ._common import (Architecture, AttentionFacts, AttentionShape, LayerDims, attention_dims, attention_shape,
                      is_llama_style_rmsnorm, latent_dims,
                      mlp_form_names, pointwise_mlp_form, layer_role, rms_norm, rope_bshd,
                      rotate_half, text_config)
from .gemma import GEMMA2, GEMMA3
from .llama import LLAMA, MISTRAL
from .others import GPT_NEOX, MIXTRAL, OLMO2, OLMOE, PHI3, QWEN2_MOE, QWEN3_MOE
from .qwen import QWEN2, QWEN3

# the registry: model_type -> Architecture
ARCHITECTURES: Dict[str, Architecture] = {t: a for a in (LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA2, GEMMA3, PHI3, OLMO2,
                                                         GPT_NEOX, MIXTRAL, QWEN2_MOE, QWEN3_MOE, OLMOE)
                                         for t in a.model_types}

FUSED_ARCHITECTURES: Dict[str, AttentionFacts] = {t: a.attention for t, a in ARCHITECTURES.items()
                                                  if a.attention is not None}


def facts_for(model_type: Optional[str]) -> Optional[AttentionFacts]:
    return FUSED_ARCHITECTURES.get(model_type)


def mlp_class_names() -> Tuple[str, ...]:
    return tuple(dict.fromkeys(a.mlp_class for a in ARCHITECTURES.values()))


def mlp_facts(class_name: str) -> Optional[Architecture]:
    """The architecture whose decoder MLP class is ``class_name`` (None: not known to be pointwise)."""
    return next((a for a in ARCHITECTURES.values() if a.mlp_class == class_name), None)


def supported_names() -> str:
    """For error messages: 'llama, mistral, qwen2, ...'."""
    return ", ".join(ARCHITECTURES)


__all__ = ["LayerDims", "attention_dims", "latent_dims", "mlp_facts", "Architecture", "ARCHITECTURES", "AttentionFacts", "AttentionShape", "attention_shape", "FUSED_ARCHITECTURES", "facts_for", "mlp_class_names",
           "supported_names", "layer_role", "mlp_form_names", "pointwise_mlp_form", "is_llama_style_rmsnorm", "rms_norm", "rope_bshd", "rotate_half",
           "text_config"]
