"""treetensor for Python: tree tensors on treetensor's C++ core.

    import treetensor.torch as ttorch      # DI-treetensor's everyday surface
    import treetensor.asyncs as asyncs     # OneFlow's asyncs.thread
    import treetensor.common               # trees of any Python values (Object)
    import treetensor.numpy as tnp         # trees of numpy arrays (needs numpy)
    import treetensor.optim                # torch.optim's Adam / AdamW / SGD over trees
    import treetensor.nn                   # a module's parameters and gradients as consolidated trees
    import treetensor.distributed          # all_reduce of trees over torch.distributed (buckets)
    treetensor.Tensor, treetensor.Object, treetensor.ndarray, treetensor.__version__  # as DI-treetensor's

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
from . import asyncs, common, config, distributed, nn, optim, torch, utils  # noqa: E402
from .common import Object  # noqa: E402
from .torch import Tensor  # noqa: E402

#: The package's version (CMake's project version, as pip installed it).
__version__ = _C.__version__

#: The CMake prefix of the installed C++ package (lib/cmake/treetensor), like
#: ``torch.utils.cmake_prefix_path``; its config finds the torch installed beside it.
cmake_prefix_path = _os.path.dirname(_os.path.abspath(__file__))

__all__ = ["torch", "asyncs", "common", "config", "distributed", "nn", "optim", "utils", "Tensor", "Object", "cmake_prefix_path"]


def __getattr__(name):
    # ``treetensor.ndarray`` as DI-treetensor's top level has it; numpy is optional, so
    # treetensor.numpy is imported on this first use only.
    if name == "ndarray":
        from .numpy import ndarray
        return ndarray
    raise AttributeError(f"module 'treetensor' has no attribute '{name}'")
