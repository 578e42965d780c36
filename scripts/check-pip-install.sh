#!/usr/bin/env bash
# What a user does with this repository (DESIGN.md §18): `pip install .` into a clean venv, with
# build isolation (pip fetches scikit-build-core, pybind11 and torch==2.11.* into a temporary
# build env and builds from scratch), then, from another folder:
#   1. `import treetensor.torch` and one tree call;
#   2. a C++ extension of one's own (python/tests/interop) built by find_package(treetensor)
#      from the installed package, exchanging a tree with it.
# CI runs this once (.ci/run); it takes minutes (torch is fetched twice, the library is built
# with nothing cached), so it is not a ctest case. Exits non-zero on any failure.
#
#   bash scripts/check-pip-install.sh      # WORK=<folder> keeps the venv and builds there
set -euo pipefail
cd "$(dirname "$0")/.."
source=$PWD

work="${WORK:-}"
if [ -z "$work" ]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
fi
venv="$work/venv"
python=$(command -v python3)
start=$(date +%s)
step() { echo "check-pip-install: $* ($(( $(date +%s) - start )) s)"; }

rm -rf "$venv" "$work/interop"
"$python" -m venv "$venv"
step "pip install . into $venv"
"$venv/bin/python" -m pip install -q "$source"

cd "$work"  # nothing of the source tree on sys.path
step "import treetensor.torch from $work"
"$venv/bin/python" -c "import treetensor.torch as ttorch; print(ttorch.randn({'a': (2, 3)}))"

step "a C++ extension built against the installed package"
cmake -S "$source/python/tests/interop" -B "$work/interop" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DPython3_EXECUTABLE="$venv/bin/python" >/dev/null
cmake --build "$work/interop" >/dev/null
"$venv/bin/python" - "$work/interop" <<'EOF'
import sys

import torch
import treetensor.torch as ttorch

sys.path.insert(0, sys.argv[1])
import _treetensor_interop  # noqa: E402

t = ttorch.Tensor({"a": torch.ones(2), "b": {"c": torch.arange(3.0)}})
d = _treetensor_interop.double_it(t)
assert ttorch.equal(d, t * 2), d
ttorch.stream(2)
assert _treetensor_interop.stream_mode() == "stream(2)"  # one libtreetensor in the process
EOF
step "passed"
