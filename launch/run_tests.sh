#!/usr/bin/env bash
# Install, build (warnings are errors), and run the whole test suite through CTest.
# With --asan: the same suite under AddressSanitizer + UndefinedBehaviorSanitizer (build/asan).
set -euo pipefail
cd "$(dirname "$0")/.."
preset=release
[[ ${1:-} == --asan ]] && preset=asan
launch/build.sh "$preset"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
ctest --preset "$preset" -j "${AMP_TEST_JOBS:-2}"
