"""The files ds_longctx ships (ds_configs/ and its model presets): found in a source checkout, an editable install
or the wheel. A leaf: the training command, the needle command and cli.py import it."""
from __future__ import annotations

import os
from typing import Optional


def shipped_configs_dir() -> Optional[str]:
    """ds_configs/: copied into the package by the wheel's build (setup.py), at the repository root otherwise."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # ds_longctx/
    for path in (os.path.join(package, "ds_configs"), os.path.join(os.path.dirname(package), "ds_configs")):
        if os.path.isdir(path):
            return path
    return None


def default_model_config() -> str:
    return os.path.join(shipped_configs_dir() or "ds_configs", "models", "tiny-llama.json")


def resolve_config_path(path: str) -> str:
    """A --deepspeed_config that is not a file but names a shipped config (``tiny-cpu.json``, ``5m.json``)."""
    if os.path.exists(path) or os.sep in path:
        return path
    shipped = shipped_configs_dir()
    if shipped:
        for name in (path, path + ".json"):
            if os.path.isfile(os.path.join(shipped, name)):
                return os.path.join(shipped, name)
    return path
