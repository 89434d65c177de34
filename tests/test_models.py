"""The architecture registry is the one list: every registered architecture has a tiny test config, and
every piece of per-architecture knowledge comes from it."""
import importlib

from tiny_models import ARCHS, build, tiny_config


def test_registry_and_tiny_configs_agree():
    """Fused-attention architectures have a tiny config in tiny_models.py, MLP-only ones in arch_cases.py
    (tests/test_arch_batches.py runs those)."""
    from arch_cases import arch_config
    from ds_longctx.models import ARCHITECTURES, FUSED_ARCHITECTURES

    assert set(FUSED_ARCHITECTURES) == set(ARCHS)
    for model_type in set(ARCHITECTURES) - set(ARCHS):
        name = "gemma3" if model_type == "gemma3_text" else model_type
        assert arch_config(name).model_type in ARCHITECTURES[model_type].model_types, model_type


def test_registered_classes_exist_and_are_recognised():
    from ds_longctx.memory.tiling import find_mlps
    from ds_longctx.models import ARCHITECTURES, is_llama_style_rmsnorm, layer_role

    for model_type, arch in ARCHITECTURES.items():
        if arch.attention is None:  # MLP-only: tests/test_arch_batches.py
            continue
        mod = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        assert hasattr(mod, arch.attention.attention_class) and hasattr(mod, arch.mlp_class)
        model = build(tiny_config(model_type))
        assert len(find_mlps(model)) == tiny_config(model_type).num_hidden_layers
        layer = model.get_decoder().layers[0]
        roles = {name: layer_role(name) for name, _ in layer.named_children()}
        assert sorted(r for r in roles.values() if r) == ["attention", "mlp"], roles
        assert is_llama_style_rmsnorm(model.get_decoder().norm)
