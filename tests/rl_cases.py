"""Cases of tests/test_token_logprobs.py (importable by spawned workers): the tiny families, the three batches (plain,
padded on both sides as TRL's prompt + completion, packed with documents crossing the shard edges), one process's
per-token log-probabilities / entropy / KL and a GRPO-style loss built on them, and the same through
``ds_longctx.token_logprobs`` at SP > 1 (ZeRO-3, SGD)."""
from __future__ import annotations

import functools

import torch

VOCAB = 64
SEQ = 16
TEMPERATURE = 0.7
LR = 0.1
BETA, ENT = 0.05, 0.01  # the KL and entropy weights of the GRPO-style loss
ADV = (0.5, -1.0, 0.75)  # per-row advantages
KINDS = ("plain", "padded", "packed")
UNTIED = {"attention": {"implementation": "untied_ulysses", "heads_per_chunk": 1, "fuse_projections": False}}
ULYSSES = {"attention": {"implementation": "ulysses"}}
STACK = {"activation_checkpointing": {"enabled": True, "offload": "cpu", "pin_memory": False},
         "tiled_mlp": {"enabled": True, "shards": 2}, "tiled_loss": {"enabled": True, "shards": 3},
         "rms_norm": {"enabled": True}}
LC = {"ulysses": ULYSSES, "untied": UNTIED, "untied+stack": {**UNTIED, **STACK},
      "ulysses+stack": {**ULYSSES, **STACK}}


def build(family: str, seed: int = 0):
    """The family's tiny random-init model (fp32, sdpa): Llama, a hybrid (Qwen3-Next: Gated DeltaNet + attention,
    MoE) and MLA (DeepSeek-V3)."""
    if family in ("llama", "llama_2h"):  # llama_2h: 2 heads, so SP=4 runs Ulysses 2 x ring 2 (issue 47)
        from tiny_models import build as build_tiny, tiny_config

        heads = dict(heads=2, kv_heads=2) if family == "llama_2h" else {}
        return build_tiny(tiny_config(vocab=VOCAB, **heads), seed=seed).train()
    if family == "qwen3_next":
        from test_hybrid import build_hybrid

        return build_hybrid("qwen3_next", seed).train()
    if family == "deepseek_v3":
        from moe_cases import build_moe

        return build_moe("deepseek_v3", seed)
    raise KeyError(family)


def batches() -> dict:
    """``kind`` -> the full batch every rank holds: ``plain`` (2 rows, no padding), ``padded`` (3 rows: prompts padded
    on the left, completions on the right, as TRL builds them; one row's completion masked whole, as
    mask_truncated_completions does), ``packed`` (one row, documents of 5, 7 and 4 tokens by restarting
    position_ids). Targets: the "completion" tokens (labels -100 elsewhere)."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, VOCAB, (3, SEQ), generator=g)
    plain_labels = ids[:2].clone()
    plain_labels[:, :6] = -100
    mask = torch.ones(3, SEQ, dtype=torch.long)
    mask[0, :3] = 0           # left padding 3, right padding 2
    mask[0, 14:] = 0
    mask[1, :1] = 0           # left padding 1
    mask[2, 5:] = 0           # a prompt whose completion is masked whole (and right padding)
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :8] = -100      # the prompt part (TRL: labels[:, :-logits_to_keep] = -100)
    packed_labels = ids[:1].clone()
    packed_labels[:, [0, 5, 12]] = -100  # each document's first token has no target within it
    packed_labels[:, :2] = -100
    return {"plain": {"input_ids": ids[:2], "labels": plain_labels},
            "padded": {"input_ids": ids, "attention_mask": mask, "labels": labels},
            "packed": {"input_ids": ids[:1], "labels": packed_labels,
                       "position_ids": torch.cat([torch.arange(n) for n in (5, 7, 4)])[None]}}


def _per_row_logits(model, batch: dict):
    """Logits [B, S, V] of one process, each row's real span (or each packed document) run alone with its positions:
    what the padded (packed) batch means for every family (a hybrid's recurrence restarts per document)."""
    ids = batch["input_ids"]
    b, s = ids.shape
    mask = batch.get("attention_mask", torch.ones_like(ids))
    pos = batch.get("position_ids")
    out = torch.zeros(b, s, model.config.vocab_size)
    for i in range(b):
        real = mask[i].nonzero().flatten().tolist()
        if not real:
            continue
        l, r = real[0], real[-1] + 1
        p = pos[i, l:r] if pos is not None else torch.arange(l, r)
        starts = [0] + (((p[1:] - p[:-1]) != 1).nonzero().flatten() + 1).tolist() + [r - l]
        for a, e in zip(starts, starts[1:]):
            out[i, l + a:l + e] = model(input_ids=ids[i:i + 1, l + a:l + e], position_ids=p[None, a:e]).logits[0].float()
    return out


def reference_logits(family: str, model, batch: dict):
    """One process: Llama's padded batch through transformers' own padded forward (positions arange, the mask: what
    TRL runs), every other batch and family document by document (_per_row_logits)."""
    if family == "llama" and "attention_mask" in batch:
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    return _per_row_logits(model, batch)


def fields(logits, labels, temperature: float = TEMPERATURE):
    """Labels-aligned [B, S] log-probability and entropy of each target (0 elsewhere), and the mask:
    ``log_softmax(logits / T).gather``."""
    logp = torch.log_softmax(logits[:, :-1] / temperature, -1)
    target = labels[:, 1:]
    mask = target != -100
    lp = logp.gather(-1, target.clamp(min=0)[..., None])[..., 0].masked_fill(~mask, 0)
    ent = -(logp.exp() * logp).sum(-1).masked_fill(~mask, 0)
    pad = torch.nn.functional.pad
    return pad(lp, (1, 0)), pad(ent, (1, 0)), pad(mask, (1, 0))


def grpo_like_loss(seq_lp_sums, seq_counts, kl_sum, ent_sum, n_tokens):
    """mean over rows of -adv * (row's mean log-prob) + BETA * token-mean KL - ENT * token-mean entropy."""
    adv = torch.tensor(ADV[:seq_lp_sums.shape[0]], dtype=seq_lp_sums.dtype)
    per_row = -adv * seq_lp_sums / seq_counts.clamp(min=1)
    n = n_tokens.clamp(min=1)
    return per_row.mean() + BETA * kl_sum / n - ENT * ent_sum / n


def ref_model_logprobs(family: str, batch: dict):
    """The reference policy's labels-aligned log-probabilities (another seed), which the KL is taken against."""
    with torch.no_grad():
        ref = build(family, seed=1)
        lp, _, _ = fields(reference_logits(family, ref, batch), batch["labels"])
    return lp


@functools.lru_cache(maxsize=None)
def reference(family: str):
    """One process, no DeepSpeed, the kinds one after the other with SGD(LR) on the GRPO-style loss: per kind
    (lp, entropy, kl [B, S], loss) and the parameter deltas after all of them."""
    model = build(family)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = {}
    for kind, b in batches().items():
        lp, ent, mask = fields(reference_logits(family, model, b), b["labels"])
        ref_lp = ref_model_logprobs(family, b)
        d = ref_lp - lp
        kl = (torch.exp(d) - d - 1).masked_fill(~mask, 0)
        m = mask.float()
        loss = grpo_like_loss((lp * m).sum(1), m.sum(1), (kl * m).sum(), (ent * m).sum(), m.sum())
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= LR * p.grad
        out[kind] = (lp.detach(), ent.detach(), kl.detach(), loss.item())
    deltas = {n: p.detach() - before[n] for n, p in model.named_parameters()}
    return out, deltas, before


def sp_run(family: str, impl: str, rank: int, sp: int):
    """The same through ds_longctx.token_logprobs at SP=``sp`` (ZeRO-3, SGD(LR)): per kind the gathered
    (lp, entropy, kl) and the loss, and the deltas."""
    import ds_longctx
    from sp_cases import ds_config, full_params

    model = build(family)
    engine, *_ = ds_longctx.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                       config=ds_config(3, sp, LC[impl]))
    before = full_params(engine.module)
    out = {}
    for kind, b in batches().items():
        tl = ds_longctx.token_logprobs(engine, b, temperature=TEMPERATURE, ref_logprobs=ref_model_logprobs(family, b))
        loss = grpo_like_loss(tl.sequence_sums(tl.logprobs), tl.sequence_counts(), tl.sum(tl.kl), tl.sum(tl.entropy),
                              tl.token_count())
        engine.backward(loss)
        engine.step()
        with torch.no_grad():
            out[kind] = tuple(tl.gather(x).detach() for x in (tl.logprobs, tl.entropy, tl.kl)) + (loss.item(),)
    after = full_params(engine.module)
    engine.module._ds_longctx_patch.remove()
    return out, {n: after[n] - before[n] for n in after}
