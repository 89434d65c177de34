"""The architecture registry is the one list: every registered architecture has a tiny test config, and
every piece of per-architecture knowledge comes from it."""
import importlib

from tiny_models import ARCHS, build, tiny_config


def test_registry_and_tiny_configs_agree():
    from ds_longctx.models import ARCHITECTURES

    assert set(ARCHITECTURES) == set(ARCHS)


def test_registered_classes_exist_and_are_recognised():
    from ds_longctx.memory.tiling import find_mlps
    from ds_longctx.models import ARCHITECTURES, is_llama_style_rmsnorm, layer_role

    for model_type, arch in ARCHITECTURES.items():
        mod = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        assert hasattr(mod, arch.attention.attention_class) and hasattr(mod, arch.mlp_class)
        model = build(tiny_config(model_type))
        assert len(find_mlps(model)) == tiny_config(model_type).num_hidden_layers
        layer = model.get_decoder().layers[0]
        roles = {name: layer_role(name) for name, _ in layer.named_children()}
        assert sorted(r for r in roles.values() if r) == ["attention", "mlp"], roles
        assert is_llama_style_rmsnorm(model.get_decoder().norm)
