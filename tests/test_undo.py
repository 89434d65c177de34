"""remove() gives a model back what it had before apply_memory_stack: each decoder layer's own
checkpointing flag and function, and the input-gradient hooks (on only if they were on before)."""
import functools

from tiny_models import build, memory_stack, tiny_config

from ds_longctx.config import parse

_AC = {"activation_checkpointing": {"enabled": True, "use_reentrant": True}}


def test_remove_restores_a_plain_model():
    model = build(tiny_config(layers=2))
    handle = memory_stack(model, parse({"long_context": _AC}))
    assert model._require_grads_hooks and all(layer.gradient_checkpointing for layer in handle.checkpointed_layers)
    layers = handle.checkpointed_layers
    handle.remove()
    assert not getattr(model, "_require_grads_hooks", None)
    for layer in layers:
        assert layer.gradient_checkpointing is False and "_gradient_checkpointing_func" not in vars(layer)


def test_remove_keeps_what_the_user_had():
    model = build(tiny_config(layers=2))
    model.gradient_checkpointing_enable()  # HF's own, with its own function
    model.enable_input_require_grads()     # e.g. PEFT
    hooks = list(model._require_grads_hooks)
    layers = [m for m in model.modules() if hasattr(m, "_gradient_checkpointing_func")]
    funcs = [layer._gradient_checkpointing_func for layer in layers]
    assert layers and all(isinstance(f, functools.partial) for f in funcs)
    memory_stack(model, parse({"long_context": _AC})).remove()
    assert model._require_grads_hooks == hooks
    for layer, f in zip(layers, funcs):
        assert layer.gradient_checkpointing is True and layer._gradient_checkpointing_func is f
