"""A model ``from_pretrained`` loads, from a live engine (ZeRO-3's consolidated 16-bit state dict) or a saved tag
(DeepSpeed's ``zero_to_fp32``), written with transformers' ``save_pretrained`` (a PEFT model: its adapters)."""
from __future__ import annotations

import copy
import os
import shutil
import socket
import time
from typing import Optional, Tuple

from ...dist.runtime import proc_stat
from ...errors import ConfigError
from ...models.adapters import is_peft_model
from . import manifest
from .tags import HF_CONFIG_DIR, TMP_PREFIX, check_tag, find_resume_tag, fsync_dir, is_tag_dir
from ...dist.verdicts import broadcast, raise_everywhere, rank_world


def _clean_config(hf_config):
    cfg = copy.deepcopy(hf_config)
    for attr in ("_name_or_path",):
        if hasattr(cfg, attr):
            setattr(cfg, attr, "")
    return cfg


def _config_has_dtype() -> bool:
    """transformers >= 4.56 names the config's dtype ``dtype`` (``torch_dtype`` warns)."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return (major, minor) >= (4, 56)


def write_hf(out_dir: str, state_dict: dict, hf_config, tokenizer=None, dtype=None, generation_config=None,
              max_shard_size: str = "5GB") -> None:
    """transformers' ``save_pretrained`` of ``state_dict`` on an empty (meta) model of ``hf_config``: the
    model class's own key names, tied weights and sharding (safetensors)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    cfg = _clean_config(hf_config)
    if dtype is not None:
        state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
        if _config_has_dtype():
            cfg.dtype = dtype  # what from_pretrained(dtype="auto") picks (torch_dtype is deprecated since 4.56)
        else:
            cfg.torch_dtype = dtype
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    expected = set(model.state_dict())
    missing = sorted(expected - set(state_dict))
    tied = {k for k in missing if getattr(cfg, "tie_word_embeddings", False) and "lm_head" in k}
    if set(missing) - tied:
        raise ConfigError("export", f"the weights lack {sorted(set(missing) - tied)[:5]} of {type(model).__name__}",
                          "export a checkpoint of this model")
    unknown = sorted(set(state_dict) - expected)
    if unknown:
        raise ConfigError("export", f"the weights have names {type(model).__name__} does not know: {unknown[:5]}",
                          "report this: a ds_longctx patch renamed a parameter")
    os.makedirs(out_dir, exist_ok=True)
    # (save_pretrained empties the dict it is given as it writes the shards: a copy of the mapping)
    model.save_pretrained(out_dir, state_dict=dict(state_dict), safe_serialization=True, max_shard_size=max_shard_size)
    gen = generation_config
    if gen is None:
        try:
            gen = GenerationConfig.from_model_config(cfg)
        except Exception:
            gen = None
    if gen is not None:
        gen.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)


def _write_peft(out_dir: str, state_dict: dict, peft_model, tokenizer=None, dtype=None) -> None:
    """peft's own ``save_pretrained`` of a PeftModel from the gathered ``state_dict`` (it keeps the adapters'
    weights and writes adapter_config.json): ``PeftModel.from_pretrained(base_model, out_dir)`` loads it."""
    if dtype is not None:
        state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
    os.makedirs(out_dir, exist_ok=True)
    peft_model.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)


def export_hf(engine, out_dir: str, tokenizer=None, dtype=None, max_shard_size: str = "5GB", log=print) -> None:
    """Write the engine's current weights as a Hugging Face model directory (every rank calls it; rank 0 writes).

    Weights are gathered by DeepSpeed: ZeRO-3's consolidated 16-bit state dict (what HF Trainer's save_model and
    ``engine.save_16bit_model`` use), the module's own state dict otherwise. ds_longctx's patches leave parameter
    names and the config untouched (checked: the names must be the model class's). ``from_pretrained(out_dir)``
    needs no ds_longctx. A ``peft.PeftModel`` writes its adapters (peft's format: ``PeftModel.from_pretrained(base,
    out_dir)``)."""
    rank, _ = rank_world()
    t0 = time.monotonic()
    if engine.zero_optimization_partition_weights():
        sd = engine._zero3_consolidated_16bit_state_dict()  # DeepSpeed's gather; the full dict on rank 0
    else:
        sd = engine.module.state_dict() if rank == 0 else None
    outcome = None
    if rank == 0:
        # written beside out_dir under a temporary name and renamed when complete: an export killed midway (the
        # job's end, a preemption) leaves no half model in out_dir, which would refuse the same command line's
        # next start ("--save-hf ... is not empty"); the temporary directories of dead exports are removed first
        out_dir = os.path.abspath(out_dir)
        parent, base = os.path.split(out_dir)
        prefix = f"{TMP_PREFIX}{base}-{socket.gethostname()}-"
        tmp = f"{os.path.join(parent, prefix)}{os.getpid()}"
        try:
            for entry in os.listdir(parent):
                pid = entry[len(prefix):]
                if entry.startswith(prefix) and pid.isdigit() and proc_stat(int(pid)) is None:
                    shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
            sd = {k: v.detach().to("cpu") for k, v in sd.items()}
            if is_peft_model(engine.module):  # an adapter run: the adapter directory PeftModel.from_pretrained loads
                _write_peft(tmp, sd, engine.module, tokenizer=tokenizer, dtype=dtype)
            else:
                write_hf(tmp, sd, engine.module.config, tokenizer=tokenizer, dtype=dtype,
                         generation_config=getattr(engine.module, "generation_config", None),
                         max_shard_size=max_shard_size)
            os.replace(tmp, out_dir)  # (out_dir: absent or empty, checked before step 1)
            fsync_dir(parent)
        except ConfigError as e:
            outcome = (e.key, e.problem, e.fix)
        except OSError as e:
            outcome = ("--save-hf", f"writing {out_dir!r} failed ({e.strerror}: {e.filename})",
                       "give a writable directory with free space")
        if outcome is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    raise_everywhere(broadcast(outcome))
    if rank == 0:
        log(exported_line(out_dir, tokenizer, time.monotonic() - t0))


def exported_line(out_dir: str, tokenizer, seconds: float) -> str:
    """What an export wrote: the tokenizer only where the run has one (``--tokenizer``, a ``--model`` directory or
    hub id); the built-in copy task trains on token ids without one."""
    side = "config, generation config, tokenizer" if tokenizer is not None else \
        "config, generation config; no tokenizer: the run has none (the built-in task's token ids; --tokenizer " \
        "names one)"
    return f"exported the model to {out_dir} (safetensors, {side}; from_pretrained loads it) in {seconds:.1f} s"


def export_checkpoint(path: str, out_dir: str, tag: Optional[str] = None, dtype: Optional[str] = "auto",
                      model_config=None, tokenizer=None, log=print) -> str:
    """Export a saved tag (no GPU, one process): DeepSpeed's ``zero_to_fp32`` gathers the fp32 master weights,
    cast to ``dtype`` ("auto": the dtype the run trained in; "fp32"/"bf16"/"fp16"), written with the HF config
    and tokenizer saved in the tag (or ``model_config``/``tokenizer`` given). Returns the tag exported."""
    import torch

    tag, record, side = read_tag(path, tag, log=log)
    if model_config is None:
        if not os.path.isfile(os.path.join(side, "config.json")):
            raise ConfigError("--model-config", f"{os.path.join(path, tag)!r} holds no HF config (saved before ds_longctx "
                              "kept one)", "pass --model-config (the config.json the run trained)")
        from transformers import AutoConfig

        model_config = AutoConfig.from_pretrained(side)
    if tokenizer is None and os.path.isfile(os.path.join(side, "tokenizer_config.json")):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(side)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if dtype == "auto":
        target = dtypes.get(record.get("dtype")) if record.get("dtype") else None
    elif dtype in dtypes:
        target = dtypes[dtype]
    elif dtype is None:
        target = None
    else:
        raise ConfigError("--dtype", f"unknown dtype {dtype!r}", "use auto, fp32, bf16 or fp16")
    t0 = time.monotonic()
    sd = fp32_weights(path, tag)
    generation_config = None
    if os.path.isfile(os.path.join(side, "generation_config.json")):
        from transformers import GenerationConfig

        generation_config = GenerationConfig.from_pretrained(side)
    write_hf(out_dir, dict(sd), model_config, tokenizer=tokenizer, dtype=target, generation_config=generation_config)
    log(f"exported {os.path.join(path, tag)} to {out_dir} in {time.monotonic() - t0:.2f} s")
    return tag


def read_tag(path: str, tag: Optional[str] = None, name: str = "checkpoint", log=None) -> Tuple[str, dict, str]:
    """(the tag, its record, its HF config directory) to read from the save directory ``path``: ``tag`` checked
    complete and by content (every file's checksum), or the newest such one (a note about ``latest`` goes to
    ``log``)."""
    if is_tag_dir(path):
        parent, one = os.path.split(os.path.normpath(path))
        raise ConfigError(name, f"{path!r} is one tag, not a save directory", f"give {parent!r} and --tag {one}")
    if tag is None:
        tag, record, note = find_resume_tag(path, name=name, verify=manifest.verify_tag)
        if note and log is not None:
            log(f"warning: {note}")
    else:
        record, problem = check_tag(path, tag, manifest.verify_tag)
        if problem:
            raise ConfigError("--tag", problem, f"give a complete tag of {path!r} (default: its newest)")
    return tag, record, os.path.join(path, tag, HF_CONFIG_DIR)


def fp32_weights(path: str, tag: str) -> dict:
    """The tag's fp32 master weights, gathered by DeepSpeed's ``zero_to_fp32`` (its progress prints silenced)."""
    import contextlib
    import io

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(io.StringIO()):
        return dict(get_fp32_state_dict_from_zero_checkpoint(path, tag=tag))
