"""Architectures whose MLP tiled_mlp runs exactly but which have no fused untied attention (fused qkv, a
q/k-norm over the whole projection, partial rotary, ...): untied attention runs at the attention-function
level for them (``fuse_projections`` 'auto', the default, picks it; ``true`` is refused).

Phi3: one fused gate_up_proj, chunked, SiLU-gated. OLMo2: Llama's SwiGLU (its q/k RMSNorm spans all heads).
GPT-NeoX: dense_h_to_4h, GELU, dense_4h_to_h. Mixtral and Qwen2-MoE: the sparse MoE block; routing is per
token (top-k of the token's own router logits, no capacity limit), so tiling the sequence is exact; Qwen2-MoE's
shared expert and its sigmoid gate are per token too. Qwen3-MoE and OLMoE: the same routing (their router and
experts are Mixtral's code, no shared expert, no jitter). Their blocks unpack [batch, seq, hidden].
Every other MLP running one of the reference forwards of ``_common._MLP_FORMS`` verbatim (LlamaMLP's, Phi3MLP's,
NemotronMLP's, PhiMLP's, SeedOssMLP's, Starcoder2MLP's, GraniteMoeSharedMLP's) is recognised by its source (models.pointwise_mlp_form),
without an entry here."""
from ._common import Architecture

PHI3 = Architecture(None, mlp_class="Phi3MLP", types=("phi3",))
OLMO2 = Architecture(None, mlp_class="Olmo2MLP", types=("olmo2",))
GPT_NEOX = Architecture(None, mlp_class="GPTNeoXMLP", types=("gpt_neox",))
MIXTRAL = Architecture(None, mlp_class="MixtralSparseMoeBlock", types=("mixtral",), mlp_batched=True,
                       mlp_noise_attr="jitter_noise")
QWEN2_MOE = Architecture(None, mlp_class="Qwen2MoeSparseMoeBlock", types=("qwen2_moe",), mlp_batched=True)
QWEN3_MOE = Architecture(None, mlp_class="Qwen3MoeSparseMoeBlock", types=("qwen3_moe",), mlp_batched=True)
OLMOE = Architecture(None, mlp_class="OlmoeSparseMoeBlock", types=("olmoe",), mlp_batched=True)
