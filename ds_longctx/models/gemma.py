"""Gemma2 and Gemma3 (text): GeGLU MLP (gate/up/down, gelu-tanh), pointwise over tokens. No fused untied
attention (attention soft-capping, query_pre_attn_scalar, q/k-norm): the function-level path (Gemma3; Gemma2
has no SDPA path, so under SP it runs 'ulysses' with flex_attention). Their sliding-window layers and Gemma2's
attention soft-capping are applied on the gathered sequence (models/windows.py, attention/kernels.py)."""
from ._common import Architecture

GEMMA2 = Architecture(None, mlp_class="Gemma2MLP", types=("gemma2",))
GEMMA3 = Architecture(None, mlp_class="Gemma3MLP", types=("gemma3_text", "gemma3"))
