#!/usr/bin/env bash
# Installs what a fresh Debian 12 machine lacks to build, test and benchmark treetensor, and
# prints the venv's path on stdout (scripts/env.sh reads it). Idempotent: what is present is
# skipped, so a second run takes about a second.
#
# 1. Debian's packages (apt-get): the compiler, CMake, ninja, ccache, GoogleTest, Google
#    Benchmark, CLI11, nlohmann-json, gnuplot, Gloo's headers (c10d's ProcessGroupGloo.hpp
#    includes them; libtorch_cpu carries Gloo itself), python3-dev, Graphviz's dot (the tests
#    draw graph()'s output, and DI-treetensor, the oracle, builds its graphs only with dot).
# 2. The venv (TREETENSOR_VENV, default ~/.cache/treetensor/venv: one per machine, shared by
#    every clone, so a second clone pays nothing): PyTorch from PyPI as the LibTorch
#    (torch==$TREETENSOR_TORCH, default 2.11.0, a CUDA 13.0 build that also runs without a GPU:
#    about 4 GB, 1 minute on a fresh machine here), numpy, pytest, pybind11, scikit-build-core.
#    The io tests' fixtures are written by this torch; the Python module is built against it.
# 3. graphviz from PyPI into the same venv (tests of graph()/graphics()).
set -euo pipefail

torch_version="${TREETENSOR_TORCH:-2.11.0}"
venv="${TREETENSOR_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/treetensor/venv}"

packages=(
  g++ cmake ninja-build ccache pkg-config
  libgtest-dev libgmock-dev libbenchmark-dev
  libcli11-dev nlohmann-json3-dev
  gnuplot-nox
  libgloo-dev
  python3-dev python3-venv
  graphviz
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}" >&2
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "setup: need root or sudo to install: ${missing[*]}" >&2; exit 1; }
    sudo=sudo
  fi
  export DEBIAN_FRONTEND=noninteractive
  if ! $sudo apt-get update -q >/dev/null; then
    echo "setup: 'apt-get update' failed; check the network or the apt sources" >&2; exit 1
  fi
  if ! $sudo apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null; then
    echo "setup: could not install: ${missing[*]} (see apt-get's messages above)" >&2; exit 1
  fi
fi

# The venv's Python: python3 on PATH (3.9+; Debian's /usr/bin/python3 works as well).
stamp="$venv/.treetensor-torch-$torch_version"
if [ ! -f "$stamp" ]; then
  python=$(command -v python3)
  echo "setup: making the venv $venv (torch==$torch_version from PyPI, about 4 GB)" >&2
  start=$(date +%s)
  [ -x "$venv/bin/python" ] || "$python" -m venv "$venv" >&2
  "$venv/bin/python" -m pip install -q --upgrade pip >&2
  if ! "$venv/bin/python" -m pip install -q "torch==$torch_version" numpy pytest \
         "pybind11>=2.12" "scikit-build-core>=0.10" >&2; then
    echo "setup: pip could not install torch==$torch_version into $venv (see pip's messages above)" >&2
    exit 1
  fi
  touch "$stamp"
  echo "setup: venv ready in $(( $(date +%s) - start )) s" >&2
fi
# 3. graphviz (PyPI, pure Python) for the tests of graph()/graphics(), which build a
#    graphviz.Digraph; the package needs it only for those (its extra treetensor[graph]).
if ! "$venv/bin/python" -c "import graphviz" 2>/dev/null; then
  if ! "$venv/bin/python" -m pip install -q "graphviz>=0.20" >&2; then
    echo "setup: pip could not install graphviz into $venv (see pip's messages above)" >&2
    exit 1
  fi
fi
echo "$venv"
