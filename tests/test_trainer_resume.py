"""Resume under SP=2 (ds_longctx.enable(), untied attention + the whole memory stack): a run resumed from a
mid-run checkpoint trains the steps after it exactly as the uninterrupted run did, through the HF Trainer
(``save_steps`` + ``train(resume_from_checkpoint=...)``), TRL's SFTTrainer (packed padding-free rows, gradient
accumulation 3) and a plain Accelerate loop (``save_state`` / ``load_state`` + ``skip_first_batches``).

Same layout and arithmetic on both sides, so every comparison is exact: each micro-batch's loss after the
resume, the tokens each rank trained in it (no sample repeated or skipped), and the final weights. AdamW with a
linear warmup/decay schedule, so optimizer moments and the LR schedule must come back from the checkpoint
(DeepSpeed's, through the Trainer's / Accelerate's own save and load) for the losses to agree.

One spawn runs the six trainings (uninterrupted with a save, then resumed, per path)."""
import pytest

from dist_utils import run_distributed
from eco_cases import ProcessState, assert_resumed_equal, shared_tmpdir  # also puts examples/ on sys.path

ADAMW = dict(optim="adamw_torch", lr_scheduler_type="linear", warmup_steps=1)
# Trainer: 4 samples = 2 per rank = 4 SP turns per epoch; 6 steps cross into epoch 2; the checkpoint after
# step 3 leaves 1 whole batch + 1 turn of the next to skip (the turn remainder)
TRAINER = dict(steps=6, save_steps=3, samples=4, lr=0.01, **ADAMW)
# TRL packed rows, 3 micro-batches per step: the checkpoint after step 1 leaves 3 turns to skip (1 batch + 1 turn)
TRL = dict(steps=2, save_strategy="steps", save_steps=1, gradient_accumulation_steps=3, packing=True, seq_len=31,
           samples=25, lr=0.01, **ADAMW)
# Accelerate: the loader is replicated over the SP group (one item per batch): 3 batches to skip after step 3
ACCEL = dict(steps=5, save_at=3, optimizer="adamw", warmup_steps=1, lr=0.01)


def _resume_runs(rank, world):
    import os
    import shutil

    import torch.distributed as dist

    import accelerate_loop
    import hf_trainer
    import trl_sft

    state = ProcessState()
    root = shared_tmpdir(rank)
    dirs = {k: os.path.join(root, k) for k in ("trainer", "trl", "accel")}
    out = {}
    kw = dict(sp=2, record_params=True, output_dir=dirs["trainer"])
    out["trainer"] = hf_trainer.train(**kw, **TRAINER)
    state.reset()
    out["trainer_resumed"] = hf_trainer.train(**kw, **TRAINER,
                                              resume_from_checkpoint=f"{dirs['trainer']}/checkpoint-3")
    state.reset()
    kw = dict(sp=2, attention="untied_ulysses", memory_stack=True, record_params=True, output_dir=dirs["trl"])
    out["trl"] = trl_sft.train(**kw, **TRL)
    state.reset()
    out["trl_resumed"] = trl_sft.train(**kw, **TRL, resume_from_checkpoint=f"{dirs['trl']}/checkpoint-1")
    state.reset()
    kw = dict(sp=2, record_params=True, save_dir=dirs["accel"])
    out["accel"] = accelerate_loop.train(**kw, **ACCEL)
    state.reset()
    out["accel_resumed"] = accelerate_loop.train(**kw, **ACCEL, resume=True)
    state.reset()
    dist.barrier()  # (a failed run leaves its directory: not removed under a rank still in a collective)
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    return out


@pytest.mark.distributed
def test_resume_under_sp_equals_uninterrupted_run():
    res = run_distributed(_resume_runs, 2)
    for rank, r in enumerate(res):
        print(rank, {k: v["losses"] for k, v in r.items()})
        assert_resumed_equal(r["trainer"], r["trainer_resumed"], 3, "trainer", epoch_items=4)
        assert_resumed_equal(r["trl"], r["trl_resumed"], 3, "trl")
        assert_resumed_equal(r["accel"], r["accel_resumed"], 3, "accel")
