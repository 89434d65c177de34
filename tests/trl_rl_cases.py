"""TRL's GRPOTrainer and RLOOTrainer through ``ds_longctx.enable()`` at SP > 1 against one process (importable by
spawned workers): a tiny Llama saved to a directory (TRL builds the reference model from its path), a word-level
tokenizer, prompts of 2 to 5 tokens, a verifiable toy reward, seeded sampling (the completions of both runs are
recorded and compared), SGD, 2 optimizer steps, fp32, ZeRO-3."""
from __future__ import annotations

import os

import torch

VOCAB = 64
STEPS, LR = 2, 0.05


def tokenizer():
    import eco_cases  # noqa: F401  (examples/ on sys.path)
    from trl_sft import tiny_tokenizer

    return tiny_tokenizer(VOCAB)


def prompts(n: int = 16, seed: int = 0):
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        k = int(torch.randint(2, 6, (1,), generator=g))
        rows.append({"prompt": " ".join(f"t{int(i)}" for i in torch.randint(4, VOCAB, (k,), generator=g))})
    return Dataset.from_list(rows)


def reward_t7(completions, **kwargs):
    """How many of the completion's tokens are t7 or t8, minus a tenth of its length: varies within every group."""
    return [sum(w in ("t7", "t8") for w in c.split()) - 0.1 * len(c.split()) for c in completions]


_DIRS: dict = {}


def _build(family: str):
    import eco_cases  # noqa: F401  (examples/ on sys.path)
    from _common import tiny_model

    if family == "llama":
        return tiny_model(seed=0)
    import rl_cases  # the hybrid (Qwen3-Next: Gated DeltaNet + attention, MoE) and MLA (DeepSeek-V3) of item 1

    model = rl_cases.build(family)
    model.config.eos_token_id, model.config.pad_token_id = 1, 0  # the word-level tokenizer's
    return model


def model_dir(rank: int, family: str = "llama") -> str:
    """The family's tiny model (Llama: examples/_common.tiny_model, seed 0) saved once per spawn by rank 0
    (transformers' save_pretrained writes on rank 0 only) in a fresh shared directory (removed by :func:`cleanup`)."""
    if family not in _DIRS:
        import torch.distributed as dist

        import eco_cases

        path = eco_cases.shared_tmpdir(rank)
        if rank == 0:
            _build(family).save_pretrained(path)
        dist.barrier()
        _DIRS[family] = path
    return _DIRS[family]


def out_dir(case: str, rank: int) -> str:
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"ds_longctx_rl_{case}_{rank}")


def cleanup(rank: int, *more) -> None:
    """Remove this rank's output directories (and ``more``), and on rank 0 the saved models once every rank is done with
    them (the spawned ranks end with os._exit: no atexit)."""
    import shutil

    import torch.distributed as dist

    for case in CASES:  # this rank's trainer output directories
        shutil.rmtree(out_dir(case, rank), ignore_errors=True)
    for path in more:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()
    if rank == 0:
        for path in _DIRS.values():
            shutil.rmtree(path, ignore_errors=True)
    _DIRS.clear()


def ds_config(sp: int, long_context: bool = True, impl: str = "untied_ulysses", stack: bool = True) -> dict:
    import eco_cases  # noqa: F401
    from hf_trainer import ds_config as cfg

    return cfg(sp, impl, memory_stack=stack, long_context=long_context)


# (name, trainer, config overrides, LoRA): every GRPO loss type of TRL 1.16, beta 0 and > 0, num_iterations 1 and 2,
# mask_truncated_completions, the entropy mask, sequence-level importance sampling (GSPO), a LoRA policy (its reference
# = the adapters disabled), RLOO
CASES = {
    "grpo": ("grpo", dict(loss_type="grpo", beta=0.0, num_iterations=1), False),
    "bnpo": ("grpo", dict(loss_type="bnpo", beta=0.04, num_iterations=2), False),
    "dr_grpo": ("grpo", dict(loss_type="dr_grpo", beta=0.0, num_iterations=2, mask_truncated_completions=True), False),
    "dapo": ("grpo", dict(loss_type="dapo", beta=0.04, num_iterations=1, top_entropy_quantile=0.5), False),
    "cispo": ("grpo", dict(loss_type="cispo", beta=0.0, num_iterations=2), False),
    "sapo": ("grpo", dict(loss_type="sapo", beta=0.04, num_iterations=1), False),
    "luspo": ("grpo", dict(loss_type="luspo", beta=0.0, num_iterations=2, importance_sampling_level="sequence"), False),
    "vespo": ("grpo", dict(loss_type="vespo", beta=0.04, num_iterations=2), False),
    "lora": ("grpo", dict(loss_type="grpo", beta=0.04, num_iterations=2), True),
    "rloo": ("rloo", dict(beta=0.04, num_iterations=2), False),
    "rloo_b0": ("rloo", dict(beta=0.0, num_iterations=1), False),
    # the families of 2026 beyond Llama: a hybrid (Gated DeltaNet) and multi-head latent attention, whole stack
    # (MoE models: router_aux_loss_coef 0, the load-balancing loss is refused under SP: hf/rl.check_rl_trainer)
    "hybrid": ("grpo", dict(loss_type="dapo", beta=0.04, num_iterations=2, router_aux_loss_coef=0.0), False,
               "qwen3_next"),
    "mla": ("grpo", dict(loss_type="grpo", beta=0.04, num_iterations=1, router_aux_loss_coef=0.0), False,
            "deepseek_v3"),
}


def train(case: str, sp: int, rank: int, use_ds_longctx: bool = True, impl: str = "untied_ulysses",
          stack: bool = True, dp: int = 1) -> dict:
    """``case`` trained ``STEPS`` steps; returns per-step losses, the completions generated (in order), the
    parameters before/after (gathered; LoRA: the adapters), and what the packing saw (documents crossing a shard edge).
    ``use_ds_longctx=False``: TRL alone (the reference, sp must be 1); ``dp``: data-parallel replicas of the SP groups
    (world = sp x dp)."""
    from peft import LoraConfig

    import ds_longctx

    kind, overrides, lora, *family = CASES[case]
    if kind == "grpo":
        from trl import GRPOConfig as Config, GRPOTrainer as Trainer
    else:
        from trl import RLOOConfig as Config, RLOOTrainer as Trainer
    path = model_dir(rank, *family)  # saved before the DeepSpeed config exists (ZeRO-3 would build it partitioned)
    if use_ds_longctx:
        ds_longctx.enable()
    kw = {}
    if sp > 1:
        from accelerate.utils import DeepSpeedSequenceParallelConfig, ParallelismConfig

        kw["parallelism_config"] = ParallelismConfig(
            sp_backend="deepspeed", sp_size=sp, sp_handler=DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa"),
            **({"dp_replicate_size": dp} if dp > 1 else {}))
    args = Config(output_dir=out_dir(case, rank), per_device_train_batch_size=4, num_generations=2,
                  max_completion_length=6, max_steps=STEPS, learning_rate=LR, optim="sgd", bf16=False,
                  lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1, report_to=[], seed=0,
                  temperature=0.9, save_strategy="no", use_cpu=not torch.cuda.is_available(),
                  dataloader_num_workers=0, deepspeed=ds_config(sp, use_ds_longctx, impl, stack), **overrides, **kw)
    seen = {"completions": [], "losses": [], "crossing": 0, "docs": 0}

    class Recording(Trainer):
        def _generate(self, prompts_):
            out = super()._generate(prompts_)
            seen["completions"].append([list(map(int, c)) for c in out[1]])
            return out

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            seen["losses"].append(float(loss.detach()))
            return loss

    from ds_longctx.objectives import replicated

    real_pack = replicated.pack

    def pack(*a, **k):  # which documents of the packed rows cross an SP shard edge (the test's packed-batch claim)
        p = real_pack(*a, **k)
        n = p.length // max(1, k.get("multiple", 1))
        ends = torch.tensor(p.doc_lens).cumsum(0)
        starts = ends - torch.tensor(p.doc_lens)
        seen["docs"] += len(p.doc_lens)
        seen.setdefault("layouts", []).append((p.length, list(p.doc_lens)))
        seen["crossing"] += int(((starts // n) != ((ends - 1) // n)).sum())
        return p

    replicated.pack = pack
    try:
        trainer = Recording(model=path, reward_funcs=reward_t7, args=args, train_dataset=prompts(),
                          processing_class=tokenizer(),
                          peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 init_lora_weights=False) if lora else None)
        named = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]
        before = _params(named)
        trainer.train()
        after = _params([(n, p) for n, p in trainer.model_wrapped.module.named_parameters() if p.requires_grad]
                        if hasattr(trainer.model_wrapped, "module") else named)
    finally:
        replicated.pack = real_pack
        if use_ds_longctx:
            ds_longctx.disable()
    return {"losses": seen["losses"], "completions": seen["completions"], "before": before, "after": after,
            "crossing": seen["crossing"], "docs": seen["docs"], "layouts": seen.get("layouts", [])}


def _params(named) -> dict:
    import deepspeed

    params = [p for _, p in named]
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        return {n.replace("base_model.model.", ""): p.detach().float().clone() for n, p in named}
