"""HF Trainer + ds_longctx: the full long-context stack by adding keys and one line.

    deepspeed --num_gpus 2 examples/hf_trainer.py                     # untied attention + memory stack
    deepspeed --num_gpus 2 examples/hf_trainer.py --attention ulysses
    deepspeed --num_gpus 2 examples/hf_trainer.py --hf-alst          # HF's own ALST path, for comparison
    python examples/hf_trainer.py --sp 1 --hf-alst                   # the single-process reference
    deepspeed --num_gpus 2 examples/hf_trainer.py --steps 6 --save-steps 3 --optim adamw_torch --lr 0.01
    deepspeed --num_gpus 2 examples/hf_trainer.py --steps 6 --save-steps 3 --optim adamw_torch --lr 0.01 \
        --resume /tmp/ds_longctx_hf_trainer/checkpoint-3            # steps 4-6 again, equal to the first run's

(on a CPU box: ``deepspeed --num_gpus 2`` works too, or ``torchrun --nproc_per_node 2``.)

What a Trainer user adds to an existing script:

1. ``ds_longctx.enable()`` before building the ``Trainer``;
2. a ``long_context`` section in the DeepSpeed config (plus ``sequence_parallel_size``);
3. ``parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=N)`` in ``TrainingArguments``
   (this is what makes the Trainer shard each sample's sequence over the SP ranks; it is also HF's own
   ALST switch), and samples carrying ``position_ids``.

Checkpoints and resume are the Trainer's own (``save_steps``, ``trainer.train(resume_from_checkpoint=...)``:
DeepSpeed's checkpoint with optimizer moments and LR schedule, the RNG states, and the already-trained samples
skipped; under SP the skip counts SP turns, which ``enable()`` makes Accelerate's ``skip_first_batches`` do).

The model is the local tiny Llama (ds_configs/models/tiny-llama.json, random init): no download.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import RandomTokens, full_params, prepare_launched_process, tiny_model  # noqa: E402


def ds_config(sp: int, attention: str = "untied_ulysses", memory_stack: bool = True, long_context: bool = True,
              stage: int = 3) -> dict:
    """What goes into the user's ds_config.json ("auto" values are filled in by the Trainer)."""
    cfg = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    if sp > 1:
        cfg["sequence_parallel_size"] = sp
    if long_context:
        lc = {"attention": {"implementation": attention}}
        if attention == "untied_ulysses":
            lc["attention"]["heads_per_chunk"] = 1
        if memory_stack:
            lc.update({"activation_checkpointing": {"enabled": True, "offload": "cpu", "pin_memory": False},
                       "tiled_mlp": {"enabled": True, "shards": 2}, "tiled_loss": {"enabled": True, "shards": 2},
                       "rms_norm": {"enabled": True}})
        cfg["long_context"] = lc
    return cfg


class StepLossTrainer:
    """Mixin recording each training micro-batch's loss at full precision (the Trainer's log rounds to 4 digits;
    with gradient_accumulation_steps 1, one per optimizer step) and a digest of the tokens this rank trained in it
    (``step_inputs``: which sample, or which shard of it, each micro-batch was)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                   num_items_in_batch=num_items_in_batch)
        loss = out[0] if return_outputs else out
        if model.training:
            self.step_losses.append(float(loss.detach().float()))
            self.step_inputs.append(token_digest(inputs))
        return out


def token_digest(inputs) -> str:
    """A short digest of a batch's input_ids (equal iff the same tokens)."""
    import hashlib

    ids = inputs["input_ids"].detach().to("cpu", torch.long).contiguous()
    return hashlib.blake2b(str(tuple(ids.shape)).encode() + ids.numpy().tobytes(), digest_size=8).hexdigest()


def train(sp: int = 2, attention: str = "untied_ulysses", memory_stack: bool = True, use_ds_longctx: bool = True,
          steps: int = 3, seq_len: int = 32, samples: int = 8, lr: float = 0.05, seed: int = 0, max_grad_norm=0.0,
          output_dir: str = "/tmp/ds_longctx_hf_trainer", micro_batch: int = 1, record_params: bool = False,
          parallelism_config: bool = True, config: dict | None = None, data_seed: int | None = 0,
          dp_replicate_size: int | None = None, sample_order: list | None = None, optim: str = "sgd",
          lr_scheduler_type: str = "constant", warmup_steps: int = 0, gradient_accumulation_steps: int = 1,
          save_steps: int | None = None, resume_from_checkpoint: str | None = None, lora: bool = False):
    """Train ``steps`` steps (SGD unless ``optim``); returns {"losses": [...], "inputs": [...], "lrs": [...],
    "before"/"after": params (if asked)} (StepLossTrainer; ``lrs``: the rate of every logged step).

    ``dp_replicate_size``: data-parallel replicas of the SP groups (world = sp x this); Accelerate needs
    it declared. ``sample_order``: read the samples sequentially in this order (default: shuffled).
    ``save_steps``: a checkpoint (DeepSpeed's, through the Trainer) every that many steps under ``output_dir``;
    ``resume_from_checkpoint``: continue from one (the Trainer skips the samples already trained); ``losses`` and
    ``inputs`` then hold the steps after it. ``optim``/``lr_scheduler_type``/``warmup_steps``: the Trainer's.
    ``lora``: train a PEFT LoRA adapter (r=8 on every projection; the base frozen) handed to the Trainer as the
    PeftModel, the usual fine-tuning setup."""
    from transformers import Trainer, TrainingArguments

    import ds_longctx

    if use_ds_longctx:
        ds_longctx.enable()  # <- the one line
    model = tiny_model(seed=seed)  # same weights on every rank (built before ZeRO-3 partitions it)
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(seed + 1)  # init_lora_weights=False: lora_B random too, so the adapters act from step 1
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    before = {n: p.detach().clone() for n, p in model.named_parameters()} if record_params else None
    kw = {}
    if sp > 1 and parallelism_config:
        from accelerate.utils import DeepSpeedSequenceParallelConfig, ParallelismConfig

        dp = {} if dp_replicate_size is None else {"dp_replicate_size": dp_replicate_size}
        kw["parallelism_config"] = ParallelismConfig(
            sp_backend="deepspeed", sp_size=sp, **dp,
            sp_handler=DeepSpeedSequenceParallelConfig(sp_attn_implementation=model.config._attn_implementation))
    if sample_order is not None:
        kw["train_sampling_strategy"] = "sequential"
    args = TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=micro_batch, max_steps=steps, learning_rate=lr,
        # optim="sgd": plain SGD, so parameter deltas are lr x gradient and compare gradients. (Passing
        # optimizers=(torch.optim.SGD(...), None) does not work under DeepSpeed: transformers'
        # integrations/deepspeed.py:deepspeed_init sets trainer.optimizer = None and builds args.optim,
        # AdamW by default, whose first steps are ~lr x sign(gradient), blind to a gradient's scale.)
        optim=optim, lr_scheduler_type=lr_scheduler_type, warmup_steps=warmup_steps, max_grad_norm=max_grad_norm,
        gradient_accumulation_steps=gradient_accumulation_steps, logging_steps=1,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        report_to=[], seed=seed, data_seed=data_seed, use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0,
        deepspeed=config if config is not None else ds_config(sp, attention, memory_stack, use_ds_longctx), **kw)
    data = RandomTokens(samples, seq_len, model.config.get_text_config().vocab_size, seed=seed)  # (multimodal: its text model)
    if sample_order is not None:
        data = torch.utils.data.Subset(data, sample_order)
    trainer_cls = type("Trainer", (StepLossTrainer, Trainer), {})
    trainer = trainer_cls(model=model, args=args, train_dataset=data)
    trainer.step_losses, trainer.step_inputs = [], []
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    out = {"losses": trainer.step_losses, "inputs": trainer.step_inputs,
           "lrs": [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]}
    if record_params:
        out["before"], out["after"] = before, full_params(trainer.model_wrapped.module)
    if use_ds_longctx:
        ds_longctx.disable()
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sp", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    p.add_argument("--attention", default="untied_ulysses", choices=["ulysses", "untied_ulysses"])
    p.add_argument("--no-memory-stack", action="store_true")
    p.add_argument("--hf-alst", action="store_true", help="HF's own ALST path (no ds_longctx)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--optim", default="sgd", help="the Trainer's optim (adamw_torch: moments to carry on resume)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--save-steps", type=int, default=None, help="a checkpoint every N steps (Trainer save_steps)")
    p.add_argument("--resume", default=None, help="a checkpoint-N directory to resume from")
    p.add_argument("--lora", action="store_true", help="train a PEFT LoRA adapter (the PeftModel to the Trainer)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1)
    a = p.parse_args(argv)
    if a.hf_alst:  # HF's own path on a CPU box; ds_longctx.enable() does this itself
        prepare_launched_process()
    res = train(sp=a.sp, attention=a.attention, memory_stack=not a.no_memory_stack, use_ds_longctx=not a.hf_alst,
                steps=a.steps, seq_len=a.seq_len, optim=a.optim, lr=a.lr, save_steps=a.save_steps,
                resume_from_checkpoint=a.resume, lora=a.lora)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"losses": res["losses"]}))


if __name__ == "__main__":
    import ds_longctx

    # an error on any rank ends the job; no interpreter finalization at the end (gloo/NCCL threads can
    # abort it: ds_longctx/dist/runtime.py)
    ds_longctx.run(main)
