"""Gemma2 and Gemma3 (text): GeGLU MLP (gate/up/down, gelu-tanh), pointwise over tokens. No fused untied
attention (attention soft-capping, query_pre_attn_scalar, sliding-window layers): the function-level path,
which refuses the windows under SP (config.check_sp_attention_pattern)."""
from ._common import Architecture

GEMMA2 = Architecture(None, mlp_class="Gemma2MLP", types=("gemma2",))
GEMMA3 = Architecture(None, mlp_class="Gemma3MLP", types=("gemma3_text", "gemma3"))
