"""Which transformers decoders see packed documents under their own attention ("none"): transformers builds the
packed block mask from restarting ``position_ids`` only where the decoder hands them to its mask builder."""
from __future__ import annotations

import inspect
import re
import sys

_BUILDERS = re.compile(r"create_\w*mask\(")


def _call_text(src: str, start: int) -> str:
    """The text from ``start`` (an opening bracket's index) to its matching closing bracket."""
    depth, i = 0, start
    pairs = {"(": ")", "{": "}"}
    close = pairs[src[start]]
    while i < len(src):
        c = src[i]
        if c == src[start]:
            depth += 1
        elif c == close:
            depth -= 1
            if depth == 0:
                return src[start:i + 1]
        i += 1
    return src[start:]


def mask_ignores_positions(model) -> bool:
    """True when the model's modeling module builds its causal masks without ``position_ids`` (GPT-OSS,
    GraniteMoeHybrid, and decoders with no RoPE positions: OPT, BLOOM, MPT, ...; 40 causal LMs of transformers 5.24):
    transformers' packed path cannot see the documents there, so its own attention would cross them. Read from the
    source of the modeling module of the first transformers module in ``model`` (a PEFT wrapper is looked through)."""
    hf = next((m for m in model.modules() if type(m).__module__.startswith("transformers.models.")), model)
    mod = sys.modules.get(type(hf).__module__)
    try:
        src = inspect.getsource(mod) if mod is not None else ""
    except (OSError, TypeError):
        return False
    calls = [_call_text(src, m.end() - 1) for m in _BUILDERS.finditer(src)
             if not src[max(0, m.start() - 4):m.start()].endswith("def ")]
    if not calls:
        return False
    kwargs = [_call_text(src, m.end() - 1) for m in re.finditer(r"mask_kwargs\s*=\s*\{", src)]
    return not any("position_ids" in t for t in calls + kwargs)
