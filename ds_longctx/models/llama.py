"""Llama and Mistral: q/k/v/o projections (optional biases for Llama via attention_bias), RoPE from
the model-level rotary embedding (passed as position_embeddings), no q/k-norm, SwiGLU MLP."""
from ._common import Architecture, AttentionFacts

LLAMA = Architecture(AttentionFacts(model_types=("llama",), attention_class="LlamaAttention"), mlp_class="LlamaMLP")
# Mistral reads config.sliding_window inside attention (every layer; models/windows.py gives it per layer)
MISTRAL = Architecture(AttentionFacts(model_types=("mistral",), attention_class="MistralAttention",
                                      sliding_window_attr="config.sliding_window"), mlp_class="MistralMLP")
