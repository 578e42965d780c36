"""The package's metadata (``treetensor.config.meta``), where DI-treetensor keeps its own."""
from . import meta

__all__ = ["meta"]
