"""The model's own logit transform: what a causal LM's forward does between ``lm_head`` and the loss.

ds_longctx replaces ``model.forward`` by a loss forward that computes ``lm_head(hidden)`` and the
cross entropy itself (tiled or not), so anything the model does to its logits in between must be
applied by us too, or training optimises a different objective (Gemma2/3 soft-capping, Granite's
``logits_scaling``, Cohere's ``logit_scale``).

How a model's transform is found: from the source of its class's ``forward`` (HF's CausalLM
forwards are written out per model, so the lines between ``logits = self.lm_head(...)`` and the
loss are exactly the transform). Those lines, comments and blank lines dropped, are looked up in
:data:`KNOWN_TRANSFORMS`; no lines is the identity. Anything else (an unknown transform, a scaled
hidden state before ``lm_head``, a loss that is not ``self.loss_function``, a router auxiliary
loss that is switched on) is refused with a ConfigError naming the class: reproducing only part of
a model's logit path would train silently wrong.
"""
from __future__ import annotations

import inspect
import re
import textwrap
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..errors import ConfigError
from ._common import text_config

LogitFn = Callable[[torch.Tensor], torch.Tensor]


def _softcap(model) -> Optional[LogitFn]:
    # Gemma2, Gemma3, VaultGemma, ...: logits = tanh(logits / cap) * cap, skipped when cap is None
    def fn(logits):
        cap = model.config.final_logit_softcapping
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap

    return fn


def _softcap_text(model) -> Optional[LogitFn]:
    # Gemma 4's multimodal causal LM: the same soft-capping, its cap read from the text config
    def fn(logits):
        cap = text_config(model.config).final_logit_softcapping
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap

    return fn


def _softcap_fp32(model) -> Optional[LogitFn]:
    # Beam: the same soft-capping, computed after an upcast to fp32
    def fn(logits):
        cap = model.config.final_logit_softcapping
        if cap is None:
            return logits
        return torch.tanh(logits.float() / cap) * cap

    return fn


def _logits_soft_cap(model) -> LogitFn:
    # RecurrentGemma: always on, from config.logits_soft_cap
    return lambda logits: torch.tanh(logits / model.config.logits_soft_cap) * model.config.logits_soft_cap


def _logits_scaling(model) -> LogitFn:
    # Granite, GraniteMoe, ...: logits / config.logits_scaling
    return lambda logits: logits / model.config.logits_scaling


def _logits_scaling_multiply(model) -> LogitFn:
    # HyperCLOVAX: logits * config.logits_scaling (the same key name as Granite's, the other way round)
    return lambda logits: logits * model.config.logits_scaling


def _lm_head_multiplier(model) -> LogitFn:
    # FalconH1: logits * model.model.lm_head_multiplier
    return lambda logits: logits * model.model.lm_head_multiplier


def _logit_scale(model) -> LogitFn:
    # Cohere, Cohere2, ...: logits * model.logit_scale (an attribute the model copies from its config)
    return lambda logits: logits * model.logit_scale


# normalised source lines between lm_head and the loss -> (what it is, builder of the transform)
KNOWN_TRANSFORMS: Dict[Tuple[str, ...], Tuple[str, Optional[Callable]]] = {
    (): ("identity", None),
    ("if self.config.final_logit_softcapping is not None:",
     "logits = logits / self.config.final_logit_softcapping",
     "logits = torch.tanh(logits)",
     "logits = logits * self.config.final_logit_softcapping"): ("final_logit_softcapping", _softcap),
    ("if self.config.final_logit_softcapping is not None:",
     "logits = logits.float() / self.config.final_logit_softcapping",
     "logits = torch.tanh(logits)",
     "logits = logits * self.config.final_logit_softcapping"): ("final_logit_softcapping in fp32", _softcap_fp32),
    ("if (final_logit_softcapping := self.config.get_text_config().final_logit_softcapping) is not None:",
     "logits = logits / final_logit_softcapping",
     "logits = torch.tanh(logits)",
     "logits = logits * final_logit_softcapping"): ("final_logit_softcapping (text config)", _softcap_text),
    ("cap = self.config.logits_soft_cap",
     "logits = nn.functional.tanh(logits / cap) * cap"): ("logits_soft_cap", _logits_soft_cap),
    ("logits = logits / self.config.logits_scaling",): ("logits_scaling", _logits_scaling),
    ("logits = logits * self.config.logits_scaling",): ("logits_scaling (multiplied)", _logits_scaling_multiply),
    ("logits = logits * self.logit_scale",): ("logit_scale", _logit_scale),
    ("logits = logits * self.model.lm_head_multiplier",): ("lm_head_multiplier", _lm_head_multiplier),
}

# lines allowed between the decoder's output and lm_head (taking the last hidden state, logits_to_keep);
# the first ones start that stretch
_TAKE_HIDDEN = tuple(f"hidden_states = {src}" for out in ("outputs", "transformer_outputs")
                     for src in (f"{out}.last_hidden_state", f"{out}[0]",
                                 f"slice_logits_to_keep({out}.last_hidden_state, logits_to_keep)"))
_BEFORE_LM_HEAD = _TAKE_HIDDEN + (
    "hidden_states = slice_logits_to_keep(hidden_states, logits_to_keep)",
    "slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep",
    # Gemma 4: the slice guarded by "not already sliced" (its KV-shared layers may slice to logits_to_keep first)
    "if hidden_states.shape[1] == (input_ids if input_ids is not None else inputs_embeds).shape[1]:",
)
# logits = self.lm_head(hidden_states) [.contiguous() | .float() | * <factor>]; a factor becomes its own line
_LM_HEAD = re.compile(r"^logits = self\.lm_head\(hidden_states(\[:, slice_indices, :\])?\)"
                      r"(?P<suffix>|\.contiguous\(\)|\.float\(\)| \* [\w.]+)$")
_KEY = "model"


def _normalised_lines(fn) -> List[str]:
    try:
        src = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return []
    out = []
    for line in src.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def _refuse(cls_name: str, problem: str):
    raise ConfigError(_KEY, f"{cls_name}: {problem}; ds_longctx computes the loss from lm_head itself and "
                      "reproduces only the logit transforms it knows (final_logit_softcapping, logits_scaling, "
                      "logit_scale), so this model is not supported",
                      "train this model without ds_longctx, or add its logit transform to "
                      "ds_longctx/models/logits.py with a test that the loss equals the model's own forward loss")


def _is_causal_lm_loss(loss_type) -> bool:
    """transformers maps ``loss_type`` to the causal-LM cross entropy (``ForConditionalGeneration``: Gemma 4's
    multimodal causal LM, text-only batches)."""
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    except ImportError:
        return False
    return LOSS_MAPPING.get(loss_type) is ForCausalLMLoss


def describe_logit_path(model) -> str:
    """The name of ``model``'s logit transform ('identity', 'final_logit_softcapping', ...), or a
    ConfigError naming the class when its path between lm_head and the loss is not one we reproduce."""
    kind, rest = classify_forward(type(model))
    name = type(model).__name__
    loss_type = getattr(model, "loss_type", None)
    if loss_type not in (None, "ForCausalLM") and not _is_causal_lm_loss(loss_type):
        _refuse(name, f"its loss_type is {loss_type!r}, not the causal-LM cross entropy")

    # a router auxiliary loss (output_router_logits) is computed by patch._install_router_aux_loss (models.moe)
    return kind


def classify_forward(cls) -> Tuple[str, List[str]]:
    """(transform name, the forward's lines from the loss on) for a CausalLM class, from its forward's
    source; ConfigError naming the class when the path is not one ds_longctx reproduces."""
    name = cls.__name__
    lines = _normalised_lines(cls.forward)
    head = [i for i, line in enumerate(lines) if "self.lm_head(" in line]
    if not lines or not head:
        _refuse(name, "its forward's source has no 'self.lm_head(...)' call that ds_longctx can read")
    i = head[0]
    if lines[i].startswith("lm_logits = "):  # the older spelling (Falcon, ...): one name for the logits
        lines = [re.sub(r"\blm_logits\b", "logits", line) for line in lines]
    m = _LM_HEAD.match(lines[i])
    if not m:
        _refuse(name, f"its forward feeds lm_head with something other than the last hidden state "
                      f"({lines[i]!r})")
    factor = m.group("suffix")
    if factor.startswith(" * "):  # logits = self.lm_head(h) * f  ==  logits = self.lm_head(h); logits = logits * f
        lines = lines[:i + 1] + [f"logits = logits{factor}"] + lines[i + 1:]
    starts = [j for j in range(i) if lines[j] in _TAKE_HIDDEN]
    if not starts:
        _refuse(name, "its forward does not take the decoder's last hidden state before lm_head")
    before = lines[starts[-1]:i]
    odd = [line for line in before if line not in _BEFORE_LM_HEAD]
    if odd:
        _refuse(name, f"its forward changes the hidden state before lm_head ({odd[0]!r})")
    ends = [j for j in range(i + 1, len(lines))
            if lines[j] == "loss = None" or lines[j].startswith("if labels is not None")]
    if not ends:
        _refuse(name, "its forward's loss computation could not be found after lm_head")
    j = ends[0]
    between = tuple(lines[i + 1:j])
    if between not in KNOWN_TRANSFORMS:
        _refuse(name, "its forward transforms the logits between lm_head and the loss in a way ds_longctx does not "
                      f"know ({' / '.join(between)[:200]!r})")
    rest = lines[j:]
    calls = [line for line in rest if line.startswith("loss = ") and line != "loss = None"]
    if not calls or not calls[0].startswith("loss = self.loss_function("):
        _refuse(name, "its forward computes the loss with something other than self.loss_function "
                      f"({calls[0] if calls else 'nothing found'!r})")
    return KNOWN_TRANSFORMS[between][0], rest


_CALLS_DECODER = re.compile(r"^(?:outputs|transformer_outputs)(?:: [\w.\[\]]+)? = self\.(\w+)\($")


def decoder_of(model):
    """The module ``model``'s forward calls for the last hidden state: the attribute its forward's source calls
    (``outputs = self.model(`` / ``self.transformer(``), else ``get_decoder()``. ``get_decoder()`` alone is not
    enough: Llama4ForCausalLM's returns the CausalLM itself. ConfigError when neither names a submodule."""
    for line in _normalised_lines(type(model).forward):
        m = _CALLS_DECODER.match(line)
        if m and isinstance(getattr(model, m.group(1), None), torch.nn.Module):
            return getattr(model, m.group(1))
    dec = model.get_decoder() if hasattr(model, "get_decoder") else None
    if not isinstance(dec, torch.nn.Module) or dec is model:
        _refuse(type(model).__name__, "its decoder (the module giving the last hidden state) could not be found")
    return dec


def logit_transform(model) -> Optional[LogitFn]:
    """``model``'s own transform of ``lm_head``'s output (applied in lm_head's dtype, before the loss
    upcasts to fp32, as HF does), None for the identity; ConfigError when it cannot be reproduced."""
    kind = describe_logit_path(model)
    builder = next(b for k, (n, b) in KNOWN_TRANSFORMS.items() if n == kind)
    return builder(model) if builder is not None else None


__all__ = ["decoder_of", "logit_transform", "describe_logit_path", "classify_forward", "KNOWN_TRANSFORMS"]
