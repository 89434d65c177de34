"""What a training loop checks after ``initialize`` and before step 1, so that it does not fail hours later.

:func:`reserve_offload_storage`: with ``activation_checkpointing.offload: "nvme"``, every rank reserves on its
drive the bytes the planner says its step writes there (layer inputs, and with ``keep_attention_output`` the kept
layers' attention outputs and LSEs), agreed over the job: a drive that is too full is one clear error on every
rank now, not a failed write in step 1. The save directory's checks live in checkpoint.SaveDir.
"""
from __future__ import annotations

from ..memory import get_memory_handle, naming_nvme_keys
from ..memory.nvme import ALIGN, NVMeTarget, _align, reserve_on_every_rank
from ..planner.host import kept_attention_bytes, layer_input_bytes
from ..planner.model_states import _DTYPE_BYTES, model_dtype


def reserve_offload_storage(engine, seq_len: int) -> None:
    """Every rank, after ``ds_longctx.initialize`` and before step 1 (a collective when offloading to NVMe; a
    no-op otherwise). ``seq_len``: the global tokens per sample this run trains."""
    handle = get_memory_handle(engine)
    target = getattr(getattr(handle, "offloader", None), "target", None)
    if not isinstance(target, NVMeTarget):
        return
    model_config, ds_config = engine.module.config, engine.config
    micro = engine.train_micro_batch_size_per_gpu()
    spec = engine.long_context_spec  # every count resolved by initialize
    lc = spec.config
    offloaded, kept = spec.offloaded_layers, spec.offloaded_kept_attention_layers  # the first layers keep theirs
    per_input = _align(layer_input_bytes(model_config, ds_config, lc, seq_len, micro))
    # output and LSE, each in its own aligned slot
    per_kept = kept_attention_bytes(model_config, lc, seq_len, micro, _DTYPE_BYTES[model_dtype(ds_config)]) + 2 * ALIGN
    with naming_nvme_keys():  # the same ConfigError on every rank, naming nvme_path
        reserve_on_every_rank(target, offloaded * per_input + kept * per_kept)


__all__ = ["reserve_offload_storage"]
