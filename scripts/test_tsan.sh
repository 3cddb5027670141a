#!/usr/bin/env bash
# The comm tests under ThreadSanitizer, as CI runs them: configure build-tsan with
# -DSHARDLM_SANITIZE=thread, build only comm_tests (comm links no OpenMP, whose uninstrumented
# runtime TSan cannot follow), and run the multi-process tests (`ctest -R comm_`: mpirun at
# N = 1..4). Reports from inside Open MPI's own libraries are suppressed (tests/comm/tsan.supp);
# any report in shardlm's code fails the run.
#
#   bash scripts/test_tsan.sh [extra ctest args]
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
JOBS="${JOBS:-$(nproc)}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=Debug -DSHARDLM_SANITIZE=thread \
  -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g1" >/dev/null
cmake --build build-tsan -j"$JOBS" --target comm_tests

# mpirun passes its environment to the ranks it starts on this machine. exitcode=66 with
# halt_on_error makes the first report fail that rank, hence the test. Why
# ignore_noninstrumented_modules: see tests/comm/tsan.supp.
export TSAN_OPTIONS="suppressions=$REPO/tests/comm/tsan.supp ignore_noninstrumented_modules=1 halt_on_error=1 exitcode=66 second_deadlock_stack=1 ${TSAN_OPTIONS:-}"
ctest --test-dir build-tsan -R comm_ --output-on-failure "$@"
