"""The ``long_context`` section checked against what it runs on: the model (its heads, layers and attention
pattern), the world (SP degree, sequence length) and this machine (the kernel name).

config.py checks the section on its own (a leaf: the schema and what the ds_config alone decides); this module
adds the checks that need the model's facts (ds_longctx.models) or the attention kernels. The spec builder
(``spec.build_spec``) calls :func:`check_against` and :func:`check_kernel` for every spec, the planner
(``Planner``) calls :func:`check_against` once at its entry. Pure (no collectives): every rank reaches the same
verdict from the same config, model config and world size, and raises the same error before any collective can
hang.
"""
from __future__ import annotations

from typing import Optional

from ..attention.kernels import KernelError, available_backends, backend_for, is_available, is_known
from ..config import (FUSE_KEY, KERNEL_KEY, KERNEL_NAMES, SECTION, LongContextConfig, check_heads_per_chunk, check_shards)
from ..dist.layout import ring_length_multiple
from ..errors import ConfigError, naming
from ..models import FUSED_ARCHITECTURES, attention_shape, facts_for, text_config
from ..models.hybrid import check_mixer_heads, runs_layer_type
from ..models.windows import has_sdpa_path, is_bidirectional, restricted_layers

_NOT_YET_UNDER_SP = ("train with long_context.attention.implementation 'none' at sequence_parallel_size 1, where "
                     "transformers' own attention runs it exactly")


def check_against(cfg: LongContextConfig, model_config=None, world_size: int = 1,
                  sequence_length: Optional[int] = None) -> None:
    """Check the section against the model's shape and the world. Pure: same verdict on every rank."""
    sp = cfg.sequence_parallel_size
    if world_size % sp != 0:
        raise ConfigError("sequence_parallel_size", f"{sp} does not divide the world size {world_size}",
                          f"launch a multiple of {sp} processes or pick a degree dividing {world_size}")
    seq = sequence_length if sequence_length is not None else cfg.sequence_length
    if seq is not None and seq % sp != 0:
        key = f"{SECTION}.sequence_length" if sequence_length is None else "sequence length"
        raise ConfigError(key, f"{seq} is not divisible by sequence_parallel_size={sp}",
                          f"use a multiple of {sp}, e.g. {(seq // sp + 1) * sp}")
    impl = cfg.attention.implementation
    if model_config is None:
        return
    if sp > 1 or impl == "untied_ulysses":  # else transformers' own attention, nothing split: any model trains
        _check_split_attention(cfg, model_config, seq)
    ac = cfg.activation_checkpointing
    layers = getattr(text_config(model_config), "num_hidden_layers", None)
    if isinstance(layers, int) and ac.enabled and ac.offload != "none" and ac.keep_on_device != "auto" \
            and ac.keep_on_device > layers:
        raise ConfigError(f"{SECTION}.activation_checkpointing.keep_on_device",
                          f"{ac.keep_on_device} is more than the model's {layers} decoder layers",
                          f"give at most {layers} ({layers} keeps every input on the device: then offload='none' "
                          "says the same)")
    check_shards(cfg, seq)


def _check_split_attention(cfg: LongContextConfig, model_config, seq: Optional[int]) -> None:
    """check_against's part for attention that ds_longctx splits (SP > 1, untied): heads, kernel, pattern.
    Not at SP=1 with transformers' own attention, where a model without heads (state-space) trains too."""
    sp, impl = cfg.sequence_parallel_size, cfg.attention.implementation
    shape = attention_shape(model_config)
    tc = text_config(model_config)
    v_dim = getattr(tc, "v_head_dim", None)
    indexer = next((k for k in ("index_topk", "index_n_heads", "index_head_dim") if getattr(tc, k, None)), None)
    if indexer is not None and impl != "none":  # DeepSeek's sparse attention indexer (deepseek_v32, glm_moe_dsa)
        name = getattr(tc, "model_type", None) or type(tc).__name__
        raise ConfigError(f"{SECTION}.attention.implementation", f"the {name} model has DeepSeek's sparse attention "
                          f"indexer ({indexer}={getattr(tc, indexer)}): its top-k key selection per query is not "
                          f"split by {impl!r}", _NOT_YET_UNDER_SP)
    mla = getattr(tc, "kv_lora_rank", None) or (isinstance(v_dim, int) and v_dim != shape.head_dim)
    # 'ulysses' and untied (function level: MLA has no fused path) split the heads after the up-projections
    if mla and impl not in ("ulysses", "untied_ulysses"):
        name = getattr(tc, "model_type", None) or type(tc).__name__
        raise ConfigError(f"{SECTION}.attention.implementation", f"the {name} model has multi-head latent attention "
                          f"(query/key head dim {getattr(tc, 'qk_head_dim', None) or shape.head_dim}, value head dim "
                          f"{v_dim}), which {impl!r} does not split",
                          "use long_context.attention.implementation 'ulysses' or 'untied_ulysses' (they split the "
                          f"heads after the up-projections); or {_NOT_YET_UNDER_SP}")
    ulysses = sp // ring_degree_for(cfg, model_config, seq)  # the heads' verdict (Ulysses x ring), errors named
    if sp > 1:
        attn_impl = getattr(model_config, "_attn_implementation", None)
        if attn_impl is not None and "eager" in str(attn_impl):
            raise ConfigError("model.config._attn_implementation", f"{attn_impl!r} cannot run sequence parallel",
                              "load the model with attn_implementation='sdpa' (or flash_attention_2/3); a model "
                              "with no SDPA path (Gemma2: attention soft-capping) trains with "
                              "attn_implementation='flex_attention' under long_context.attention.implementation "
                              "'ulysses'")
        check_mixer_heads(model_config, sp, "sequence_parallel_size")
    if impl == "untied_ulysses" or (impl == "ulysses" and sp > 1):
        check_sp_attention_pattern(impl, model_config, seq)
    if impl == "untied_ulysses" and cfg.attention.heads_per_chunk != "auto":
        for layer_shape in shape.distinct():
            check_heads_per_chunk(cfg.attention.heads_per_chunk, layer_shape.heads, layer_shape.kv_heads, ulysses)
    if impl == "untied_ulysses" and cfg.attention.fuse_projections is True and facts_for(tc.model_type) is None:
        raise ConfigError(FUSE_KEY, f"architecture {tc.model_type!r} has no fused untied attention (fused: "
                          f"{', '.join(FUSED_ARCHITECTURES)})", "set it to 'auto' (the default) or false: heads are "
                          "then chunked at the attention-function level, which works for any model using "
                          "transformers' attention interface")


RING_KEY = f"{SECTION}.attention.ring_degree"


def _ulysses_ok(shapes, u: int) -> bool:
    """Every layer shape's heads split over ``u`` ranks: query heads divided, KV heads divided or replicated."""
    return all(sh.heads % u == 0 and (sh.kv_heads % u == 0 or u % sh.kv_heads == 0) for sh in shapes)


def ring_degree_for(cfg: LongContextConfig, model_config, seq: Optional[int] = None) -> int:
    """The ring degree R of SP = U x R (``long_context.attention.ring_degree`` resolved): 'auto' takes the largest
    Ulysses degree U dividing SP that every layer's heads allow (so R = 1, plain Ulysses, wherever the heads allow
    SP); an integer must divide SP and leave such a U. With R > 1 the sequence length must be a multiple of
    dist.layout.ring_length_multiple. Pure; the one error names the counts and the degrees that work."""
    sp, att = cfg.sequence_parallel_size, cfg.attention
    if sp <= 1 or att.implementation == "none":
        return 1
    shapes = attention_shape(model_config).distinct()
    works = [r for r in range(1, sp + 1) if sp % r == 0 and _ulysses_ok(shapes, sp // r)]
    heads = "; ".join(f"{sh.heads} query / {sh.kv_heads} key-value heads" for sh in shapes)
    ring = att.ring_degree
    if ring == "auto":
        ring = works[0]  # ring-only (U = 1) always works: works is never empty
    elif sp % ring:
        raise ConfigError(RING_KEY, f"{ring} does not divide sequence_parallel_size {sp}",
                          f"use 'auto' ({works[0]} here) or one of {works}")
    elif ring not in works:
        raise ConfigError(RING_KEY, f"{ring} leaves Ulysses degree {sp // ring} (sequence_parallel_size {sp} / "
                          f"{ring}), which does not split the model's {heads}",
                          f"use 'auto' ({works[0]} here) or a ring degree that works at SP {sp}: {works}")
    if ring > 1 and seq is not None and seq % ring_length_multiple(sp, ring):
        m = ring_length_multiple(sp, ring)
        raise ConfigError(f"{SECTION}.sequence_length", f"{seq} is not divisible by {m}: sequence_parallel_size {sp} "
                          f"as Ulysses {sp // ring} x ring {ring} cuts the sequence in {2 * ring} zigzag chunks, each "
                          f"ring rank's two into {sp // ring} equal shards", f"use a multiple of {m}, e.g. "
                          f"{(seq // m + 1) * m}")
    return ring


_KERNEL_HINTS = {"flash_attention_2": "pip install flash-attn (needs CUDA)",
                 "flash_attention_3": "install FA3 (flash_attn_interface, Hopper GPU)"}


def check_kernel(name: str) -> str:
    """Validate a value of ``long_context.attention.kernel`` against this machine, without any tensor (the
    one check of the name: the spec builder calls it; installs and ops trust it). Returns it."""
    if not is_known(name):
        raise ConfigError(KERNEL_KEY, f"unknown kernel {name!r}", f"use one of {', '.join(KERNEL_NAMES)}")
    if not is_available(name):
        hint = _KERNEL_HINTS.get(name, "")
        raise ConfigError(KERNEL_KEY, f"{name!r} is not available on this machine (found: {available_backends()})",
                          f"{hint + '; or ' if hint else ''}set it to 'auto' or 'sdpa'")
    return name


def get_backend(name: str, device):
    """The kernel backend for the config value ``name`` on ``device``: :func:`check_kernel`, then
    ``attention.kernels.backend_for``, whose KernelError (no such kernel for the device) becomes a ConfigError
    naming the key. For direct callers; installs hold the spec's ``KernelChoice``."""
    check_kernel(name)
    with naming(KERNEL_KEY, KernelError):
        return backend_for(name, device)


def check_sp_attention_pattern(impl: str, model_config, seq_len: Optional[int]) -> None:
    """Our SP attention ('ulysses' at SP > 1, 'untied_ulysses') computes causal attention over the whole
    gathered sequence, applying each layer's sliding window and attention soft-cap there
    (models.windows.layer_attention). Refuse every model whose attention is something else: chunked
    attention and other layer types, bidirectional attention, and flex_attention under 'untied_ulysses'
    (its BlockMask is built for the local shard; 'ulysses' runs flex layers causal). Never advise dropping
    a window: the pretrained model attends through it. Chunked attention runs as documents cut at every chunk on
    'ulysses' and the function-level untied path (the fused path refuses a chunk shorter than the sequence at its
    first forward, models.windows.not_runnable). Layers that are not attention at all (linear attention,
    Mamba, convolutions: they would mix only their rank's shard) are refused too. A chunked layer whose chunk covers
    ``seq_len`` is exact; the installs check it again per forward with the batch's length
    (models.windows.LayerAttention.runnable)."""

    key = f"{SECTION}.attention.implementation"
    name = getattr(text_config(model_config), "model_type", None) or type(model_config).__name__
    attn_impl = getattr(model_config, "_attn_implementation", None)
    # a model with no SDPA path (GPT-OSS's attention sinks) is loaded with flex_attention: its BlockMask is checked
    # to be the shard's causal / window pattern at the function level (attention/hf._check_mask), the attention
    # (sinks included) runs in untied's kernel; where SDPA exists it is the same attention without the BlockMask
    if attn_impl == "flex_attention" and impl == "untied_ulysses" and has_sdpa_path(model_config):
        raise ConfigError("model.config._attn_implementation",
                          f"'flex_attention' under {impl!r}: its BlockMask is built for the local sequence shard, "
                          "and without it flex_attention is not causal",
                          "load the model with attn_implementation='sdpa' (or flash_attention_2/3): the same "
                          f"attention, which {impl!r} runs causal over the gathered sequence; or use "
                          "implementation 'ulysses', which runs flex_attention models causal")
    if is_bidirectional(model_config):
        raise ConfigError(key, f"the {name} model attends bidirectionally (use_bidirectional_attention), and "
                          f"{impl!r} computes causal attention only", _NOT_YET_UNDER_SP)
    for group in restricted_layers(model_config):
        if group.kind == "sliding_attention" or group.exact_for(seq_len):
            continue  # windows are applied on the gathered sequence (a window covering it is full causal)
        if runs_layer_type(model_config, group.kind):
            continue  # split by heads (attention/mixers.py, models/hybrid.py)
        if group.kind == "chunked_attention" and group.span is not None:
            continue  # chunks run as documents cut at every chunk (attention.documents.chunk_documents)
        if group.span is None:
            raise ConfigError(key, f"the {name} model has {group.describe()}, which {impl!r} does not run: it "
                              "computes causal attention (with sliding windows) over the gathered sequence",
                              f"this layer type is not supported under sequence parallelism; {_NOT_YET_UNDER_SP}")
        length = (f"shorter than long_context.sequence_length {seq_len}" if seq_len is not None else
                  "and long_context.sequence_length is not set, so nothing shows it covers every sample")
        fix = f"chunked attention is not supported under sequence parallelism yet; {_NOT_YET_UNDER_SP}"
        if seq_len is None:
            fix += (f", or set long_context.sequence_length if every sample has at most {group.span} tokens (a "
                    "chunk covering the whole sample is exact)")
        raise ConfigError(key, f"the {name} model has {group.describe()}, {length}; {impl!r} computes causal "
                          "attention over the gathered sequence, so the chunking would be silently dropped", fix)


__all__ = ["RING_KEY", "check_against", "check_kernel", "ring_degree_for", "check_sp_attention_pattern", "get_backend"]
