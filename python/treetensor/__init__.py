"""treetensor for Python: tree tensors on treetensor's C++ core.

    import treetensor.torch as ttorch      # DI-treetensor's everyday surface
    import treetensor.asyncs as asyncs     # OneFlow's asyncs.thread

The compiled module is ``_treetensor`` (built by CMake with -DTREETENSOR_BUILD_PYTHON=ON into
build/python); put that folder and python/ on PYTHONPATH.
"""
import torch  # noqa: F401  (LibTorch's Python state before the module loads)

import _treetensor as _C  # noqa: E402

from . import torch as torch  # noqa: E402,F811
from . import asyncs  # noqa: E402,F401

__all__ = ["torch", "asyncs"]
