"""The package version (its own module, so that any module can read it without a cycle)."""

__version__ = "0.5.0"
