#!/usr/bin/env bash
# The second README command, and what CI runs: set up, then the whole test suite twice — the
# release build (everything, including the slow end-to-end runs) and an AddressSanitizer +
# UndefinedBehaviorSanitizer build of the unit tests (suites named *Slow are release-only).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
bash scripts/setup.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
JOBS="$(nproc)"

echo "=== release build: all tests ==="
ctest --test-dir build --output-on-failure -j"$JOBS" --timeout 900

echo "=== address,undefined sanitizer build: unit tests ==="
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DSHARDLM_SANITIZE=address,undefined \
  -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g1" >/dev/null
cmake --build build-asan -j"$JOBS"
# OpenMP's runtime (uninstrumented) keeps thread-local allocations alive at exit.
ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  ctest --test-dir build-asan --output-on-failure -j"$JOBS" --timeout 900 -E 'Slow'

if command -v nvcc >/dev/null 2>&1; then
  # The CUDA backend compiles where nvcc is; its tests skip without a GPU (and say so).
  echo "=== CUDA build (nvcc found): compile, kernel tests ==="
  cmake -S . -B build-cuda -DSHARDLM_CUDA=ON -DSHARDLM_NATIVE=OFF >/dev/null
  cmake --build build-cuda -j"$JOBS" --target shardlm cuda_tests cuda_kernels_bench
  build-cuda/tests/cuda_tests
fi

echo "=== thread sanitizer build: comm tests under mpirun ==="
bash scripts/test_tsan.sh
