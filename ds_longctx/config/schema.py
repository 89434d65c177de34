"""The ``long_context`` section of ds_config.json: its schema, its parse, and the checks the ds_config alone
decides (the checks against the model, the world and this machine's kernels are checks.py's).

A leaf of the package: it imports nothing of ds_longctx but errors.py, so every layer may import it (the key
names, the schema, the "auto" keys). Everything here is pure (no collectives), so every rank reaches the same
verdict from the same config and raises the same error before any collective can hang.
"""
from __future__ import annotations

import copy
import difflib
import json
import os
from typing import Any, Dict, List, Literal, Mapping, Optional, Tuple, Union

from typing_extensions import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import ConfigError  # noqa: F401  (re-exported: ds_longctx.config.ConfigError is public)

SECTION = "long_context"
# the key whose value names the attention kernel: the kernels' own refusals (attention.kernels.KernelError)
# become a ConfigError naming it where the name came from the config (checks.get_backend, the attention installs)
KERNEL_KEY = f"{SECTION}.attention.kernel"
# the values it accepts: "auto" (measured on CUDA), the backends a config may name (attention/kernels.py registers
# each with config_name=True and refuses one missing here), and "sdpa" (torch's flash kernel for the device)
KERNEL_NAMES: Tuple[str, ...] = ("auto", "flash_attention_3", "flash_attention_2", "sdpa_cuda_cudnn", "sdpa_cuda_flash",
                                 "sdpa")
# the switch between the fused and the attention-function-level untied attention (attention/hf.py)
FUSE_KEY = f"{SECTION}.attention.fuse_projections"
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
    kernel: Literal[KERNEL_NAMES] = Field(
        default="auto", description="Attention kernel for untied attention (the registered backends of "
        "attention/kernels.py): 'auto' picks the best available for the device; a named kernel that is "
        "missing is an error.")
    heads_per_chunk: Union[PositiveInt, Literal["auto"]] = Field(
        default=1, description="Query heads per rank per stage of untied attention; must divide "
        "heads / SP. 1 saves the most memory, larger is faster; 'auto': the planner picks the fastest "
        "that fits (needs sequence_length).", json_schema_extra=_fix("use 1 for the most memory saving, "
                                                                     "larger for speed"))
    fuse_projections: Union[bool, Literal["auto"]] = Field(
        default="auto", description="true: project q/k/v (+ RoPE, q/k-norm) per head chunk inside the stage loop, "
        "so full q/k/v never exist (the architectures in ds_longctx.models: llama, mistral, qwen2, qwen3); false: "
        "chunk at transformers' attention-function level (any model using its attention interface); 'auto': "
        "fused where ds_longctx.models has the architecture, function level otherwise (logged at initialize).",
        json_schema_extra=_fix("use 'auto', true (llama, mistral, qwen2, qwen3) or false"))
    ring_degree: Union[PositiveInt, Literal["auto"]] = Field(
        default="auto", description="Sequence parallelism past the head count: SP = Ulysses degree x ring degree. "
        "The Ulysses groups (SP / ring consecutive ranks: keep them inside a node) split the heads, the ring groups "
        "pass key/value blocks round (async P2P, zigzag shard order) for attention, and the mixers of hybrid models "
        "split channels over the whole SP group. 'auto': the largest Ulysses degree every layer's heads allow, a "
        "ring for the rest (1 wherever the heads allow SP: plain Ulysses); an integer must divide "
        "sequence_parallel_size.", json_schema_extra=_fix("use 'auto' or a divisor of sequence_parallel_size"))


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


class WatchdogConfig(_Strict):
    """The job's watchdog (ds_longctx/job/watchdog.py): a rank that goes silent ends the job, with a diagnosis."""
    timeout_s: Union[PositiveInt, Literal["auto"]] = Field(
        default="auto", description="Seconds a rank may go silent (no heartbeat: stopped, hung, its node lost) "
        "before every live rank prints which rank went silent and which collective it waits in, and the job ends "
        "(within about this time, under every launcher); also every process group's timeout (plus three heartbeat "
        "intervals), so no collective waits longer. 'auto': DeepSpeed's default (600 s, or DEEPSPEED_TIMEOUT "
        "minutes), raised on a CUDA machine to 3 x the planner's predicted step time when sequence_length is set. "
        "Raise it for phases where ranks wait on one rank's long work (a save to slow storage).",
        json_schema_extra=_fix("give whole seconds (1 or more) or 'auto'"))


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
    watchdog: WatchdogConfig = Field(default_factory=WatchdogConfig)

    # filled from the top level of the ds_config, not from the section
    sequence_parallel_size: int = Field(default=1, exclude=True)


# The keys whose "auto" the memory planner resolves (ds_longctx.initialize, on rank 0, for this machine's budgets),
# each with the fix when it cannot (no sequence_length). The one list: parse, the spec builder (refuses one left
# unresolved), initialize and the planner's search read it. (tiled_mlp/tiled_loss shards "auto" is a run-time rule
# instead: ceil(local rows / hidden), agreed per forward; the planner's search sets them too when it runs.)
AUTO_KEYS: Dict[str, str] = {
    "attention.heads_per_chunk": "give a positive integer (1 saves the most memory)",
    "activation_checkpointing.keep_attention_output": "give true, false or a number of layers",
    "activation_checkpointing.keep_on_device": "give a number of layers",
}


def value_at(lc: LongContextConfig, key: str):
    """The value of ``key`` (a path inside the section, e.g. "attention.heads_per_chunk")."""
    section, name = key.split(".")
    return getattr(getattr(lc, section), name)


def auto_keys(lc: LongContextConfig) -> List[str]:
    """The :data:`AUTO_KEYS` this section sets to "auto"."""
    return [k for k in AUTO_KEYS if value_at(lc, k) == "auto"]


def with_values(lc: LongContextConfig, values: Mapping[str, Any]) -> LongContextConfig:
    """A copy of ``lc`` with ``values`` ({"attention.heads_per_chunk": 4, "tiled_mlp.shards": 2, ...}) set, each
    validated as the field's type (``sequence_parallel_size`` kept): the resolved config initialize builds from the
    planner's choices."""
    out = lc.model_copy(deep=True)
    for key, value in values.items():
        section, name = key.split(".")
        try:
            setattr(getattr(out, section), name, value)
        except ValidationError as err:
            raise _from_validation_error(err) from None
    out.sequence_parallel_size = lc.sequence_parallel_size
    return out


def resolved_ds_config(ds_config: dict, lc: LongContextConfig) -> dict:
    """A copy of ``ds_config`` whose ``long_context`` section is ``lc`` (every key written out, "auto" values as
    resolved): what the planner reads for the run as configured (e.g. ``planner.planned_work`` for the
    profiler)."""
    out = copy.deepcopy(ds_config)
    out[SECTION] = lc.model_dump(mode="json")
    out["sequence_parallel_size"] = lc.sequence_parallel_size
    return out


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

    if cfg.sequence_length is None:
        for key in auto_keys(cfg):
            raise ConfigError(f"{SECTION}.{key}", "'auto' is resolved by the memory planner for a sequence length, "
                              "and long_context.sequence_length is not set",
                              f"set long_context.sequence_length, or {AUTO_KEYS[key]}")
    ac = cfg.activation_checkpointing
    if ac.offload != "none" and not ac.enabled:
        raise ConfigError(f"{SECTION}.activation_checkpointing.offload",
                          f"offload {ac.offload!r} needs checkpointing", "also set activation_checkpointing.enabled=true")
    _check_nvme_keys(ac)
    # "auto" resolves to 0 where these do not hold (planner/search.py)
    if ac.keep_attention_output not in ("auto", False, 0):
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
    dp = world_size // sp  # layout.Layout's dp (world = SP x DP)
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
    """``hpc`` query heads per stage must be a positive integer dividing the heads per rank (checked by
    ``checks.check_against``, which the spec builder runs)."""
    if not isinstance(hpc, int) or isinstance(hpc, bool) or hpc < 1:
        raise ConfigError(HPC_KEY, f"must be a positive integer here, got {hpc!r}",
                          "use 1 for the most memory saving (ds_longctx.initialize resolves 'auto' first)")
    check_sp_heads(heads, kv_heads, sp)
    local = heads // sp
    if local % hpc != 0:
        valid = [d for d in range(1, local + 1) if local % d == 0]
        raise ConfigError(HPC_KEY, f"{hpc} does not divide the {local} query heads per rank ({heads} heads / SP {sp})",
                          f"use one of {valid}")
