"""The package's metadata lives in pyproject.toml (PEP 621). This file adds one build step: the wheel carries the
shipped ds_configs/ inside the package (ds_longctx/ds_configs), so that an installed ds_longctx finds them
(``ds-longctx configs``; train's ``--deepspeed_config tiny-cpu.json``) the way a source checkout does."""
import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


class BuildPyWithConfigs(build_py):
    def run(self):
        super().run()
        src = os.path.join(HERE, "ds_configs")
        dst = os.path.join(self.build_lib, "ds_longctx", "ds_configs")
        if os.path.isdir(src) and not self.editable_mode:
            shutil.copytree(src, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.md"))


setup(cmdclass={"build_py": BuildPyWithConfigs})
