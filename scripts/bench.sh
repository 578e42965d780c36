#!/usr/bin/env bash
# The README's first command: installs what a fresh Debian 12 machine lacks, builds
# treetensor-bench (Release, in build-release/), then runs the seed experiment, an Adam step over
# ResNet-50, the elementwise grid, the all_reduce of MobileNetV3-Small's and ResNet-50's
# gradient trees over 2 local ranks and the seed's loop with pending asyncs scopes (overlap), on
# their defaults; then the peers workload
# (python/bench/peers.py): our Python package beside DI-treetensor, tensordict, optree and
# torch's own pytree and optimizers, each library in its own process, and the gradient
# all_reduce beside tensordict's and PyTorch's bucketing (python/bench/bench_allreduce.py); then the training step
# against PyTorch's (python/bench/bench_train.py, OneFlow CI's relative speed). Tables go to stdout; JSON
# and PNG plots to out/.
#
#   bash scripts/bench.sh            # the defaults (about 4 minutes on 2 cores)
#   bash scripts/bench.sh -T 5       # extra flags go to every treetensor-bench run, so only flags
#                                    # all take: -M -T --warmup --dtype --device --seed
#                                    # --caching-allocator (the peers workload takes none)
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/env.sh

echo "bench.sh: building treetensor-bench and treetensor-inspect (Release, build-release/; log in build-release/bench-build.log)" >&2
cmake -S . -B build-release -G Ninja -DCMAKE_BUILD_TYPE=Release "${cmake_torch[@]}" >/dev/null
# Both tools and the library: what `cmake --install build-release` installs (README), not the
# tests; and tree_bench, the C++ figures of the peers workload's structure rows.
if ! cmake --build build-release -j"$(nproc)" --target treetensor-bench treetensor-inspect tree_bench \
  >build-release/bench-build.log 2>&1; then
  tail -n 40 build-release/bench-build.log >&2
  echo "bench.sh: the build failed; full log in build-release/bench-build.log" >&2
  exit 1
fi

mkdir -p out
bench=build-release/tools/treetensor-bench
# Every workload runs and writes its outputs whatever the other's status; the exit status
# (2: a row was not verified, 1: a workload failed) comes at the end, with one summary line.
failed=()
"$bench" seed --json out/seed.json --plot out/seed.png "$@" || failed+=("seed (exit $?)")
echo
"$bench" optimizer --model resnet50 --json out/optimizer.json --plot out/optimizer.png "$@" ||
  failed+=("optimizer (exit $?)")
echo
"$bench" elementwise --json out/elementwise.json --plot out/elementwise.png "$@" ||
  failed+=("elementwise (exit $?)")
echo
"$bench" allreduce --json out/allreduce.json --plot out/allreduce.png "$@" ||
  failed+=("allreduce (exit $?)")
echo
"$bench" overlap --json out/overlap.json --plot out/overlap.png "$@" || failed+=("overlap (exit $?)")
echo
# The peers: our package (pip-installed into build-release/python, never into the venv; its
# build folder persists, so a second run rebuilds nothing) under the venv's Python, the peers
# (scripts/peers-env.sh) in their own venv and process: both are named `treetensor`.
if ! peers_python=$(bash scripts/peers-env.sh); then
  failed+=("peers (scripts/peers-env.sh could not make the peers' venv)")
elif ! CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" "$python" -m pip install -q --no-build-isolation --no-deps \
    --upgrade -Cbuild-dir=build-release/wheel --target build-release/python . \
    >build-release/python-install.log 2>&1; then
  tail -n 20 build-release/python-install.log >&2
  failed+=("peers (pip could not install the package; log in build-release/python-install.log)")
else
  "$python" python/bench/peers.py --peers-python "$peers_python" --ours-path build-release/python \
    --tree-bench build-release/bench/tree_bench --json out/peers.json --plot out/peers.png ||
    failed+=("peers (exit $?)")
  echo
  # The gradient all_reduce beside tensordict and PyTorch's bucketing (2 Gloo ranks).
  PYTHONPATH="$PWD/build-release/python" "$python" python/bench/bench_allreduce.py \
    --peers-python "$peers_python" --json out/allreduce_peers.json || failed+=("allreduce_peers (exit $?)")
fi
echo
# The training step against PyTorch's (python/bench/bench_train.py: the policy MLP and ResNet-50
# at batch 1, one process and DDP on 2 Gloo ranks), on the package installed above.
if [ -f build-release/python/treetensor/__init__.py ]; then
  PYTHONPATH="$PWD/build-release/python" "$python" python/bench/bench_train.py --json out/train.json ||
    failed+=("train (exit $?)")
else
  failed+=("train (the package was not installed; see peers above)")
fi
if [ ${#failed[@]} -gt 0 ]; then
  echo "bench.sh: not every row was verified or measured: ${failed[*]}; see the lines above" >&2
  exit 2
fi
