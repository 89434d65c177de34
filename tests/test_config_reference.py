"""README's config reference is what tools/config_reference.py generates from ds_longctx/config/schema.py."""
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tool():
    spec = importlib.util.spec_from_file_location("config_reference", os.path.join(ROOT, "tools",
                                                                                   "config_reference.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_readme_config_reference_is_generated():
    tool = _tool()
    with open(os.path.join(ROOT, "README.md")) as f:
        block = tool.readme_block(f.read())
    assert block == tool.render(), "README.md's config reference is out of date: run python tools/config_reference.py"


def test_every_field_is_described():
    from ds_longctx.config import LongContextConfig

    tool = _tool()
    rows = list(tool._rows(LongContextConfig, "long_context"))
    assert rows and all(not row.endswith("|  |") for row in rows), [r for r in rows if r.endswith("|  |")]
