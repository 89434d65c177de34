"""Per-architecture facts for the fused untied-attention path (where q/k/v/o, q/k-norm and RoPE live)."""
from __future__ import annotations

from typing import Dict, Optional

from ._common import AttentionFacts, rms_norm, rope_bshd, rotate_half, text_config
from .llama import LLAMA, MISTRAL
from .qwen import QWEN2, QWEN3

FUSED_ARCHITECTURES: Dict[str, AttentionFacts] = {t: f for f in (LLAMA, MISTRAL, QWEN2, QWEN3) for t in f.model_types}


def facts_for(model_type: Optional[str]) -> Optional[AttentionFacts]:
    return FUSED_ARCHITECTURES.get(model_type)


__all__ = ["AttentionFacts", "FUSED_ARCHITECTURES", "facts_for", "rms_norm", "rope_bshd", "rotate_half", "text_config"]
