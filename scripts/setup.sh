#!/usr/bin/env bash
# Installs what a fresh Debian 12 machine lacks to build, test and benchmark treetensor.
# Idempotent: packages already present are skipped. apt-get only. python3-torch (Debian's PyTorch
# 1.13, run as /usr/bin/python3) writes the io tests' fixture files and checks what C++ wrote;
# with pybind11-dev, python3-dev and python3-pytest it builds and tests the Python module.
set -euo pipefail

packages=(
  g++ cmake ninja-build ccache pkg-config
  libtorch-dev libopenblas0-pthread libopenblas-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libcli11-dev nlohmann-json3-dev libfmt-dev
  gnuplot-nox
  python3-torch
  pybind11-dev python3-dev python3-pytest
  libsleef-dev
  libgloo-dev
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

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
