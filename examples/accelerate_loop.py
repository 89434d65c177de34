"""A plain Accelerate training loop + ds_longctx: the full long-context stack by adding keys and one line.

    deepspeed --num_gpus 2 examples/accelerate_loop.py                 # untied attention + memory stack
    deepspeed --num_gpus 2 examples/accelerate_loop.py --hf-alst        # Accelerate's own ALST path
    python examples/accelerate_loop.py --sp 1 --hf-alst                 # the single-process reference
    deepspeed --num_gpus 2 examples/accelerate_loop.py --steps 5 --optimizer adamw --warmup-steps 1 --save-at 3
    deepspeed --num_gpus 2 examples/accelerate_loop.py --steps 5 --optimizer adamw --warmup-steps 1 --resume

What an Accelerate user adds to an existing DeepSpeed loop:

1. ``ds_longctx.enable()`` before ``accelerator.prepare``;
2. a ``long_context`` section (and ``sequence_parallel_size``) in the DeepSpeed config given to
   ``DeepSpeedPlugin(hf_ds_config=...)``;
3. ``parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=N)`` in ``Accelerator(...)``:
   ``prepare`` then shards each batch's sequence over the SP ranks (DeepSpeed's
   ``UlyssesSPDataLoaderAdapter``, samples carrying ``position_ids``).

``outputs.loss`` is then the loss of the whole sample (every SP rank returns the same value): no
all-gather of per-shard losses as in DeepSpeed's ALST tutorial. Local tiny Llama, no download.

Checkpoints: ``accelerator.save_state(dir)`` / ``accelerator.load_state(dir)`` (DeepSpeed's checkpoint, RNG
states), then ``accelerator.skip_first_batches(data, steps_done)`` for the samples already trained: under SP,
``data`` is the SP adapter and the count is of its items (what the loop's steps count); ``enable()`` makes
``skip_first_batches`` take it (the last two commands above).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import RandomTokens, full_params, prepare_launched_process, tiny_model  # noqa: E402
from hf_trainer import ds_config, token_digest  # noqa: E402  (the same keys as the Trainer example)


def train(sp: int = 2, attention: str = "untied_ulysses", memory_stack: bool = True, use_ds_longctx: bool = True,
          steps: int = 3, seq_len: int = 32, lr: float = 0.05, seed: int = 0, record_params: bool = False,
          optimizer: str = "sgd", warmup_steps: int | None = None, save_at: int | None = None,
          save_dir: str = "/tmp/ds_longctx_accelerate_loop", resume: bool = False):
    """``steps`` steps (SGD unless ``optimizer``) over samples 0..steps-1 in order; returns {"losses": [...],
    "inputs": [...], "lrs": [...], params if asked}. ``optimizer="adamw"`` trains with AdamW; ``warmup_steps``: a
    linear warmup/decay schedule over ``steps`` (transformers' get_linear_schedule_with_warmup), stepped after each
    optimizer step. ``save_at``: ``accelerator.save_state(save_dir)`` after that step; ``resume``:
    ``accelerator.load_state(save_dir)`` and ``accelerator.skip_first_batches`` past the steps it holds, then the
    rest (losses/inputs/lrs: those steps)."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    import ds_longctx

    if use_ds_longctx:
        ds_longctx.enable()  # <- the one line
    model = tiny_model(seed=seed)
    before = {n: p.detach().clone() for n, p in model.named_parameters()} if record_params else None
    cfg = ds_config(sp, attention, memory_stack, use_ds_longctx)
    cfg.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1, gradient_clipping=0.0)
    kw = {}
    if sp > 1:
        from accelerate.utils import DeepSpeedSequenceParallelConfig, ParallelismConfig

        kw["parallelism_config"] = ParallelismConfig(
            sp_backend="deepspeed", sp_size=sp,
            sp_handler=DeepSpeedSequenceParallelConfig(sp_attn_implementation=model.config._attn_implementation))
    # no cpu=True even on a CPU box: with it Accelerate takes the MULTI_CPU path, never DeepSpeed's
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg), **kw)
    data = torch.utils.data.DataLoader(RandomTokens(steps, seq_len, model.config.vocab_size, seed=seed),
                                       batch_size=1, shuffle=False)
    if optimizer == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    objs = [model, optimizer, data]
    if warmup_steps is not None:
        from transformers import get_linear_schedule_with_warmup

        objs.append(get_linear_schedule_with_warmup(optimizer, warmup_steps, steps))
    model, optimizer, data, *scheduler = accelerator.prepare(*objs)
    done = 0
    if resume:
        accelerator.load_state(save_dir)  # DeepSpeed's checkpoint (moments, schedule) and the RNG states
        with open(os.path.join(save_dir, "steps_done.json")) as f:
            done = json.load(f)
        # data yields SP turns under SP (ds_longctx's adapter): skip_first_batches counts them, as steps do
        data = accelerator.skip_first_batches(data, done)
    losses, inputs, lrs = [], [], []
    for batch in data:
        if use_ds_longctx or sp == 1:
            loss = model(**batch).loss
        else:
            # Accelerate's own ALST path: each rank holds a shard with shift_labels and no labels (so no
            # outputs.loss); the sample's loss is the sum over shards / the valid targets of all shards,
            # as in DeepSpeed's ALST tutorial (ds_longctx returns that loss itself)
            loss = _sp_loss_from_logits(model(**batch).logits, batch["shift_labels"])
        accelerator.backward(loss)
        optimizer.step()
        for sched in scheduler:
            lrs.append(sched.get_last_lr()[0])  # the rate this step used
            sched.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
        inputs.append(token_digest(batch))
        done += 1
        if done == save_at:
            accelerator.save_state(save_dir)
            if accelerator.is_main_process:
                with open(os.path.join(save_dir, "steps_done.json"), "w") as f:
                    json.dump(done, f)
            accelerator.wait_for_everyone()
    out = {"losses": losses, "inputs": inputs, "lrs": lrs}
    if record_params:
        out["before"], out["after"] = before, full_params(model.module)
    if use_ds_longctx:
        ds_longctx.disable()
    return out


def _sp_loss_from_logits(logits, shift_labels):
    import torch.distributed.nn.functional as dist_fn
    from deepspeed.utils import groups

    group = groups._get_sequence_parallel_group()
    total = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), shift_labels.flatten(),
                                              ignore_index=-100, reduction="sum")
    count = (shift_labels != -100).sum().to(total.dtype)
    return sum(dist_fn.all_gather(total, group=group)) / sum(dist_fn.all_gather(count, group=group))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sp", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    p.add_argument("--attention", default="untied_ulysses", choices=["ulysses", "untied_ulysses"])
    p.add_argument("--no-memory-stack", action="store_true")
    p.add_argument("--hf-alst", action="store_true", help="Accelerate's own ALST path (no ds_longctx)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw"])
    p.add_argument("--warmup-steps", type=int, default=None, help="a linear warmup/decay LR schedule")
    p.add_argument("--save-at", type=int, default=None, help="accelerator.save_state after this step")
    p.add_argument("--resume", action="store_true", help="accelerator.load_state, skip the steps done, go on")
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1)
    a = p.parse_args(argv)
    if a.hf_alst:  # HF's own path on a CPU box; ds_longctx.enable() does this itself
        prepare_launched_process()
    res = train(sp=a.sp, attention=a.attention, memory_stack=not a.no_memory_stack, use_ds_longctx=not a.hf_alst,
                steps=a.steps, optimizer=a.optimizer, warmup_steps=a.warmup_steps, save_at=a.save_at, resume=a.resume)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"losses": res["losses"]}))


if __name__ == "__main__":
    import ds_longctx

    # an error on any rank ends the job; no interpreter finalization at the end (gloo/NCCL threads can
    # abort it: ds_longctx/dist/runtime.py)
    ds_longctx.run(main)
