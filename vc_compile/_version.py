"""The package version: the one place it is written (pyproject.toml reads it, ``vc_compile.__version__``
and ``python -m vc_compile --version`` print it)."""
__version__ = "0.1.0"
