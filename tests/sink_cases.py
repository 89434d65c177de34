"""GPT-OSS (attention sinks) tiny random-init models and the spawned SP cases of tests/test_sinks_sp.py."""
from __future__ import annotations

import torch

from arch_cases import BASE, VOCAB

SEQ = 16
DOC_LENS = (5, 7, 4)


def gpt_oss_config(window: int = 4):
    """Sliding (``window`` tokens) and full layers alternating, both with sinks; 4 experts top-2."""
    import transformers as tf

    return tf.GptOssConfig(**dict(BASE, num_hidden_layers=2), num_key_value_heads=2, head_dim=8, num_local_experts=4,
                           num_experts_per_tok=2, sliding_window=window, attention_dropout=0.0)


def build_gpt_oss(seed: int = 0, sinks_zero: bool = False, attn: str = "eager"):
    """``attn``: 'eager' (the one-process reference) or 'flex_attention' (what SP runs: GPT-OSS has no SDPA path,
    and ds_longctx refuses 'eager' under SP; its own kernel runs the attention, sinks included)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(gpt_oss_config(), dtype=torch.float32, attn_implementation=attn)
    with torch.no_grad():
        for layer in model.model.layers:
            if sinks_zero:
                layer.self_attn.sinks.fill_(-1e4)  # exp(sink) ~ 0: no sink
            else:  # sinks of the size that matters (the default init is small)
                layer.self_attn.sinks.copy_(torch.linspace(-1.0, 2.0, layer.self_attn.sinks.numel()))
    return model


def batch(kind: str, seed: int = 0):
    from sp_cases import token_batch

    return token_batch(kind, VOCAB, SEQ, DOC_LENS, seed)


def reference(b: dict, sinks_zero: bool = False):
    """One process, transformers' eager attention. Packed: each document run alone (GPT-OSS's forward builds its
    masks without position_ids, so transformers does not mask packed documents for it; running them alone is what
    document masking means), the logits concatenated and the loss taken over the whole sample as HF's forward does."""
    import torch.nn.functional as F

    model = build_gpt_oss(sinks_zero=sinks_zero)
    if "position_ids" not in b:
        loss = model(**b, use_cache=False).loss
    else:
        ids, labels = b["input_ids"], b["labels"]
        starts = [0]
        for n in DOC_LENS:
            starts.append(starts[-1] + n)
        logits = torch.cat([model(input_ids=ids[:, a:e], use_cache=False).logits
                            for a, e in zip(starts[:-1], starts[1:])], dim=1)
        loss = F.cross_entropy(logits[0, :-1].float(), labels[0, 1:], ignore_index=-100)
    loss.backward()
    return loss.item(), {n: (-p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
                         for n, p in model.named_parameters()}, {n: p.detach().clone() for n, p in model.named_parameters()}


def sp_step(lc: dict, b: dict, sp: int):
    from sp_cases import one_sgd_step

    return one_sgd_step(build_gpt_oss(attn="flex_attention"), b, sp, lc)
