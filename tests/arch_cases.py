"""Tiny models of the architectures users bring (transformers' own config classes, random init) and the
spawned SP=2 cases of tests/test_arch_batches.py (importable by spawned workers)."""
from __future__ import annotations

import math

import torch

VOCAB = 64
BASE = dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, vocab_size=VOCAB, intermediate_size=48,
            max_position_embeddings=256, tie_word_embeddings=False)


def arch_config(name: str):
    """Each config as a user writes it: no head_dim (Mixtral's default None), no num_key_value_heads where the
    architecture has none (GPT-NeoX)."""
    import transformers as tf

    if name == "mixtral":  # head_dim left at its default None
        return tf.MixtralConfig(**BASE, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    if name == "gpt_neox":  # no num_key_value_heads, no head_dim
        return tf.GPTNeoXConfig(**BASE, attention_dropout=0.0, hidden_dropout=0.0)
    if name == "phi3":
        return tf.Phi3Config(**BASE, num_key_value_heads=2, pad_token_id=0)
    if name == "olmo2":
        return tf.Olmo2Config(**BASE, num_key_value_heads=2)
    if name == "qwen2_moe":
        return tf.Qwen2MoeConfig(**BASE, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=24, shared_expert_intermediate_size=24)
    if name == "gemma2":  # window covering the samples (SP refuses shorter ones)
        return tf.Gemma2Config(**BASE, num_key_value_heads=2, head_dim=8, sliding_window=64)
    if name == "gemma3":
        return tf.Gemma3TextConfig(**BASE, num_key_value_heads=2, head_dim=8, sliding_window=64)
    if name == "llama":
        return tf.LlamaConfig(**BASE, num_key_value_heads=2)
    if name == "qwen3_moe":
        return tf.Qwen3MoeConfig(**BASE, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=24)
    if name == "olmoe":
        return tf.OlmoeConfig(**BASE, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2)
    # MLPs recognised by their source (LlamaMLP's forward): no entry in ds_longctx.models
    if name == "gemma":
        return tf.GemmaConfig(**BASE, num_key_value_heads=2, head_dim=8)
    if name == "granite":
        return tf.GraniteConfig(**BASE, num_key_value_heads=2)
    if name == "cohere":
        return tf.CohereConfig(**BASE, num_key_value_heads=2)
    if name == "olmo":
        return tf.OlmoConfig(**BASE, num_key_value_heads=2)
    if name == "glm4":
        return tf.Glm4Config(**BASE, num_key_value_heads=2, head_dim=8, pad_token_id=0, eos_token_id=1)
    if name == "nemotron":
        return tf.NemotronConfig(**BASE, num_key_value_heads=2, head_dim=8)
    if name == "starcoder2":  # residual dropout 0 (tiling refuses a dropout in training)
        return tf.Starcoder2Config(**BASE, num_key_value_heads=2, residual_dropout=0.0, embedding_dropout=0.0,
                                   attention_dropout=0.0)
    if name == "phi":
        return tf.PhiConfig(**BASE, num_key_value_heads=2, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)
    # MLPs recognised by their source: FalconH1MLP's (scalar multipliers), Llama4TextMLP's, Lfm2MLP's (F.silu)
    if name == "falcon_h1":  # every layer attention beside a Mamba2 mixer (one B/C group)
        return tf.FalconH1Config(**BASE, num_key_value_heads=2, head_dim=8, mamba_n_heads=8, mamba_d_head=8,
                                 mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=4, mamba_d_ssm=64,
                                 mamba_n_groups=1, mlp_multipliers=[1.5, 0.5])
    if name == "lfm2":
        return tf.Lfm2Config(**BASE, num_key_value_heads=2, layer_types=["conv", "full_attention"], conv_L_cache=3)
    if name == "llama4_text":  # dense layers only (Llama4TextMLP)
        return tf.Llama4TextConfig(**BASE, num_key_value_heads=2, head_dim=8, intermediate_size_mlp=48, moe_layers=[])
    if name == "phimoe":  # its window (8 < the 16-token samples) applied through the mask only
        return tf.PhimoeConfig(**BASE, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                               sliding_window=8, router_jitter_noise=0.0, input_jitter_noise=0.0)
    raise KeyError(name)


def build_arch(name: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    attn = "eager" if name == "gemma2" else "sdpa"  # transformers has no sdpa path for Gemma2 (soft-capping)
    return AutoModelForCausalLM.from_config(arch_config(name), dtype=torch.float32, attn_implementation=attn)


def sample(seq: int = 16, seed: int = 0):
    ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[:, :3] = -100
    return {"input_ids": ids, "labels": labels}


def reference(name: str, batch: dict):
    """One process, no DeepSpeed: the loss and SGD(lr=1) deltas (= -grad)."""
    model = build_arch(name)
    loss = model(**batch).loss
    loss.backward()
    return loss.item(), {n: -p.grad.detach().clone() for n, p in model.named_parameters()}, \
        {n: p.detach().clone() for n, p in model.named_parameters()}


def sp_step(name: str, lc: dict, batch: dict, rank: int):
    """One SGD(lr=1) step at SP=2 through ds_longctx.initialize (ZeRO-3): (loss, deltas)."""
    import ds_longctx
    from ds_longctx.data import shard_batch
    from sp_cases import ds_config, full_params

    model = build_arch(name)
    engine, _, _, _ = ds_longctx.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                            config=ds_config(3, 2, lc))
    before = full_params(engine.module)
    loss = engine(**shard_batch(batch, rank, 2)).loss
    engine.backward(loss)
    engine.step()
    after = full_params(engine.module)
    engine.module._ds_longctx_patch.remove()
    return loss.item(), {n: after[n] - before[n] for n in after}


def max_delta_error(ref: dict, got: dict, params: dict):
    """Worst relative Frobenius error of the SGD deltas beyond one ulp of the parameter per element (an update
    rounding the other way, eco_cases.delta_errors), and the tensor it is in."""
    errs = {}
    for n in ref:
        ulp = torch.finfo(torch.float32).eps * (params[n] + ref[n]).abs()
        beyond = ((got[n] - ref[n]).abs() - ulp).clamp(min=0)
        errs[n] = float(beyond.norm() / ref[n].norm().clamp(min=1e-30))
    worst = max(errs, key=errs.get)
    return errs[worst], worst


def trainer_eval(name: str, sp: int, lc: dict | None, rank: int, steps: int = 1, samples: int = 4, seq: int = 16,
                 logits: bool = False):
    """HF Trainer (SGD) with ds_longctx.enable(): ``steps`` training steps, then evaluate() on ``samples``
    full-length samples. Returns (the Trainer's eval_loss, the one-process eval loss of the same trained
    weights: the mean over the samples of an unpatched model's loss). ``logits``: evaluate with a
    compute_metrics (the Trainer then asks for logits, prediction_loss_only False) and return (the logits
    compute_metrics got [samples, seq, vocab], the one-process logits of the same weights) instead."""
    from transformers import Trainer, TrainingArguments

    import ds_longctx
    from hf_trainer import ds_config

    sys_path_examples()
    from _common import RandomTokens

    if lc is not None:
        ds_longctx.enable()
    model = build_arch(name)
    ref = build_arch(name)  # before TrainingArguments: its ZeRO-3 config would partition models built later
    kw = {}
    if sp > 1:
        from accelerate.utils import DeepSpeedSequenceParallelConfig, ParallelismConfig

        kw["parallelism_config"] = ParallelismConfig(sp_backend="deepspeed", sp_size=sp,
                                                     sp_handler=DeepSpeedSequenceParallelConfig(
                                                         sp_attn_implementation="sdpa"))
    cfg = ds_config(sp, long_context=False)
    if lc is not None:
        cfg["long_context"] = lc
    args = TrainingArguments(output_dir=f"/tmp/ds_longctx_arch_eval{rank}", per_device_train_batch_size=1,
                             per_device_eval_batch_size=1, max_steps=steps, learning_rate=0.05, optim="sgd",
                             lr_scheduler_type="constant", max_grad_norm=0.0, save_strategy="no", report_to=[],
                             seed=0, data_seed=0, use_cpu=True, dataloader_num_workers=0, deepspeed=cfg,
                             **kw)
    train = RandomTokens(8, seq, VOCAB, seed=0)
    evald = RandomTokens(samples, seq, VOCAB, seed=1)
    got = []

    def compute_metrics(pred):
        got.append(torch.as_tensor(pred.predictions))
        return {"n": len(got[-1])}

    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=evald,
                      compute_metrics=compute_metrics if logits else None)
    trainer.train()
    try:
        metrics = trainer.evaluate()
    finally:
        if lc is not None:
            ds_longctx.disable()
    # the one-process eval loss of the same (trained) weights: the Trainer's mean of per-batch losses
    from _common import full_params

    params = full_params(trainer.model_wrapped.module if hasattr(trainer.model_wrapped, "module") else model)
    ref.load_state_dict(params)
    with torch.no_grad():
        outs = [ref(input_ids=evald[i]["input_ids"][None], labels=evald[i]["labels"][None]) for i in range(samples)]
    if logits:
        return got[0], torch.cat([o.logits for o in outs])
    one = [o.loss.item() for o in outs]
    return metrics["eval_loss"], sum(one) / len(one)


def sys_path_examples():
    import eco_cases  # noqa: F401  (puts examples/ on sys.path)


def isclose(a, b, rel=1e-5):
    return math.isclose(a, b, rel_tol=rel)
