"""Shared helpers for SP-vs-single-process equivalence tests (importable by spawned workers)."""
from __future__ import annotations

import torch

from tiny_models import build, tiny_config


def sample(seq: int, vocab: int, bsz: int = 1, seed: int = 123):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (bsz, seq), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100  # some ignored targets, incl. across the first shard
    return {"input_ids": ids, "labels": labels}


def ds_config(stage: int, sp: int, extra_lc: dict | None = None, **top):
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "sequence_parallel_size": sp,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    }
    if extra_lc is not None:
        cfg["long_context"] = extra_lc
    cfg.update(top)
    return cfg


def full_params(module):
    """Full (gathered) fp32 copies of every parameter, by name."""
    import deepspeed

    params = list(module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
        return {n: p.detach().float().clone() for n, p in params}


def reference_step(cfg_kwargs: dict, batch: dict, seed: int = 0, clip: float = 0.0, more: tuple = ()):
    """Single process, no DeepSpeed: loss and SGD(lr=1) parameter deltas. ``more``: further micro-batches of the
    same optimizer step (gradient accumulation: each loss divided by their number, as DeepSpeed's backward does);
    ``clip``: the global gradient-norm clip applied before the step (torch's clip_grad_norm_, DeepSpeed's
    formula). With ``more`` or ``clip`` also returns the micro-batch losses and the norm before clipping."""
    model = build(tiny_config(**cfg_kwargs), seed=seed)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    micro = (batch,) + tuple(more)
    losses = []
    for b in micro:
        loss = model(input_ids=b["input_ids"], labels=b["labels"]).loss
        (loss / len(micro)).backward()
        losses.append(loss.item())
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip else float("inf")))
    deltas = {n: -p.grad.detach().clone() for n, p in model.named_parameters()}
    if more or clip:
        return losses, deltas, before, norm
    return losses[0], deltas, before


def sp_step(cfg_kwargs: dict, batch: dict, stage: int, sp: int, lc: dict | None = None, seed: int = 0,
            use_model_init: bool = False, clip: float = 0.0, more: tuple = ()):
    """One SGD(lr=1) step through ds_longctx.initialize; returns (loss, deltas, initial params). ``more``: further
    micro-batches of the step (DeepSpeed's gradient_accumulation_steps = 1 + len(more)), ``clip``: DeepSpeed's
    gradient_clipping; with either, the loss is the list of the micro-batches' losses."""
    import ds_longctx
    from ds_longctx.dist.comm import sp_group, sp_rank
    from ds_longctx.data import shard_batch

    config = ds_config(stage, sp, lc, gradient_clipping=clip, gradient_accumulation_steps=1 + len(more))
    if use_model_init:
        with ds_longctx.model_init(config):
            model = build(tiny_config(**cfg_kwargs), seed=seed)
    else:
        model = build(tiny_config(**cfg_kwargs), seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    engine, _, _, _ = ds_longctx.initialize(model=model, optimizer=opt, config=config)
    before = full_params(engine.module)
    losses = []
    for b in (batch,) + tuple(more):
        shard = shard_batch(b, sp_rank(sp_group()) if sp > 1 else 0, sp)
        loss = engine(**shard).loss
        engine.backward(loss)
        engine.step()  # the optimizer steps at the last micro-batch only (gradient accumulation boundary)
        losses.append(loss.item())
    after = full_params(engine.module)
    deltas = {n: after[n] - before[n] for n in after}
    engine.destroy() if hasattr(engine, "destroy") else None
    return (losses if more or clip else losses[0]), deltas, before


def token_batch(kind: str, vocab: int, seq: int, doc_lens, seed: int = 0):
    """One sample of ``seq`` random tokens (the first 3 targets ignored); ``kind`` "packed": position_ids restarting
    at each of ``doc_lens``'s documents."""
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[:, :3] = -100
    out = {"input_ids": ids, "labels": labels}
    if kind == "packed":
        out["position_ids"] = torch.cat([torch.arange(n) for n in doc_lens])[None]
    return out


def one_sgd_step(model, b: dict, sp: int, lc: dict, stage: int = 3, inspect=None):
    """One SGD(lr=1) step of ``model`` through ds_longctx.initialize on this rank's shard of ``b``; returns (loss,
    parameter deltas), and ``inspect(engine)``'s answer third when given; the patch is removed after."""
    import ds_longctx
    from ds_longctx.dist.comm import sp_group, sp_rank
    from ds_longctx.data import shard_batch

    engine, _, _, _ = ds_longctx.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                            config=ds_config(stage, sp, lc))
    seen = inspect(engine) if inspect is not None else None
    before = full_params(engine.module)
    loss = engine(**shard_batch(b, sp_rank(sp_group()), sp)).loss
    engine.backward(loss)
    engine.step()
    after = full_params(engine.module)
    engine.module._ds_longctx_patch.remove()
    deltas = {n: after[n] - before[n] for n in after}
    return (loss.item(), deltas) if inspect is None else (loss.item(), deltas, seen)
