"""The ``long_context`` section of ds_config.json and its checks against the model and the world.

Everything here is pure (no collectives), so every rank reaches the same verdict from the same
config, model config and world size, and raises the same error before any collective can hang.
"""
from __future__ import annotations

import json
import os
from typing import Any, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

SECTION = "long_context"

ATTENTION_IMPLEMENTATIONS = ("none", "ulysses", "untied_ulysses")
KERNELS = ("auto", "flash_attention_3", "flash_attention_2", "sdpa")


class ConfigError(ValueError):
    """A bad config or shape. The message names the key path and the fix."""

    def __init__(self, key: str, problem: str, fix: str):
        self.key, self.problem, self.fix = key, problem, fix
        super().__init__(f"{key}: {problem}. Fix: {fix}")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class AttentionConfig(_Strict):
    implementation: Literal["none", "ulysses", "untied_ulysses"] = "ulysses"
    kernel: Literal["auto", "flash_attention_3", "flash_attention_2", "sdpa"] = "auto"
    heads_per_chunk: Union[int, Literal["auto"]] = Field(default=1)
    fuse_projections: bool = True


class ActivationCheckpointingConfig(_Strict):
    enabled: bool = False
    offload: Literal["none", "cpu", "nvme"] = "none"
    """Where each checkpointed layer's input goes until backward: "cpu" (an exact-size, pinned host arena
    per rank) or "nvme" (a file per rank under ``nvme_path``, through DeepSpeed's async I/O op)."""
    nvme_path: Optional[str] = None
    """offload="nvme": an existing, writable directory on a local NVMe drive (O_DIRECT-capable, e.g. ext4/xfs),
    on every node. Each rank writes one file in a fresh subdirectory, removed at the end."""
    nvme_buffer_count: int = 3
    """offload="nvme": staging buffers (each one layer input, pinned host memory) between device and drive;
    2 is the least that overlaps a write with the next layer's forward."""
    keep_on_device: int = 0
    """With offload: the last this-many decoder layers keep their checkpointed input on the device. Backward
    needs those first, so with HBM headroom they cost no transfer and save their host/NVMe bytes
    (the planner reports how many fit: ``ds-longctx plan``)."""
    pin_memory: bool = True
    use_reentrant: bool = False
    prefetch: bool = True


class TiledConfig(_Strict):
    enabled: bool = False
    shards: Union[int, Literal["auto"]] = "auto"


class RMSNormConfig(_Strict):
    enabled: bool = False  # memory-efficient RMSNorm: saves the input and 1/rms, recomputes in backward


class ProfileConfig(_Strict):
    enabled: bool = False
    steps: List[int] = Field(default_factory=lambda: [2, 3])
    output_dir: str = "profiles"


class LongContextConfig(_Strict):
    sequence_length: Optional[int] = None
    attention: AttentionConfig = Field(default_factory=AttentionConfig)
    activation_checkpointing: ActivationCheckpointingConfig = Field(default_factory=ActivationCheckpointingConfig)
    tiled_mlp: TiledConfig = Field(default_factory=TiledConfig)
    tiled_loss: TiledConfig = Field(default_factory=TiledConfig)
    rms_norm: RMSNormConfig = Field(default_factory=RMSNormConfig)
    profile: ProfileConfig = Field(default_factory=ProfileConfig)

    # filled from the top level of the ds_config, not from the section
    sequence_parallel_size: int = Field(default=1, exclude=True)


def _key_path(loc) -> str:
    return ".".join([SECTION] + [str(p) for p in loc])


def _fields_at(loc) -> List[str]:
    model = LongContextConfig
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        if field is None or not isinstance(field.annotation, type) or not issubclass(field.annotation, BaseModel):
            return []
        model = field.annotation
    return sorted(k for k in model.model_fields if k != "sequence_parallel_size")


def _from_validation_error(err: ValidationError) -> ConfigError:
    e = err.errors()[0]
    loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and (p.startswith("literal[") or p in ("int", "str"))))
    key = _key_path(loc)
    if e["type"] == "extra_forbidden":
        return ConfigError(key, "unknown key", f"remove it; the keys allowed here are {_fields_at(loc)}")
    if e["type"] == "model_type" or e["type"] == "dict_type":
        return ConfigError(key, f"expected an object, got {e.get('input')!r}", "write it as a JSON object {...}")
    if e["type"] == "literal_error":
        return ConfigError(key, f"{e.get('input')!r} is not allowed", f"use one of {e['ctx']['expected']}")
    return ConfigError(key, f"{e['msg']} (got {e.get('input')!r})", "set it to a valid value")


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
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError("config", f"{path} is not valid JSON ({e})", "fix the JSON syntax") from None


def parse(ds_config: dict) -> LongContextConfig:
    """Parse and check the section on its own (no model, no world)."""
    sp = ds_config.get("sequence_parallel_size", 1)
    if not isinstance(sp, int) or isinstance(sp, bool) or sp < 1:
        raise ConfigError("sequence_parallel_size", f"must be a positive integer, got {sp!r}",
                          "set it to the Ulysses degree, e.g. the number of GPUs per node")
    raw = ds_config.get(SECTION, {})
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(SECTION, f"expected an object, got {raw!r}", "write it as a JSON object {...}")
    try:
        cfg = LongContextConfig(**raw)
    except ValidationError as err:
        raise _from_validation_error(err) from None
    cfg.sequence_parallel_size = sp

    if cfg.sequence_length is not None and cfg.sequence_length < 1:
        raise ConfigError(f"{SECTION}.sequence_length", f"must be positive, got {cfg.sequence_length}",
                          "give the global tokens per sample, or leave it out")
    hpc = cfg.attention.heads_per_chunk
    if hpc == "auto" and cfg.sequence_length is None:
        raise ConfigError(f"{SECTION}.attention.heads_per_chunk", "'auto' is resolved by the memory planner for "
                          "a sequence length, and long_context.sequence_length is not set",
                          "set long_context.sequence_length, or give a positive integer (1 saves the most memory)")
    if isinstance(hpc, int) and hpc < 1:
        raise ConfigError(f"{SECTION}.attention.heads_per_chunk", f"must be a positive integer, got {hpc}",
                          "use 1 for the most memory saving, larger for speed")
    for name in ("tiled_mlp", "tiled_loss"):
        shards = getattr(cfg, name).shards
        if isinstance(shards, int) and shards < 1:
            raise ConfigError(f"{SECTION}.{name}.shards", f"must be a positive integer or 'auto', got {shards}",
                              "use 'auto' (ceil(local_seq / hidden)) or a positive integer")
    ac = cfg.activation_checkpointing
    if ac.offload != "none" and not ac.enabled:
        raise ConfigError(f"{SECTION}.activation_checkpointing.offload",
                          f"offload {ac.offload!r} needs checkpointing", "also set activation_checkpointing.enabled=true")
    _check_nvme_keys(ac)
    if sp > 1 and cfg.attention.implementation == "none":
        raise ConfigError(f"{SECTION}.attention.implementation",
                          f"'none' cannot run with sequence_parallel_size={sp} (attention must see the whole sequence)",
                          "use 'ulysses' or 'untied_ulysses', or set sequence_parallel_size to 1")
    return cfg


def _check_nvme_keys(ac: ActivationCheckpointingConfig) -> None:
    """The NVMe keys go together (the path itself is checked on each node when the target is built)."""
    key = f"{SECTION}.activation_checkpointing"
    if ac.offload == "nvme" and not ac.nvme_path:
        raise ConfigError(f"{key}.nvme_path", "offload='nvme' needs a directory on the NVMe drive",
                          'set "nvme_path": "/local_nvme" (an existing, writable local NVMe mount on every node)')
    if ac.offload != "nvme" and ac.nvme_path is not None:
        raise ConfigError(f"{key}.nvme_path", f"is set but offload is {ac.offload!r}",
                          "set offload='nvme' to use it, or remove nvme_path")
    if ac.keep_on_device < 0:
        raise ConfigError(f"{key}.keep_on_device", f"must be 0 or more, got {ac.keep_on_device}",
                          "give the number of last layers whose inputs stay on the device")
    if ac.nvme_buffer_count < 2:
        raise ConfigError(f"{key}.nvme_buffer_count", f"must be at least 2, got {ac.nvme_buffer_count}",
                          "use 2 or 3 (one buffer is written while the next layer fills another)")


def _text_config(model_config):
    return model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config


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
    if model_config is None:
        return
    tc = _text_config(model_config)
    heads = tc.num_attention_heads
    kv = getattr(tc, "num_key_value_heads", None) or heads
    impl = cfg.attention.implementation
    if sp > 1:
        attn_impl = getattr(model_config, "_attn_implementation", None)
        if attn_impl is not None and "eager" in str(attn_impl):
            raise ConfigError("model.config._attn_implementation", f"{attn_impl!r} cannot run sequence parallel",
                              "load the model with attn_implementation='sdpa' (or flash_attention_2/3)")
        if heads % sp != 0:
            raise ConfigError("sequence_parallel_size", f"{sp} does not divide the {heads} attention heads",
                              f"pick a degree that divides {heads}")
        if kv % sp != 0 and sp % kv != 0:
            raise ConfigError("sequence_parallel_size",
                              f"{sp} neither divides nor is divided by the {kv} key/value heads",
                              f"pick a degree that divides {kv} or is a multiple of it")
    if impl == "untied_ulysses" and cfg.attention.heads_per_chunk != "auto":
        hpc = cfg.attention.heads_per_chunk
        local = heads // sp
        if local % hpc != 0:
            valid = [d for d in range(1, local + 1) if local % d == 0]
            raise ConfigError(f"{SECTION}.attention.heads_per_chunk",
                              f"{hpc} does not divide the {local} query heads per rank ({heads} heads / SP {sp})",
                              f"use one of {valid}")
