"""TRL SFTTrainer + ds_longctx, with packing (padding-free rows, ``position_ids`` restarting per document).

    deepspeed --num_gpus 2 examples/trl_sft.py                          # packed, ulysses, through ds_longctx
    deepspeed --num_gpus 2 examples/trl_sft.py --attention untied_ulysses --memory-stack
    deepspeed --num_gpus 2 examples/trl_sft.py --no-packing             # fixed-length samples
    python examples/trl_sft.py --sp 1 --no-ds-longctx                   # TRL's one-process run (the reference)

Same recipe as the HF Trainer example: ``ds_longctx.enable()``, a ``long_context`` section in the
DeepSpeed config, ``parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=N)`` in
``SFTConfig``. Local tiny Llama and a word-level tokenizer built in place: no download.

Packing: TRL's ``packing=True, padding_free=True`` rows (one flattened row per batch, ``position_ids``
restarting at 0 per document, TRL's ``cu_seq_lens_*``) go through ds_longctx's SP data loader adapter
(ds_longctx/hf/loader.py), which ``enable()`` puts in place of DeepSpeed's ``UlyssesSPDataLoaderAdapter``
for a ds_longctx engine: every rank gets the row's document structure (attention runs per document),
ranks may hold rows of different lengths (the SP group takes turns on each rank's row, in the
one-process order, as DeepSpeed's adapter does), and a row whose length is not a multiple of SP is
padded with one ignored document (no ``pad_to_multiple_of`` needed). DeepSpeed's own adapter (HF's
ALST path) cannot take these rows: ``deepspeed/runtime/sequence_parallel/ulysses_sp.py``:
``UlyssesSPDataLoaderAdapter.refill`` all-gathers rows of different lengths (measured with
``--no-ds-longctx``: "ProcessGroupGloo::allgather: invalid tensor size at index 1 (expected (1, 5), got
(1, 31))") and reads dim 1 of every tensor, which TRL's 1-D ``cu_seq_lens_q`` does not have.

Verified (tests/test_ecosystem.py; 2-core CPU box, 2026-11-26; ZeRO-3 fp32, SGD, 3 steps, SP=2):
per-step losses and parameter deltas equal TRL's one-process run (losses rel 1e-5, bit-identical in
the runs measured; deltas < 1e-6 relative beyond one ulp of the parameter) for fixed-length samples
(ds_longctx ulysses, and HF's own ALST path) and packed rows (ulysses; untied_ulysses + the memory
stack).

Two things in a TRL script make an SP run depart from the one-process run without SP being wrong
(they were why an SP=2 run equalled the one-process run at step 1 only, HF's ALST path and ours alike):

* ``SFTConfig`` defaults to ``bf16=True`` (``trl/trainer/base_config.py``, ``__post_init__``:
  ``self.bf16 = not (self.fp16)``), which Accelerate turns into DeepSpeed bf16
  (``accelerate/utils/dataclasses.py``: ``DeepSpeedPlugin.set_mixed_precision`` adds
  ``{"bf16": {"enabled": true}}`` to a config without a bf16 section). In bf16 the SP run's arithmetic
  is not the one-process run's (each rank's weight gradient over its part of the sequence is rounded to
  bf16 before ZeRO sums them; one process rounds the whole sum once), so from step 2 on the losses
  differ at ~1e-4 (measured: step-2 loss 4.169119 vs 4.168798, rel 7.7e-5, the same for ds_longctx and
  HF's ALST path). The same script with ``bf16=False`` is bit-identical at every step. This example
  passes ``bf16=False``.
* The Trainer drops ``optimizers=(torch.optim.SGD(...), None)`` under DeepSpeed
  (``transformers/integrations/deepspeed.py``: ``deepspeed_init`` sets ``trainer.optimizer = None`` and
  builds ``args.optim``, AdamW by default, whose first steps are about lr x sign(gradient) and amplify
  rounding differences); pass ``optim="sgd"`` to get SGD.

TRL's ``entropy`` and ``mean_token_accuracy`` metrics are logged as NaN under ds_longctx: its loss
never builds per-token log-probabilities.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import prepare_launched_process, tiny_model  # noqa: E402


def tiny_tokenizer(vocab: int):
    """A word-level tokenizer over the tokens "t0".."t{vocab-1}" (ids = token numbers)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t3")


def dataset(n: int, vocab: int, seed: int = 0, lengths=(5, 10, 16)):
    """Pre-tokenized samples of varying length (TRL packs them into rows)."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    rows = [{"input_ids": torch.randint(4, vocab, (lengths[i % len(lengths)],), generator=g).tolist()}
            for i in range(n)]
    return Dataset.from_list(rows)


def train(sp: int = 2, attention: str = "ulysses", use_ds_longctx: bool = True, packing: bool = True,
          steps: int = 3, seq_len: int = 32, samples: int = 24, lr: float = 0.05, seed: int = 0,
          output_dir: str = "/tmp/ds_longctx_trl", record_params: bool = False, memory_stack: bool = False,
          eval_samples: int = 0, resume_from_checkpoint: str | None = None, **sft_overrides):
    """Train ``steps`` steps of SFTTrainer (SGD unless ``optim``); returns {"losses": [...], "inputs": [...],
    "lrs": [...], "before"/"after": params (if asked) (as hf_trainer.train), "eval": trainer.evaluate()'s metrics
    on ``eval_samples`` fixed-length samples (if asked)}.
    ``sft_overrides``: any SFTConfig field (e.g. ``save_strategy="steps", save_steps=1``, ``optim``,
    ``gradient_accumulation_steps``); ``resume_from_checkpoint``: the Trainer's (losses/inputs: the steps after)."""
    from trl import SFTConfig, SFTTrainer

    import ds_longctx
    from hf_trainer import StepLossTrainer, ds_config

    if use_ds_longctx:
        ds_longctx.enable()  # <- the one line
    model = tiny_model(seed=seed)
    before = {n: p.detach().clone() for n, p in model.named_parameters()} if record_params else None
    kw = {}
    if sp > 1:
        from accelerate.utils import DeepSpeedSequenceParallelConfig, ParallelismConfig

        kw["parallelism_config"] = ParallelismConfig(
            sp_backend="deepspeed", sp_size=sp,
            sp_handler=DeepSpeedSequenceParallelConfig(sp_attn_implementation=model.config._attn_implementation))
    if packing:
        # rows need no padding to a multiple of SP: ds_longctx's SP loader pads a row with one ignored document
        kw.update(packing=True, packing_strategy="bfd", padding_free=True, max_length=seq_len)
    else:
        kw.update(packing=False, max_length=seq_len)
    args = dict(
        output_dir=output_dir, per_device_train_batch_size=1, max_steps=steps, learning_rate=lr,
        # optim="sgd" (not optimizers=(SGD, None), which the Trainer drops under DeepSpeed: see hf_trainer.py);
        # bf16=False: SFTConfig's default bf16=True would train in DeepSpeed bf16 (see the module doc)
        optim="sgd", bf16=False,
        lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1, save_strategy="no", report_to=[],
        seed=seed, data_seed=seed, use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0,
        dataset_num_proc=None,
        deepspeed=ds_config(sp, attention, memory_stack=memory_stack, long_context=use_ds_longctx), **kw)
    args.update(sft_overrides)
    args = SFTConfig(**args)
    trainer_cls = type("SFTTrainer", (StepLossTrainer, SFTTrainer), {})
    data = dataset(samples, model.config.vocab_size, seed) if packing else \
        dataset(samples, model.config.vocab_size, seed, lengths=(seq_len,))
    evald = dataset(eval_samples, model.config.vocab_size, seed + 1, lengths=(seq_len,)) if eval_samples else None
    trainer = trainer_cls(model=model, args=args, train_dataset=data, eval_dataset=evald,
                          processing_class=tiny_tokenizer(model.config.vocab_size))
    trainer.step_losses, trainer.step_inputs = [], []
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    out = {"losses": trainer.step_losses, "inputs": trainer.step_inputs,
           "lrs": [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]}
    if eval_samples:
        out["eval"] = trainer.evaluate()
    if record_params:
        from _common import full_params

        out["before"], out["after"] = before, full_params(trainer.model_wrapped.module)
    if use_ds_longctx:
        ds_longctx.disable()
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sp", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    p.add_argument("--attention", default="ulysses", choices=["ulysses", "untied_ulysses"])
    p.add_argument("--memory-stack", action="store_true",
                   help="offloaded checkpointing, tiled MLP/loss, memory-efficient RMSNorm")
    p.add_argument("--no-packing", action="store_true")
    p.add_argument("--no-ds-longctx", action="store_true", help="plain TRL (at SP>1: HF's own ALST path)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1)
    a = p.parse_args(argv)
    if a.no_ds_longctx:  # HF's own path on a CPU box; ds_longctx.enable() does this itself
        prepare_launched_process()
    kw = dict(seq_len=31, samples=25) if not a.no_packing else {}  # the packed rows of tests/test_ecosystem.py
    res = train(sp=a.sp, attention=a.attention, packing=not a.no_packing, use_ds_longctx=not a.no_ds_longctx,
                memory_stack=a.memory_stack, steps=a.steps, **kw)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"losses": res["losses"]}))


if __name__ == "__main__":
    import ds_longctx

    # an error on any rank ends the job; no interpreter finalization at the end (gloo/NCCL threads can
    # abort it: ds_longctx/dist/runtime.py)
    ds_longctx.run(main)
