#!/usr/bin/env bash
# The GPU check (DESIGN.md §18): on a machine with a CUDA GPU and a CUDA build of PyTorch,
# builds treetensor against that PyTorch, runs the C++ suite (the CUDA tests included: they
# skip nowhere there) and the seed experiment at its full size on the GPU
# (`treetensor-bench seed --device cuda`: 200 leaves of 512x1024 @ 1024x2048), and writes the
# logs, tables and JSON under one folder. Made for the GPU machine this project is lent at
# times (one H200, PyTorch 2.11 cu130 in /opt/torch/.venv, CMake and ninja, no network, nothing
# installable): it needs nothing but a copy of the work tree and the bundle below.
#
#   bash scripts/gpu-check.sh --prepare   # here (Debian 12): bundles the build dependencies the
#                                         # GPU machine lacks (GoogleTest, Google Benchmark,
#                                         # CLI11, nlohmann-json, Gloo's headers; ~5 MB)
#                                         # from Debian's packages into .gpu-deps/ (git-ignored)
#   bash scripts/gpu-check.sh             # there: build, test, bench; ~5 minutes on 16 cores
#
# Outputs go to $OUT when set (the device tool's folder), else out/gpu-check/: gpu-check.log
# (everything), ctest.log, ctest.xml (JUnit), seed.txt (the table), seed.json, summary.txt.
# Environment: TREETENSOR_PYTHON (default /opt/torch/.venv/bin/python3 when present, else
# python3) is the Python whose torch is built against; GPU_CHECK_BUDGET_S (default 450) bounds
# the whole run so it ends inside 8 minutes whatever hangs. Exit status: 0 when the build, every
# test and the verified bench succeeded.
set -uo pipefail
cd "$(dirname "$0")/.."

deps=.gpu-deps
# Debian packages whose files the GPU machine needs: headers, CMake configs, libraries.
dep_packages=(libgtest-dev libgmock-dev libbenchmark-dev libbenchmark1debian libcli11-dev
              nlohmann-json3-dev libgloo-dev)

if [ "${1:-}" = "--prepare" ]; then
  set -e
  bash scripts/setup.sh >/dev/null  # the packages themselves
  rm -rf "$deps" && mkdir -p "$deps"
  for p in "${dep_packages[@]}"; do
    dpkg-query -L "$p" | while read -r f; do
      [ -f "$f" ] || [ -L "$f" ] || continue
      mkdir -p "$deps$(dirname "$f")" && cp -a "$f" "$deps$f"
    done
  done
  echo "gpu-check: bundled ${dep_packages[*]} into $deps/ ($(du -sh "$deps" | cut -f1));"
  echo "gpu-check: on the GPU machine run 'bash scripts/gpu-check.sh' with $deps carried beside the tree"
  exit 0
fi

out="${OUT:-out/gpu-check}"
mkdir -p "$out" && out=$(cd "$out" && pwd)  # absolute: ctest writes its JUnit file from the build folder
exec > >(tee "$out/gpu-check.log") 2>&1
start=$(date +%s)
budget="${GPU_CHECK_BUDGET_S:-450}"
left() { echo $(( budget - ($(date +%s) - start) )); }
status=0
step() {  # step NAME COMMAND...: runs COMMAND within the time left, records its result
  local name=$1; shift
  local t0; t0=$(date +%s)
  echo "=== $name ($(left) s left)"
  timeout --kill-after=10 "$(left)" "$@"
  local rc=$?
  echo "=== $name: exit $rc after $(( $(date +%s) - t0 )) s" | tee -a "$out/summary.txt"
  [ $rc -eq 0 ] || status=1
  return $rc
}

python="${TREETENSOR_PYTHON:-}"
[ -n "$python" ] || { [ -x /opt/torch/.venv/bin/python3 ] && python=/opt/torch/.venv/bin/python3; }
[ -n "$python" ] || python=$(command -v python3)
export TREETENSOR_PYTHON="$python"
source scripts/env.sh  # cmake_torch from that Python's torch; no setup.sh (nothing to install)

{
  echo "gpu-check: $(date -u +%FT%TZ) on $(hostname), $(nproc) cores"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null ||
    echo "nvidia-smi: not found"
  "$python" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda,
"available", torch.cuda.is_available(), "devices", torch.cuda.device_count())'
  command -v g++ >/dev/null && g++ --version | head -n 1
  cmake --version | head -n 1
} | tee "$out/summary.txt"

prefix=()
if [ -d "$deps/usr" ]; then
  prefix=(-DCMAKE_PREFIX_PATH="${cmake_torch[0]#-DCMAKE_PREFIX_PATH=};$PWD/$deps/usr")
  export LD_LIBRARY_PATH="$PWD/$deps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
else
  echo "gpu-check: no $deps/ (run 'bash scripts/gpu-check.sh --prepare' where Debian's packages are); using the system's"
fi
build=build-gpu
generator=(-G Ninja)
command -v ninja >/dev/null || generator=()
step configure cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
  "${cmake_torch[@]}" "${prefix[@]}" -DTREETENSOR_BUILD_PYTHON=OFF || { echo "gpu-check: FAILED"; exit 1; }
step build cmake --build "$build" -j"$(nproc)" || { echo "gpu-check: FAILED"; exit 1; }

# The suite, CUDA tests first (they are what this machine is for), then everything else.
step ctest-cuda ctest --test-dir "$build" -R '^Cuda' --output-on-failure --no-tests=error
step ctest ctest --test-dir "$build" --output-on-failure --no-tests=error -j"$(( $(nproc) / 2 ))" \
  --timeout 240 --output-junit "$out/ctest.xml" > "$out/ctest.log" 2>&1
tail -n 30 "$out/ctest.log"
step bench-seed "$build/tools/treetensor-bench" seed --device cuda --json "$out/seed.json" \
  --no-progress > "$out/seed.txt" 2>&1
cat "$out/seed.txt"

echo "gpu-check: $([ $status -eq 0 ] && echo passed || echo FAILED) in $(( $(date +%s) - start )) s; outputs in $out"
exit $status
