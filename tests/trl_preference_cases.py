"""TRL's DPOTrainer and DistillationTrainer through ``ds_longctx.enable()`` at SP=2 against one process (importable by
spawned workers): the tiny Llama of trl_rl_cases (a second seed as the teacher), word-level preference pairs, SGD,
2 optimizer steps, fp32."""
from __future__ import annotations

import torch

from trl_rl_cases import LR, STEPS, VOCAB, model_dir, out_dir, prompts, tokenizer

# (name, trainer, config overrides, ZeRO stage): DPO's sigmoid and IPO losses and the RPO term (the chosen
# completions' NLL: loss_type [sigmoid, sft]); the distillation trainer (generalised JSD, the teacher under SP too;
# ZeRO-2: TRL's divergence reads both lm_head weights directly, which ZeRO-3 partitions)
CASES = {
    "dpo_sigmoid": ("dpo", dict(loss_type=["sigmoid"], beta=0.1), 3),
    "dpo_ipo": ("dpo", dict(loss_type=["ipo"], beta=0.1), 3),
    "dpo_rpo": ("dpo", dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5], beta=0.1), 3),
    "distill": ("distill", dict(beta=0.5, temperature=0.9, max_completion_length=6), 2),
}


def pairs(n: int = 16, seed: int = 0):
    """Prompts of 2..5 tokens, chosen and rejected completions of 1..6 tokens (different lengths: right padding)."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)

    def words(lo, hi):
        k = int(torch.randint(lo, hi, (1,), generator=g))
        return " ".join(f"t{int(i)}" for i in torch.randint(4, VOCAB, (k,), generator=g))

    return Dataset.from_list([{"prompt": words(2, 6), "chosen": words(1, 7), "rejected": words(1, 7)}
                              for _ in range(n)])


_TEACHER: list = []


def teacher_dir(rank: int) -> str:
    if not _TEACHER:
        import torch.distributed as dist

        import eco_cases
        from _common import tiny_model

        path = eco_cases.shared_tmpdir(rank)
        if rank == 0:
            tiny_model(seed=1).save_pretrained(path)
        dist.barrier()
        _TEACHER.append(path)
    return _TEACHER[0]


def train(case: str, sp: int, rank: int, use_ds_longctx: bool = True) -> dict:
    import ds_longctx
    from trl_rl_cases import _params, ds_config

    kind, overrides, stage = CASES[case]
    path = model_dir(rank)
    teacher = teacher_dir(rank) if kind == "distill" else None
    if use_ds_longctx:
        ds_longctx.enable()
    kw = {}
    if sp > 1:
        from accelerate.utils import DeepSpeedSequenceParallelConfig, ParallelismConfig

        kw["parallelism_config"] = ParallelismConfig(
            sp_backend="deepspeed", sp_size=sp, sp_handler=DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa"))
    config = ds_config(sp, use_ds_longctx)
    config["zero_optimization"] = {"stage": stage}
    common = dict(output_dir=out_dir(case, rank), per_device_train_batch_size=4, max_steps=STEPS,
                  learning_rate=LR, optim="sgd", bf16=False, lr_scheduler_type="constant", max_grad_norm=0.0,
                  logging_steps=1, report_to=[], seed=0, save_strategy="no", use_cpu=not torch.cuda.is_available(),
                  dataloader_num_workers=0, deepspeed=config, **overrides, **kw)
    seen = {"losses": []}
    if kind == "dpo":
        from trl import DPOConfig as Config, DPOTrainer as Trainer

        args = Config(max_length=16, **common)
        data, extra = pairs(), {}
    else:
        from trl import DistillationConfig as Config, DistillationTrainer as Trainer

        args = Config(**common)
        data, extra = prompts(), {"teacher_model": teacher}

    class Recording(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            loss = out[0] if isinstance(out, tuple) else out
            if model.training:
                seen["losses"].append(float(loss.detach()))
            return out

    from ds_longctx.objectives import distill

    real_pack = distill.pack

    def pack(*a, **k):  # the distillation loss ran on sequence shards (objectives/distill.py)
        seen["sharded"] = seen.get("sharded", 0) + 1
        return real_pack(*a, **k)

    distill.pack = pack
    try:
        trainer = Recording(model=path, args=args, train_dataset=data, processing_class=tokenizer(), **extra)
        named = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]
        before = _params(named)
        trainer.train()
        after = _params([(n, p) for n, p in trainer.model_wrapped.module.named_parameters() if p.requires_grad])
    finally:
        distill.pack = real_pack
        if use_ds_longctx:
            ds_longctx.disable()
    return {"losses": seen["losses"], "before": before, "after": after, "sharded": seen.get("sharded", 0)}


def cleanup(rank: int) -> None:
    import trl_rl_cases

    import shutil

    import torch.distributed as dist

    trl_rl_cases.cleanup(rank, *[out_dir(c, rank) for c in CASES])
    if rank == 0:
        for path in _TEACHER:
            shutil.rmtree(path, ignore_errors=True)
    _TEACHER.clear()
    dist.barrier()
