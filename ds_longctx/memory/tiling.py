"""Sequence-tiled MLP and sequence-tiled lm_head + cross-entropy, correct under ZeRO-3.

Why not DeepSpeed's ``TiledMLP`` / ``TiledFusedLogitsLoss`` (ulysses_sp.py):
- both split with ``torch.chunk``, which returns *fewer* pieces than asked whenever the length is
  not a convenient multiple (10 rows in 6 chunks -> 5 pieces). Ranks that agreed on the shard count
  but hold different local lengths then run the MLP a different number of times, i.e. issue different
  numbers of ZeRO-3 all-gathers (deadlock), and ``ds_grad_is_ready`` is keyed on the requested count,
  so a short split never marks the weights ready and their gradient is never reduced. We split with
  ``torch.tensor_split``, which always yields exactly ``shards`` pieces (some empty).
- ``TiledFusedLogitsLoss`` runs the weight backward inside forward with an assumed upstream gradient
  of 1 and only rescales the *input* gradient in backward, so any scale applied after it (our SP
  token-mean division, DeepSpeed's gradient-accumulation and fp16 loss scaling) reaches ``lm_head``'s
  gradient unscaled. Our loss recomputes each shard in backward with the real upstream gradient.
"""
from __future__ import annotations

import contextlib
import math
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..dist.comm import max_int
from ..loss import IGNORE_INDEX, fused_token_fields, lm_logits
from ..measure.simulation import holds_values
from ..models import layer_role, mlp_class_names, mlp_facts, mlp_form_names, pointwise_mlp_form
from ..models.moe import (block_rows, capacity_limit, output_form, is_moe_candidate, returns_tuple,
                          token_locality_problem)
from .checkpointing import decoder_layers, text_body
from .tiles import each_tile

# decoder MLPs whose forward is pointwise over tokens (SwiGLU/GeGLU/GELU MLPs, per-token MoE routing), so row
# tiling is exact (models/: one Architecture per model type), besides every MLP running one of the reference
# forwards verbatim (models.pointwise_mlp_form: LlamaMLP's, Phi3MLP's, NemotronMLP's, PhiMLP's, SeedOssMLP's,
# Starcoder2MLP's, GraniteMoeSharedMLP's, FalconH1MLP's, Llama4TextMLP's, Lfm2MLP's)
SUPPORTED_MLPS = mlp_class_names()
SUPPORTED_TEXT = (f"{', '.join(SUPPORTED_MLPS)}, any MLP whose forward is the code of one of "
                  f"{', '.join(mlp_form_names())}, and any mixture-of-experts block with transformers' experts "
                  "module whose routing is per token (models.moe)")


def is_tileable_mlp(module) -> bool:
    # an instance forward set by someone else (another patching library) is not the code checked here
    if "forward" in module.__dict__:
        return False
    return type(module).__name__ in SUPPORTED_MLPS or pointwise_mlp_form(module) is not None


# ---------------------------------------------------------------------------------------------
# shard counts
# ---------------------------------------------------------------------------------------------


def auto_shards(local_seq: int, hidden: int) -> int:
    return max(1, math.ceil(local_seq / max(1, hidden)))


def agree_max(local: int) -> int:
    """MAX of ``local`` over every rank. Every rank must call it at the same point.

    Over every rank, not the SP group: the agreement must cover every rank that shares ZeRO-3 parameter
    all-gathers with this one, which with DP x SP is the whole world. Under the planner the same all-reduce runs
    on its fake process group (comm.max_int: control data, outside tensor modes).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return int(local)
    return max_int(local)


def resolve_shards(shards: Optional[int], local_seq: int, hidden: int) -> int:
    """An integer is taken as is (identical config on every rank, no collective); None ("auto") is
    ceil(local_seq / hidden) agreed by MAX over every rank."""
    if shards is None:
        return agree_max(auto_shards(local_seq, hidden))
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ValueError(f"shards: {shards!r} is not a shard count; use a positive integer or None (auto)")
    return shards


def _mark_ready(params: Sequence[torch.nn.Parameter], ready: bool) -> None:
    # ZeRO (stage3.py, stage_1_and_2.py) adds a gradient to its reduce bucket only when this is True,
    # so the per-shard partial gradients accumulate locally and are reduced once, after the last shard
    for p in params:
        p.ds_grad_is_ready = ready


# ---------------------------------------------------------------------------------------------
# tiled MLP
# ---------------------------------------------------------------------------------------------


class TiledRowsFunction(torch.autograd.Function):
    """y = fn(module, x) computed over ``shards`` row tiles of x flattened to [rows, hidden]; backward
    recomputes one tile at a time. ``fn`` must be pointwise over rows (tokens).

    ``tap``: a models.moe.RouterTap taking the router's load-balancing sums (None: no auxiliary loss). With a tap
    the Function has a second output, the tiles' router-probability sums per expert; its gradient reaches each
    tile's recompute in backward (the tap backpropagates the tile's sum with it), so the auxiliary loss is exact
    without keeping any tile's router logits."""

    @staticmethod
    def forward(ctx, x, fn, module, shards, params, tap=None):
        ctx.fn, ctx.module, ctx.shards, ctx.params = fn, module, shards, [p for p in params if p.requires_grad]
        ctx.tap = tap
        ctx.save_for_backward(x)
        flat = x.reshape(-1, x.shape[-1])
        out = None
        row = 0
        pieces = torch.tensor_split(flat, shards, dim=0)
        if tap is not None:
            tap.tile_probs = None
        with torch.no_grad():
            for piece in each_tile(pieces, flat.shape[0], pieces[0].shape[0]):
                if tap is not None:
                    tap.rows_at = row
                y = fn(module, piece)
                if out is None:  # allocated once the output width and dtype are known
                    out = y.new_empty(flat.shape[0], y.shape[-1])
                out[row:row + piece.shape[0]].copy_(y)
                row += piece.shape[0]
                del y
        if tap is not None:
            tap.rows_at = 0
            probs = tap.tile_probs if tap.tile_probs is not None else \
                torch.zeros(tap.facts.num_experts, dtype=torch.float32, device=x.device)
            tap.tile_probs = None
            return out.view(*x.shape[:-1], out.shape[-1]), probs
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out, grad_probs=None):
        (x,) = ctx.saved_tensors
        fn, module, shards, params, tap = ctx.fn, ctx.module, ctx.shards, ctx.params, ctx.tap
        need_x = ctx.needs_input_grad[0]
        flat = x.detach().reshape(-1, x.shape[-1])
        g = grad_out.reshape(-1, grad_out.shape[-1])
        x_grad = torch.zeros_like(flat) if need_x else None
        try:
            pairs = list(zip(torch.tensor_split(flat, shards, 0), torch.tensor_split(g, shards, 0)))
            _tiles_backward(each_tile(pairs, flat.shape[0], pairs[0][0].shape[0]), fn, module, shards, params, need_x,
                            x_grad, tap, grad_probs)
        finally:
            _mark_ready(params, True)
        return (x_grad.view_as(x) if need_x else None), None, None, None, None, None


def _tiles_backward(pairs, fn, module, shards, params, need_x, x_grad, tap=None, grad_probs=None):
    """Recompute and backpropagate each (input tile, output-gradient tile); input gradients into x_grad's rows. With
    a tap and a gradient of the router sums, each tile's router sum is backpropagated with it too."""
    row = 0
    aux = tap is not None and grad_probs is not None
    for i, (piece, g_piece) in enumerate(pairs):
        _mark_ready(params, i == shards - 1)
        piece = piece.detach().requires_grad_(need_x)
        if aux:
            tap.backward_grad, tap.rows_at, tap.pending = grad_probs, row, []
        try:
            with torch.enable_grad():
                y = fn(module, piece)
        finally:
            if aux:
                tap.backward_grad, tap.rows_at = None, 0
        outs, grads = ([y], [g_piece]) if y.requires_grad else ([], [])
        if aux:
            for p, gp in tap.pending:
                if p.requires_grad:
                    outs.append(p)
                    grads.append(gp.to(p.device))
            tap.pending = []
        if outs:
            torch.autograd.backward(outs, grads)
        if need_x and piece.grad is not None:
            x_grad[row:row + piece.shape[0]].copy_(piece.grad)
        row += piece.shape[0]


def _class_forward(module, x):
    # the class's own forward: submodule calls go through __call__, so ZeRO-3 fetch hooks fire per tile
    return type(module).forward(module, x)


def _block_rows(module, y, x):
    """An MoE block's output as rows shaped like its input ``x`` (models.moe.block_rows; the probe checked the form of
    a probed block's output, a known block's is known)."""
    rows = block_rows(y, x.shape)
    if rows is None:
        raise TilingError(f"{type(module).__name__} (a mixture-of-experts block) returned {output_form(y)}, not its "
                          f"rows shaped like its input {tuple(x.shape)}", "(exact, untiled)")
    return rows


def _batched_class_forward(module, x):
    # MoE blocks unpack [batch, seq, hidden]: a tile of rows goes in as one sequence
    return _block_rows(module, type(module).forward(module, x.unsqueeze(0)), x)


def _batched_class_forward_3d(module, x):
    return type(module).forward(module, x)


class TilingState:
    """Shard count of the tiled MLPs, agreed once per model forward (one all-reduce, not one per layer
    per forward and again per recompute) and reused by every layer and by the backward recompute."""

    def __init__(self, shards: Optional[int]):
        self.shards = shards  # None: "auto", agreed per forward
        self.forward_id = 0
        self._cached = None  # (forward_id, shards)
        self.probed = {}  # (MoE block class, training, dtype) -> models.moe's verdict (None: token-local)
        self.tap = None  # models.moe.RouterTap when the model's loss adds the router's auxiliary loss

    def new_forward(self, *_):
        self.forward_id += 1

    def mlp_shards(self, x: torch.Tensor) -> int:
        if self.shards is not None:
            return self.shards
        if self._cached is not None and self._cached[0] == self.forward_id:
            return self._cached[1]
        local_seq = x.shape[-2] if x.dim() >= 3 else x.shape[0]
        n = resolve_shards(None, local_seq, x.shape[-1])
        self._cached = (self.forward_id, n)
        return n


class TilingError(ValueError):
    """An MLP the tiled forward cannot tile exactly, in op terms (no config key): ``problem``; ``untiled``: what
    running that MLP untiled means (the fix that always works); ``other``: another fix, or "". The install that
    took the switch from the config re-raises it as the ConfigError naming its key (memory.apply_memory_stack,
    through ``install_tiled_mlp(refusals=...)`` for the ones raised at a forward)."""

    def __init__(self, problem: str, untiled: str, other: str = ""):
        self.problem, self.untiled, self.other = problem, untiled, other
        self.fix = f"do not tile it {untiled}" + (f", or {other}" if other else "")
        super().__init__(f"{problem}. Fix: {self.fix}")

    def __reduce__(self):
        return (type(self), (self.problem, self.untiled, self.other))


def _mlp_facts(module):
    """(batched, randomness) of a tileable MLP: whether its forward unpacks [batch, seq, hidden] (MoE blocks),
    and (attribute, what) of the random numbers it draws in training (Mixtral's router jitter, a form's
    dropout) or None. Read once, at install."""
    arch = mlp_facts(type(module).__name__)
    if arch is not None:
        return arch.mlp_batched, ((arch.mlp_noise_attr, "router jitter") if arch.mlp_noise_attr else None)
    form = pointwise_mlp_form(module)
    return False, ((form.dropout, "dropout") if form is not None and form.dropout else None)


def _probe_verdict(module, x, verdicts: dict, tap=None):
    """models.moe's token-locality probe of ``module``'s class, once per (class, mode, dtype) in one model (its layers
    share one config; ``verdicts``: the install's cache); a TilingError naming the class when its forward is not per
    token. Skipped where ``x`` holds no values (the planner's step: it measures memory only)."""
    if not holds_values(x):
        return
    key = (type(module), module.training, x.dtype)
    if key not in verdicts:
        if tap is not None:  # the probe's router calls are not this forward's
            tap.suspended += 1
        try:
            verdicts[key] = token_locality_problem(module, _batched_class_forward_3d, x.shape[-1], x.dtype, x.device)
        finally:
            if tap is not None:
                tap.suspended -= 1
    problem = verdicts[key]
    if problem is not None:
        raise TilingError(f"{type(module).__name__} (a mixture-of-experts block) cannot run in row tiles: {problem}",
                          "(exact, untiled)")


def tiled_mlp_forward(module, x, state: TilingState, batched: bool = False, randomness=None, probe: bool = False):
    shards = state.mlp_shards(x)
    if shards <= 1:  # every rank agreed on 1: the plain forward issues the same collectives everywhere
        return _class_forward(module, x)
    if probe:  # same probe input and weights on every rank: the same verdict everywhere, before the first tile
        _probe_verdict(module, x, state.probed, state.tap)
    if randomness is not None and module.training and getattr(module, randomness[0], 0):
        # same verdict on every rank (one config): raised before the tile loop's first ZeRO-3 fetch
        attr, what = randomness
        raise TilingError(f"{type(module).__name__} draws random numbers in training ({attr}="
                          f"{getattr(module, attr)}, its {what}); a tile recomputed in backward would draw others "
                          "than its forward, so the gradient would not be this forward's", "(exact, untiled)",
                          f"set the model config's {attr} to 0 if you mean to train without that {what} (a "
                          "different regularisation than the model's config asks for)")
    fn = _batched_class_forward if batched else _class_forward
    params = [p for p in module.parameters() if p.requires_grad]
    tap = state.tap
    if tap is None or not any(isinstance(m, tap.facts.router_class) for m in module.modules()):
        return TiledRowsFunction.apply(x, fn, module, shards, params)
    y, probs = TiledRowsFunction.apply(x, fn, module, shards, params, tap)
    if tap.active:
        tap.probs.append(probs)
    return y


def _moe_candidates(model) -> List[torch.nn.Module]:
    """Decoder-layer MLP children (by HF's naming) that no other rule tiles but that hold transformers' experts
    module (models.moe.is_moe_candidate): tiled as a whole, after the probe's verdict at their first tiled forward."""
    out = []
    for layer in decoder_layers(model):
        for name, child in layer.named_children():
            if (layer_role(name) == "mlp" and "forward" not in child.__dict__ and not is_tileable_mlp(child)
                    and is_moe_candidate(child)):
                out.append(child)
    return out


def find_mlps(model) -> List[torch.nn.Module]:
    """Every supported MLP that is not inside another one (Qwen2-MoE's shared expert is an MLP inside the
    MoE block, which is tiled as a whole), MoE blocks recognised by models.moe included."""
    found = []
    blocks = {id(m) for m in _moe_candidates(model)}

    def walk(m):
        if is_tileable_mlp(m) or id(m) in blocks:
            found.append(m)
            return
        for c in m.children():
            walk(c)

    walk(model)
    return found


def _untiled_layer_mlps(model, mlps) -> List[str]:
    """"layer i's name (Class)" for each decoder layer's MLP child (by HF's naming) that is not tiled."""
    tiled = {id(m) for m in mlps}
    out = []
    for i, layer in enumerate(decoder_layers(model)):
        for name, child in layer.named_children():
            if layer_role(name) == "mlp" and id(child) not in tiled:
                out.append(f"layer {i}'s {name} ({type(child).__name__})")
    return out


def install_tiled_mlp(model, shards: Optional[int], refusals=contextlib.nullcontext):
    """Patch the forward of every supported MLP *instance* (the class stays untouched, so other models
    in the process are unaffected) to run in ``shards`` row tiles (an int, or None: "auto", agreed per forward).
    ``refusals``: a context manager factory around each tiled forward (the install's translation of a
    :class:`TilingError` raised there). Returns (state, modules, hook handles). Issues no collectives.
    A model without a supported MLP is a TilingError."""
    root = text_body(model)  # a multimodal model's vision tower is not on the sequence: not tiled
    mlps = find_mlps(root)
    if not mlps:
        raise TilingError(f"{type(model).__name__} has no MLP that tiled_mlp knows to be pointwise over tokens "
                          f"(supported: {SUPPORTED_TEXT})", "for this model (its MLP then runs untiled: "
                          "exact, with the whole shard's MLP activations in memory)")
    for m in _moe_candidates(root):
        cap = capacity_limit(m)
        if cap is not None:
            raise TilingError(f"{type(m).__name__} (a mixture-of-experts block) routes with an expert capacity ({cap}):"
                              " tokens beyond an expert's capacity in one call are dropped, so row tiles would drop "
                              "others than the whole sequence", "for this model (exact, untiled)")
    untiled = _untiled_layer_mlps(root, mlps)
    if untiled:
        # a partly tiled model (dense layers tiled, MoE blocks not) would hold the untiled layers' activations
        # while the config says tiled: refuse rather than tile some
        raise TilingError(f"{type(model).__name__} has decoder-layer MLPs that tiled_mlp does not know to be "
                          f"pointwise over tokens: {', '.join(untiled)} (supported: {SUPPORTED_TEXT})",
                          "for this model (its MLPs then run untiled: exact, with the whole shard's MLP activations "
                          "in memory)")
    state = TilingState(shards)

    probed = {id(m) for m in _moe_candidates(root)}

    def tiled(mod):
        probe = id(mod) in probed
        batched, randomness = (True, None) if probe else _mlp_facts(mod)
        pair = probe and returns_tuple(mod)  # Llama 4's block: (out, router_logits), the layer drops the logits

        def forward(x):
            with refusals():
                y = tiled_mlp_forward(mod, x, state, batched, randomness, probe)
            return (y, None) if pair and not isinstance(y, tuple) else y
        return forward

    for m in mlps:
        m.forward = tiled(m)
    hooks = [root.register_forward_pre_hook(state.new_forward)]
    return state, mlps, hooks


def uninstall_tiled_mlp(mlps, hooks):
    for m in mlps:
        m.__dict__.pop("forward", None)
    for h in hooks:
        h.remove()


# ---------------------------------------------------------------------------------------------
# tiled loss
# ---------------------------------------------------------------------------------------------


def _ce_sum(lm_head, x, y, logit_fn=None):
    logits = lm_logits(lm_head, x, logit_fn)
    return F.cross_entropy(logits, y, ignore_index=IGNORE_INDEX, reduction="sum")


def _row_tiles(hidden, labels, shards):
    """(hidden rows, labels) of each of ``shards`` row tiles of the flattened [b * s] rows (hidden detached)."""
    flat = hidden.detach().reshape(-1, hidden.shape[-1])
    return zip(torch.tensor_split(flat, shards, 0), torch.tensor_split(labels.reshape(-1), shards, 0))


def _save_tiling(ctx, hidden, labels, lm_head, shards, params, shared, logit_fn, anchors):
    """What the tiled lm_head Functions' backward (:func:`_backward_over_tiles`) reads from ``ctx``."""
    ctx.lm_head, ctx.shards, ctx.params, ctx.shared, ctx.logit_fn = lm_head, shards, params, shared, logit_fn
    ctx.n_anchors = len(anchors)
    ctx.save_for_backward(hidden, labels)


class TiledLMLossSum(torch.autograd.Function):
    """fp32 sum of CE(lm_head(hidden), labels) over ``shards`` row tiles, never holding more than one
    tile's logits. Backward recomputes each tile with the true upstream gradient; ``lm_head``'s
    parameter gradients are accumulated directly by that recompute, marked ready for ZeRO after the
    last tile. Trailing tensor inputs are anchors only (they get no gradient)."""

    @staticmethod
    def forward(ctx, hidden, labels, lm_head, shards, params, shared, logit_fn, *anchors):
        _save_tiling(ctx, hidden, labels, lm_head, shards, params, shared, logit_fn, anchors)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with torch.no_grad():
            for xp, yp in _row_tiles(hidden, labels, shards):
                total += _ce_sum(lm_head, xp, yp, logit_fn)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        g = grad_out.detach().float()

        def tile(xp, yp, rows):
            loss = _ce_sum(ctx.lm_head, xp, yp, ctx.logit_fn)
            if loss.requires_grad:
                torch.autograd.backward(loss, g)

        x_out = _backward_over_tiles(ctx, tile)
        return (x_out, None, None, None, None, None, None) + (None,) * ctx.n_anchors


def _backward_over_tiles(ctx, tile):
    """The tiled lm_head Functions' backward: recompute each row tile with grad (``tile(xp, yp, rows)`` runs
    its autograd backward with the true upstream gradient), accumulate the hidden gradient, and let lm_head's
    parameter gradients accumulate locally, marked ready for ZeRO after the last tile only."""
    hidden, labels = ctx.saved_tensors
    shards, params = ctx.shards, ctx.params
    # a parameter the model also uses elsewhere (tied input embedding) gets its other gradient later in
    # this backward: it must not be reduced after the last tile too (ZeRO-3 asserts on a parameter
    # reduced twice in one bucket), so it is marked ready only at the end and reduced once, with the sum
    own = [p for p in params if not any(p is q for q in ctx.shared)]
    need_x = ctx.needs_input_grad[0]
    x_grad = hidden.new_zeros(hidden.shape[:-1].numel(), hidden.shape[-1]) if need_x else None
    row = 0
    try:
        for i, (xp, yp) in enumerate(_row_tiles(hidden, labels, shards)):
            _mark_ready(params, False)
            _mark_ready(own, i == shards - 1)
            xp = xp.detach().requires_grad_(need_x)
            with torch.enable_grad():
                tile(xp, yp, slice(row, row + xp.shape[0]))
            if need_x and xp.grad is not None:
                x_grad[row:row + xp.shape[0]].copy_(xp.grad)
            row += xp.shape[0]
            del xp
    finally:
        _mark_ready(params, True)
    return x_grad.view_as(hidden) if need_x else None


class TiledTokenFields(torch.autograd.Function):
    """TRL's fused LM head fields per token (label log-probability, entropy, is-top-1; zero where the label
    is ignored: ``loss.fused_token_fields``) over ``shards`` row tiles, never holding more than one tile's
    logits. Backward recomputes each tile with the true upstream gradients of log_probs and entropy (a loss
    may weight tokens, e.g. TRL's DFT, or use the entropy); is_top1 has none."""

    @staticmethod
    def forward(ctx, hidden, labels, lm_head, shards, params, shared, logit_fn, *anchors):
        _save_tiling(ctx, hidden, labels, lm_head, shards, params, shared, logit_fn, anchors)
        ctx.set_materialize_grads(False)
        names = ("log_probs", "entropy", "is_top1", "mean_logits", "log_sum_sq_probs")
        parts = {k: [] for k in names}
        with torch.no_grad():
            for xp, yp in _row_tiles(hidden, labels, shards):
                f = fused_token_fields(lm_logits(lm_head, xp, logit_fn), yp)
                for k, v in parts.items():
                    v.append(f[k])
        lp, ent, top1, mean, sq = (torch.cat(parts[k]).view(labels.shape) for k in names)
        ctx.mark_non_differentiable(top1, mean, sq)
        return lp, ent, top1, mean, sq

    @staticmethod
    def backward(ctx, g_lp, g_ent, _g_top1, _g_mean, _g_sq):
        def tile(xp, yp, rows):
            f = fused_token_fields(lm_logits(ctx.lm_head, xp, ctx.logit_fn), yp, metrics=False)
            outs, grads = [], []
            for out, g in ((f["log_probs"], g_lp), (f["entropy"], g_ent)):
                if g is not None and out.requires_grad:
                    outs.append(out)
                    grads.append(g.detach().reshape(-1)[rows].to(out.dtype))
            if outs:
                torch.autograd.backward(outs, grads)

        x_out = _backward_over_tiles(ctx, tile) if (g_lp is not None or g_ent is not None) else None
        return (x_out, None, None, None, None, None, None) + (None,) * ctx.n_anchors


def _apply_tiled(function, name, hidden, lm_head, shift_labels, shards, logit_fn, shared):
    """Check the shapes, resolve the shard count and apply a tiled lm_head Function: (its output, labels on
    hidden's device). lm_head's trainable parameters are not inputs of the Function (ZeRO-3 parameters cannot
    be: their recorded shape is the empty partition, and the recompute's gathered-weight gradient is then
    rejected); when only lm_head trains, an empty leaf anchor keeps the output requiring grad."""
    if hidden.dim() != 3 or shift_labels.shape != hidden.shape[:2]:
        raise ValueError(f"{name}: hidden {tuple(hidden.shape)} must be [b, s, h] and "
                         f"shift_labels {tuple(shift_labels.shape)} must be [b, s]")
    labels = shift_labels.to(hidden.device)
    n = resolve_shards(shards, hidden.shape[1], hidden.shape[-1])
    params = [p for p in lm_head.parameters() if p.requires_grad]
    anchor = ()
    if params and not hidden.requires_grad and torch.is_grad_enabled():
        anchor = (hidden.new_empty(0).requires_grad_(True),)
    return function.apply(hidden, labels, lm_head, n, params, tuple(shared), logit_fn, *anchor), labels


def tiled_token_fields(hidden: torch.Tensor, lm_head: torch.nn.Module, shift_labels: torch.Tensor,
                       shards: Optional[int] = None, logit_fn=None, shared: Sequence[torch.Tensor] = ()) -> dict:
    """TRL's fused LM head fields ({log_probs, entropy, is_top1, label_mask, mean_logits, log_sum_sq_probs}, each
    [b, s_local]) without [seq, vocab] logits: what ``loss.fused_token_fields`` gives from full logits, tile by tile. Arguments as
    :func:`tiled_causal_lm_loss_sum`."""
    (lp, ent, top1, mean, sq), labels = _apply_tiled(TiledTokenFields, "tiled_token_fields", hidden, lm_head,
                                                     shift_labels, shards, logit_fn, shared)
    return {"log_probs": lp, "entropy": ent, "is_top1": top1, "label_mask": labels != IGNORE_INDEX,
            "mean_logits": mean, "log_sum_sq_probs": sq}


def tiled_causal_lm_loss_sum(hidden: torch.Tensor, lm_head: torch.nn.Module, shift_labels: torch.Tensor,
                             shards: Optional[int] = None, logit_fn=None, shared: Sequence[torch.Tensor] = ()):
    """(fp32 sum of CE over valid tokens, number of valid tokens) without [seq, vocab] logits.

    hidden [b, s_local, h]; shift_labels [b, s_local] with -100 = ignore. Shards with no valid label
    contribute exactly 0 (a CE *sum*, never a mean, so never NaN). ``shards`` None ("auto") is
    ceil(s_local / h) MAX-agreed over every rank (world-wide, not the SP group: ZeRO-3's lm_head
    all-gathers span DP x SP).
    ``logit_fn``: the model's own logit transform (``models.logits.logit_transform``), None = identity.
    ``shared``: lm_head parameters the model also uses elsewhere (tied embeddings).
    """
    loss_sum, labels = _apply_tiled(TiledLMLossSum, "tiled_causal_lm_loss_sum", hidden, lm_head, shift_labels,
                                    shards, logit_fn, shared)
    count = (labels != IGNORE_INDEX).sum()
    return loss_sum, count
