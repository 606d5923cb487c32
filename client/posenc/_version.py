"""The SDK's version: the package's (pyproject.toml reads it from here)."""

__version__ = "1.0.0"
