"""The run's record in every tag: its layout, batch sizes, data identity, model facts, RoPE and stages (context
extension), the dtype and the version; what a resume compares."""
from __future__ import annotations

import json
from typing import List, Tuple

from ..._version import __version__
from ...dist.layout import zero_stage
from ...models import text_config
from .tags import model_facts


def run_record(*, world_size: int, sp: int, dp: int, zero_stage: int, micro_batch: int, gas: int, seq_len: int,
               seed: int, data, concat_documents: bool, model_config, ds_config: dict) -> dict:
    """The record of a run: what a resume compares (layout, data, model, optimizer) and what it needs."""
    return {"world_size": world_size, "sequence_parallel_size": sp, "data_parallel_size": dp,
            "zero_stage": zero_stage, "micro_batch": micro_batch, "gradient_accumulation_steps": gas,
            "seq_len": seq_len, "seed": seed, "data": data, "concat_documents": concat_documents,
            "model": model_facts(model_config), "optimizer": ds_config.get("optimizer"),
            "scheduler": ds_config.get("scheduler"), "gradient_clipping": ds_config.get("gradient_clipping"),
            "dtype": _train_dtype(ds_config), "ds_longctx_version": _version()}


def rope_facts(model_config) -> dict:
    """The model's RoPE as a stage trains it: its parameters (theta, scaling type and factor) and
    max_position_embeddings."""
    tc = text_config(model_config)
    params = getattr(tc, "rope_parameters", None) or getattr(tc, "rope_scaling", None)
    if params is None and getattr(tc, "rope_theta", None) is not None:
        params = {"rope_theta": tc.rope_theta}
    return {"parameters": json.loads(json.dumps(params, default=str)) if params is not None else None,
            "max_position_embeddings": getattr(tc, "max_position_embeddings", None)}


def stage_of(record: dict) -> dict:
    """The stage a checkpoint's record was trained in (a record written before stages existed: stage 1 from step
    0 at its seq_len)."""
    return record.get("stage") or {"index": 1, "seq_len": record.get("seq_len"), "rope": None, "start_step": 0,
                                   "start_sample": 0, "data": "start"}


def stage_start_sample(mode: str, samples_consumed: int, old_len: int, new_len: int) -> int:
    """Where a new stage's data starts: "restart" at sample 0; "keep" at the token position the last stage reached
    (``samples_consumed`` samples of ``old_len`` tokens), as a sample index at ``new_len``, rounded up so that no
    token is trained twice (a corpus' samples are consecutive slices of its token stream: corpus.CorpusDataset)."""
    if mode == "restart":
        return 0
    return -(-samples_consumed * old_len // new_len)


def next_stage(saved: dict, seq_len: int, rope: dict, data: str, start_sample: int) -> Tuple[dict, List[dict]]:
    """A new stage after the checkpoint whose record is ``saved``: (the stage, the stages before it, each with
    the step it ended at). Recorded in every checkpoint of the stage (``stage``, ``stages``)."""
    prev = dict(stage_of(saved), end_step=int(saved["step"]))
    stage = {"index": int(prev["index"]) + 1, "seq_len": seq_len, "rope": rope, "start_step": int(saved["step"]),
             "start_sample": start_sample, "data": data}
    return stage, list(saved.get("stages") or []) + [prev]


def batch_sizes(ds_config: dict, dp: int) -> Tuple[int, int]:
    """(micro batch, gradient accumulation steps) as DeepSpeed derives them from the batch keys."""
    tbs, micro = ds_config.get("train_batch_size"), ds_config.get("train_micro_batch_size_per_gpu")
    gas = ds_config.get("gradient_accumulation_steps")
    if micro is None:
        micro = tbs // ((gas or 1) * dp) if tbs else 1
    if gas is None:
        gas = tbs // (micro * dp) if tbs else 1
    return int(micro), int(gas)


def layout_record(ds_config: dict, world_size: int, model_config=None, **extra) -> dict:
    """A custom loop's record from its ds_config and world size (the layout, ZeRO stage, optimizer; the model's
    facts when ``model_config`` is given); ``extra`` adds what the loop's data position depends on (``seq_len``,
    ``seed``, ``data``: a resume refuses a change of any key both records hold)."""
    sp = int(ds_config.get("sequence_parallel_size") or 1)
    dp = world_size // sp
    micro, gas = batch_sizes(ds_config, dp)
    rec = {"world_size": world_size, "sequence_parallel_size": sp, "data_parallel_size": dp,
           "zero_stage": zero_stage(ds_config), "micro_batch": micro, "gradient_accumulation_steps": gas,
           "optimizer": ds_config.get("optimizer"), "scheduler": ds_config.get("scheduler"),
           "gradient_clipping": ds_config.get("gradient_clipping"), "dtype": _train_dtype(ds_config),
           "ds_longctx_version": _version()}
    if model_config is not None:
        rec["model"] = model_facts(model_config)
    rec.update(extra)
    return rec


def _train_dtype(ds_config: dict) -> str:
    for key, name in (("bf16", "bf16"), ("fp16", "fp16")):
        if (ds_config.get(key) or {}).get("enabled"):
            return name
    return "fp32"


def _version() -> str:
    return __version__
