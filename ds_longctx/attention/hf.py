"""Hooking untied Ulysses attention into Hugging Face models.

Two ways in, picked by ``long_context.attention.fuse_projections`` (resolved in the spec, ``spec.fused``: 'auto'
is fused where ds_longctx.models has the architecture):

* fused: the attention module's forward is replaced for the architectures in
  ``ds_longctx.models`` (Llama, Mistral, Qwen2, Qwen3). The layer's input RMSNorm, q/k/v projections,
  attention and o_proj run as one Function (attention/block.py): q/k/v are projected per head chunk
  from the layer input, so the full q/k/v, the normed input and the full attention-output gradient
  never exist.
* attention-function level: any model that calls transformers' attention interface. HF
  computes q/k/v for all heads (local sequence), we chunk the all-to-all + kernel over heads.

The model sees per-rank local position_ids (the loader shards input_ids and position_ids), so HF's
rotary embedding yields local cos/sin; attention is causal over the gathered sequence (with the layer's
sliding window and soft-cap from models.windows.layer_attention, applied by the kernel per stage: a
kernel that cannot apply them is replaced by the banded one under 'auto', refused when named), or within
each document when the forward patch_model installs passes the batch's documents
(``documents.DOCS_KWARG``; HF's packed mask is then redundant and ignored). Without documents a
causal mask built by HF for the local shard is ignored; any other mask (padding, packed documents)
is an error, because causal-over-the-full-sequence would silently be wrong for it.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import types
import weakref
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ..config import FUSE_KEY, KERNEL_KEY
from ..errors import ConfigError, naming
from ..measure.simulation import holds_values
from ..models import (AttentionFacts, AttentionShape, attention_shape, facts_for, is_llama_style_rmsnorm, rms_norm,
                      rope_bshd, text_config)
from ..models.adapters import effective_linear, fused_adapter_problem
from ..models.windows import LayerAttention, layer_attention, not_runnable
from . import kernels, registry
from .block import untied_attention_block
from .documents import DOCS_KWARG, chunk_documents, is_no_mask
from .ring import ring_backend
from .untied import ProjectionSpec, Schedule, untied_attention_qkv

logger = logging.getLogger("ds_longctx")


@contextlib.contextmanager
def naming_kernel_key():
    """The kernels' refusals in the block (kernels.KernelError: a layer's window or soft-cap the configured
    kernel cannot apply, a build that drops them, another device's tensors) as the ConfigError naming
    ``long_context.attention.kernel``: the kernel name came from the config. Same verdict on every rank (one
    kernel name, one model config), raised before the layer's first all-to-all or at the kernel's first call."""
    with naming(KERNEL_KEY, kernels.KernelError):
        yield


@dataclass
class _State:
    group: object  # the group the heads are split over (the SP group; with a ring the Ulysses group, None at U 1)
    sp: int  # the whole SP degree (global length = local length x sp)
    heads_per_chunk: int
    kernel: str
    backend: kernels.KernelChoice  # the kernel name checked once at install, resolved once per device type
    schedule: Schedule  # built once at install for the model's head counts and the SP degree
    shape: Optional[AttentionShape] = None  # heads, KV heads, head_dim (models.attention_shape), read once
    facts: Optional[AttentionFacts] = None
    layers: Tuple = ()  # models.windows.layer_attention per layer_idx: sliding window, soft-cap, type
    ulysses: int = 0  # the heads' split degree: sp / ring (0: sp)
    ring_group: object = None  # the ring group (attention/ring.py) when ring > 1

    def attention(self, backend, global_len: int, docs):
        """(kernel, documents for the stage loop): the layer's kernel as is, or rung over the ring group (which then
        reads the documents itself)."""
        if self.ring_group is None:
            return backend, docs
        return ring_backend(backend, self.ring_group, global_len, docs), None


@dataclass(frozen=True)
class _FusedLayer:
    """What one attention module's fused forward needs that does not change between calls (built at install)."""
    spec: ProjectionSpec
    heads: int
    kv_heads: int


class UntiedInstall:
    """What :func:`install_untied` changed on one model; ``remove()`` puts it back."""

    def __init__(self):
        self.fused_modules = []      # (module, its class before) on the fused path
        self.leaf_class = None       # the attention class marked as a ZeRO-3 leaf, and the model
        self.model = None
        self.function_level = None   # registry.Installation on the attention-function path
        self.fused = False           # the fused path installed (the spec's 'auto' may meet adapters it cannot fuse)
        self.fused_off_because = None  # why 'auto' was not fused (a sentence), else None
        self.fused_norms = []        # (attention, its input norm) whose norm runs inside the attention block

    def remove(self) -> None:
        for m, cls in self.fused_modules:
            m.__class__ = cls
            m.__dict__.pop("forward", None)
            m.__dict__.pop("_ds_longctx_untied", None)
            m.__dict__.pop("_ds_longctx_fused", None)
        self.fused_modules = []
        for attn, norm in self.fused_norms:
            norm.__dict__.pop("forward", None)
            attn.__dict__.pop("_ds_longctx_input_norm", None)
        self.fused_norms = []
        if self.leaf_class is not None:
            from deepspeed.utils import unset_z3_leaf_modules

            unset_z3_leaf_modules(self.model, [self.leaf_class], raise_if_not_found=False)
            self.leaf_class = self.model = None
        if self.function_level is not None:
            self.function_level.remove()
            self.function_level = None



def _dropout_message(p) -> str:
    return (f"untied attention does not apply attention dropout (the model's attention_dropout is {p}); "
            "setting model.config.attention_dropout=0 trains without it, a different regularisation than the "
            "config asks for; to keep it, use long_context.attention.implementation 'ulysses' (transformers' "
            "attention function, dropout included, on full-attention layers) or 'none' at SP=1")


def install_untied(model, spec) -> UntiedInstall:
    """Patch ``model`` (a built HF PreTrainedModel, possibly ZeRO-3 partitioned) to use untied Ulysses.

    ``spec``: the :class:`ds_longctx.patching.spec.LongContextSpec` built for this model (its schedule, kernel, fused path,
    SP group and degree are used as given: checked when the spec was built, the model's attention pattern
    included). Runs no collectives (the planner calls it under a fake process group). Returns the undo handle.
    """
    tc = text_config(model.config)
    facts = spec.model
    shape = AttentionShape(facts.heads, facts.kv_heads, facts.head_dim)
    state = _State(group=spec.head_group, sp=spec.sp, ulysses=spec.ulysses, ring_group=spec.ring_group,
                   heads_per_chunk=spec.schedule.heads_per_chunk,
                   kernel=spec.kernel.name, backend=spec.kernel, schedule=spec.schedule, shape=shape,
                   layers=tuple(layer_attention(tc)))
    handle = UntiedInstall()
    fused = spec.fused
    if fused:
        problem = _fused_adapter_problem(model, tc, spec.layout.zero_stage)
        if problem is not None:
            if spec.config.attention.fuse_projections is True:
                raise ConfigError(FUSE_KEY, f"is true, but {problem}", f"set {FUSE_KEY} to false or 'auto' (the "
                                  "attention-function path calls the projection modules, adapters included)")
            logger.warning("ds_longctx: untied attention at the attention-function level, not fused (%s is 'auto' "
                           "and %s)", FUSE_KEY, problem)
            handle.fused_off_because = problem
            fused = False
    handle.fused = fused
    if fused:
        _install_fused(model, tc, state, handle)
    else:
        handle.function_level = _install_function_level(model, state)
    return handle


def _fused_adapter_problem(model, tc, zero_stage: int):
    """The first q/k/v/o projection whose forward the fused GEMMs cannot reproduce (a PEFT layer they cannot
    apply as a weight delta, models/adapters.py), as a sentence; None when every projection is fusable."""
    facts = facts_for(getattr(tc, "model_type", None))
    mod = importlib.import_module(f"transformers.models.{tc.model_type}.modeling_{tc.model_type}")
    cls = getattr(mod, facts.attention_class)
    for name, m in model.named_modules():
        if isinstance(m, cls):
            for proj in (facts.q, facts.k, facts.v, facts.o):
                problem = fused_adapter_problem(getattr(m, proj), f"{name}.{proj}", zero_stage)
                if problem is not None:
                    return problem
    return None


# ---------------------------------------------------------------------------------------------
# fused path
# ---------------------------------------------------------------------------------------------


def _install_fused(model, tc, state: _State, handle: UntiedInstall):
    model_type = getattr(tc, "model_type", None)
    facts = facts_for(model_type)  # the spec's fused path exists only for these (checks.check_against)
    mod = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    cls = getattr(mod, facts.attention_class)
    found = [m for m in model.modules() if isinstance(m, cls)]
    if not found:
        raise ConfigError(FUSE_KEY, f"no {facts.attention_class} modules found in the {model_type} model",
                          f"set {FUSE_KEY} to false")
    state.facts = facts
    for m in found:
        layer = _fused_layer(m, facts)
        handle.fused_modules.append((m, type(m)))
        m._ds_longctx_untied = state
        m._ds_longctx_fused = layer
        m.forward = types.MethodType(_fused_forward, m)
        m.__class__ = _positional_call_class(type(m))
    handle.fused_norms = _fuse_input_norms(model, found)
    try:
        from deepspeed.utils import set_z3_leaf_modules
    except ImportError:  # no DeepSpeed, no ZeRO-3 (the single-GPU bench)
        return
    # the stage loop reads q/k/v/o (and q/k-norm) weights directly, not through child modules, so
    # ZeRO-3 must gather the whole attention module at its forward and again for its backward
    set_z3_leaf_modules(model, [cls])
    handle.leaf_class, handle.model = cls, model


def _fuse_input_norms(model, attentions):
    """Move each decoder layer's input RMSNorm into its attention block Function (attention/block.py):
    the norm module's forward becomes the identity and the attention normalises its input itself, so
    the normed input is never saved (backward re-derives it per row tile). Only Llama-style norms (the
    formula the block implements); the module, its weight and state_dict stay where they were. Returns the
    (attention, norm) pairs changed, for the install handle's remove()."""
    fused = []
    owners = {id(a): layer for layer in model.modules() for a in layer.children() if id(a) in
              {id(x) for x in attentions}}
    for a in attentions:
        layer = owners.get(id(a))
        norm = getattr(layer, "input_layernorm", None) if layer is not None else None
        if norm is None or not is_llama_style_rmsnorm(norm) or "forward" in norm.__dict__:
            continue
        norm.forward = _norm_fused_away
        # in __dict__, not through Module.__setattr__: the norm must not become a submodule of the
        # attention (parameter names, state_dict and ZeRO-3's module tree stay as they were)
        a.__dict__["_ds_longctx_input_norm"] = norm
        fused.append((a, norm))
    return fused


def _norm_fused_away(hidden_states):
    return hidden_states  # the attention block applies this norm (see _fuse_input_norms)


_CALL_CLASSES = {}


def _positional_call_class(cls):
    """Same class, but ``hidden_states`` passed by keyword is moved to the first positional argument.

    DeepSpeed reduces a ZeRO-3 leaf module's grads from a full backward hook, and such hooks see
    only positional inputs. HF decoder layers call attention with keywords only, so the hook would
    fire on the output grads, before any weight grad exists (it then reduces zeros and the real
    grads hit partitioned params). With hidden_states positional it fires after the input grad.
    """
    if getattr(cls, "_ds_longctx_positional", False):
        return cls
    if cls not in _CALL_CLASSES:
        def __call__(self, *args, **kwargs):
            if not args and "hidden_states" in kwargs:
                args = (kwargs.pop("hidden_states"),)
            return torch.nn.Module.__call__(self, *args, **kwargs)

        def extra_repr(self):
            st = self.__dict__.get("_ds_longctx_untied")
            base = cls.extra_repr(self)
            if st is None:
                return base
            mine = (f"ds_longctx: fused untied Ulysses (sp={st.sp}, heads_per_chunk={st.heads_per_chunk}, "
                    f"kernel={st.kernel})")
            return f"{base}, {mine}" if base else mine

        _CALL_CLASSES[cls] = type(cls.__name__, (cls,), {"__call__": __call__, "extra_repr": extra_repr,
                                                         "__module__": cls.__module__,
                                                         "__qualname__": cls.__qualname__,
                                                         "_ds_longctx_positional": True})
    return _CALL_CLASSES[cls]


def _sliding_window(module, facts: AttentionFacts):
    attr = facts.sliding_window_attr
    if attr is None:
        return None
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _fused_layer(module, facts: AttentionFacts) -> _FusedLayer:
    """The per-module constants of the fused forward: projection spec (q/k-norm eps), head counts, and the
    check of q_proj's rows against the config (on the full shape: ``ds_shape`` under ZeRO-3)."""
    qn = getattr(module, facts.q_norm) if facts.q_norm else None
    eps = getattr(qn, "variance_epsilon", getattr(qn, "eps", 1e-6)) if qn is not None else None
    spec = ProjectionSpec(head_dim=module.head_dim, rope=rope_bshd,
                          norm=(lambda t, w, eps=eps: rms_norm(t, w, eps)) if qn is not None else None)
    shape_ = attention_shape(module.config)
    heads, kv_heads = shape_.heads, shape_.kv_heads
    w = getattr(module, facts.q).weight
    shape = tuple(getattr(w, "ds_shape", None) or w.shape)
    H = shape[0] // module.head_dim if len(shape) == 2 and shape[0] * shape[1] else None
    if H is not None and H != heads:
        raise ValueError(f"untied attention: q_proj has {H} heads, config says {heads}")
    return _FusedLayer(spec=spec, heads=heads, kv_heads=kv_heads)


def _fused_forward(self, hidden_states, position_embeddings=None, attention_mask=None, *args, **kwargs):
    state: _State = self._ds_longctx_untied
    layer: _FusedLayer = self._ds_longctx_fused
    facts = state.facts
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is not None and not self.training:
        raise NotImplementedError("untied Ulysses attention does not fill a KV cache; call the model with "
                                  "use_cache=False (it is a training path)")
    if position_embeddings is None:
        raise ValueError("untied attention needs position_embeddings (cos, sin) from the model's rotary embedding")
    b, s, _ = hidden_states.shape
    docs = kwargs.get(DOCS_KWARG)
    # the layer's window / soft-cap (from the config; the module's own attribute must agree), applied by the
    # kernel per stage; before the mask check: HF's mask of a windowed layer is not plain causal
    with naming_kernel_key():
        backend, window = layer_backend(state, self, s * state.sp, hidden_states.device,
                                        _sliding_window(self, facts), None)
    if docs is None:  # with documents HF's (packed) mask is redundant: attention runs per document
        _check_mask(attention_mask, s, window)
    if self.training and getattr(self, "attention_dropout", 0.0):
        raise ValueError(_dropout_message(self.attention_dropout))
    cos, sin = position_embeddings
    # what each projection's forward applies: its own weight, or with PEFT LoRA the base weight plus the active
    # adapters' deltas (models/adapters.py; the stage loop runs GEMMs, it never calls these modules)
    (wq, bq), (wk, bk), (wv, bv), (wo, bo) = (effective_linear(getattr(self, n))
                                              for n in (facts.q, facts.k, facts.v, facts.o))
    qn = getattr(self, facts.q_norm) if facts.q_norm else None
    kn = getattr(self, facts.k_norm) if facts.k_norm else None
    norm = self.__dict__.get("_ds_longctx_input_norm")
    norm_w = norm.weight if norm is not None else None
    if norm_w is not None and norm_w.numel() != hidden_states.shape[-1]:
        raise ConfigError("zero_optimization.stage3_param_persistence_threshold",
                          f"the input norm weight fused into untied attention is partitioned by ZeRO-3 "
                          f"({norm_w.numel()} of {hidden_states.shape[-1]} elements here)",
                          f"keep norm weights persistent: a threshold >= the hidden size {hidden_states.shape[-1]} "
                          "(DeepSpeed's default 1e5 is)")
    ring_kernel, stage_docs = state.attention(backend, s * state.sp, docs)
    # norm + attention + o_proj as one Function (attention/block.py); o_proj's module is not called, its
    # weights are gathered with the attention module (a ZeRO-3 leaf)
    with naming_kernel_key():  # a kernel's refusal at its first call (kernels.verify_native_pattern, ...)
        out = untied_attention_block(
            hidden_states, cos.to(hidden_states.dtype), sin.to(hidden_states.dtype), wq, wk, wv,
            wo, schedule=state.schedule, spec=layer.spec, norm_weight=norm_w,
            norm_eps=norm.variance_epsilon if norm is not None else 1e-6, bq=bq, bk=bk, bv=bv,
            bo=bo, q_norm=qn.weight if qn is not None else None, k_norm=kn.weight if kn is not None else None,
            group=state.group, backend=ring_kernel, causal=True, scale=self.scaling, docs=stage_docs)
    return out, None


# ---------------------------------------------------------------------------------------------
# attention-function path
# ---------------------------------------------------------------------------------------------


def _install_function_level(model, state: _State) -> registry.Installation:
    impl = getattr(model.config, "_attn_implementation", None)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if impl is None or impl == "eager" or impl not in ALL_ATTENTION_FUNCTIONS:
        raise ConfigError("model.config._attn_implementation",
                          f"{impl!r} does not go through transformers' attention interface",
                          "load the model with attn_implementation='sdpa' (or flash_attention_2/3); a model with "
                          "no SDPA path (Gemma2: attention soft-capping) trains with "
                          "attn_implementation='flex_attention' under long_context.attention.implementation "
                          "'ulysses'")

    def untied(module, query, key, value, attention_mask, *args, **kwargs):
        return _function_level_attention(state, module, query, key, value, attention_mask, *args, **kwargs)

    # HF looks the function up by name: the registry routes only this model's modules to it
    return registry.install(model, impl, untied, "untied Ulysses")


def _function_level_attention(state: _State, module, query, key, value, attention_mask, dropout=0.0,
                              scaling=None, is_causal=None, sliding_window=None, softcap=None, **kwargs):
    """HF layout in: query [b, H, s, d], key/value [b, G, s, d]; out [b, s, H, d], weights None."""
    if dropout:
        raise ValueError(_dropout_message(dropout))
    if is_causal is False or getattr(module, "is_causal", True) is False:
        raise ValueError("untied attention is causal-only; this attention module is bidirectional")
    s = query.shape[2]
    if key.shape[2] != s:
        raise NotImplementedError("untied attention needs as many keys as queries (no KV cache); "
                                  "call the model with use_cache=False")
    docs = kwargs.get(DOCS_KWARG)
    idx = getattr(module, "layer_idx", None)
    lf = state.layers[idx] if isinstance(idx, int) and 0 <= idx < len(state.layers) else LayerAttention()
    chunked = lf.kind == "chunked_attention" and lf.chunk is not None
    if chunked and lf.chunk < s * state.sp:  # causal within every chunk (and document): the documents machinery
        docs = chunk_documents(docs, query.shape[0], s * state.sp, lf.chunk)
    with naming_kernel_key():
        backend, window = layer_backend(state, module, s * state.sp, query.device, sliding_window, softcap,
                                        chunked_by_documents=chunked)
    if kwargs.get(DOCS_KWARG) is None:  # with documents HF's (packed) mask is redundant: attention runs per document
        _check_mask(attention_mask, s, window, **({"chunk": lf.chunk} if chunked else {}))
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    v_dim = v.shape[-1]
    if v_dim != q.shape[-1]:
        if k.shape[-1] != q.shape[-1] or v_dim > q.shape[-1]:
            raise ValueError(f"untied attention: query/key/value head dims {q.shape[-1]}/{k.shape[-1]}/{v_dim}; "
                             "only a value head dim at most the query/key one (multi-head latent attention) runs")
        # multi-head latent attention after its up-projections: ordinary heads whose value head dim is below the
        # query/key one. The stage buffers have one head dim, so the values go zero-padded to it (as transformers'
        # own flash path for MLA does) and the padding is cut from the output: exact (zero value columns give zero
        # output columns, and their gradient is dropped); it moves qk/v - 1 more value bytes through the all-to-all
        v = torch.nn.functional.pad(v, (0, q.shape[-1] - v_dim))
    sched = state.schedule
    if (q.shape[2], k.shape[2]) != (sched.heads, sched.kv_heads):
        # the install's schedule is for the config's head counts; a module attending over others gets its own
        sched = Schedule(q.shape[2], k.shape[2], state.ulysses or state.sp, state.heads_per_chunk)
    with naming_kernel_key():  # a kernel's refusal at its first call (kernels.verify_native_pattern, ...)
        # attention sinks (s_aux, GPT-OSS): a per-head logit in the softmax denominator, applied per stage from the
        # kernel's LSE (untied.stage_sinks)
        ring_kernel, stage_docs = state.attention(backend, s * state.sp, docs)
        out, _ = untied_attention_qkv(q, k, v, sched, group=state.group, backend=ring_kernel, causal=True,
                                      scale=scaling if scaling is not None else q.shape[-1] ** -0.5,
                                      docs=stage_docs, sinks=kwargs.get("s_aux"))
    return (out[..., :v_dim] if v_dim != out.shape[-1] else out), None


# ---------------------------------------------------------------------------------------------
# masks
# ---------------------------------------------------------------------------------------------

_LAST_MASK = [None, None, None]  # weakref to the last mask checked, its version, verdict


_UNSET = object()


def layer_backend(state: _State, module, global_len: int, device, hf_window=_UNSET, hf_softcap=_UNSET,
                  chunked_by_documents: bool = False):
    """(backend, the layer's window or None). The kernel backend of ``module``'s layer: the install's kernel
    with the layer's sliding window and soft-cap bound (kernels.KernelChoice.for_layer), from the config
    facts read at install. What the module or transformers passes (``hf_window``, ``hf_softcap``) must agree
    with them. A windowed layer runs its windowed kernel at every length (a window covering the gathered
    sequence is exactly causal attention): which kernel signatures a rank meets must not depend on its batch's
    length, or 'auto''s measuring collective (kernels.MeasuredChoice) would pair different layers of ranks
    with different lengths. Same verdict on every rank, raised before the layer's first all-to-all.
    ``chunked_by_documents``: the caller runs a chunked layer's chunks as documents (the function-level path)."""
    idx = getattr(module, "layer_idx", None)
    layers = state.layers
    facts = layers[idx] if isinstance(idx, int) and 0 <= idx < len(layers) else LayerAttention()
    if not (chunked_by_documents and facts.kind == "chunked_attention") and not facts.runnable(global_len):
        raise not_runnable(idx, facts, global_len, "untied_ulysses")
    for what, hf, ours in (("sliding_window", hf_window, facts.passed_window), ("softcap", hf_softcap, facts.softcap)):
        if hf is not _UNSET and (hf or None) != ours:
            raise ConfigError("model.config", f"layer {idx}: the model applies {what}={hf!r}, the config reads as "
                              f"{ours!r}", "report this model: ds_longctx.models.windows reads its attention "
                              "pattern wrongly")
    where = f"layer {idx}" if idx is not None else "this layer"
    return state.backend.for_layer(device, facts.window, facts.softcap, where), facts.window


def _check_mask(mask, s_local, window=None, chunk=None):
    """Accept None or the plain causal mask of the local shard (with the layer's sliding ``window``, as HF
    builds it for a windowed layer: the kernel applies the window over the gathered sequence; with a chunked
    layer's ``chunk``, HF's chunked mask of the shard: the chunks run as documents over the gathered sequence);
    reject padding/packed masks."""
    if mask is None or is_no_mask(mask):  # ds_longctx's forward read the batch's documents (documents.no_mask)
        return
    if isinstance(mask, torch.Tensor) and not holds_values(mask):
        return  # the planner's simulated step (no values): HF built it from one contiguous sample
    block_mask = type(mask).__name__ == "BlockMask" and callable(getattr(mask, "mask_mod", None))
    if not isinstance(mask, torch.Tensor) and not block_mask:
        raise ValueError(f"untied attention got a {type(mask).__name__} mask; only causal attention is supported")
    ref, version, verdict = _LAST_MASK
    key = (getattr(mask, "_version", None), window, chunk)
    if ref is not None and ref() is mask and version == key:  # one mask is shared by layers
        if not verdict:
            raise ValueError(_BAD_MASK)
        return
    if block_mask:  # flex_attention (a model with no SDPA path: GPT-OSS): HF's BlockMask of the local shard
        ok = _block_mask_is(mask, s_local, window, chunk)
    elif mask.dim() == 2:  # flash-attention style padding mask [b, s]: must be all ones
        ok = bool(mask.bool().all())
    elif mask.dim() == 4:
        allowed = mask if mask.dtype == torch.bool else (mask == 0)
        sq, sk = allowed.shape[-2:]
        causal = torch.ones(sq, sk, dtype=torch.bool, device=mask.device).tril(sk - sq)
        if window:
            causal &= ~torch.ones(sq, sk, dtype=torch.bool, device=mask.device).tril(sk - sq - window)
        if chunk:
            qi = torch.arange(sk - sq, sk, device=mask.device)
            causal &= (qi[:, None] // chunk) == (torch.arange(sk, device=mask.device)[None, :] // chunk)
        ok = bool((allowed == causal).all())
    else:
        ok = False
    _LAST_MASK[:] = [weakref.ref(mask), key, ok]
    if not ok:
        raise ValueError(_BAD_MASK)


def _block_mask_is(mask, s_local: int, window=None, chunk=None) -> bool:
    """Whether a flex_attention BlockMask allows exactly the causal (``window``, ``chunk``) pattern of an
    ``s_local``-token shard for every sample: its mask_mod evaluated on every (query, key) pair, in row tiles (the
    s^2 evaluations transformers' create_block_mask made building it; memory one tile)."""
    if tuple(mask.seq_lengths) != (s_local, s_local):
        return False
    mm, dev = mask.mask_mod, mask.kv_num_blocks.device
    kv = torch.arange(s_local, device=dev)
    zero = torch.zeros((), dtype=torch.long, device=dev)
    tile = max(1, (1 << 22) // s_local)
    for b in range(mask.kv_num_blocks.shape[0]):
        for q0 in range(0, s_local, tile):
            qi = torch.arange(q0, min(q0 + tile, s_local), device=dev)[:, None]
            want = kv[None, :] <= qi
            if window:
                want &= kv[None, :] > qi - window
            if chunk:
                want &= (qi // chunk) == (kv[None, :] // chunk)
            got = mm(zero + b, zero, qi, kv[None, :])
            if not bool((torch.as_tensor(got, device=dev).bool().expand_as(want) == want).all()):
                return False
    return True


_BAD_MASK = ("ds_longctx's attention got an attention mask that is not plain causal (padding, packed sequences, or "
             "a mask or score bias the model's attention module builds itself); it computes causal attention over the "
             "whole gathered sequence (with the layer's window) unless given the documents: for a model that builds "
             "its own mask, train at sequence_parallel_size 1 with long_context.attention.implementation 'none'; "
             "for padding or packing, call the "
             "model patched by ds_longctx.initialize (engine(**batch)) with batches from ds_longctx.data.shard_batch, "
             "which turns packed position_ids and right padding into per-document attention")


__all__ = ["install_untied"]
