# Sourced by scripts/test.sh, bench.sh and gpu-check.sh: runs setup.sh (unless the caller set
# TREETENSOR_PYTHON to a Python whose torch is the LibTorch to build against), then sets
#   python        that Python (the venv's)
#   cmake_torch   the CMake arguments that build against its torch (DESIGN.md §18)
# and points ccache at this checkout, so that clones at other paths share its objects.
if [ -z "${TREETENSOR_PYTHON:-}" ]; then
  venv=$(bash scripts/setup.sh)
  python="$venv/bin/python"
else
  python="$TREETENSOR_PYTHON"
fi
torch_prefix=$("$python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)' 2>/dev/null) || {
  echo "$0: '$python -c \"import torch\"' failed: no PyTorch to build against" >&2; exit 1; }
cmake_torch=(-DCMAKE_PREFIX_PATH="$torch_prefix" -DPython3_EXECUTABLE="$python")
export CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=1
# Four configurations (tests, the pip package, TSan, ASan) of ~1 GB of objects each: ccache's
# default 5 GB evicts one while building the next, and a CI run then recompiles everything.
export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-16G}"
