"""TRL's GRPOTrainer + ds_longctx: RL under sequence parallelism, the stock trainer, one line added.

    deepspeed --num_gpus 2 examples/grpo.py                  # SP=2: untied attention + the memory stack, ZeRO-3
    torchrun --nproc_per_node 2 examples/grpo.py --attention ulysses
    python examples/grpo.py --sp 1                            # one process

The recipe is the SFT one (examples/trl_sft.py): ``ds_longctx.enable()``, a ``long_context`` section in the DeepSpeed
config, ``parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=N)``. The SP group is one TRL process:
its ranks generate the same completions (transformers' generate, the ds_longctx patch suspended), score them with the
same rewards, and shard the prompt + completion batch along the sequence for the policy's, the old policy's and the
reference's log-probabilities (tiled through the lm_head, gathered over the group: ds_longctx/hf/rl.py).

The task is a verifiable toy: the reward is the fraction of completion tokens that are "t7". The local tiny Llama
(ds_configs/models/tiny-llama.json, random init) learns it in about 20 steps; the log shows the reward rising.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import tiny_model  # noqa: E402
from hf_trainer import ds_config  # noqa: E402
from trl_sft import tiny_tokenizer  # noqa: E402


def reward_t7(completions, **kwargs):
    """Verifiable: the share of the completion's tokens that are t7."""
    return [sum(w == "t7" for w in c.split()) / max(1, len(c.split())) for c in completions]


def prompts(n: int, vocab: int, seed: int = 0):
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    return Dataset.from_list([{"prompt": " ".join(f"t{int(i)}" for i in torch.randint(8, vocab, (int(k),), generator=g))}
                              for k in torch.randint(2, 9, (n,), generator=g)])


def train(sp: int, attention: str = "untied_ulysses", steps: int = 20, lr: float = 1e-2, beta: float = 0.0,
          output_dir: str = "/tmp/ds_longctx_grpo"):
    from trl import GRPOConfig, GRPOTrainer

    import ds_longctx

    ds_longctx.enable()  # <- the one line
    model = tiny_model(seed=0)
    kw = {}
    if sp > 1:
        from accelerate.utils import DeepSpeedSequenceParallelConfig, ParallelismConfig

        kw["parallelism_config"] = ParallelismConfig(
            sp_backend="deepspeed", sp_size=sp,
            sp_handler=DeepSpeedSequenceParallelConfig(sp_attn_implementation=model.config._attn_implementation))
    args = GRPOConfig(output_dir=output_dir, per_device_train_batch_size=8, num_generations=8, max_completion_length=8,
                      max_steps=steps, learning_rate=lr, beta=beta, bf16=False, lr_scheduler_type="constant",
                      logging_steps=2, report_to=[], seed=0, save_strategy="no", disable_tqdm=True,
                      use_cpu=not torch.cuda.is_available(), deepspeed=ds_config(sp, attention), **kw)
    trainer = GRPOTrainer(model=model, reward_funcs=reward_t7, args=args, processing_class=tiny_tokenizer(64),
                          train_dataset=prompts(8 * steps, model.config.vocab_size))
    trainer.train()
    return [(h["step"], round(h["reward"], 4)) for h in trainer.state.log_history if "reward" in h]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sp", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    p.add_argument("--attention", default="untied_ulysses", choices=["ulysses", "untied_ulysses"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--beta", type=float, default=0.0, help="KL weight (> 0: a reference model, under SP too)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1)
    a = p.parse_args(argv)
    rewards = train(a.sp, a.attention, a.steps, beta=a.beta)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"reward_by_step": rewards}))


if __name__ == "__main__":
    import ds_longctx

    ds_longctx.run(main)  # an error on any rank ends the job; no interpreter finalization at the end
