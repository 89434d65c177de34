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


# the router's auxiliary (load-balancing) loss on: what the "aux" batch kind trains (a plain sample)
AUX = {"output_router_logits": True, "router_aux_loss_coef": 0.5}


def build_gpt_oss(seed: int = 0, sinks_zero: bool = False, attn: str = "eager", aux: bool = False):
    """``attn``: 'eager' (the one-process reference) or 'flex_attention' (what SP runs: GPT-OSS has no SDPA path,
    and ds_longctx refuses 'eager' under SP; its own kernel runs the attention, sinks included); ``aux``: the
    router's auxiliary loss added to the loss (AUX)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = gpt_oss_config()
    for key, value in (AUX.items() if aux else ()):
        setattr(cfg, key, value)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation=attn)
    with torch.no_grad():
        for layer in model.model.layers:
            if sinks_zero:
                layer.self_attn.sinks.fill_(-1e4)  # exp(sink) ~ 0: no sink
            else:  # sinks of the size that matters (the default init is small)
                layer.self_attn.sinks.copy_(torch.linspace(-1.0, 2.0, layer.self_attn.sinks.numel()))
    return model


def batch(kind: str, seed: int = 0):
    """``kind``: 'plain', 'packed', or 'aux' (the plain sample, trained with the router's auxiliary loss)."""
    from sp_cases import token_batch

    return token_batch("plain" if kind == "aux" else kind, VOCAB, SEQ, DOC_LENS, seed)


def reference(b: dict, sinks_zero: bool = False, aux: bool = False):
    """One process, transformers' eager attention. Packed: each document run alone (GPT-OSS's forward builds its
    masks without position_ids, so transformers does not mask packed documents for it; running them alone is what
    document masking means), the logits concatenated and the loss taken over the whole sample as HF's forward does.
    ``aux``: a plain sample's loss with the router's auxiliary loss (HF's forward adds it)."""
    import torch.nn.functional as F

    assert not (aux and "position_ids" in b), "the aux reference is HF's forward over one plain sample"
    model = build_gpt_oss(sinks_zero=sinks_zero, aux=aux)
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


def sp_step(lc: dict, b: dict, sp: int, aux: bool = False):
    """(loss, deltas, the MLP classes tiled_mlp runs in tiles)."""
    from sp_cases import one_sgd_step

    def tiled(engine):
        memory = engine.module._ds_longctx_patch.memory
        return [type(m).__name__ for m in memory.tiled_mlps] if memory is not None else []

    return one_sgd_step(build_gpt_oss(attn="flex_attention", aux=aux), b, sp, lc, inspect=tiled)
