"""``initialize``: config -> checks -> SP groups -> patch model -> ``deepspeed.initialize`` -> data.

Drop-in for ``deepspeed.initialize``: same arguments, same four return values. Everything extra is
driven by the ``long_context`` section of the ds_config.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import os
import types
from typing import Any, Optional

import torch
import torch.distributed as dist

from . import comm
from .config import ConfigError, LongContextConfig, check_against, load_ds_config, parse
from .data import SPDataLoader
from .loss import causal_lm_loss_sum, shift_labels_of

logger = logging.getLogger("ds_longctx")


# ---------------------------------------------------------------------------------------------
# model patching (no collectives: the planner runs this under a fake process group)
# ---------------------------------------------------------------------------------------------


# the HF attention functions as they were before we overrode them (one override per process)
_ORIGINAL_ATTENTION: dict = {}


def _install_ulysses(model, group) -> None:
    """DeepSpeed's own Ulysses attention, built for our group instead of through
    ``register_with_transformers`` (which also creates the groups: we need them before, and the
    planner needs no collectives here)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = model.config._attn_implementation
    core = _ORIGINAL_ATTENTION.setdefault(impl, ALL_ATTENTION_FUNCTIONS[impl])
    tc = model.config.get_text_config()
    from .attention.documents import document_core

    uattn = UlyssesSPAttentionHF(
        attn=document_core(core, impl), batch_size=1, attn_head_count=tc.num_attention_heads,
        attn_head_size=getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
        kv_head_count=tc.num_key_value_heads, num_hidden_layers=tc.num_hidden_layers, process_group=group,
        seq_length_is_variable=True)
    uattn.core_attn_implementation = impl

    def ulysses_attention(module, query, key, value, attention_mask, *args, **kwargs):
        bs = query.shape[0]
        if uattn.batch_size != bs:  # DeepSpeed fixes the batch size at construction
            uattn.batch_size = bs
            for name in ("required_query_shape", "required_key_value_shape", "required_context_shape"):
                shape = list(getattr(uattn, name))
                shape[1] = bs
                setattr(uattn, name, torch.Size(shape))
        # HF built the mask for the local shard; attention runs causal over the gathered sequence.
        return uattn(module, query, key, value, None, *args, **kwargs)

    # Same interception as DeepSpeed's register_with_transformers: overriding the core key keeps
    # every HF branch that tests `_attn_implementation == "flash_attention_2"` etc.
    ALL_ATTENTION_FUNCTIONS[impl] = ulysses_attention


def _install_loss_forward(model, lc: LongContextConfig, group, grad_scale: float) -> None:
    """Make ``model(**batch).loss`` the SP-global token-mean loss computed from hidden states."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    sp_loss = comm.SPLoss(group=group, grad_scale=grad_scale)
    sp = comm.sp_world_size(group)
    tiled = lc.tiled_loss
    if tiled.enabled:
        from .memory.tiling import tiled_causal_lm_loss_sum
    orig_forward = model.forward

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, shift_labels=None,
                **kwargs):
        if labels is None and shift_labels is None:
            return orig_forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                **kwargs)
        if shift_labels is None:
            if sp > 1:
                raise ConfigError("batch.labels", "unshifted labels on a sequence shard lose the target of the "
                                  "shard's last token", "feed batches from the loader returned by "
                                  "ds_longctx.initialize, or shard with ds_longctx.data.shard_batch")
            shift_labels = shift_labels_of(labels)
        if sp > 1 and position_ids is None:
            raise ConfigError("batch.position_ids", "missing on a sequence shard (RoPE needs global positions)",
                              "feed batches from the loader returned by ds_longctx.initialize, or shard with "
                              "ds_longctx.data.shard_batch")
        kwargs.pop("use_cache", None)
        kwargs.pop("logits_to_keep", None)
        out = self.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 use_cache=False, **kwargs)
        hidden = out.last_hidden_state
        logits = None
        if tiled.enabled:
            loss_sum, count = tiled_causal_lm_loss_sum(hidden, self.lm_head, shift_labels, tiled.shards, group)
        else:
            loss_sum, count, logits = causal_lm_loss_sum(hidden, self.lm_head, shift_labels)
        return CausalLMOutputWithPast(loss=sp_loss(loss_sum, count), logits=logits)

    model.forward = types.MethodType(forward, model)


def patch_model(model, lc: LongContextConfig, group=None, grad_scale: float = 1.0) -> None:
    """Install the configured attention, memory stack and SP loss on a built HF causal LM.

    Issues no collectives, so the planner can run it under a fake process group.
    """
    if getattr(model, "_ds_longctx_patched", False):
        raise RuntimeError("model is already patched by ds_longctx (initialize it once)")
    impl = lc.attention.implementation
    sp = comm.sp_world_size(group)
    if impl == "ulysses" and sp > 1:
        _install_ulysses(model, group)
    elif impl == "untied_ulysses":
        from .attention.hf import install_untied

        install_untied(model, lc.attention, group)
    ac, tm = lc.activation_checkpointing, lc.tiled_mlp
    if ac.enabled or tm.enabled or lc.rms_norm.enabled:
        from .memory import apply_memory_stack

        model._ds_longctx_memory = apply_memory_stack(model, lc, group)
    _install_loss_forward(model, lc, group, grad_scale)
    from .attention.documents import install_document_forward

    # packed documents / padding -> per-document attention (ours reads them; "none" is HF's packed path)
    install_document_forward(model, group, own_attention=impl == "untied_ulysses" or (impl == "ulysses" and sp > 1))
    model._ds_longctx_patched = True


# ---------------------------------------------------------------------------------------------
# initialize
# ---------------------------------------------------------------------------------------------


def _zero_stage(ds_config: dict) -> int:
    return int((ds_config.get("zero_optimization") or {}).get("stage", 0))


def _reduce_scatter(ds_config: dict) -> bool:
    return bool((ds_config.get("zero_optimization") or {}).get("reduce_scatter", True))


def init_distributed(ds_config: Optional[dict] = None, distributed_port: int = 29500,
                     dist_init_required: Optional[bool] = None):
    """Start the process group from whichever launcher started us (env vars, MPI or SLURM)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if dist.is_initialized() or dist_init_required is False:
        return
    from .launch import env_from_slurm

    env_from_slurm()  # srun sets only SLURM_*; MPI ranks are discovered by DeepSpeed via mpi4py
    comm.disable_cpu_shm_allreduce()
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                               distributed_port=distributed_port, auto_mpi_discovery=True)


def _device_budget_bytes() -> int:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # CPU runs: host RAM is the device


def _resolve_auto(ds_config: dict, model_config, world: int) -> dict:
    """Replace "auto" values by the planner's fastest fitting choice: computed on rank 0 (the
    simulation is pure but costs seconds) and broadcast, so every rank builds the same model."""
    from .planner import resolve_auto

    box = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            box[0] = resolve_auto(ds_config, model_config, world, _device_budget_bytes(), log=logger.info)
        except ConfigError as e:
            box[0] = e
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    return box[0]


def initialize(args: Any = None, model: Optional[torch.nn.Module] = None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, distributed_port: int = 29500, mpu=None,
               dist_init_required: Optional[bool] = None, collate_fn=None, config=None, mesh_param=None,
               config_params=None, data_shuffle: bool = False, data_seed: int = 0):
    """Same arguments and return values as ``deepspeed.initialize``:
    ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    ``training_dataloader`` (when ``training_data`` is given) yields this rank's sequence shard of
    each sample, with ``position_ids`` and ``shift_labels``; feed its batches to ``engine(**batch)``.
    """
    import deepspeed

    if model is None:
        raise ConfigError("model", "is required", "pass the Hugging Face model to ds_longctx.initialize")
    ds_config = load_ds_config(config if config is not None else config_params, args)
    lc = parse(ds_config)
    sp = lc.sequence_parallel_size
    if mpu is not None:
        raise ConfigError("mpu", "ds_longctx builds the sequence-parallel groups itself",
                          "drop mpu= and set sequence_parallel_size in the config")
    init_distributed(ds_config, distributed_port, dist_init_required)
    world = dist.get_world_size() if dist.is_initialized() else 1
    model_config = getattr(model, "config", None)
    check_against(lc, model_config, world)  # same verdict on every rank, before any group is built

    if lc.attention.heads_per_chunk == "auto":
        ds_config = _resolve_auto(ds_config, model_config, world)
        lc = parse(ds_config)
        check_against(lc, model_config, world)

    ds_mpu = comm.initialize_groups(sp)
    group = comm.sp_group() if sp > 1 else None
    grad_scale = comm.sp_grad_scale(_zero_stage(ds_config), _reduce_scatter(ds_config), sp)
    patch_model(model, lc, group, grad_scale)

    if args is not None and getattr(args, "deepspeed_config", None) is not None:
        # deepspeed.initialize refuses a config given both ways; we pass the parsed dict.
        args = copy.copy(args)
        args.deepspeed_config = None
    engine, opt, _, sched = deepspeed.initialize(
        args=args, model=model, optimizer=optimizer, model_parameters=model_parameters, lr_scheduler=lr_scheduler,
        distributed_port=distributed_port, mpu=ds_mpu, dist_init_required=dist_init_required, config=ds_config,
        mesh_param=mesh_param)
    engine.long_context = lc

    loader = None
    if training_data is not None:
        dp_size, dp_rank = comm.dp_world_size_and_rank(sp)
        loader = SPDataLoader(training_data, batch_size=engine.train_micro_batch_size_per_gpu(),
                              sp_rank=comm.sp_rank(group), sp_size=sp, dp_rank=dp_rank, dp_size=dp_size,
                              collate_fn=collate_fn, shuffle=data_shuffle, seed=data_seed)
    if not dist.is_initialized() or dist.get_rank() == 0:
        dp = world // sp
        logger.info(f"ds_longctx: world={world} sp={sp} dp={dp} zero_stage={_zero_stage(ds_config)} "
                    f"attention={lc.attention.implementation} grad_scale={grad_scale}")
    return engine, opt, loader, sched


@contextlib.contextmanager
def model_init(config, args: Any = None):
    """Build HF models inside this context to have ZeRO-3 partition them as they are created.

    ``AutoModelForCausalLM.from_pretrained/from_config`` see the ds_config through transformers'
    ``HfDeepSpeedConfig`` and wrap construction in ``deepspeed.zero.Init``, so no rank ever holds
    the full model (DeepSpeed issue #7458). Without ZeRO-3 this is a no-op.
    """
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    ds_config = load_ds_config(config, args)
    parse(ds_config)
    if _zero_stage(ds_config) != 3:
        yield
        return
    init_distributed(ds_config)
    hf_ds = HfDeepSpeedConfig(ds_config)
    try:
        yield hf_ds
    finally:
        del hf_ds
        unset_hf_deepspeed_config()


@torch.no_grad()
def deterministic_init(model, seed: int) -> None:
    """Re-draw every weight from a generator keyed by (seed, parameter name), one parameter at a time.

    HF's own init draws from the global RNG in module order, and under ``zero.Init`` that order and
    the RNG stream differ from a plain build, so the same seed gave different weights per layout.
    Keyed draws make random init identical for every SP degree, ZeRO stage and process count.
    Distribution as HF's causal LMs: weights N(0, initializer_range), biases 0, norm weights 1.
    Under ZeRO-3 only one full parameter exists at a time, on rank 0, and is re-partitioned.
    """
    import zlib

    import deepspeed

    std = getattr(model.config.get_text_config(), "initializer_range", 0.02)
    for mod_name, mod in model.named_modules():
        is_norm = "norm" in type(mod).__name__.lower()
        for pname, p in mod.named_parameters(recurse=False):
            # every rank draws the same values; under ZeRO-3 rank 0's copy is the one re-partitioned
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                if is_norm:
                    p.fill_(1.0)
                elif pname == "bias" or p.dim() < 2:
                    p.zero_()
                else:
                    key = f"{mod_name}.{pname}".encode()
                    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key))
                    p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).mul_(std).to(p.dtype))
