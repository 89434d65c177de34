"""Shared bits of the examples: a local tiny model (no download) and fixed-length samples.

Every sample carries ``position_ids``: DeepSpeed's ``UlyssesSPDataLoaderAdapter`` (what the HF
Trainer / Accelerate use under ``ParallelismConfig(sp_backend="deepspeed")``) requires them so that
each sequence shard keeps its global positions.
"""
from __future__ import annotations

import json
import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TINY_LLAMA = os.path.join(ROOT, "ds_configs", "models", "tiny-llama.json")


def tiny_model(path: str = TINY_LLAMA, seed: int = 0, **overrides):
    """A randomly initialised HF causal LM from a local config.json (same weights on every rank)."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    with open(path) as f:
        d = json.load(f)
    d.pop("architectures", None)
    attn = d.pop("attn_implementation", "sdpa")
    d.update(overrides)
    cfg = CONFIG_MAPPING[d.pop("model_type")](**d)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32)


class RandomTokens(torch.utils.data.Dataset):
    """``n`` samples of ``seq_len`` random tokens; sample i depends only on (seed, i)."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int = 0):
        self.n, self.seq_len, self.vocab, self.seed = n, seq_len, vocab, seed

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        ids = torch.randint(0, self.vocab, (self.seq_len,), generator=g)
        labels = ids.clone()
        labels[:5] = -100  # ignored targets, as a prompt would have (uneven valid tokens per SP shard)
        return {"input_ids": ids, "labels": labels, "position_ids": torch.arange(self.seq_len)}


def full_params(module) -> dict:
    """Gathered fp32 copies of every parameter (ZeRO-3 safe), by name."""
    import deepspeed

    params = list(module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
        return {n: p.detach().float().clone() for n, p in params}


def prepare_launched_process() -> None:
    """What a launched example needs on a CPU box for HF's own ALST path (``--hf-alst``: no ds_longctx), before
    Accelerate starts: no DeepSpeed shm all-reduce (its JIT build hung a 2-rank torchrun), and deepspeed.comm
    initialised here: on GPUs Accelerate's PartialState does that, with ``use_cpu`` it does not
    (accelerate/state.py), and DeepSpeed's parallel_state_sp (register_with_transformers) asserts it.
    ``ds_longctx.enable()`` does both itself (ds_longctx/hf/integration.py), so the ds_longctx runs skip this."""
    from ds_longctx.dist.comm import disable_cpu_shm_allreduce

    disable_cpu_shm_allreduce()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available():
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
