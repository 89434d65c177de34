"""The memory stack: activation checkpointing (+ host offload of checkpointed layer inputs), tiled
MLP, memory-efficient RMSNorm and tiled loss. ``apply_memory_stack`` installs the first three on a
built model; the tiled loss is
a function the engine's loss forward calls (:func:`tiling.tiled_causal_lm_loss_sum`)."""
from __future__ import annotations

import contextlib
from typing import Optional

from ..config import AC_KEY, TILED_MLP_KEY
from ..errors import ConfigError, naming
from .checkpointing import decoder_layers, install_checkpointing, uninstall_checkpointing
from .norm import (MemoryEfficientRMSNorm, install_memory_efficient_rmsnorm,
                   uninstall_memory_efficient_rmsnorm)
from .nvme import NVMeError, NVMeTarget
from .offload import (AutoTarget, CheckpointInputOffloader, HostCopyTarget, OffloadTarget, PinnedHostTarget)
from .tiling import (TilingError, TilingState, agree_max, auto_shards, install_tiled_mlp, resolve_shards,
                     tiled_causal_lm_loss_sum, uninstall_tiled_mlp)


class MemoryStackHandle:
    """What :func:`apply_memory_stack` installed, with host-memory accounting and an undo."""

    def __init__(self):
        self.offloader: Optional[CheckpointInputOffloader] = None
        self.checkpointed_layers = []
        self.tiling: Optional[TilingState] = None
        self.tiled_mlps = []
        self.rms_norms = []
        self._ckpt_hooks = []
        self._mlp_hooks = []

    def host_bytes(self) -> int:
        """Bytes of checkpoint inputs held in host memory right now."""
        return self.offloader.host_bytes() if self.offloader is not None else 0

    def host_bytes_peak(self) -> int:
        return self.offloader.stats.host_bytes_peak if self.offloader is not None else 0

    def stats(self) -> dict:
        """Counters of the memory stack; with offload also what the target holds now (``pinned_bytes``,
        ``arena_bytes``: the host arena; ``nvme_bytes``, ``staging_bytes``: the NVMe target), so a
        per-step log shows the pinned/NVMe footprint and that it does not grow."""
        out = {"checkpointed_layers": len(self.checkpointed_layers), "tiled_mlps": len(self.tiled_mlps),
               "rms_norms": len(self.rms_norms),
               "host_bytes": self.host_bytes(), "host_bytes_peak": self.host_bytes_peak()}
        if self.offloader is not None:
            s = self.offloader.stats
            out.update(offloaded_tensors=s.offloaded_tensors, offloaded_bytes=s.offloaded_bytes,
                       restored_tensors=s.restored_tensors, restored_bytes=s.restored_bytes,
                       prefetched_tensors=s.prefetched_tensors)
            out.update(self.offloader.target.memory_stats())
        return out

    def set_offload_target(self, target: OffloadTarget) -> None:
        if self.offloader is None:
            raise RuntimeError("activation_checkpointing.offload is not enabled on this model")
        self.offloader.target = target

    def remove(self) -> None:
        if self.offloader is not None:
            close = getattr(self.offloader.target, "close", None)
            if close is not None:
                close()  # frees the arena / staging ring, removes NVMe files
        uninstall_checkpointing(self.checkpointed_layers)
        for h in self._ckpt_hooks:
            h.remove()
        uninstall_tiled_mlp(self.tiled_mlps, self._mlp_hooks)
        uninstall_memory_efficient_rmsnorm(self.rms_norms)
        self.checkpointed_layers, self.tiled_mlps, self._ckpt_hooks, self._mlp_hooks = [], [], [], []
        self.rms_norms = []


def apply_memory_stack(model, spec, offload_target: Optional[OffloadTarget] = None) -> MemoryStackHandle:
    """Install activation checkpointing (with optional host offload), the tiled MLP and the
    memory-efficient RMSNorm on ``model`` per ``spec`` (a :class:`ds_longctx.patching.spec.LongContextSpec`: its switches,
    its resolved ``keep_on_device``, ``kept_attention_layers`` and ``mlp_shards``). Call after the model is built
    and before ``deepspeed.initialize``. Issues no collectives (the "auto" MLP shard count is agreed at run time,
    once per forward, over every rank: see tiling.agree_max). ``offload_target`` replaces the default host target
    (tests, CPU).
    """
    lc_cfg = spec.config
    handle = MemoryStackHandle()
    ac, tm = lc_cfg.activation_checkpointing, lc_cfg.tiled_mlp
    if ac.enabled:
        if ac.offload in ("cpu", "nvme"):
            refusals = contextlib.nullcontext
            if offload_target is None and ac.offload == "nvme":
                # built now, before deepspeed.initialize: a missing aio op or a bad path fails here
                with naming_nvme_keys():
                    offload_target = NVMeTarget(ac.nvme_path, ring=ac.nvme_buffer_count, pin_memory=ac.pin_memory)
                refusals = naming_nvme_keys  # a drive that fills up at a forward
            handle.offloader = CheckpointInputOffloader(target=offload_target, pin_memory=ac.pin_memory,
                                                        prefetch=ac.prefetch, refusals=refusals)
        handle.checkpointed_layers, handle._ckpt_hooks = install_checkpointing(
            model, ac.use_reentrant, handle.offloader, spec.keep_on_device, spec.kept_attention_layers)
    if tm.enabled:
        # "auto" (None) is agreed over every rank, not the SP group: see tiling.agree_max. The op's refusals
        # (tiling.TilingError: no supported MLP here, router noise at a training forward) name the config switch
        def untiled_fix(e: TilingError) -> str:
            return f"set {TILED_MLP_KEY}=false {e.untiled}" + (f", or {e.other}" if e.other else "")

        def refusals():
            return naming(TILED_MLP_KEY, TilingError, untiled_fix)

        with refusals():
            handle.tiling, handle.tiled_mlps, handle._mlp_hooks = install_tiled_mlp(model, spec.mlp_shards, refusals)
    if lc_cfg.rms_norm.enabled:
        handle.rms_norms = install_memory_efficient_rmsnorm(model)
    return handle


@contextlib.contextmanager
def naming_nvme_keys():
    """memory.nvme's refusals in the block (nvme.NVMeError: no async_io op, an unusable nvme_path, a drive too
    full) as the ConfigError naming the activation_checkpointing key, with the fix in config terms. Used
    around building the target, around its writes, and by train.py around the all-rank reservation
    (nvme.reserve_on_every_rank: the same error on every rank)."""
    try:
        yield
    except NVMeError as e:
        if e.kind == "space":
            fix = "free space on that drive, point nvme_path at a larger drive, raise keep_on_device, or use " \
                  "offload='cpu'"
        else:
            fix = f"{e.options}, or use offload='cpu'" if e.host_fallback else e.fix
        key = f"{AC_KEY}.offload" if e.kind == "aio" else f"{AC_KEY}.nvme_path"
        raise ConfigError(key, e.problem, fix) from None


def get_memory_handle(model) -> Optional[MemoryStackHandle]:
    """The handle the engine stored on the model (accepts a DeepSpeed engine too)."""
    module = getattr(model, "module", model)
    return getattr(module, "_ds_longctx_memory", None)


__all__ = ["apply_memory_stack", "get_memory_handle", "MemoryStackHandle", "tiled_causal_lm_loss_sum",
           "CheckpointInputOffloader", "OffloadTarget", "HostCopyTarget", "PinnedHostTarget", "AutoTarget",
           "agree_max", "auto_shards", "resolve_shards", "decoder_layers", "MemoryEfficientRMSNorm",
           "install_memory_efficient_rmsnorm", "uninstall_memory_efficient_rmsnorm", "naming_nvme_keys"]
