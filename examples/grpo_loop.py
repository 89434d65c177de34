"""GRPO in a plain DeepSpeed loop under sequence parallelism, with ds_longctx's per-token log-probabilities.

    deepspeed --num_gpus 2 examples/grpo_loop.py          # SP=2, untied attention + the memory stack, ZeRO-2
    python examples/grpo_loop.py --sp 1

Each step: every rank of the SP group takes the same prompts and generates the same completions (one seed; the
ds_longctx patch suspended: transformers' generate on whole sequences, the weights gathered); the rewards give
group-normalised advantages; ``ds_longctx.token_logprobs`` packs the prompt + completion batch, shards it along the
sequence and returns this rank's per-token log-probabilities (tiled through the lm_head); the GRPO loss (per-sequence
token mean, on-policy ratio) is built from sums reduced over the group, then ``engine.backward``. Toy task as
examples/grpo.py: the reward is the share of completion tokens that are t7.
"""
import argparse
import os
import sys

import torch

import ds_longctx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import tiny_model  # noqa: E402
from hf_trainer import ds_config  # noqa: E402

T7, EOS, GROUP = 7, 1, 8  # the rewarded token, end of sequence, completions per prompt


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--sp", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1)
    a = p.parse_args(argv)
    # ZeRO-2: generate() runs on whole weights (under ZeRO-3 its changing module order breaks DeepSpeed's prefetch
    # trace unless the hooks are taken off, as TRL's unwrap_model_for_generation does)
    config = dict(ds_config(a.sp, stage=2), train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1,
                  gradient_clipping=1.0, optimizer={"type": "AdamW", "params": {"lr": 1e-2}})
    model = tiny_model(seed=0)
    engine, *_ = ds_longctx.initialize(model=model, model_parameters=model.parameters(), config=config)
    for step in range(a.steps):
        g = torch.Generator().manual_seed(step)  # the same prompt on every rank of the group
        prompt = torch.randint(8, 64, (1, int(torch.randint(2, 9, (1,), generator=g))), generator=g)
        torch.manual_seed(1000 + step)  # the same sampling on every rank of the group
        with ds_longctx.suspended(engine.module), torch.no_grad():
            out = engine.module.generate(prompt.repeat(GROUP, 1), do_sample=True, max_new_tokens=8, temperature=1.0,
                                         pad_token_id=0, eos_token_id=EOS, attention_mask=torch.ones(GROUP, prompt.shape[1]))
        completion = out[:, prompt.shape[1]:]
        ended = (completion == EOS).int().cumsum(1)
        mask = ((ended == 0) | ((ended == 1) & (completion == EOS))).long()  # through the first EOS
        reward = ((completion == T7) * mask).sum(1) / mask.sum(1).clamp(min=1)
        adv = (reward - reward.mean()) / (reward.std() + 1e-4)
        ids = torch.cat([prompt.repeat(GROUP, 1), completion], 1)
        attention = torch.cat([torch.ones_like(prompt.repeat(GROUP, 1)), mask], 1)
        batch = {"input_ids": ids, "attention_mask": attention,
                 "completion_mask": torch.cat([torch.zeros_like(prompt.repeat(GROUP, 1)), mask], 1)}
        tl = ds_longctx.token_logprobs(engine, batch)  # this rank's shard of the completion tokens
        ratio = torch.exp(tl.logprobs - tl.logprobs.detach())  # on-policy: 1, its gradient that of the log-prob
        per_seq = tl.sequence_sums(-ratio * tl.per_token(adv)) / tl.sequence_counts().clamp(min=1)
        loss = per_seq.mean()  # GRPO's "grpo" loss: the mean over sequences of each one's token mean
        engine.backward(loss)
        engine.step()
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"step {step}: reward {reward.mean().item():.3f} loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    ds_longctx.run(main)
