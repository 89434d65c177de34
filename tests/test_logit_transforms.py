"""The model's own logit transform (issue 19): ds_longctx's loss forward applies exactly what the HF
model's forward applies between lm_head and the loss (Gemma soft-capping, Granite logits_scaling,
Cohere logit_scale), tiled or not; a CausalLM whose logit path it cannot reproduce is refused.

One process, SP=1, implementation "none", real tiny random-init models from transformers' config classes.
The logits are made large (lm_head scaled up) or the transform strong (softcap 0.5), so that dropping the
transform changes the loss far beyond the tolerance.
"""
import pytest
import torch

from eco_cases import config_error

SMALL = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_hidden_layers=2,
             vocab_size=64, intermediate_size=48, max_position_embeddings=256, tie_word_embeddings=False)


def _config(arch):
    import transformers as tf

    if arch == "llama":
        return tf.LlamaConfig(**SMALL), "sdpa", 40.0
    if arch == "gemma2_softcap_0.5":  # eager: Gemma2 has no sdpa path (attention soft-capping)
        return tf.Gemma2Config(**SMALL, final_logit_softcapping=0.5), "eager", 40.0
    if arch == "gemma2_default_cap_large_logits":  # softcap 30 with logits at a trained model's scale
        return tf.Gemma2Config(**SMALL), "eager", 400.0
    if arch == "gemma3_softcap_0.5":
        return tf.Gemma3TextConfig(**SMALL, final_logit_softcapping=0.5, sliding_window=8), "sdpa", 40.0
    if arch == "granite_scaling_8":
        return tf.GraniteConfig(**SMALL, logits_scaling=8.0), "sdpa", 40.0
    if arch == "cohere":
        return tf.CohereConfig(**SMALL, logit_scale=0.0625), "sdpa", 40.0
    raise KeyError(arch)


def _build(arch):
    from transformers import AutoModelForCausalLM

    cfg, attn, lm_scale = _config(arch)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation=attn)
    with torch.no_grad():
        model.lm_head.weight.mul_(lm_scale)
    return model


def _lc(tiled: bool):
    from ds_longctx.config import parse

    return parse({"long_context": {"attention": {"implementation": "none"},
                                   "tiled_loss": {"enabled": tiled, "shards": 3}}})


def _loss_and_grads(model, ids, labels):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=labels, use_cache=False).loss
    loss.backward()
    return loss.detach(), model.lm_head.weight.grad.clone(), model.get_input_embeddings().weight.grad.clone()


ARCHS = ["llama", "gemma2_softcap_0.5", "gemma2_default_cap_large_logits", "gemma3_softcap_0.5", "granite_scaling_8",
         "cohere"]


@pytest.mark.parametrize("arch", ARCHS)
def test_loss_equals_hf_forward_loss(arch):
    from tiny_models import patch

    model = _build(arch)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, 24), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100
    ref = _loss_and_grads(model, ids, labels)
    for tiled in (False, True):
        handle = patch(model, _lc(tiled))
        try:
            got = _loss_and_grads(model, ids, labels)
        finally:
            handle.remove()
        for r, o in zip(ref, got):
            torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-6)
    if arch != "llama":  # the case is sensitive: without the model's transform the loss is far off
        from ds_longctx.loss import causal_lm_loss_sum, shift_labels_of

        with torch.no_grad():
            hidden = model.get_decoder()(input_ids=ids).last_hidden_state
            s, n, _ = causal_lm_loss_sum(hidden, model.lm_head, shift_labels_of(labels))
        assert abs(float(s / n) - float(ref[0])) > 1e-2


def test_logit_paths_of_transformers_classes():
    """The forward-source reading names each known transform and refuses the ones it does not know."""
    import transformers as tf

    from ds_longctx.models.logits import classify_forward

    assert classify_forward(tf.LlamaForCausalLM)[0] == "identity"
    assert classify_forward(tf.Qwen2ForCausalLM)[0] == "identity"
    assert classify_forward(tf.Gemma2ForCausalLM)[0] == "final_logit_softcapping"
    assert classify_forward(tf.Gemma3ForCausalLM)[0] == "final_logit_softcapping"
    assert classify_forward(tf.GraniteForCausalLM)[0] == "logits_scaling"
    assert classify_forward(tf.GraniteMoeForCausalLM)[0] == "logits_scaling"
    assert classify_forward(tf.CohereForCausalLM)[0] == "logit_scale"
    assert classify_forward(tf.FalconH1ForCausalLM)[0] == "lm_head_multiplier"
    # MiniCPM3 scales the hidden state before lm_head: refused, naming the class
    e = config_error(lambda: classify_forward(tf.MiniCPM3ForCausalLM))
    assert e.startswith("model: MiniCPM3ForCausalLM") and "not supported" in e and "Fix:" in e


def test_unknown_logit_path_refused_at_patch():
    """A model whose forward does something ds_longctx does not know to its logits: ConfigError at patch time."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tiny_models import patch

    class TemperedLlama(LlamaForCausalLM):
        def forward(self, input_ids=None, labels=None, logits_to_keep=0, **kwargs):
            outputs = self.model(input_ids=input_ids, **kwargs)
            hidden_states = outputs.last_hidden_state
            logits = self.lm_head(hidden_states)
            logits = logits / 0.7  # a temperature
            loss = None
            if labels is not None:
                loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
            return loss, logits

    torch.manual_seed(0)
    model = TemperedLlama(LlamaConfig(**SMALL))
    e = config_error(lambda: patch(model, _lc(False)))
    assert e is not None and "TemperedLlama" in e and "logits / 0.7" in e
    assert getattr(model, "_ds_longctx_patch", None) is None and "forward" not in model.__dict__
