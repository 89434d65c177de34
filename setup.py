"""The package's metadata lives in pyproject.toml (PEP 621); this shim keeps `python setup.py ...` and tools
that look for setup.py working."""
from setuptools import setup

setup()
