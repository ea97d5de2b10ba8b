"""The package version (its own module, so that modules need not import the package root for it)."""

__version__ = "0.1.0"
