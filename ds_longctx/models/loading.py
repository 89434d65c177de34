"""A transformers config from what a user hands us: the one loader behind train.py's ``--model-config`` and
the planner's ``--model-config`` / ``--model`` (and ``ds_longctx.plan``)."""
from __future__ import annotations

import json
import os
from typing import Optional

from ..errors import ConfigError

_FLAG = "--model-config"


def load_model_config(model_config=None, model: Optional[str] = None):
    """A transformers config from a config object, a dict, a config.json path or a model directory.

    The config's ``attn_implementation`` key (default "sdpa") becomes ``config._attn_implementation``.
    Every problem is a ConfigError of ``--model-config`` naming the file and the fix.
    """
    from transformers import CONFIG_MAPPING, PretrainedConfig

    src = model_config if model_config is not None else model
    if src is None:
        raise ConfigError(_FLAG, "no model config was given",
                          "pass --model-config config.json or --model <local model directory>")
    if isinstance(src, PretrainedConfig):
        return src
    if isinstance(src, dict):
        d, where = dict(src), "the model config"
    else:
        path = os.fspath(src)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.exists(path):
            if model_config is None:  # --model: a local directory only (the planner fetches nothing from the hub)
                raise ConfigError("--model", f"{os.fspath(src)!r} is not a local model directory (the planner reads "
                                  "a local config.json and does not download from the Hugging Face hub)",
                                  "pass --model-config path/to/config.json (e.g. ds_configs/models/llama3-8b.json) or "
                                  "--model <local directory holding config.json> (e.g. from `huggingface-cli download "
                                  "<id> config.json --local-dir DIR`; a gated repo needs `huggingface-cli login`)")
            raise ConfigError(_FLAG, f"{path!r} does not exist",
                              "pass an HF config.json (e.g. ds_configs/models/llama3-8b.json) or a model directory")
        try:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
        except (ValueError, UnicodeDecodeError) as e:
            raise ConfigError(_FLAG, f"{path} is not valid JSON ({e})", "give a HF config.json") from None
        where = path
        if not isinstance(d, dict):
            raise ConfigError(_FLAG, f"{path} holds a JSON {type(d).__name__}, not an object", "give a HF config.json")
    model_type = d.pop("model_type", None)
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        what = "has no \"model_type\"" if model_type is None else f"has model_type {model_type!r}, which " \
            "this transformers does not know"
        raise ConfigError(_FLAG, f"{where} {what}", "set \"model_type\" to a transformers model type "
                          "(e.g. \"llama\", \"qwen2\")")
    attn = d.pop("attn_implementation", "sdpa")
    try:
        cfg = CONFIG_MAPPING[model_type](**d)
    except (TypeError, ValueError) as e:
        raise ConfigError(_FLAG, f"{where} is not a valid {model_type} config ({e})",
                          "fix the config.json fields") from None
    cfg._attn_implementation = attn
    return cfg


__all__ = ["load_model_config"]
