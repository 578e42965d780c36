"""The installed package (``pip install .``, DESIGN.md §18): what the wheel carries, and that
this suite runs against it rather than against the sources in python/treetensor."""
import ast
import pathlib
import subprocess
import sys

import treetensor
import treetensor.torch as ttorch
from conftest import ROOT

PACKAGE = pathlib.Path(treetensor.__file__).parent


def test_suite_imports_the_installed_package():
    assert not PACKAGE.samefile(pathlib.Path(ROOT, "python", "treetensor"))
    assert pathlib.Path(treetensor._C.__file__).parent == PACKAGE
    assert treetensor.torch is ttorch  # the package's own torch module, not PyTorch


def test_package_carries_stubs_headers_libraries_and_cmake_package():
    for rel in ["py.typed", "_C.pyi", "torch.pyi", "asyncs.pyi", "common.pyi", "numpy.pyi",
                "include/treetensor/treetensor.hpp", "include/treetensor/python.hpp",
                "lib/libtreetensor.so", "lib/libtreetensor_distributed.so",
                "lib/cmake/treetensor/treetensorConfig.cmake"]:
        assert (PACKAGE / rel).is_file(), rel
    assert pathlib.Path(treetensor.cmake_prefix_path) == PACKAGE


def test_stubs_parse_and_are_current():
    for stub in PACKAGE.glob("*.pyi"):
        ast.parse(stub.read_text(), str(stub))
    generator = pathlib.Path(ROOT, "scripts", "gen_stubs.py")
    check = subprocess.run([sys.executable, str(generator), "--check"], capture_output=True, text=True,
                           timeout=120)
    assert check.returncode == 0, check.stderr
