"""Tiny HF model configs built locally (no hub): Llama, Mistral, Qwen2, Qwen3; and the spec a test patches them
with (spec_for: ds_longctx.patching.spec.build_spec from a parsed section and the SP group)."""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

ARCHS = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}


def tiny_config(arch: str = "llama", heads: int = 4, kv_heads: int = 2, head_dim: int = 8, layers: int = 2,
                vocab: int = 64, intermediate: int = 48, attn: str = "sdpa", **overrides):
    cls = ARCHS[arch]
    kw = dict(hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
              head_dim=head_dim, num_hidden_layers=layers, vocab_size=vocab, intermediate_size=intermediate,
              max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False)
    if arch == "mistral":
        kw["sliding_window"] = None
    if arch in ("qwen2", "qwen3"):
        kw["use_sliding_window"] = False
    kw.update(overrides)
    cfg = cls(**kw)
    cfg._attn_implementation = attn
    return cfg


def build(cfg, seed: int = 0, dtype=torch.float32):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=cfg._attn_implementation)
    return model


def spec_for(model, lc, group=None, grad_scale: float = 1.0, sequence_length=None):
    """The spec patching ``model`` (or a model config) with the parsed section ``lc`` needs
    (ds_longctx.patching.spec.build_spec, which checks it): the SP degree is ``group``'s size (None: the config's), the
    world that of the default process group when there is one."""
    import torch.distributed as dist

    from ds_longctx.dist.layout import Layout
    from ds_longctx.patching.spec import build_spec

    config = getattr(model, "config", None) if isinstance(model, torch.nn.Module) else model
    sp = dist.get_world_size(group) if group is not None else lc.sequence_parallel_size
    if sp != lc.sequence_parallel_size:
        lc = lc.model_copy(deep=True)
        lc.sequence_parallel_size = sp
    live = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if live and dist.get_world_size() % sp == 0 else sp
    layout = Layout(world=world, sp=sp, rank=dist.get_rank() if live else 0, grad_scale=grad_scale)
    return build_spec(lc, config, layout, group, sequence_length)


def patch(model, lc, group=None, grad_scale: float = 1.0, sequence_length=None):
    """ds_longctx.patching.patch.patch_model(model, spec_for(model, lc, group, ...))."""
    from ds_longctx.patching.patch import patch_model

    return patch_model(model, spec_for(model, lc, group, grad_scale, sequence_length))


def memory_stack(model, lc, offload_target=None):
    """ds_longctx.memory.apply_memory_stack(model, spec_for(model, lc), offload_target)."""
    from ds_longctx.memory import apply_memory_stack

    return apply_memory_stack(model, spec_for(model, lc), offload_target)
