"""This package's title, version and description, under the names DI-treetensor's
``treetensor.config.meta`` uses. The values are this package's, not DI-treetensor's: the
title is ``treetensor`` and the version is the one ``pip`` installed (CMake's project
version, compiled into ``treetensor._C``)."""
from .._C import __version__ as _version

#: The distribution's name.
__TITLE__ = "treetensor"
#: The version (``treetensor.__version__``).
__VERSION__ = _version
#: One line on what the package is (pyproject.toml's description).
__DESCRIPTION__ = "Tree tensors on a C++ LibTorch core (DI-treetensor's treetensor.torch)"
