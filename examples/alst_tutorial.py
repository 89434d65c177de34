"""DeepSpeed's ALST tutorial (docs/_tutorials/ulysses-alst-sequence-parallelism.md, Part 1), ported to a
local tiny model on CPU, with the one-line swap to ds_longctx.

    deepspeed --num_gpus 2 examples/alst_tutorial.py                  # DeepSpeed's own Ulysses (as published)
    deepspeed --num_gpus 2 examples/alst_tutorial.py --ds-longctx     # the same script through ds_longctx

Differences from the published script (and why):
- a local tiny Llama (no download), gloo/fp32 on CPU, torch Adam (no op build), and ``model.step()``
  after ``model.backward(loss)`` (the published loop never steps, so it never trains);
- with ``--ds-longctx`` the only changed line is ``deepspeed.initialize`` -> ``ds_longctx.initialize``,
  plus a ``long_context`` section in the config. ``register_with_transformers`` and ``mpu=mpu`` stay:
  ds_longctx takes DeepSpeed's mpu (same SP degree) and replaces the Ulysses attention that
  ``register_with_transformers`` installed instead of wrapping it twice. Batches from
  ``UlyssesSPDataLoaderAdapter`` (sharded, with ``shift_labels``) are taken as they are.
- the loss: the tutorial computes it from ``outputs.logits`` and aggregates it over the SP group by
  hand. That still works through ds_longctx (``outputs.loss`` is then unused). With
  ``long_context.tiled_loss`` on, logits are never built (that is the memory it saves) and
  ``outputs.logits`` raises an error naming the key: use ``outputs.loss``, already the SP-global
  token-mean loss with the right gradient, and drop the aggregation block (``--tiled-loss`` does).

Note on data: like the tutorial, every rank's DataLoader here yields the *same* samples, and
``UlyssesSPDataLoaderAdapter`` makes the SP group take turns on each rank's batch, so every sample is
trained on ``sp`` times in a row (the published output shows each loss twice). With a
DistributedSampler over the whole world instead, each step sees a new sample.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import RandomTokens, tiny_model  # noqa: E402


def config(sp: int, ds_longctx: bool, tiled_loss: bool = False) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "sequence_parallel_size": sp,
        "steps_per_print": 10**9,
    }
    if ds_longctx:
        cfg["long_context"] = {"attention": {"implementation": "ulysses"},
                               "tiled_loss": {"enabled": tiled_loss}}
    return cfg


def run(use_ds_longctx: bool = False, tiled_loss: bool = False, samples: int = 2, seq_len: int = 16, seed: int = 0):
    """The tutorial's loop; returns the losses rank 0 printed."""
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    from deepspeed.runtime.utils import move_to_device
    from deepspeed.utils import groups

    import ds_longctx

    micro_batch_size = 1
    if not dist.is_initialized():  # as a script (the tests start the group themselves)
        from ds_longctx.dist.comm import disable_cpu_shm_allreduce

        disable_cpu_shm_allreduce()  # CPU: no JIT build of DeepSpeed's shm all-reduce (see ds_longctx.dist.comm)
        dist.init_distributed(dist_backend="gloo", dist_init_required=True)
    sequence_parallel_size = dist.get_world_size()
    config_dict = config(sequence_parallel_size, use_ds_longctx, tiled_loss)

    model = tiny_model(seed=seed)
    # Ulysses injection into HF Transformers (kept as published)
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=sequence_parallel_size,
        micro_batch_size=micro_batch_size, seq_length=seq_len, seq_length_is_variable=True)

    initialize = ds_longctx.initialize if use_ds_longctx else deepspeed.initialize  # <- the one-line swap
    model, _, _, _ = initialize(config=config_dict, model=model, model_parameters=model.parameters(), mpu=mpu)

    sp_group = groups._get_sequence_parallel_group()
    sp_world_size = groups._get_sequence_parallel_world_size()
    sp_rank = groups._get_sequence_parallel_rank()
    ds = RandomTokens(samples, seq_len, model.module.config.vocab_size, seed=seed)
    dl = torch.utils.data.DataLoader(ds, batch_size=micro_batch_size)
    dl = UlyssesSPDataLoaderAdapter(dl, sp_rank=sp_rank, sp_group=sp_group, sp_world_size=sp_world_size,
                                    device=model.device)
    losses = []
    for it, batch in enumerate(dl):
        batch = move_to_device(batch, model.device)
        outputs = model(**batch)
        if use_ds_longctx and tiled_loss:
            loss = outputs.loss  # SP-global already; outputs.logits would raise (never built)
        else:
            shift_labels = batch["shift_labels"]
            loss = model.module.loss_function(logits=outputs.logits, labels=None, shift_labels=shift_labels,
                                              vocab_size=model.module.config.vocab_size)
            # differentiable weighted per-shard-loss aggregation across ranks
            losses_per_rank = torch.distributed.nn.functional.all_gather(loss, group=sp_group)
            good_tokens = (shift_labels != -100).view(-1).sum()
            good_tokens_per_rank = torch.distributed.nn.functional.all_gather(good_tokens, group=sp_group)
            total_loss = sum(losses_per_rank[r] * good_tokens_per_rank[r] for r in range(sp_world_size))
            total_good_tokens = sum(good_tokens_per_rank)
            loss = total_loss / max(total_good_tokens, 1)
        if dist.get_rank() == 0:
            print(f"{it}: loss={loss.item():.6f}", flush=True)
        losses.append(loss.item())
        model.backward(loss)
        model.step()
    return losses


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ds-longctx", action="store_true", help="the one-line swap to ds_longctx.initialize")
    p.add_argument("--tiled-loss", action="store_true", help="with --ds-longctx: tiled loss, use outputs.loss")
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1)
    a = p.parse_args(argv)
    run(a.ds_longctx, a.tiled_loss)


if __name__ == "__main__":
    import ds_longctx

    # an error on any rank ends the job; no interpreter finalization at the end (gloo/NCCL threads can
    # abort it: ds_longctx/dist/runtime.py)
    ds_longctx.run(main)
