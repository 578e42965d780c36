"""treetensor for Python: tree tensors on treetensor's C++ core.

    import treetensor.torch as ttorch      # DI-treetensor's everyday surface
    import treetensor.asyncs as asyncs     # OneFlow's asyncs.thread
    import treetensor.common               # trees of any Python values (Object)
    import treetensor.numpy as tnp         # trees of numpy arrays (needs numpy)

Installed by ``pip install .``; the compiled core is ``treetensor._C``. The package also
carries the C++ headers, libtreetensor and its CMake package, for C++ extensions that exchange
trees with it (``treetensor/python.hpp``)::

    cmake -DCMAKE_PREFIX_PATH="$(python -c 'import treetensor; print(treetensor.cmake_prefix_path)')"
    find_package(treetensor CONFIG REQUIRED)   # then link treetensor::treetensor
"""
import os as _os

# LibTorch's Python state before the module loads. Bound privately: a package attribute named
# `torch` would make `from . import torch` below return it instead of importing treetensor.torch.
import torch as _torch  # noqa: F401

from . import _C  # noqa: E402
from . import asyncs, common, torch  # noqa: E402

#: The CMake prefix of the installed C++ package (lib/cmake/treetensor), like
#: ``torch.utils.cmake_prefix_path``; its config finds the torch installed beside it.
cmake_prefix_path = _os.path.dirname(_os.path.abspath(__file__))

__all__ = ["torch", "asyncs", "common", "cmake_prefix_path"]
