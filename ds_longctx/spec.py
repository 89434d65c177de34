"""``LongContextSpec``: everything patching a model needs, resolved and checked once, then trusted.

Built once on every rank (:func:`build_spec`) from the parsed ``long_context`` section
(``config.LongContextConfig``, "auto" values already resolved), the rank :class:`~ds_longctx.layout.Layout`
(with the SP process group carried beside it), the model's facts (heads, KV heads, head_dim, layers,
hidden, vocab), the untied attention :class:`~ds_longctx.attention.untied.Schedule` and the chosen kernel
(:class:`~ds_longctx.attention.kernels.KernelChoice`). ``patch.patch_model``, the installs
(``attention.hf.install_untied``, ``attention.ulysses.install_ulysses``, ``memory.apply_memory_stack``), the
planner's simulation and the GPU benches take the spec and trust it: nothing below re-derives the SP
degree from the group or re-checks ``heads_per_chunk`` or the kernel name.

Where each value is checked (once):

* the section's own keys: pydantic and ``config.parse``;
* against the model and the world (SP degree vs heads, ``heads_per_chunk`` dividing the heads per rank,
  windows, shard counts): ``config.check_against``, called here and nowhere else on the patch path;
* the kernel name against this machine: ``config.check_kernel``, called here;
* ``Schedule.__post_init__`` keeps its ValueError as the op's own invariant for direct callers of the
  attention functions (never reached through a spec: the check above ran first).

Pure: no collectives (the group is only carried), so every rank reaches the same verdict.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from .config import LongContextConfig, check_against, check_kernel
from .layout import Layout


@dataclass(frozen=True)
class ModelFacts:
    """The model's shape as ds_longctx reads it (``models.attention_shape`` + ``text_config``)."""
    heads: int
    kv_heads: int
    head_dim: int
    layers: Optional[int] = None
    hidden: Optional[int] = None
    vocab: Optional[int] = None

    @classmethod
    def of(cls, model_config) -> "ModelFacts":
        from .models import attention_shape, text_config

        shape = attention_shape(model_config)
        tc = text_config(model_config)
        ints = {k: getattr(tc, a, None) for k, a in (("layers", "num_hidden_layers"), ("hidden", "hidden_size"),
                                                     ("vocab", "vocab_size"))}
        return cls(heads=shape.heads, kv_heads=shape.kv_heads, head_dim=shape.head_dim,
                   **{k: v if isinstance(v, int) else None for k, v in ints.items()})


@dataclass(frozen=True)
class LongContextSpec:
    """The resolved, checked long-context setup of one rank (frozen: "auto" yields a new spec).

    ``config``: a private copy of the parsed section (no "auto" ``heads_per_chunk``); ``layout``: world,
    SP/DP degrees and ranks, ZeRO stage, the SP loss's gradient scale; ``group``: the SP process group (None
    at SP 1; carried, never queried for its size); ``model``: the model's facts (None when not read);
    ``schedule`` and ``kernel``: the untied attention's head schedule and kernel (None unless
    ``attention.implementation`` is 'untied_ulysses'); ``mlp_shards``/``loss_shards``: the tiled MLP /
    loss shard counts (an int, "auto": agreed at run time from the local length, or None when off).
    """
    config: LongContextConfig
    layout: Layout
    group: Any = None
    model: Optional[ModelFacts] = None
    schedule: Any = None   # attention.untied.Schedule
    kernel: Any = None     # attention.kernels.KernelChoice
    mlp_shards: Any = None
    loss_shards: Any = None
    sequence_length: Optional[int] = None

    @property
    def sp(self) -> int:
        return self.layout.sp

    @property
    def dp(self) -> int:
        return self.layout.dp

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
    def owns_attention(self) -> bool:
        """Attention is ours (reads the batch's documents): untied, or DeepSpeed's Ulysses at SP > 1."""
        impl = self.config.attention.implementation
        return impl == "untied_ulysses" or (impl == "ulysses" and self.sp > 1)

    def with_group(self, group) -> "LongContextSpec":
        """The same spec carrying the SP ``group`` (built after every check: creating it is a collective)."""
        return dataclasses.replace(self, group=group)

    def describe(self) -> str:
        a = self.config.attention
        out = f"{self.layout.describe()} attention={a.implementation}"
        if self.schedule is not None:
            out += f"(heads_per_chunk={self.schedule.heads_per_chunk}, kernel={self.kernel.name})"
        return out


# the "auto" values the planner resolves at initialize, and when the installs would use them
_RESOLVED_AT_INITIALIZE = (
    ("attention.heads_per_chunk", lambda lc: lc.attention.implementation == "untied_ulysses"),
    ("activation_checkpointing.keep_attention_output", lambda lc: lc.activation_checkpointing.enabled),
    ("activation_checkpointing.keep_on_device", lambda lc: lc.activation_checkpointing.enabled),
)


def build_spec(lc: LongContextConfig, model_config=None, layout: Optional[Layout] = None, group=None,
               sequence_length: Optional[int] = None, check: str = "world") -> LongContextSpec:
    """The one builder of a :class:`LongContextSpec` (``initialize``, ``patch_model``'s config form, the
    planner and the benches all come through here).

    ``layout`` defaults to the world of one SP group (``world = sp``, rank 0, ZeRO 0, grad scale 1).
    Raises ``ConfigError`` (naming the key and the fix) for anything the model, the world or this
    machine cannot run; "auto" ``heads_per_chunk`` must have been resolved first (``initialize`` does it with
    the planner).

    ``check`` says what is checked here, so that each value is checked once on every path:

    * ``"world"``: ``config.check_against`` (model and world, ``heads_per_chunk`` included): ``initialize``;
    * ``"heads"``: ``heads_per_chunk`` only: ``initialize`` after the planner resolved "auto" (check_against
      ran before, with "auto" unresolved), and a direct ``patch_model(model, lc, group)`` (no world check, as
      before: its attention refuses windows per layer at run time);
    * ``"done"``: the caller ran ``check_against`` on this config for this world (the planner's
      ``Planner.run``).

    The kernel name is checked here on every path (``config.check_kernel``).
    """
    if check not in ("world", "heads", "done"):
        raise ValueError(f"build_spec: check={check!r}, expected 'world', 'heads' or 'done'")
    from .config import check_heads_per_chunk
    from .errors import ConfigError

    sp = lc.sequence_parallel_size
    if layout is None:
        layout = Layout(world=sp, sp=sp)
    if layout.sp != sp:
        raise ConfigError("sequence_parallel_size", f"is {sp} but the layout has SP {layout.sp}",
                          "build the spec from the same config the SP groups were built for")
    att = lc.attention
    for key, used in _RESOLVED_AT_INITIALIZE:
        section, name = key.split(".")
        if getattr(getattr(lc, section), name) == "auto" and used(lc):
            raise ConfigError(f"long_context.{key}", "'auto' is resolved by ds_longctx.initialize (the planner, for "
                              "this machine's budgets) and reached the model unresolved", "go through "
                              "ds_longctx.initialize, or resolve it with ds_longctx.planner.resolve_auto, or give a "
                              "value")
    if check == "world":
        check_against(lc, model_config, layout.world, sequence_length)
    needs_facts = att.implementation == "untied_ulysses" or (att.implementation == "ulysses" and sp > 1)
    facts = ModelFacts.of(model_config) if needs_facts and model_config is not None else None
    schedule = kernel = None
    if att.implementation == "untied_ulysses":
        from .attention.kernels import KernelChoice
        from .attention.untied import Schedule

        if facts is None:
            raise ConfigError("model.config", "is needed by untied attention (heads, KV heads)",
                              "patch a Hugging Face model (with a config)")
        if check == "heads":
            check_heads_per_chunk(att.heads_per_chunk, facts.heads, facts.kv_heads, sp)
        kernel = KernelChoice(check_kernel(att.kernel))
        schedule = Schedule(facts.heads, facts.kv_heads, sp, att.heads_per_chunk)
    return LongContextSpec(config=lc.model_copy(deep=True), layout=layout, group=group, model=facts,
                           schedule=schedule, kernel=kernel,
                           mlp_shards=lc.tiled_mlp.shards if lc.tiled_mlp.enabled else None,
                           loss_shards=lc.tiled_loss.shards if lc.tiled_loss.enabled else None,
                           sequence_length=sequence_length if sequence_length is not None else lc.sequence_length)


def spec_for_group(lc: LongContextConfig, model_config=None, group=None, grad_scale: float = 1.0) -> LongContextSpec:
    """A spec for the public ``patch_model(model, lc, group, grad_scale)`` form (no world check, as before:
    see :func:`build_spec`'s ``check_world``): the SP degree is the group's size (None: 1), the world that of
    the default process group when the group divides it."""
    import torch.distributed as dist

    sp = 1 if group is None else dist.get_world_size(group)
    if sp != lc.sequence_parallel_size:
        lc = lc.model_copy(deep=True)
        lc.sequence_parallel_size = sp
    live = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if live else sp
    world = world if world % sp == 0 else sp
    layout = Layout(world=world, sp=sp, rank=dist.get_rank() if live else 0, grad_scale=grad_scale)
    return build_spec(lc, model_config, layout, group, check="heads")


def spec_for_attention(attn_cfg, model_config, group=None) -> LongContextSpec:
    """A spec for the ``install_untied(model, attn_cfg, group)`` form: the attention section alone."""
    return spec_for_group(LongContextConfig(attention=attn_cfg), model_config, group)


__all__ = ["LongContextSpec", "ModelFacts", "build_spec", "spec_for_attention", "spec_for_group"]
