#!/usr/bin/env bash
# The README's first command: installs what a fresh Debian 12 machine lacks, builds
# treetensor-bench (Release, in build-release/), then runs the seed experiment, an Adam step over
# ResNet-50, the elementwise grid and the all_reduce of MobileNetV3-Small's and ResNet-50's
# gradient trees over 2 local ranks, on their defaults. Tables go to stdout; JSON and PNG plots to
# out/.
#
#   bash scripts/bench.sh            # the defaults (about 3 minutes on 2 cores)
#   bash scripts/bench.sh -T 5       # extra flags go to every run, so only flags all take:
#                                    # -M -T --warmup --dtype --device --seed --caching-allocator
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/env.sh

echo "bench.sh: building treetensor-bench and treetensor-inspect (Release, build-release/; log in build-release/bench-build.log)" >&2
cmake -S . -B build-release -G Ninja -DCMAKE_BUILD_TYPE=Release "${cmake_torch[@]}" >/dev/null
# Both tools and the library: what `cmake --install build-release` installs (README), not the tests.
if ! cmake --build build-release -j"$(nproc)" --target treetensor-bench treetensor-inspect \
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
if [ ${#failed[@]} -gt 0 ]; then
  echo "bench.sh: not every row was verified or measured: ${failed[*]}; see the lines above" >&2
  exit 2
fi
