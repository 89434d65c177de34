"""DeepSpeed's own Ulysses attention (``UlyssesSPAttentionHF``) installed on one model.

Built for our SP group instead of through DeepSpeed's ``register_with_transformers``, which also
creates the groups (we need them earlier, and the planner needs no collectives here) and writes
transformers' attention table process-wide; we route only this model's modules through the
attention registry, so other models keep the original function and the install can be undone.

DeepSpeed calls the core attention on the gathered sequence with no mask (HF's mask was built for the
local shard), so the core here is what makes that exact (:func:`pattern_core`): full-causal layers run
the model's own attention function causal over the gathered sequence; a layer with a sliding window
shorter than the sequence or with attention soft-capping (Gemma2) runs the window / soft-cap on the
gathered sequence (flash cores natively through transformers' flash path, every other core through
ds_longctx's banded kernel, attention/kernels.py); 'flex_attention' (whose BlockMask was built for the
shard; without it flex is bidirectional) runs torch's SDPA causal, or the banded kernel for such a layer.
"""
from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist

from ..dist.layout import shard_index
from ..errors import ConfigError
from ..models import latent_dims as _latent_dims, text_config
from ..models.windows import LayerAttention, layer_attention, not_runnable
from . import registry
from .documents import DOCS_KWARG, chunk_documents, document_core, is_no_mask
from .hf import _check_mask as check_mask, naming_kernel_key
from .kernels import KernelChoice
from .ring import RingBackend


class _PatternAttention(torch.autograd.Function):
    """HF layout q [b, h, S, d], k/v [b, hk, S, d] -> out [b, S, h, d] through one kernels.Backend (a
    Windowed one for a window / soft-cap), keeping its LSE for the backward."""

    @staticmethod
    def forward(ctx, q, k, v, backend, scale: float):
        qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
        out, lse = backend.forward(qs, ks, vs, True, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.backend, ctx.scale = backend, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
        dq, dk, dv = ctx.backend.backward(dout, qs, ks, vs, out, lse, True, ctx.scale)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), None, None


class _SinkAttention(torch.autograd.Function):
    """Attention with a per-head sink logit in the softmax denominator (GPT-OSS's ``sinks``, transformers' ``s_aux``)
    through one kernels.Backend, exact from the kernel's LSE: with ``lse`` = log of the row's sum of exp(scores),
    the sink adds exp(sink) to that sum, so lse' = logaddexp(lse, sink) and out' = out * exp(lse - lse') =
    out * sigmoid(lse - sink). Backward: the kernel's own backward given (out', lse') is the gradient of the softmax
    including the sink (it recomputes P = exp(scores - lse') and takes rowsum(dout * out') as its delta), and the
    sink's gradient is -sum over rows of P_sink * rowsum(dout * out'), P_sink = exp(sink - lse'). HF layout q [b, h,
    S, d], k/v [b, hk, S, d], sinks [h] -> out [b, S, h, d]."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, backend, scale: float):
        qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
        out, lse = backend.forward(qs, ks, vs, True, scale)  # lse fp32 (fp64 for fp64 inputs), [b, h, S]
        lse_sink = torch.logaddexp(lse, sinks.detach().to(lse.dtype).view(1, -1, 1))
        out = (out.to(lse.dtype) * torch.exp(lse - lse_sink).transpose(1, 2).unsqueeze(-1)).to(out.dtype)
        ctx.save_for_backward(q, k, v, out, lse_sink, sinks)
        ctx.backend, ctx.scale = backend, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse_sink, sinks = ctx.saved_tensors
        qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
        dq, dk, dv = ctx.backend.backward(dout, qs, ks, vs, out, lse_sink, True, ctx.scale)
        delta = (dout.to(lse_sink.dtype) * out.to(lse_sink.dtype)).sum(-1).transpose(1, 2)  # [b, h, S]
        p_sink = torch.exp(sinks.detach().to(lse_sink.dtype).view(1, -1, 1) - lse_sink)
        dsinks = -(p_sink * delta).sum(dim=(0, 2)).to(sinks.dtype)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), dsinks, None, None


def _rank_sinks(sinks, heads_here: int, group):
    """This rank's heads' sinks after Ulysses' all-to-all (DeepSpeed gives rank r the query heads
    [r * h, (r + 1) * h) of the layer's ``sinks``)."""
    if sinks.shape[0] == heads_here:
        return sinks
    rank = dist.get_rank(group) if group is not None else 0
    return sinks[rank * heads_here:(rank + 1) * heads_here]


def _layer_facts(layers, idx, kwargs) -> LayerAttention:
    """The attention facts of layer ``idx`` (a module's ``layer_idx``), checked against what transformers passes
    (``sliding_window``, ``softcap``): a disagreement is an error, never a silently different pattern."""
    facts = layers[idx] if isinstance(idx, int) and 0 <= idx < len(layers) else LayerAttention()
    hf_window, hf_cap = kwargs.get("sliding_window"), kwargs.get("softcap")
    if (hf_window or None) != facts.passed_window or (hf_cap or None) != facts.softcap:
        raise ConfigError("model.config", f"layer {idx}: transformers passes sliding_window={hf_window!r}, "
                          f"softcap={hf_cap!r}, the config reads as window={facts.window!r}, "
                          f"softcap={facts.softcap!r}", "report this model: ds_longctx.models.windows reads "
                          "its attention pattern wrongly")
    return facts


def pattern_core(core, impl: str, layers: List, kernel, group=None) -> callable:
    """The core attention DeepSpeed's Ulysses calls on the gathered sequence (see the module doc).

    ``layers``: models.windows.layer_attention of the model (per layer_idx); ``kernel``: a
    kernels.KernelChoice for the banded kernel. The window and soft-cap come from the model config per
    layer; what transformers passes (``sliding_window``, ``softcap``) must agree, else an error."""
    flash = impl.startswith("flash_attention")
    sdpa = registry.original("sdpa") if impl == "flex_attention" else None

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        idx = getattr(module, "layer_idx", None)
        facts = _layer_facts(layers, idx, kwargs)
        S = query.shape[2]
        # a chunked layer reaches the core per chunk (ulysses_attention cut its documents at the chunks): a chunk's
        # tokens, or under flash one sample whose position_ids restart at every chunk (one varlen call)
        chunked_ok = facts.kind == "chunked_attention" and facts.chunk is not None and (flash or S <= facts.chunk)
        if not chunked_ok and not facts.runnable(S):
            raise not_runnable(idx, facts, S, "ulysses")
        # a windowed layer takes the windowed kernel at every length (exact when the window covers the sequence):
        # the kernel signatures 'auto' measures with a collective must not depend on a rank's batch length
        window = facts.window
        if flash:  # transformers' flash path applies the window (window_size) and soft-cap natively
            return core(module, query, key, value, None, *args, **kwargs)
        if getattr(module, "is_causal", True) is False or kwargs.get("is_causal") is False:
            raise ValueError(f"'ulysses': layer {idx} attends bidirectionally; ds_longctx's SP attention is causal")
        sinks = kwargs.get("s_aux")
        if window is None and not facts.softcap and sinks is None:
            if sdpa is not None:  # flex_attention: its BlockMask was the local shard's; SDPA causal is the same
                kw = {n: a for n, a in kwargs.items() if n not in ("sliding_window", "softcap", "score_mod")}
                return sdpa(module, query, key, value, None, *args, **kw)
            return core(module, query, key, value, None, *args, **kwargs)
        if module.training and kwargs.get("dropout"):
            raise ValueError(f"'ulysses': layer {idx} has attention dropout {kwargs['dropout']}, which the "
                             "windowed / soft-capped SP kernel does not apply; setting model.config."
                             "attention_dropout=0 trains without it (a different regularisation than the config "
                             "asks for); to keep it, train at SP=1 with implementation 'none'")
        scale = kwargs.get("scaling")
        scale = float(scale) if scale is not None else query.shape[-1] ** -0.5
        with naming_kernel_key():  # the kernel name came from the config: a refusal names its key
            backend = kernel.for_layer(query.device, window, facts.softcap, f"layer {idx}")
            if sinks is not None:
                return _SinkAttention.apply(query, key, value, _rank_sinks(sinks, query.shape[1], group), backend,
                                            scale), None
            return _PatternAttention.apply(query, key, value, backend, scale), None

    return attention


def ring_core(layers: List, kernel, head_group, ring_group, sp: int) -> callable:
    """The core attention over the Ulysses group's gathered ("ring-local") sequence when SP runs a ring
    (attention/ring.py): every layer runs our kernel rung over ``ring_group`` (transformers' own core attends only the
    ring-local tokens), its window / soft-cap applied per block, sinks from the merged LSE, packed documents read by
    the ring (the batch's, or a chunked layer's chunks: ulysses_attention cut them). ``sp``: the whole SP degree
    (the global length is the gathered length x the ring degree)."""
    ring = dist.get_world_size(ring_group)

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        docs = kwargs.pop(DOCS_KWARG, None)
        idx = getattr(module, "layer_idx", None)
        facts = _layer_facts(layers, idx, kwargs)
        S = query.shape[2] * ring
        chunked_ok = facts.kind == "chunked_attention" and facts.chunk is not None
        if not chunked_ok and not facts.runnable(S):
            raise not_runnable(idx, facts, S, "ulysses")
        if getattr(module, "is_causal", True) is False or kwargs.get("is_causal") is False:
            raise ValueError(f"'ulysses': layer {idx} attends bidirectionally; ds_longctx's SP attention is causal")
        if module.training and kwargs.get("dropout"):
            raise ValueError(f"'ulysses' with a ring (long_context.attention.ring_degree > 1): layer {idx} has "
                             f"attention dropout {kwargs['dropout']}, which the ring's kernels do not apply; setting "
                             "model.config.attention_dropout=0 trains without it (a different regularisation than "
                             "the config asks for); to keep it, use a sequence_parallel_size the heads allow "
                             "without a ring")
        scale = kwargs.get("scaling")
        scale = float(scale) if scale is not None else query.shape[-1] ** -0.5
        sinks = kwargs.get("s_aux")
        with naming_kernel_key():  # the kernel name came from the config: a refusal names its key
            backend = RingBackend(kernel.for_layer(query.device, facts.window, facts.softcap, f"layer {idx}"),
                                  ring_group, S, docs)
            if sinks is not None:
                return _SinkAttention.apply(query, key, value, _rank_sinks(sinks, query.shape[1], head_group), backend,
                                            scale), None
            return _PatternAttention.apply(query, key, value, backend, scale), None

    return attention


def _shard_positions(query, spec) -> torch.Tensor:
    """[b, s_local] global token indices of this rank's shard (data.shard_batch's cut: equal shards in SP-rank order,
    zigzag with a ring: dist.layout.shard_index)."""
    s = query.shape[2]
    rank = dist.get_rank(spec.group) if spec.group is not None else 0
    idx = shard_index(s * spec.sp, spec.sp, spec.ring, rank)
    return torch.tensor(idx, device=query.device).expand(query.shape[0], s)


class _NoAllToAll:
    """Where DeepSpeed's wrapper would stand at Ulysses degree 1 (a ring over every SP rank): the core on this
    rank's shard as is, returning DeepSpeed's [b, s, heads * head_dim]."""

    def __init__(self, attn):
        self.attn, self.batch_size = attn, 1
        self.required_query_shape = self.required_key_value_shape = self.required_context_shape = torch.Size([0, 1])

    def __call__(self, module, query, key, value, attention_mask, *args, **kwargs):
        out, weights = self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        return out.reshape(out.shape[0], out.shape[1], -1), weights


def install_ulysses(model, spec) -> registry.Installation:
    """Route ``model``'s attention through DeepSpeed's Ulysses for the spec's SP group (SP > 1), with the head
    counts of the spec's model facts (``ds_longctx.patching.spec.LongContextSpec``, trusted as built: the model's attention
    pattern was checked then). No collectives."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF  # DeepSpeed only where used

    impl = model.config._attn_implementation
    tc = text_config(model.config)
    # the core runs per document when the batch carries packed documents (documents.DOCS_KWARG)
    facts = spec.model
    layers = layer_attention(tc)
    if spec.ring > 1:  # the ring core reads the documents itself
        wrapped = ring_core(layers, KernelChoice("auto"), spec.head_group, spec.ring_group, spec.sp)
    else:
        wrapped = document_core(pattern_core(registry.original(impl), impl, layers, KernelChoice("auto"), spec.group),
                                impl)
    uattns = {}  # one DeepSpeed wrapper per attention shape: its all-to-all shapes are fixed at construction

    def ulysses_for(shape):
        """(DeepSpeed's wrapper, q/k head dim, v head dim) for a layer of ``shape`` (models.AttentionShape): per
        layer where the config gives shapes per layer (Gemma 4's global layers have their own head_dim)."""
        if shape not in uattns:
            qk, vd = _latent_dims(tc, shape.head_dim)
            if spec.head_group is None:  # ring only (Ulysses degree 1): no all-to-all, the core on the shard itself
                u = _NoAllToAll(wrapped)
            else:
                u = UlyssesSPAttentionHF(attn=wrapped, batch_size=1, attn_head_count=shape.heads, attn_head_size=qk,
                                         kv_head_count=shape.kv_heads, num_hidden_layers=facts.layers,
                                         process_group=spec.head_group, seq_length_is_variable=True)
                # not "flex_attention": DeepSpeed would rebuild a causal BlockMask for it; the core above runs it causal
                u.core_attn_implementation = impl if impl != "flex_attention" else "sdpa"
            uattns[shape] = (u, qk, vd)
        return uattns[shape]

    for shape in facts.distinct_shapes():
        ulysses_for(shape)

    def ulysses_attention(module, query, key, value, attention_mask, *args, **kwargs):
        # sinks (s_aux): applied from the kernel's LSE on the gathered sequence (pattern_core, _SinkAttention)
        shape = facts.layer_shape(getattr(module, "layer_idx", None))
        uattn, qk_dim, v_dim = ulysses_for(shape)
        bs = query.shape[0]
        if uattn.batch_size != bs:  # DeepSpeed fixes the batch size at construction
            uattn.batch_size = bs
            for name in ("required_query_shape", "required_key_value_shape", "required_context_shape"):
                dims = list(getattr(uattn, name))
                dims[1] = bs
                setattr(uattn, name, torch.Size(dims))
        # what DeepSpeed's wrapper asserts (and the heads it splits), as our refusal on every rank, before the
        # all-to-all: a model whose attention call lacks them has no Ulysses path
        shapes = tuple((t.shape[1], t.shape[-1]) for t in (query, key, value))  # (heads, head_dim), HF's layout
        expect = ((shape.heads, qk_dim), (shape.kv_heads, qk_dim), (shape.kv_heads, v_dim))
        if "position_ids" not in kwargs and shapes == expect:
            # Llama 4's attention hands its function no position_ids; DeepSpeed gathers them only to give the core
            # the whole sequence's (flash detects packing from them). ds_longctx's shards are equal and in rank
            # order, so this shard's are its global token indices; packed documents reach the core as documents
            kwargs["position_ids"] = _shard_positions(query, spec)
        idx = getattr(module, "layer_idx", None)
        lf = layers[idx] if isinstance(idx, int) and 0 <= idx < len(layers) else LayerAttention()
        if lf.kind == "chunked_attention" and lf.chunk is not None:
            total = query.shape[2] * spec.sp
            if lf.chunk < total:  # causal within every chunk (and document): the packed-documents machinery
                kwargs[DOCS_KWARG] = chunk_documents(kwargs.get(DOCS_KWARG), query.shape[0], total, lf.chunk)
        if "position_ids" not in kwargs or shapes != expect:
            problem = (f"{type(module).__name__} calls its attention function without position_ids, which DeepSpeed's "
                       "Ulysses needs" if "position_ids" not in kwargs else
                       f"{type(module).__name__} hands its attention (heads, head_dim) q {shapes[0]}, k {shapes[1]}, "
                       f"v {shapes[2]}, not the config's {expect[0]} / {expect[1]} (multi-head latent or "
                       "differential attention, or another layout)")
            raise ConfigError("long_context.attention.implementation", f"'ulysses': {problem}",
                              "this model has no Ulysses path: try implementation 'untied_ulysses', or train at "
                              "sequence_parallel_size 1 with implementation 'none'")
        # HF built the mask for the local shard: the core runs causal (+ the layer's window / soft-cap) over the
        # gathered sequence instead. A mask that is neither our no-mask nor that causal mask (a model that builds
        # its own, e.g. Doge's score bias) would be dropped: refused, before the all-to-all
        if isinstance(attention_mask, torch.Tensor) and not is_no_mask(attention_mask):
            idx = getattr(module, "layer_idx", None)
            window = layers[idx].window if isinstance(idx, int) and 0 <= idx < len(layers) else None
            check_mask(attention_mask, query.shape[2], window,
                       **({"chunk": lf.chunk} if lf.kind == "chunked_attention" else {}))
        if v_dim != qk_dim:
            # multi-head latent attention after its up-projections: ordinary heads whose value head dim differs
            # from the query/key one. DeepSpeed's UlyssesSPAttentionHF has one head size for q, k and v (its
            # all-to-all shapes), so the values go zero-padded to the query/key dim (as transformers' own flash
            # path for MLA does) and the padding is cut from the output: exact (zero value columns give zero
            # output columns, and their gradient is dropped)
            value = torch.nn.functional.pad(value, (0, qk_dim - v_dim))
        out, weights = uattn(module, query, key, value, None, *args, **kwargs)
        # DeepSpeed returns [b, s_local, heads * head_dim]; transformers' attention functions return [b, s, heads,
        # head_dim], which some modules rely on (GPT-2 reshapes by its last two dims, Beam and HRM gate per head)
        out = out.view(out.shape[0], out.shape[1], query.shape[1], value.shape[-1])
        return (out[..., :v_dim] if v_dim != qk_dim else out), weights

    # Same interception as DeepSpeed's register_with_transformers (the core key is overridden, which
    # keeps every HF branch that tests `_attn_implementation == "flash_attention_2"` etc.), per module.
    return registry.install(model, impl, ulysses_attention, "DeepSpeed Ulysses")


__all__ = ["install_ulysses", "pattern_core"]
