"""The package version (a leaf: the package __init__ and checkpoint records read it)."""
__version__ = "0.1.0"
