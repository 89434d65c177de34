"""``LongContextSpec``: everything patching a model needs, resolved and checked once, then trusted.

Built once on every rank (:func:`build_spec`) from the parsed ``long_context`` section
(``config.LongContextConfig`` with its ``config.AUTO_KEYS`` resolved: ``initialize`` has the planner do it, see
``config.with_values``), the rank :class:`~ds_longctx.dist.layout.Layout` (with the SP process group carried beside
it) and the model's config. The spec holds every count the run uses as a plain int, resolved here and nowhere
else: the model's facts (heads, KV heads, head_dim, layers, hidden, vocab), the untied attention's
:class:`~ds_longctx.attention.untied.Schedule` (heads per chunk) and kernel
(:class:`~ds_longctx.attention.kernels.KernelChoice`), whether its projections are fused, the checkpointed
layers whose input stays on the device, those that keep their attention output, and the tile shard counts.
``patch.patch_model``, the installs (``attention.hf.install_untied``, ``attention.ulysses.install_ulysses``,
``memory.apply_memory_stack``), the planner and train.py read these fields and re-derive none of them.

Where each value is checked (once, here):

* the section's own keys: pydantic and ``config.parse`` (before the spec);
* against the model and the world (SP degree vs heads, ``heads_per_chunk`` dividing the heads per rank,
  windows, shard counts, layer counts, the fused path's architecture): ``checks.check_against``;
* the kernel name against this machine: ``checks.check_kernel``;
* ``Schedule.__post_init__`` keeps its ValueError as the op's own invariant for direct callers of the
  attention functions (never reached through a spec: the check above ran first).

Pure: no collectives (the group is only carried), so every rank reaches the same verdict.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from ..attention.kernels import KernelChoice
from ..attention.untied import Schedule
from .checks import check_against, check_kernel, ring_degree_for
from ..config import SECTION, LongContextConfig, auto_keys
from ..errors import ConfigError
from ..dist.layout import Layout
from ..models import AttentionShape, attention_shape, facts_for, text_config


@dataclass(frozen=True)
class ModelFacts:
    """The model's shape as ds_longctx reads it (``models.attention_shape`` + ``text_config``). ``heads``,
    ``kv_heads`` and ``head_dim`` are read only where ds_longctx splits attention (a model without heads trains
    with transformers' own attention at SP 1): None otherwise."""
    heads: Optional[int] = None
    kv_heads: Optional[int] = None
    head_dim: Optional[int] = None
    layers: Optional[int] = None
    hidden: Optional[int] = None
    vocab: Optional[int] = None
    model_type: Optional[str] = None
    # where the config gives attention shapes per layer (Gemma 4): each layer's (models.AttentionShape); then heads,
    # kv_heads and head_dim above are the largest over the layers. () where every layer has the one shape
    layer_shapes: tuple = ()

    def layer_shape(self, idx):
        """Layer ``idx``'s attention shape (heads, kv_heads, head_dim)."""
        return AttentionShape(self.heads, self.kv_heads, self.head_dim, self.layer_shapes).of_layer(idx)

    def distinct_shapes(self) -> tuple:
        """Every attention shape some layer has, once each."""
        return AttentionShape(self.heads, self.kv_heads, self.head_dim, self.layer_shapes).distinct()

    @classmethod
    def of(cls, model_config, attention: bool = True) -> "ModelFacts":
        tc = text_config(model_config)
        ints = {k: getattr(tc, a, None) for k, a in (("layers", "num_hidden_layers"), ("hidden", "hidden_size"),
                                                     ("vocab", "vocab_size"))}
        shape = attention_shape(model_config) if attention else None
        return cls(heads=shape and shape.heads, kv_heads=shape and shape.kv_heads, head_dim=shape and shape.head_dim,
                   model_type=getattr(tc, "model_type", None), layer_shapes=shape.layers if shape else (),
                   **{k: v if isinstance(v, int) and not isinstance(v, bool) else None for k, v in ints.items()})


@dataclass(frozen=True)
class LongContextSpec:
    """The resolved, checked long-context setup of one rank (frozen).

    ``config``: a private copy of the parsed section, every ``config.AUTO_KEYS`` value resolved; ``layout``: world,
    SP/DP degrees and ranks, ZeRO stage, the SP loss's gradient scale; ``group``: the SP process group (None at
    SP 1; carried, never queried for its size); ``model``: the model's facts (None when built without a model
    config); ``schedule`` and ``kernel``: the untied attention's head schedule and kernel, ``fused``: whether its
    q/k/v projections run inside the stage loop (``fuse_projections`` resolved; all three only under
    'untied_ulysses'); ``keep_on_device``: with offload, the last this-many checkpointed layers keep their input
    on the device (else 0); ``offloaded_layers``: the checkpointed layers whose input goes to the offload target
    (the first ``layers - keep_on_device``; 0 without offload); ``kept_attention_layers``: the first this-many
    checkpointed layers keep their attention output and LSE (``keep_attention_output``; 0 when off);
    ``mlp_shards``/``loss_shards``: the tiled MLP / loss tile count (None: "auto", ceil(local rows / hidden) agreed
    per forward over every rank; meaningful where ``config.tiled_mlp`` / ``tiled_loss`` is enabled).
    """
    config: LongContextConfig
    layout: Layout
    group: Any = None
    model: Optional[ModelFacts] = None
    schedule: Optional[Schedule] = None
    kernel: Optional[KernelChoice] = None
    fused: bool = False
    keep_on_device: int = 0
    offloaded_layers: int = 0
    kept_attention_layers: int = 0
    mlp_shards: Optional[int] = None
    loss_shards: Optional[int] = None
    sequence_length: Optional[int] = None
    # Ulysses x ring (attention/ring.py): SP = ulysses x ring; the groups inside the SP group (None at ring 1: the
    # Ulysses group is then ``group`` itself)
    ring: int = 1
    ulysses_group: Any = None
    ring_group: Any = None

    @property
    def sp(self) -> int:
        return self.layout.sp

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def ulysses(self) -> int:
        """The Ulysses degree: SP / ring (the ranks that split the heads)."""
        return self.sp // self.ring

    @property
    def head_group(self):
        """The group the heads are split over (the Ulysses all-to-all): the SP group without a ring, else the Ulysses
        group (None when it is one rank: ring only)."""
        return self.group if self.ring == 1 else self.ulysses_group

    @property
    def grad_scale(self) -> float:
        return self.layout.grad_scale

    @property
    def attention(self):
        return self.config.attention

    @property
    def heads_per_chunk(self) -> Optional[int]:
        return self.schedule.heads_per_chunk if self.schedule is not None else None

    @property
    def offloaded_kept_attention_layers(self) -> int:
        """Of the offloaded layers (the first ones), those whose kept attention output goes with their input."""
        return min(self.kept_attention_layers, self.offloaded_layers)

    @property
    def owns_attention(self) -> bool:
        """Attention is ours (reads the batch's documents): untied, or DeepSpeed's Ulysses at SP > 1."""
        impl = self.config.attention.implementation
        return impl == "untied_ulysses" or (impl == "ulysses" and self.sp > 1)

    def with_group(self, group, ulysses_group=None, ring_group=None) -> "LongContextSpec":
        """The same spec carrying the SP ``group`` and, with a ring, its Ulysses and ring groups (built after every
        check: creating them is a collective)."""
        return dataclasses.replace(self, group=group, ulysses_group=ulysses_group, ring_group=ring_group)

    def describe(self) -> str:
        a = self.config.attention
        out = f"{self.layout.describe()} attention={a.implementation}"
        if self.ring > 1:
            out += f"(ulysses {self.ulysses} x ring {self.ring}, zigzag)"
        if self.schedule is not None:
            out += (f"(heads_per_chunk={self.schedule.heads_per_chunk}, kernel={self.kernel.name}, "
                    f"{'fused projections' if self.fused else 'attention-function level'})")
        return out


def build_spec(lc: LongContextConfig, model_config=None, layout: Optional[Layout] = None, group=None,
               sequence_length: Optional[int] = None) -> LongContextSpec:
    """The one builder of a :class:`LongContextSpec` (``initialize``, the planner, the benches and a direct
    ``patch_model`` all come through here): checks ``lc`` against the model, the world (``checks.check_against``)
    and this machine's kernels (``checks.check_kernel``), then resolves every count.

    ``layout`` defaults to the world of one SP group (``world = sp``, rank 0, ZeRO 0, grad scale 1); ``group``: the
    SP process group (None at SP 1); ``sequence_length``: the global length planned for (default
    ``lc.sequence_length``). Raises ``ConfigError`` (naming the key and the fix) for anything the model, the world or
    this machine cannot run, and for a ``config.AUTO_KEYS`` value left "auto" (``initialize`` resolves them with
    the planner first).
    """
    sp = lc.sequence_parallel_size
    if layout is None:
        layout = Layout(world=sp, sp=sp)
    if layout.sp != sp:
        raise ConfigError("sequence_parallel_size", f"is {sp} but the layout has SP {layout.sp}",
                          "build the spec from the same config the SP groups were built for")
    att, ac = lc.attention, lc.activation_checkpointing
    for key in auto_keys(lc):
        if key == "attention.heads_per_chunk" and att.implementation != "untied_ulysses":
            continue  # unused: nothing reads it
        if key.startswith("activation_checkpointing.") and not ac.enabled:
            continue
        raise ConfigError(f"{SECTION}.{key}", "'auto' is resolved by ds_longctx.initialize (the planner, for this "
                          "machine's budgets) and reached the model unresolved", "go through ds_longctx.initialize, "
                          "or resolve it with ds_longctx.planner.resolve_auto and config.with_values, or give a value")
    seq = sequence_length if sequence_length is not None else lc.sequence_length
    check_against(lc, model_config, layout.world, seq)
    ring = ring_degree_for(lc, model_config, seq) if model_config is not None else 1
    owns = att.implementation == "untied_ulysses" or (att.implementation == "ulysses" and sp > 1)
    if owns and model_config is None:
        raise ConfigError("model.config", f"is needed by attention.implementation {att.implementation!r} (heads, "
                          "KV heads, head_dim)", "build the spec with the Hugging Face model's config")
    facts = ModelFacts.of(model_config, attention=owns) if model_config is not None else None
    schedule = kernel = None
    fused = False
    if att.implementation == "untied_ulysses":
        kernel = KernelChoice(check_kernel(att.kernel))
        schedule = Schedule(facts.heads, facts.kv_heads, sp // ring, att.heads_per_chunk)
        fused = att.fuse_projections if isinstance(att.fuse_projections, bool) else \
            facts_for(facts.model_type) is not None
    layers = facts.layers if facts is not None else None
    offloading = ac.enabled and ac.offload != "none"
    keep_on_device = ac.keep_on_device if offloading else 0
    kept = 0
    if ac.enabled and ac.keep_attention_output not in (False, 0):
        if layers is None:
            raise ConfigError(f"{SECTION}.activation_checkpointing.keep_attention_output", "counts decoder layers and "
                              "the model config gives no num_hidden_layers", "give the model's config, or remove the key")
        kept = layers if ac.keep_attention_output is True else min(ac.keep_attention_output, layers)
    offloaded = max(0, layers - keep_on_device) if offloading and layers is not None else 0
    return LongContextSpec(config=lc.model_copy(deep=True), layout=layout, group=group, model=facts,
                           schedule=schedule, kernel=kernel, fused=fused, keep_on_device=keep_on_device,
                           offloaded_layers=offloaded, kept_attention_layers=kept,
                           mlp_shards=_shards(lc.tiled_mlp), loss_shards=_shards(lc.tiled_loss), sequence_length=seq,
                           ring=ring)


def _shards(tiled) -> Optional[int]:
    return tiled.shards if tiled.enabled and tiled.shards != "auto" else None


__all__ = ["LongContextSpec", "ModelFacts", "build_spec"]
