"""Mixture-of-experts blocks: which ones tiled MLP may run in row tiles, recognised by what they do.

A decoder layer's MLP child is an *MoE block candidate* when it holds an experts module with transformers' experts
contract: a submodule whose forward takes ``(hidden_states, <expert choice>, <expert weights>)`` (the
``@use_experts_implementation`` classes of transformers 5: Mixtral's, DeepSeek-V3's, GLM-4-MoE's, MiniMax-M2's,
HunYuan's, ERNIE-4.5's, EXAONE-MoE's, PhiMoE's, GraniteMoE's, Qwen3.5-MoE's, ... and older ModuleDict experts), or
experts stacked in 3-D parameters whose forward takes the routed rows only (Llama 4's).
No class names: the next release's blocks are candidates the day they ship.

Whether such a block may be tiled is then decided by what its forward *does*, by a probe run once per class at its
first tiled forward, on the block's own weights (fetched by ZeRO-3's hooks like any forward): the rows of a token
must come out the same whatever the other rows of the call are (token-choice routing: top-k of the token's own
router scores, experts applied to the token's own row, a shared expert and its gate per token). A router with an
expert capacity (Switch Transformers: tokens beyond an expert's capacity are dropped, in sequence order), expert-
choice routing or any statistic over the tokens of the call changes a token's row when the others change: the
probe feeds rows that overload one token's experts and refuses the block, naming it. A forward that draws random
numbers in training (router or input jitter) gives two different outputs for one input: refused too (a tile's
recompute in backward would draw others). The probe is deterministic (fixed seed, the same weights on every rank),
so every rank reaches the same verdict at the same point.
"""
from __future__ import annotations

import inspect
import math
import re
from dataclasses import dataclass
from typing import Optional

import torch

from ..measure.simulation import holds_values

_PROBE_ROWS = 8


def _forward_params(module):
    fn = inspect.unwrap(type(module).forward)
    try:
        params = list(inspect.signature(fn).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    return params


def is_experts_module(module) -> bool:
    """transformers' experts contract: ``forward(hidden_states, <expert choice per token>, <expert weights>)``."""
    params = _forward_params(module)
    if params is None:
        return False
    required = [p for p in params if p.default is inspect.Parameter.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(required) == 3 and required[0].name == "hidden_states"


def has_stacked_experts(module) -> bool:
    """Its own parameters hold the experts stacked: two or more 3-D parameters with one leading (expert) dimension of
    at least 2 (Llama 4's Llama4TextExperts, whose forward takes only the already-routed rows)."""
    lead = [p.shape[0] for p in module.parameters(recurse=False) if p.dim() == 3]
    return len(lead) >= 2 and len(set(lead)) == 1 and lead[0] >= 2


def returns_tuple(module) -> bool:
    """Whether the class forward returns a tuple literal (``return out, router_logits``: Llama 4's block, whose decoder
    layer unpacks it) on every path, read from its source; False when the source cannot be read."""
    import ast
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(type(module).forward))))
    except (OSError, TypeError, SyntaxError):
        return False
    rets = [n for n in ast.walk(tree) if isinstance(n, ast.Return) and n.value is not None]
    return bool(rets) and all(isinstance(r.value, ast.Tuple) for r in rets)


def block_rows(y, shape) -> Optional[torch.Tensor]:
    """An MoE block's output ``y`` as rows shaped like its input (``shape``): the first output of a block that returns
    a tuple (Llama 4's (out, router_logits): its decoder layer drops the logits, HF's recorder takes them from the
    router), its rows in any leading shape ([tokens, hidden], [1, tokens, hidden]); None when it is not that."""
    if isinstance(y, tuple) and y and isinstance(y[0], torch.Tensor):
        y = y[0]
    if isinstance(y, torch.Tensor) and y.dim() >= 1 and y.shape[-1] == shape[-1] and y.numel() == math.prod(shape):
        return y.reshape(shape)
    return None


def output_form(y) -> str:
    """What a block returned, for an error: its (first) output's shape, else its type."""
    first = y[0] if isinstance(y, tuple) and y else y
    return str(tuple(first.shape)) if isinstance(first, torch.Tensor) else type(y).__name__


def is_moe_candidate(module) -> bool:
    """A module holding an experts module (itself excluded): transformers' experts contract, or experts stacked in
    3-D parameters. A block the probe decides on."""
    return any(is_experts_module(m) or has_stacked_experts(m) for m in module.modules() if m is not module)


def capacity_limit(module) -> Optional[str]:
    """'Class.attribute=value' of the first expert capacity set on ``module`` or a submodule (Switch Transformers'
    ``expert_capacity``): a fixed number of tokens per expert per call, which a probe of a few rows cannot reach but
    a long sequence does; None when there is none."""
    for m in module.modules():
        for k, v in vars(m).items():
            if "capacity" in k.lower() and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
                return f"{type(m).__name__}.{k}={v}"
    return None


def _rng_states(device):
    states = [torch.get_rng_state()]
    if torch.device(device).type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def _restore_rng(device, states) -> bool:
    """Put the generators back as they were before the probe; True when the probe had moved one (it drew random
    numbers: PhiMoE's sparse mixer samples in training even where its output happens not to change)."""
    now = _rng_states(device)
    moved = any(not torch.equal(a, b) for a, b in zip(states, now))
    torch.set_rng_state(states[0])
    if len(states) > 1:
        torch.cuda.set_rng_state(states[1], device)
    return moved


def token_locality_problem(module, forward, hidden: int, dtype: torch.dtype, device) -> Optional[str]:
    """None when ``forward(module, x[1, rows, hidden])`` computes each token's row from that row alone on the probe
    (and draws no random numbers); else what it does instead, in one phrase. Runs without autograd."""
    g = torch.Generator().manual_seed(1234)
    kept = torch.randn(_PROBE_ROWS, hidden, generator=g)
    others = torch.randn(_PROBE_ROWS, hidden, generator=g)
    # the same kept rows last, after: other rows / copies of the first kept row (its experts overloaded) / the kept
    # rows themselves (every kept row's experts chosen twice as often)
    inputs = [torch.cat([others, kept]), torch.cat([kept[:1].expand(_PROBE_ROWS, hidden), kept]),
              torch.cat([kept, kept])]
    outs = []
    rng = _rng_states(device)
    try:
        with torch.no_grad():
            shape = (1, 2 * _PROBE_ROWS, hidden)
            for x in inputs:
                raw = forward(module, x.to(device=device, dtype=dtype).unsqueeze(0))
                y = block_rows(raw, shape)
                if y is None:
                    return f"its forward returns {output_form(raw)}, not one tensor shaped like its input {list(shape)}"
                outs.append(y[0, _PROBE_ROWS:].float())
            again = block_rows(forward(module, inputs[0].to(device=device, dtype=dtype).unsqueeze(0)), shape)
            again = again[0, _PROBE_ROWS:].float()
    finally:
        drew = _restore_rng(device, rng)
    if drew or not torch.equal(again, outs[0]):
        return ("it draws random numbers in its forward in training (router or input jitter, sampled routing), so "
                "a tile recomputed in backward would not be this forward's")
    tol = 1e-4 if dtype == torch.float32 or dtype == torch.float64 else 2e-2
    scale = max(float(o.abs().max()) for o in outs) + 1e-12
    for o in outs[1:]:
        if not torch.allclose(o, outs[0], rtol=tol, atol=tol * scale):
            return ("a token's output depends on the other tokens of the call (an expert capacity, expert-choice "
                    "routing or a statistic over the tokens: rows that overload its experts changed it), so row tiles "
                    "would compute another function than the whole sequence")
    return None




# ---------------------------------------------------------------------------------------------
# the router's auxiliary (load-balancing) loss: HF's sums, per shard, per tile
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AuxLossFacts:
    """What a CausalLM's forward adds when ``output_router_logits`` is on: ``coef * load_balancing_loss_func(router
    logits of every call of ``router_class`` (output ``index``), num_experts, top_k, attention_mask)``, read from its
    forward's source (attribute paths on the model)."""
    router_class: type
    index: int
    num_experts: int
    top_k: int
    coef: float


def _attr_path(model, expr: str):
    expr = expr.rstrip(",").strip()
    if not expr.startswith("self."):
        return None
    obj = model
    for part in expr[len("self."):].split("."):
        obj = getattr(obj, part, None)
    return obj


_AUX_CALL = "aux_loss = load_balancing_loss_func("
_AUX_ADD = re.compile(r"^loss \+= (self\.[\w.]+) \* aux_loss(\.to\([^)]*\))?$")


def aux_loss_facts(model, forward_lines, decoder) -> Optional[AuxLossFacts]:
    """The model's router auxiliary loss as :class:`AuxLossFacts`, or None when its forward adds none. ValueError
    (a phrase) when it adds one that ds_longctx cannot reproduce exactly: a load-balancing function other than
    Mixtral's (HF copies it verbatim into every token-choice family), other arguments, or a router it cannot find."""
    import importlib

    if not any(line.startswith(_AUX_CALL) for line in forward_lines):
        return None
    i = next(j for j, line in enumerate(forward_lines) if line.startswith(_AUX_CALL))
    args = [a.rstrip(",").strip() for a in forward_lines[i + 1:i + 5]]
    if args[0] != "outputs.router_logits" or args[3] != "attention_mask" or forward_lines[i + 5] != ")":
        raise ValueError(f"its forward calls load_balancing_loss_func with arguments ds_longctx does not know "
                         f"({', '.join(args)})")
    num_experts, top_k = _attr_path(model, args[1]), _attr_path(model, args[2])
    adds = [m for m in (_AUX_ADD.match(line) for line in forward_lines[i:]) if m]
    coef = _attr_path(model, adds[0].group(1)) if adds else None
    if not (isinstance(num_experts, int) and isinstance(top_k, int) and isinstance(coef, (int, float))):
        raise ValueError("its forward's auxiliary-loss expert count, top-k or coefficient could not be read "
                         f"({args[1]}, {args[2]}, {adds[0].group(1) if adds else 'no loss += line'})")
    own = importlib.import_module(type(model).__module__)
    ref = importlib.import_module("transformers.models.mixtral.modeling_mixtral")
    fn = getattr(own, "load_balancing_loss_func", None)
    if fn is None or _body(fn) != _body(ref.load_balancing_loss_func):
        raise ValueError("its load_balancing_loss_func is not Mixtral's (the one ds_longctx reproduces per shard)")
    rec = getattr(type(decoder), "_can_record_outputs", {}).get("router_logits")
    target = getattr(rec, "target_class", None)
    names = [n for n, m in decoder.named_modules() if isinstance(m, target)] if target is not None else []
    layer = "." + (getattr(rec, "layer_name", None) or "").strip(".") + "."
    # a layer_name (MiniMax: 'mlp.gate') that every router of the class matches selects them all, as none does
    if not names or (layer != ".." and not all(layer in "." + n + "." for n in names)):
        raise ValueError("its decoder records router logits from no router module ds_longctx can find")
    return AuxLossFacts(router_class=target, index=int(getattr(rec, "index", 0) or 0), num_experts=num_experts,
                        top_k=top_k, coef=float(coef))


def _body(fn) -> str:
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):
        return ""
    src = re.sub(r'r?"""[\s\S]*?"""', "", src)
    return "\n".join(line.rstrip() for line in src.splitlines()[1:] if line.strip() and not line.strip().startswith("#"))


class RouterTap:
    """HF's load-balancing sums (``load_balancing_loss_func``: top-k assignment counts and router-probability sums per
    expert, and the row count) over every router call of one model forward, taken by forward hooks on the router
    modules, so no [tokens, experts] logits are kept for the loss (HF keeps every layer's).

    ``active`` only around the decoder call of the loss forward. A call with autograd on adds its probability sum
    (with its graph) to ``probs``; a call inside a tiled MLP forward (no autograd) adds to ``tile_probs`` instead,
    detached: the tiled Function returns that sum as an output and, in its backward, recomputes each tile with
    ``backward_grad`` set, when the hook backpropagates the tile's sum with that gradient (memory.tiling).
    ``weights``: the flat row weights (the 2-D attention mask of the shard) or None, kept after the loss forward
    for its backward's recomputes (a tile's, a checkpointed layer's: the same weighted sums). ``rows_at``: the first row of the
    call in the flat [batch * seq] rows (a tile's offset)."""

    def __init__(self, facts: AuxLossFacts):
        self.facts = facts
        self.active = False
        self.suspended = 0
        self.weights = None
        self.rows_at = 0
        self.backward_grad = None
        self.pending = []
        self.took = {}  # router module -> whether its last forward call built sums with autograd (see hook)
        self.reset()

    def reset(self):
        e = self.facts.num_experts
        self.counts = torch.zeros(e, dtype=torch.float32)
        self.rows = torch.zeros((), dtype=torch.float32)
        self.probs = []
        self.tile_probs = None

    def _sums(self, logits):
        f = self.facts
        routing = torch.nn.functional.softmax(logits, dim=-1)
        _, chosen = torch.topk(routing, f.top_k, dim=-1)
        n = routing.shape[0]
        w = None if self.weights is None else self.weights[self.rows_at:self.rows_at + n].to(routing.device)
        if w is None:
            counts = torch.bincount(chosen.reshape(-1), minlength=f.num_experts).float()
            probs = routing.float().sum(dim=0)
            rows = torch.tensor(float(n))
        else:
            w = w.float()
            counts = torch.zeros(f.num_experts, dtype=torch.float32, device=routing.device).scatter_add_(
                0, chosen.reshape(-1), w.repeat_interleave(f.top_k))
            probs = (routing.float() * w.unsqueeze(-1)).sum(dim=0)
            rows = w.sum()
        return counts.detach().cpu(), probs, rows.detach().cpu().float()

    def hook(self, module, args, output):
        if self.suspended or not holds_values(output[self.facts.index]):  # the planner's step: no values to sum
            return
        if self.backward_grad is not None:  # a tile's recompute in the tiled MLP's backward
            logits = output[self.facts.index].reshape(-1, self.facts.num_experts)
            self.pending.append((self._sums(logits)[1], self.backward_grad))
            return
        if torch._C._current_graph_task_id() != -1:
            # inside backward: a checkpointed layer's recompute (HF's gradient checkpointing, TRL's default, or
            # ours without tiled MLP). It must save the tensors its forward saved (torch.utils.checkpoint compares
            # their count), so the sums are built again where the forward built them with autograd, and dropped:
            # the forward's are the ones in the loss
            if self.took.get(module) and torch.is_grad_enabled():
                self._sums(output[self.facts.index].reshape(-1, self.facts.num_experts))
            return
        self.took[module] = False
        if not self.active:
            return
        logits = output[self.facts.index].reshape(-1, self.facts.num_experts)
        counts, probs, rows = self._sums(logits)
        self.took[module] = bool(torch.is_grad_enabled() and probs.requires_grad)
        self.counts += counts
        self.rows += rows
        if torch.is_grad_enabled() and probs.requires_grad:
            self.probs.append(probs)
        else:  # inside a tiled forward: returned by the tiled Function as an output with a graph
            p = probs.detach()
            self.tile_probs = p if self.tile_probs is None else self.tile_probs + p


def install_router_tap(decoder, facts: AuxLossFacts):
    """(tap, hook handles): a :class:`RouterTap` on every ``facts.router_class`` module of ``decoder``."""
    tap = RouterTap(facts)
    handles = [m.register_forward_hook(tap.hook) for m in decoder.modules() if isinstance(m, facts.router_class)]
    return tap, handles


__all__ = ["AuxLossFacts", "RouterTap", "aux_loss_facts", "block_rows", "output_form", "install_router_tap", "capacity_limit", "has_stacked_experts", "is_experts_module", "returns_tuple", "is_moe_candidate", "token_locality_problem"]
