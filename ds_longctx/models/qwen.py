"""Qwen2 (q/k/v biases always on, o_proj without) and Qwen3 (per-head RMS q_norm/k_norm on head_dim,
applied before RoPE). Both carry a per-layer ``sliding_window`` attribute (None unless enabled)."""
from ._common import Architecture, AttentionFacts

QWEN2 = Architecture(AttentionFacts(model_types=("qwen2",), attention_class="Qwen2Attention",
                                    sliding_window_attr="sliding_window"), mlp_class="Qwen2MLP")
QWEN3 = Architecture(AttentionFacts(model_types=("qwen3",), attention_class="Qwen3Attention", q_norm="q_norm",
                                    k_norm="k_norm", sliding_window_attr="sliding_window"), mlp_class="Qwen3MLP")
