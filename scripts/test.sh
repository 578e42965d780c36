#!/usr/bin/env bash
# The README's test command: installs what a fresh Debian 12 machine lacks, configures, builds
# and runs the whole test suite with ctest. Exits non-zero on any failed or missing test.
#
#   bash scripts/test.sh                      # everything (and the Python module's pytest), in build/
#   bash scripts/test.sh --sanitize thread    # runtime, asyncs, distributed tests under ThreadSanitizer
#   bash scripts/test.sh --sanitize address   # all tests under AddressSanitizer + UBSan
set -euo pipefail
cd "$(dirname "$0")/.."

sanitize=""
while [ $# -gt 0 ]; do
  case "$1" in
    --sanitize) sanitize="${2:?--sanitize needs thread or address}"; shift 2 ;;
    *) echo "test.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done

source scripts/env.sh

jobs=$(nproc)
build=build
args=(-DCMAKE_BUILD_TYPE=RelWithDebInfo)
ctest_args=()
if [ -z "$sanitize" ]; then
  args+=(-DTREETENSOR_BUILD_PYTHON=ON)  # the Python module and its pytest suite (label python)
else
  build="build-$sanitize"  # never the Python module: the interpreter has no sanitizer runtime
  args+=(-DTREETENSOR_SANITIZE="$sanitize" -DTREETENSOR_BUILD_PYTHON=OFF -DTREETENSOR_BUILD_BENCH=OFF -DTREETENSOR_BUILD_EXAMPLES=OFF
         -DTREETENSOR_TEST_TIMEOUT=900)
fi

configured=$(cmake -S . -B "$build" -G Ninja "${cmake_torch[@]}" "${args[@]}" 2>&1) || {
  echo "$configured" >&2; echo "test.sh: cmake could not configure $build" >&2; exit 1; }
grep "treetensor:" <<<"$configured"  # PyTorch's version, CUDA and NCCL compiled or not
case "$sanitize" in
  thread)
    # The concurrency tests: the runtime (lanes, dispatch), the asyncs threads, deferred trees
    # the distributed layer (its tests start distributed_worker, built under TSan too) and the
    # tree layer's per-thread node cache.
    targets=$(ninja -C "$build" -t targets all |
              sed -n 's/^\(\(runtime\|asyncs\|distributed\|tree_deferred\|tree_node_allocator\)_[a-z0-9_]*\(test\|worker\)\): .*/\1/p' | sort -u)
    [ -n "$targets" ] || { echo "test.sh: no runtime/asyncs/distributed test targets found" >&2; exit 1; }
    cmake --build "$build" -j"$jobs" --target $targets
    ctest_args+=(-L '^(runtime|asyncs|distributed|tree_deferred|tree_node_allocator)')
    export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$PWD/tests/tsan.supp ${TSAN_OPTIONS:-}"
    # LibTorch's intra-op threads are GNU OpenMP's (the wheel's libgomp, not built with TSan):
    # their barriers are invisible to TSan, which reports the kernel's own threads as racing.
    # One intra-op thread keeps ATen kernels on the calling thread; our lanes, asyncs workers
    # and communication threads, what this stage checks, are unaffected.
    export OMP_NUM_THREADS=1
    ;;
  address)
    cmake --build "$build" -j"$jobs"
    # LibTorch keeps process-lifetime singletons that LeakSanitizer would report.
    export ASAN_OPTIONS="detect_leaks=0 abort_on_error=1 ${ASAN_OPTIONS:-}"
    export UBSAN_OPTIONS="print_stacktrace=1 halt_on_error=1 ${UBSAN_OPTIONS:-}"
    ;;
  "")
    cmake --build "$build" -j"$jobs"
    # The Python package into the venv (pyproject.toml): python_pytest imports it from there. Its
    # build folder persists, so a second run rebuilds only what changed.
    CMAKE_BUILD_PARALLEL_LEVEL="$jobs" "$python" -m pip install -q --no-build-isolation --no-deps \
      -Cbuild-dir="$build/wheel" .
    # DI-treetensor, the oracle of python/tests/test_ditt_oracle.py (its own venv; pip, seconds).
    TREETENSOR_PEERS_PYTHON=$(bash scripts/peers-env.sh)
    export TREETENSOR_PEERS_PYTHON
    ;;
  *) echo "test.sh: --sanitize takes thread or address, not '$sanitize'" >&2; exit 2 ;;
esac

echo "test.sh: $build set up and built in $SECONDS s"
# Cases run in parallel, one per core; python_pytest is RUN_SERIAL (its timing checks).
ctest --test-dir "$build" --output-on-failure --no-tests=error -j"$jobs" "${ctest_args[@]}"
