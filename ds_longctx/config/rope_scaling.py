"""RoPE as keys: ``--rope-theta`` and ``--rope-scaling TYPE:FACTOR[,key=value...]`` -> a model config's
``rope_parameters`` (transformers 5.x), validated by transformers' own validation with every complaint a ConfigError.

    params = parse_rope_scaling("yarn:4")                  # {"rope_type": "yarn", "factor": 4.0}
    parse_rope_scaling("yarn:factor=4,original_max_position_embeddings=8192,beta_fast=32")
    parse_rope_scaling("llama3:8,low_freq_factor=1,high_freq_factor=4,original_max_position_embeddings=8192")
    parse_rope_scaling("longrope:4,factors=lr.json")       # short_factor / long_factor lists from a JSON file
    parse_rope_scaling("dynamic:2"), parse_rope_scaling("linear:4"), parse_rope_scaling("none")
    apply_rope(model_config, rope_theta=5e5, rope_scaling="yarn:4")  # before the model is built

Every ``rope_type`` of ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`` is accepted. What
:func:`apply_rope` fills in (when not given): ``rope_theta`` (the config's), ``original_max_position_embeddings``
(the config's ``max_position_embeddings``: the length the model was trained at) for yarn, longrope and llama3; and it
raises ``max_position_embeddings`` to ``factor x original`` for linear, yarn, longrope and llama3 (YaRN and Llama 3
read the extended length from it; ``dynamic`` keeps it: transformers' dynamic NTK starts rescaling past it).

Why our own parsing and checks next to transformers': its ``validate_rope`` only logs most problems (a factor below
1, an unknown key, a long_factor of the wrong length) and the model then builds anyway; here each one is a
ConfigError naming the flag and the fix. Under SP, dynamic and longrope are made exact by models/rope.py.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import Any, Dict, List, Optional

from ..errors import ConfigError
from ..models import text_config

FLAG = "--rope-scaling"
THETA_FLAG = "--rope-theta"
NEEDS_ORIGINAL = ("yarn", "longrope", "llama3")
EXTENDS_MAX_POSITION = ("linear", "yarn", "longrope", "llama3")
# the keys each type takes besides rope_type / rope_theta (transformers' _validate_<type>_rope_parameters)
TYPE_KEYS: Dict[str, tuple] = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings", "attention_factor", "factor"),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
    "proportional": ("partial_rotary_factor",),
}
DEFAULTS = {"llama3": {"low_freq_factor": 1.0, "high_freq_factor": 4.0}}  # Llama 3.1's values
_INTS = ("original_max_position_embeddings",)
_LISTS = ("short_factor", "long_factor")
_FORMAT = ("TYPE[:FACTOR][,key=value...] (e.g. yarn:4, linear:4, dynamic:2, "
           "llama3:8,original_max_position_embeddings=8192, longrope:4,factors=FILE.json) or none")


def rope_types() -> List[str]:
    """The rope types this transformers has (besides 'default')."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return list(ROPE_INIT_FUNCTIONS)


def _number(key: str, text: str, spec: str):
    t = text.strip()
    if t.lower() in ("true", "false"):
        return t.lower() == "true"
    try:
        return int(t) if key in _INTS else (float(t) if key != "truncate" else bool(int(t)))
    except ValueError:
        raise ConfigError(FLAG, f"{spec!r}: {key}={text!r} is not a number",
                          f"give {key} as a number: {_FORMAT}") from None


def _load_json(key: str, path: str, spec: str):
    if not os.path.isfile(path):
        raise ConfigError(FLAG, f"{spec!r}: {key}={path!r} is neither a number list nor a JSON file",
                          "give a JSON file holding the list (or an object with short_factor and long_factor)")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(FLAG, f"{spec!r}: {path!r} is not readable JSON ({e})", "fix the file") from None


def _factor_list(key: str, value, spec: str) -> List[float]:
    if isinstance(value, str):
        value = value.strip()
        if value.startswith("["):
            try:
                value = json.loads(value)
            except ValueError:
                raise ConfigError(FLAG, f"{spec!r}: {key} is not a JSON list", "give [1.0,1.0,...] or a JSON file") \
                    from None
        else:
            value = _load_json(key, value, spec)
            if isinstance(value, dict):
                value = value.get(key)
    if not isinstance(value, list) or not value or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                           for x in value):
        raise ConfigError(FLAG, f"{spec!r}: {key} is not a list of numbers ({str(value)[:80]})",
                          "give a JSON list of numbers, one per rotary frequency (head_dim / 2)")
    return [float(x) for x in value]


def _split(text: str) -> List[str]:
    """``text`` cut at the commas outside brackets (an inline list: short_factor=[1,1.5,...])."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return parts + [cur]


def parse_rope_scaling(spec) -> Dict[str, Any]:
    """``spec`` (the flag's text, a dict, or a JSON file path) -> transformers' ``rope_parameters`` keys for it
    (``rope_type`` and the given parameters; ``rope_theta`` and lengths are filled by :func:`apply_rope`).
    ``none``/``default``: unscaled RoPE."""
    known = rope_types()
    if isinstance(spec, dict):
        items = dict(spec)
        rtype = items.pop("rope_type", items.pop("type", None))
        text = json.dumps(spec)
    else:
        text = str(spec).strip()
        if text.endswith(".json") and os.path.isfile(text):
            return parse_rope_scaling(_load_json("rope_scaling", text, text))
        if text.startswith("{"):
            try:
                return parse_rope_scaling(json.loads(text))
            except ValueError:
                raise ConfigError(FLAG, f"{text[:60]!r} is not valid JSON", f"give {_FORMAT}") from None
        head, _, rest = text.partition(":")
        rtype = head.strip().lower()
        items = {}
        parts = [p for p in _split(rest) if p.strip()] if rest else []
        for i, part in enumerate(parts):
            if "=" in part:
                k, v = (s.strip() for s in part.split("=", 1))
                if not k:
                    raise ConfigError(FLAG, f"{text!r}: {part!r} has no key", f"give {_FORMAT}")
                if k in items:
                    raise ConfigError(FLAG, f"{text!r}: {k} is given twice", "give each key once")
                items[k] = v
            elif i == 0:
                items["factor"] = part.strip()
            else:
                raise ConfigError(FLAG, f"{text!r}: {part!r} is not key=value", f"give {_FORMAT}")
    if rtype in (None, ""):
        raise ConfigError(FLAG, f"{text!r} names no rope type", f"give {_FORMAT}; types: {', '.join(known)}")
    if rtype in ("none", "default"):
        if items:
            raise ConfigError(FLAG, f"{text!r}: unscaled RoPE takes no parameters", "give 'none' alone (theta: "
                              f"{THETA_FLAG})")
        return {"rope_type": "default"}
    if rtype not in known:
        raise ConfigError(FLAG, f"{text!r}: unknown rope type {rtype!r}", f"use one of {', '.join(known)} "
                          "(transformers' modeling_rope_utils.ROPE_INIT_FUNCTIONS), or none")
    if "factors" in items:  # longrope's two lists from one JSON file
        data = _load_json("factors", str(items.pop("factors")), text)
        if not isinstance(data, dict):
            raise ConfigError(FLAG, f"{text!r}: the factors file holds no object",
                              'give {"short_factor": [...], "long_factor": [...]}')
        for k in _LISTS:
            if k in data:
                items.setdefault(k, data[k])
    allowed = TYPE_KEYS.get(rtype)
    if "rope_theta" in items:
        raise ConfigError(FLAG, f"{text!r}: rope_theta is its own flag", f"pass {THETA_FLAG} VALUE")
    if allowed is not None:
        odd = sorted(set(items) - set(allowed))
        if odd:
            raise ConfigError(FLAG, f"{text!r}: {rtype} takes no {', '.join(odd)}",
                              f"{rtype}'s keys: {', '.join(allowed)}")
    out: Dict[str, Any] = {"rope_type": rtype}
    for k, v in items.items():
        if k in _LISTS:
            out[k] = _factor_list(k, v, text)
        elif isinstance(v, str):
            out[k] = _number(k, v, text)
        elif isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(FLAG, f"{text!r}: {k}={v!r} is not a number", f"give {k} as a number")
        else:
            out[k] = int(v) if k in _INTS else v
    if rtype in ("linear", "dynamic", "yarn", "llama3", "longrope") and "factor" not in out:
        raise ConfigError(FLAG, f"{text!r}: {rtype} needs a factor", f"give {rtype}:FACTOR (e.g. {rtype}:4)")
    if rtype == "longrope" and not all(k in out for k in _LISTS):
        raise ConfigError(FLAG, f"{text!r}: longrope needs short_factor and long_factor",
                          "give longrope:FACTOR,factors=FILE.json (an object with both lists, head_dim / 2 numbers each)")
    for k in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor",
              "mscale", "mscale_all_dim", "partial_rotary_factor"):
        if k in out and out[k] is not None and not out[k] > 0:
            raise ConfigError(FLAG, f"{text!r}: {k}={out[k]} must be > 0", f"give a positive {k}")
    if "factor" in out and out["factor"] < 1:
        raise ConfigError(FLAG, f"{text!r}: factor {out['factor']} is below 1 (that shortens the context)",
                          "give a factor >= 1: the new context length / the trained one")
    if out.get("original_max_position_embeddings", 1) < 1:
        raise ConfigError(FLAG, f"{text!r}: original_max_position_embeddings must be >= 1",
                          "give the length the model was trained at")
    for k, v in DEFAULTS.get(rtype, {}).items():
        out.setdefault(k, v)
    if rtype == "llama3" and out["high_freq_factor"] <= out["low_freq_factor"]:
        raise ConfigError(FLAG, f"{text!r}: high_freq_factor {out['high_freq_factor']} is not above "
                          f"low_freq_factor {out['low_freq_factor']}", "give high_freq_factor > low_freq_factor "
                          "(Llama 3.1: 4 and 1)")
    if rtype == "yarn" and out.get("beta_fast", 32) < out.get("beta_slow", 1):
        raise ConfigError(FLAG, f"{text!r}: beta_fast is below beta_slow", "give beta_fast > beta_slow (32 and 1)")
    return out


class _Complaints(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: List[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def _caught():
    from transformers import modeling_rope_utils

    log = logging.getLogger(modeling_rope_utils.__name__)
    h = _Complaints()
    log.addHandler(h)
    try:
        yield h.messages
    finally:
        log.removeHandler(h)


def apply_rope(config, rope_theta: Optional[float] = None, rope_scaling=None, flag: str = FLAG):
    """Set ``rope_theta`` and/or the scaling ``rope_scaling`` (text as :func:`parse_rope_scaling`, or its dict) on
    the HF ``config`` (its text config for a multimodal one), in place, before the model is built; returns the
    config. None leaves that part as the config has it. Validated by transformers' ``validate_rope`` and one
    computation of the frequencies; anything it complains about is a ConfigError naming ``flag``."""
    if rope_theta is None and rope_scaling is None:
        return config
    tc = text_config(config)
    current = getattr(tc, "rope_parameters", None)
    if not hasattr(tc, "validate_rope"):
        raise ConfigError(flag, f"{type(tc).__name__} has no RoPE parameters (transformers' "
                          "RotaryEmbeddingConfigMixin)", "drop the flag: this model does not use RoPE")
    if current and tc.nested_rope_parameter_keys(current):
        raise ConfigError(flag, f"{type(tc).__name__} has RoPE per layer type ({', '.join(current)}), each with its "
                          "own theta and scaling", "set them in the model config's rope_parameters per layer type "
                          "(--model-config)")
    if rope_theta is not None and (isinstance(rope_theta, bool) or not isinstance(rope_theta, (int, float))
                                   or not rope_theta > 0):
        raise ConfigError(THETA_FLAG, f"{rope_theta!r} is not a positive number", "give the RoPE base, e.g. 500000")
    current = dict(current or {})
    theta = float(rope_theta) if rope_theta is not None else current.get("rope_theta", tc.default_theta)
    if rope_scaling is None:  # theta only: the type and its parameters as they are
        new = dict(current, rope_theta=theta)
        new.setdefault("rope_type", "default")
    else:
        spec = parse_rope_scaling(rope_scaling)
        new = dict(spec, rope_theta=theta)
        if "partial_rotary_factor" in current and "partial_rotary_factor" not in new:
            new["partial_rotary_factor"] = current["partial_rotary_factor"]
    rtype = new["rope_type"]
    mpe = getattr(tc, "max_position_embeddings", None)
    if rtype in NEEDS_ORIGINAL and "original_max_position_embeddings" not in new:
        if not isinstance(mpe, int):
            raise ConfigError(flag, f"{rtype} needs original_max_position_embeddings and the config has no "
                              "max_position_embeddings", f"give {rtype}:FACTOR,original_max_position_embeddings=N")
        new["original_max_position_embeddings"] = mpe
    original = new.get("original_max_position_embeddings")
    old = (getattr(tc, "rope_parameters", None), getattr(tc, "max_position_embeddings", None),
           getattr(tc, "original_max_position_embeddings", None))
    if rope_scaling is not None and rtype in EXTENDS_MAX_POSITION:
        base = original if original is not None else mpe
        factor = new.get("factor")
        if factor is None and rtype == "longrope" and isinstance(mpe, int) and original:
            factor = mpe / original
        if isinstance(base, int) and factor is not None:
            tc.max_position_embeddings = max(int(mpe or 0), int(round(factor * base)))
    if original is not None and hasattr(tc, "original_max_position_embeddings"):
        tc.original_max_position_embeddings = original  # Phi3: transformers reads it over the dict on load
    tc.rope_parameters = new
    try:
        _validate(tc, new, flag)
    except ConfigError:  # the config as it was
        tc.rope_parameters, tc.max_position_embeddings = old[0], old[1]
        if hasattr(tc, "original_max_position_embeddings"):
            tc.original_max_position_embeddings = old[2]
        raise
    return config


def _validate(tc, new: dict, flag: str) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rtype = new["rope_type"]
    shown = {k: (f"[{len(v)} numbers]" if isinstance(v, list) else v) for k, v in new.items()}
    with _caught() as complaints:
        try:
            tc.validate_rope()
            if rtype in ROPE_INIT_FUNCTIONS:
                ROPE_INIT_FUNCTIONS[rtype](tc, "cpu")
        except Exception as e:  # noqa: BLE001 - transformers raises KeyError/ValueError/TypeError/... here
            complaints.append(f"{type(e).__name__}: {e}")
    if rtype == "longrope":
        head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
        half = int(head_dim * new.get("partial_rotary_factor", 1.0)) // 2
        for k in _LISTS:
            if len(new[k]) != half:
                complaints.append(f"{k} has {len(new[k])} numbers, the model's rotary dimension needs {half}")
    mpe = getattr(tc, "max_position_embeddings", None)
    if rtype == "llama3" and not complaints and isinstance(mpe, int) and new["original_max_position_embeddings"] >= mpe:
        complaints.append(f"original_max_position_embeddings {new['original_max_position_embeddings']} is not below "
                          f"max_position_embeddings {mpe}")
    if complaints:
        raise ConfigError(flag, f"transformers refuses rope_parameters {shown}: {'; '.join(complaints)}",
                          f"fix the value it names ({_FORMAT}; each type's keys: transformers' "
                          "modeling_rope_utils)")


__all__ = ["apply_rope", "parse_rope_scaling", "rope_types", "FLAG", "THETA_FLAG", "TYPE_KEYS"]
