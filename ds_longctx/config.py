"""The ``long_context`` section of ds_config.json and its checks against the model and the world.

Everything here is pure (no collectives), so every rank reaches the same verdict from the same
config, model config and world size, and raises the same error before any collective can hang.
"""
from __future__ import annotations

import json
import os
from typing import Any, List, Literal, Optional, Union

from typing_extensions import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .attention.kernels import (KernelError, available_backends, backend_for, is_available, is_known,
                                kernel_names)
from .errors import ConfigError  # noqa: F401  (re-exported: ds_longctx.config.ConfigError is public)
from .memory.keep import kept_attention_layers

SECTION = "long_context"
# the key whose value names the attention kernel: the kernels' own refusals (attention.kernels.KernelError)
# become a ConfigError naming it where the name came from the config (get_backend, the attention installs)
KERNEL_KEY = f"{SECTION}.attention.kernel"
# the switch of the tiled MLP: memory.tiling's refusals (TilingError) become a ConfigError naming it at the install
TILED_MLP_KEY = f"{SECTION}.tiled_mlp.enabled"
# activation checkpointing's keys (offload, nvme_path): memory.nvme's refusals (NVMeError) name them at the install
AC_KEY = f"{SECTION}.activation_checkpointing"
PositiveInt = Annotated[int, Field(ge=1)]
NonNegativeInt = Annotated[int, Field(ge=0)]


def _fix(text: str) -> dict:
    # the fix shown in a ConfigError when the value breaks the field's declared bound
    return {"fix": text}


class _Strict(BaseModel):
    # strict: "yes" is not a bool and "512" not an int (JSON has real booleans and numbers)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True)


class AttentionConfig(_Strict):
    implementation: Literal["none", "ulysses", "untied_ulysses"] = Field(
        default="ulysses", description="'ulysses': DeepSpeed's Ulysses (all heads at once); 'untied_ulysses': "
        "all-to-all + kernel per chunk of heads (UPipe), far less attention memory; 'none': plain HF "
        "attention, SP=1 only.")
    kernel: Literal[kernel_names()] = Field(
        default="auto", description="Attention kernel for untied attention (the registered backends of "
        "attention/kernels.py): 'auto' picks the best available for the device; a named kernel that is "
        "missing is an error.")
    heads_per_chunk: Union[PositiveInt, Literal["auto"]] = Field(
        default=1, description="Query heads per rank per stage of untied attention; must divide "
        "heads / SP. 1 saves the most memory, larger is faster; 'auto': the planner picks the fastest "
        "that fits (needs sequence_length).", json_schema_extra=_fix("use 1 for the most memory saving, "
                                                                     "larger for speed"))
    fuse_projections: bool = Field(
        default=True, description="Project q/k/v (+ RoPE, q/k-norm) per head chunk inside the stage loop, "
        "so full q/k/v never exist (architectures in ds_longctx.models); false: chunk at transformers' "
        "attention-function level (any model using its attention interface).")


class ActivationCheckpointingConfig(_Strict):
    enabled: bool = Field(default=False, description="Checkpoint every decoder layer (recompute in backward).")
    offload: Literal["none", "cpu", "nvme"] = Field(
        default="none", description="Where each checkpointed layer's input goes until backward (needs enabled): "
        "'cpu': an exact-size, pinned host arena per rank; 'nvme': a file per rank under nvme_path, through "
        "DeepSpeed's async I/O op.")
    nvme_path: Optional[str] = Field(
        default=None, description="offload='nvme': an existing, writable directory on a local NVMe drive "
        "(O_DIRECT-capable, e.g. ext4/xfs), on every node. Each rank writes one file in a fresh subdirectory, "
        "removed at the end.")
    nvme_buffer_count: int = Field(
        default=3, ge=2, description="offload='nvme': staging buffers (pinned host memory) between device and "
        "drive; 2 is the least that overlaps a write with the next layer's forward.",
        json_schema_extra=_fix("use 2 or 3 (one buffer is written while the next layer fills another)"))
    keep_on_device: Union[NonNegativeInt, Literal["auto"]] = Field(
        default=0, description="With offload: the last this-many decoder layers keep their checkpointed "
        "input on the device. Backward needs those first, so with HBM headroom they cost no transfer and save "
        "their host/NVMe bytes (the planner reports how many fit: ds-longctx plan). 'auto' (needs "
        "sequence_length): ds_longctx.initialize has the planner pick the most layers that fit this device's "
        "memory, on rank 0, logged and the same on every rank.",
        json_schema_extra=_fix("give the number of last layers whose inputs stay on the device, or 'auto'"))
    pin_memory: bool = Field(default=True, description="Offload into pinned host memory (async copies on CUDA).")
    use_reentrant: bool = Field(default=False, description="torch.utils.checkpoint's use_reentrant.")
    prefetch: bool = Field(default=True, description="Bring the next layer's input back while the current "
                           "layer's backward runs.")
    keep_attention_output: Union[bool, NonNegativeInt, Literal["auto"]] = Field(
        default=False, description="Untied attention: keep each layer's attention output and LSE from the first "
        "forward (where its input goes: device, host or NVMe) so the recompute skips q/k/v and the attention "
        "forward; costs one more [seq/SP, heads x head_dim] + fp32 [heads/SP, seq] per layer. true: every "
        "layer; a number N: the first N decoder layers (the others recompute: part of the gain for part of the "
        "memory). 'auto' (needs sequence_length): ds_longctx.initialize keeps the most layers for which the "
        "planner predicts a faster step that fits this device's memory and this machine's host memory per "
        "local rank (DS_LONGCTX_HOST_MEM overrides the host budget per node), on rank 0, logged and the same on "
        "every rank.", json_schema_extra=_fix("use true, false, a number of layers or 'auto'"))


class TiledConfig(_Strict):
    enabled: bool = Field(default=False, description="Run the MLP / the lm_head + loss over sequence tiles.")
    shards: Union[PositiveInt, Literal["auto"]] = Field(
        default="auto", description="Number of sequence tiles; 'auto': ceil(local_seq / hidden), "
        "MAX-agreed across ranks.", json_schema_extra=_fix("use 'auto' (ceil(local_seq / hidden)) or a "
                                                           "positive integer"))


class RMSNormConfig(_Strict):
    enabled: bool = Field(default=False, description="Memory-efficient RMSNorm: saves the input and the fp32 "
                          "1/rms, recomputes in backward (Llama-style norms only).")


class ProfileConfig(_Strict):
    enabled: bool = Field(default=False, description="train.py writes a torch.profiler trace, a memory "
                          "timeline and (CUDA) a memory snapshot for the chosen steps.")
    steps: List[int] = Field(default_factory=lambda: [2, 3], description="Steps (1-based) to profile.")
    output_dir: str = Field(default="profiles", description="Where the traces, snapshots and per-step "
                            "records go.")
    allocator_check: bool = Field(default=False, description="CUDA only, independent of `enabled`: on the "
                                  "`steps`, replay the step's allocations through the caching-allocator model "
                                  "(measure/allocator.py) and record its reserved bytes next to "
                                  "max_memory_reserved in the step's metrics. Writes no files.")


class LongContextConfig(_Strict):
    sequence_length: Optional[int] = Field(
        default=None, ge=1, description="Global tokens per sample (needed for 'auto' values and the planner).",
        json_schema_extra=_fix("give the global tokens per sample, or leave it out"))
    attention: AttentionConfig = Field(default_factory=AttentionConfig)
    activation_checkpointing: ActivationCheckpointingConfig = Field(default_factory=ActivationCheckpointingConfig)
    tiled_mlp: TiledConfig = Field(default_factory=TiledConfig, description="Tiled MLP.")
    tiled_loss: TiledConfig = Field(default_factory=TiledConfig, description="Tiled lm_head + loss: no "
                                    "[seq, vocab] logits.")
    rms_norm: RMSNormConfig = Field(default_factory=RMSNormConfig)
    profile: ProfileConfig = Field(default_factory=ProfileConfig)

    # filled from the top level of the ds_config, not from the section
    sequence_parallel_size: int = Field(default=1, exclude=True)


def _key_path(loc) -> str:
    return ".".join([SECTION] + [str(p) for p in loc])


def _model_at(loc):
    """The config class holding the field at ``loc`` (None when the path leaves the schema)."""
    model = LongContextConfig
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        if field is None or not isinstance(field.annotation, type) or not issubclass(field.annotation, BaseModel):
            return None
        model = field.annotation
    return model


def _fields_at(loc) -> List[str]:
    model = _model_at(loc)
    return [] if model is None else sorted(k for k in model.model_fields if k != "sequence_parallel_size")


def _field_fix(loc, default: str) -> str:
    model = _model_at(loc)
    field = model.model_fields.get(str(loc[-1])) if model is not None and loc else None
    extra = getattr(field, "json_schema_extra", None) or {}
    return extra.get("fix", default) if isinstance(extra, dict) else default


_UNION_TAGS = ("int", "str", "bool", "constrained-int")


def _from_validation_error(err: ValidationError) -> ConfigError:
    errors = err.errors()
    e = errors[0]
    loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and (p.startswith("literal[") or p in _UNION_TAGS)))
    key = _key_path(loc)
    got = e.get("input")
    if e["type"] == "extra_forbidden":
        return ConfigError(key, "unknown key", f"remove it; the keys allowed here are {_fields_at(loc)}")
    if e["type"] == "model_type" or e["type"] == "dict_type":
        return ConfigError(key, f"expected an object, got {got!r}", "write it as a JSON object {...}")
    if e["type"] == "literal_error":
        return ConfigError(key, f"{got!r} is not allowed", f"use one of {e['ctx']['expected']}")
    if e["type"] == "greater_than_equal":
        ge = e.get("ctx", {}).get("ge", 1)
        want = {1: "a positive integer", 0: "0 or more"}.get(ge, f"an integer of at least {ge}")
        return ConfigError(key, f"must be {want}, got {got!r}", _field_fix(loc, f"use {want}"))
    if e["type"] == "bool_type":
        alt = [x for x in errors[1:] if x["type"] == "literal_error"]
        want = "true or false" + (f" or {alt[0]['ctx']['expected']}" if alt else "")
        return ConfigError(key, f"expected {want}, got {got!r}", "write a JSON boolean (true/false, no quotes)"
                           + (f" or {alt[0]['ctx']['expected']}" if alt else ""))
    if e["type"] == "int_type":
        alt = [x for x in errors[1:] if x["type"] == "literal_error"]
        want = "an integer" + (f" or {alt[0]['ctx']['expected']}" if alt else "")
        return ConfigError(key, f"expected {want}, got {got!r}", "write a JSON number (no quotes)"
                           + (f" or {alt[0]['ctx']['expected']}" if alt else ""))
    return ConfigError(key, f"{e['msg']} (got {got!r})", "set it to a valid value")


def load_ds_config(config: Union[str, os.PathLike, dict, None], args: Any = None) -> dict:
    """Read a ds_config from a dict, a path, or ``args.deepspeed_config``/``args.deepspeed_config_dict``."""
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "deepspeed_config_dict", None)
    if config is None:
        raise ConfigError("config", "no DeepSpeed config was given",
                          "pass config=<dict or path> or set args.deepspeed_config")
    if isinstance(config, dict):
        return dict(config)
    path = os.fspath(config)
    if not os.path.exists(path):
        raise ConfigError("config", f"file {path!r} does not exist", "pass the path of a ds_config.json")
    if os.path.isdir(path):
        raise ConfigError("config", f"{path!r} is a directory", "pass the path of a ds_config.json file in it")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f, object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as e:
        raise ConfigError("config", f"{path} is not valid JSON ({e})", "fix the JSON syntax") from None
    except UnicodeDecodeError as e:
        raise ConfigError("config", f"{path} is not UTF-8 text ({e.reason} at byte {e.start})",
                          "save the config as UTF-8 JSON") from None
    except _DuplicateKey as e:
        raise ConfigError(e.key, f"appears more than once in {path} (JSON keeps only the last one silently)",
                          "keep one of them") from None
    if not isinstance(cfg, dict):
        raise ConfigError("config", f"{path} holds a JSON {type(cfg).__name__}, not an object",
                          "write the config as one JSON object {...}")
    return cfg


class _DuplicateKey(Exception):
    def __init__(self, key):
        self.key = key


def _no_duplicate_keys(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


# the top-level keys ds_longctx reads from the ds_config: its own section and DeepSpeed's SP keys
_OWN_TOP_LEVEL_KEYS = (SECTION, "sequence_parallel_size", "seq_parallel_communication_data_type")
# real DeepSpeed keys that resemble the ones above (never reported)
_KNOWN_SIMILAR_KEYS = frozenset({"communication_data_type", "pipeline_parallel_size"})
# difflib ratio: catches one-letter slips and long_ctx, not communication_data_type (0.78)
_NEAR_MISS_CUTOFF = 0.8


def check_top_level_keys(ds_config: dict) -> None:
    """Reject a top-level key that is a near miss of a key ds_longctx reads.

    DeepSpeed ignores unknown top-level keys, so ``"long_contex"`` would silently run with every
    feature off and ``"sequence_paralel_size"`` as SP=1."""
    import difflib

    for key in ds_config:
        if not isinstance(key, str) or key in _OWN_TOP_LEVEL_KEYS or key in _KNOWN_SIMILAR_KEYS:
            continue
        match = difflib.get_close_matches(key.lower().replace("-", "_"), _OWN_TOP_LEVEL_KEYS, n=1,
                                          cutoff=_NEAR_MISS_CUTOFF)
        if match:
            raise ConfigError(key, f"unknown top-level key, a near miss of {match[0]!r} (DeepSpeed would "
                              "ignore it silently)", f"rename it to {match[0]!r}")


_BATCH_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")


def check_batch_sizes(ds_config: dict) -> None:
    """DeepSpeed's batch keys, when given as numbers, must be positive integers (DeepSpeed itself
    fails later with a bare assertion)."""
    for key in _BATCH_KEYS:
        value = ds_config.get(key)
        if value is None or value == "auto":  # "auto": filled in by the HF integration
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(key, f"must be a positive integer, got {value!r}",
                              f"set {key} to 1 or more (or leave it out)")


def parse(ds_config: dict) -> LongContextConfig:
    """Parse and check the section on its own (no model, no world)."""
    check_top_level_keys(ds_config)
    check_batch_sizes(ds_config)
    sp = ds_config.get("sequence_parallel_size", 1)
    if not isinstance(sp, int) or isinstance(sp, bool) or sp < 1:
        raise ConfigError("sequence_parallel_size", f"must be a positive integer, got {sp!r}",
                          "set it to the Ulysses degree, e.g. the number of GPUs per node")
    raw = ds_config.get(SECTION, {})
    if raw is None:  # JSON null: not "everything off" by accident (it used to be)
        raise ConfigError(SECTION, "is null", f"give an object: {{}} for the defaults (every memory feature off), or "
                          f"the features you want; or remove the '{SECTION}' key")
    if not isinstance(raw, dict):
        raise ConfigError(SECTION, f"expected an object, got {raw!r}", "write it as a JSON object {...}")
    try:
        cfg = LongContextConfig(**raw)
    except ValidationError as err:
        raise _from_validation_error(err) from None
    cfg.sequence_parallel_size = sp

    hpc = cfg.attention.heads_per_chunk
    if hpc == "auto" and cfg.sequence_length is None:
        raise ConfigError(f"{SECTION}.attention.heads_per_chunk", "'auto' is resolved by the memory planner for "
                          "a sequence length, and long_context.sequence_length is not set",
                          "set long_context.sequence_length, or give a positive integer (1 saves the most memory)")
    ac = cfg.activation_checkpointing
    for key, fix in (("keep_attention_output", "give true, false or a number of layers"),
                     ("keep_on_device", "give a number of layers")):
        if getattr(ac, key) == "auto" and cfg.sequence_length is None:
            raise ConfigError(f"{SECTION}.activation_checkpointing.{key}", "'auto' is resolved by the memory "
                              "planner for a sequence length, and long_context.sequence_length is not set",
                              f"set long_context.sequence_length, or {fix}")
    if ac.offload != "none" and not ac.enabled:
        raise ConfigError(f"{SECTION}.activation_checkpointing.offload",
                          f"offload {ac.offload!r} needs checkpointing", "also set activation_checkpointing.enabled=true")
    _check_nvme_keys(ac)
    # "auto" resolves to 0 where these do not hold (planner/search.py)
    if ac.keep_attention_output != "auto" and kept_attention_layers(ac.keep_attention_output, 1):
        key = f"{SECTION}.activation_checkpointing.keep_attention_output"
        if not ac.enabled:
            raise ConfigError(key, "keeps what a checkpointed layer's recompute would rebuild, and checkpointing "
                              "is off", "also set activation_checkpointing.enabled=true, or remove the key")
        if cfg.attention.implementation != "untied_ulysses":
            raise ConfigError(key, f"needs attention.implementation 'untied_ulysses' (got "
                              f"{cfg.attention.implementation!r}): only its staged backward runs from a kept output "
                              "and LSE; DeepSpeed's Ulysses and HF's attention differentiate their forward's own graph",
                              "set attention.implementation to 'untied_ulysses', or remove the key")
    if sp > 1 and cfg.attention.implementation == "none":
        raise ConfigError(f"{SECTION}.attention.implementation",
                          f"'none' cannot run with sequence_parallel_size={sp} (attention must see the whole sequence)",
                          "use 'ulysses' or 'untied_ulysses', or set sequence_parallel_size to 1")
    return cfg


def _check_nvme_keys(ac: ActivationCheckpointingConfig) -> None:
    """The NVMe keys go together (the path itself is checked on each node when the target is built;
    the counts' bounds are declared on the fields)."""
    key = f"{SECTION}.activation_checkpointing"
    if ac.offload == "nvme" and not ac.nvme_path:
        raise ConfigError(f"{key}.nvme_path", "offload='nvme' needs a directory on the NVMe drive",
                          'set "nvme_path": "/local_nvme" (an existing, writable local NVMe mount on every node)')
    if ac.offload != "nvme" and ac.nvme_path is not None:
        raise ConfigError(f"{key}.nvme_path", f"is set but offload is {ac.offload!r}",
                          "set offload='nvme' to use it, or remove nvme_path")


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
    from .models import text_config

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
    from .models import attention_shape, text_config

    sp, impl = cfg.sequence_parallel_size, cfg.attention.implementation
    shape = attention_shape(model_config)
    heads, kv = shape.heads, shape.kv_heads
    tc = text_config(model_config)
    v_dim = getattr(tc, "v_head_dim", None)
    if getattr(tc, "kv_lora_rank", None) or (isinstance(v_dim, int) and v_dim != shape.head_dim):
        name = getattr(tc, "model_type", None) or type(tc).__name__
        raise ConfigError(f"{SECTION}.attention.implementation", f"the {name} model has multi-head latent attention "
                          f"(query/key head dim {getattr(tc, 'qk_head_dim', None) or shape.head_dim}, value head dim "
                          f"{v_dim}), which {impl!r} does not split", _NOT_YET_UNDER_SP)
    if sp > 1:
        attn_impl = getattr(model_config, "_attn_implementation", None)
        if attn_impl is not None and "eager" in str(attn_impl):
            raise ConfigError("model.config._attn_implementation", f"{attn_impl!r} cannot run sequence parallel",
                              "load the model with attn_implementation='sdpa' (or flash_attention_2/3); a model "
                              "with no SDPA path (Gemma2: attention soft-capping) trains with "
                              "attn_implementation='flex_attention' under long_context.attention.implementation "
                              "'ulysses'")
        check_sp_heads(heads, kv, sp)
    if impl == "untied_ulysses" or (impl == "ulysses" and sp > 1):
        check_sp_attention_pattern(impl, model_config, seq)
    if impl == "untied_ulysses" and cfg.attention.heads_per_chunk != "auto":
        check_heads_per_chunk(cfg.attention.heads_per_chunk, heads, kv, sp)


def check_shards(cfg: LongContextConfig, sequence_length: Optional[int]) -> None:
    """A tile holds at least one row: an integer ``shards`` above the rows it splits (the sequence shard
    of one sample, ``sequence_length / sequence_parallel_size``) is an error, not thousands of empty
    tiles (100000 tiles made one step take minutes). Unchecked when the length is unknown."""
    if sequence_length is None:
        return
    rows = sequence_length // cfg.sequence_parallel_size
    for name in ("tiled_mlp", "tiled_loss"):
        tc = getattr(cfg, name)
        if tc.enabled and isinstance(tc.shards, int) and tc.shards > rows:
            raise ConfigError(f"{SECTION}.{name}.shards", f"{tc.shards} is more than the {rows} rows it splits "
                              f"(sequence length {sequence_length} / sequence_parallel_size "
                              f"{cfg.sequence_parallel_size}): every tile needs at least one row",
                              f"use 'auto' or at most {rows}")


def check_train_batch_size(ds_config: dict, world_size: int, sp: int) -> None:
    """DeepSpeed's batch identity, train_batch_size = micro x gas x dp with dp = world / SP, checked with
    the SP degree (DeepSpeed's own assertion counts every rank as data parallel and names neither)."""
    tbs = ds_config.get("train_batch_size")
    micro = ds_config.get("train_micro_batch_size_per_gpu")
    gas = ds_config.get("gradient_accumulation_steps")
    if not isinstance(tbs, int) or world_size % sp:
        return  # absent or "auto" (the HF integration fills it); bad types are check_batch_sizes' job
    from .layout import Layout

    dp = Layout(world=world_size, sp=sp).dp
    m = micro if isinstance(micro, int) else None
    g = gas if isinstance(gas, int) else None
    if m is not None and g is not None:
        ok, want = tbs == m * g * dp, m * g * dp
    elif m is not None:
        ok, want = tbs % (m * dp) == 0, m * dp
    elif g is not None:
        ok, want = tbs % (g * dp) == 0, g * dp
    else:
        ok, want = tbs % dp == 0, dp
    if not ok:
        parts = [f"train_micro_batch_size_per_gpu {m}" if m is not None else None,
                 f"gradient_accumulation_steps {g}" if g is not None else None]
        parts = " x ".join(p for p in parts + [f"data-parallel size {dp} (world {world_size} / sequence_parallel_size "
                                               f"{sp})"] if p)
        exact = m is not None and g is not None
        raise ConfigError("train_batch_size", f"{tbs} is not {'' if exact else 'a multiple of '}{parts} = {want}",
                          f"set train_batch_size to {want if exact else 'a multiple of ' + str(want)}, or leave it "
                          "out (DeepSpeed derives it)")


_NOT_YET_UNDER_SP = ("train with long_context.attention.implementation 'none' at sequence_parallel_size 1, where "
                     "transformers' own attention runs it exactly")


HPC_KEY = f"{SECTION}.attention.heads_per_chunk"


def check_sp_heads(heads: int, kv_heads: int, sp: int) -> None:
    """Ulysses scatters query heads over the SP ranks; KV heads are scattered or replicated."""
    if heads % sp != 0:
        raise ConfigError("sequence_parallel_size", f"{sp} does not divide the {heads} attention heads",
                          f"pick a degree that divides {heads}")
    if kv_heads % sp != 0 and sp % kv_heads != 0:
        raise ConfigError("sequence_parallel_size",
                          f"{sp} neither divides nor is divided by the {kv_heads} key/value heads",
                          f"pick a degree that divides {kv_heads} or is a multiple of it")


def check_heads_per_chunk(hpc, heads: int, kv_heads: int, sp: int) -> None:
    """``hpc`` query heads per stage must be a positive integer dividing the heads per rank (the one check of
    it: ``check_against`` for initialize, the spec builder for a direct ``patch_model``)."""
    if not isinstance(hpc, int) or isinstance(hpc, bool) or hpc < 1:
        raise ConfigError(HPC_KEY, f"must be a positive integer here, got {hpc!r}",
                          "use 1 for the most memory saving (ds_longctx.initialize resolves 'auto' first)")
    check_sp_heads(heads, kv_heads, sp)
    local = heads // sp
    if local % hpc != 0:
        valid = [d for d in range(1, local + 1) if local % d == 0]
        raise ConfigError(HPC_KEY, f"{hpc} does not divide the {local} query heads per rank ({heads} heads / SP {sp})",
                          f"use one of {valid}")


_KERNEL_HINTS = {"flash_attention_2": "pip install flash-attn (needs CUDA)",
                 "flash_attention_3": "install FA3 (flash_attn_interface, Hopper GPU)"}


def check_kernel(name: str) -> str:
    """Validate a value of ``long_context.attention.kernel`` against this machine, without any tensor (the
    one check of the name: the spec builder calls it; installs and ops trust it). Returns it."""
    if not is_known(name):
        raise ConfigError(KERNEL_KEY, f"unknown kernel {name!r}", f"use one of {', '.join(kernel_names())}")
    if not is_available(name):
        hint = _KERNEL_HINTS.get(name, "")
        raise ConfigError(KERNEL_KEY, f"{name!r} is not available on this machine (found: {available_backends()})",
                          f"{hint + '; or ' if hint else ''}set it to 'auto' or 'sdpa'")
    return name


def get_backend(name: str, device):
    """The kernel backend for the config value ``name`` on ``device``: :func:`check_kernel`, then
    ``attention.kernels.backend_for``, whose KernelError (no such kernel for the device) becomes a ConfigError
    naming the key. For direct callers; installs hold the spec's ``KernelChoice``."""
    from .errors import naming

    check_kernel(name)
    with naming(KERNEL_KEY, KernelError):
        return backend_for(name, device)


def check_sp_attention_pattern(impl: str, model_config, seq_len: Optional[int], layer_kinds: bool = True) -> None:
    """Our SP attention ('ulysses' at SP > 1, 'untied_ulysses') computes causal attention over the whole
    gathered sequence, applying each layer's sliding window and attention soft-cap there
    (models.windows.layer_attention). Refuse every model whose attention is something else: chunked
    attention and other layer types, bidirectional attention, and flex_attention under 'untied_ulysses'
    (its BlockMask is built for the local shard; 'ulysses' runs flex layers causal). Never advise dropping
    a window: the pretrained model attends through it. ``layer_kinds`` False: only what does not depend on the
    length (the installs, which check chunked layers at their forward, with the sequence length); layers that are
    not attention at all (linear attention, Mamba, convolutions: they would mix only their rank's shard) are
    refused either way."""
    from .models import text_config
    from .models.windows import is_bidirectional, restricted_layers

    key = f"{SECTION}.attention.implementation"
    name = getattr(text_config(model_config), "model_type", None) or type(model_config).__name__
    attn_impl = getattr(model_config, "_attn_implementation", None)
    if attn_impl == "flex_attention" and impl == "untied_ulysses":
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
        if not layer_kinds and group.span is not None:
            continue  # chunked layers: the installs check them per forward, with the sequence length
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
