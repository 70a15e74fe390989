#!/usr/bin/env bash
# Install, build (warnings are errors), and run the whole test suite through CTest, twice:
#   build/release   the CPU backend (and the CUDA backend compiled by nvcc where it is installed),
#   build/cuda-emu  the same suite with the CUDA backend, cuBLAS and NCCL on the emulated GPU, so
#                   that --device cuda, test_cuda and test_nccl run without a GPU.
# After the cuda-emu suite, the cost model's report of the GPU step (tests/scripts/gpu_cost_report.sh).
# After the release suite, the installed package (tests/scripts/install_check.sh: examples/ built
# against `cmake --install` alone) and every C++ block of README.md and docs/ built against it, the
# whole programs run (tests/scripts/docs_check.sh). Then the CPU's hot-loop clones against a baseline-only build (tests/scripts/simd_clones_match.sh:
# training identical byte for byte), and the safetensors reader's fuzz target: its regression
# corpus, and AMP_FUZZ_SECONDS (default 60) of fuzzing (tests/scripts/fuzz_safetensors.sh).
# Where nvcc is installed, last: the GPU bundle for a node without our packages (launch/scripts/gpu_bundle.sh,
# the cuda preset: its objects are release's, so ccache makes it a relink) and its check
# (tests/scripts/bundle_check.sh: every library it loads is in it, and it runs unpacked).
# With --asan: the suite under AddressSanitizer + UndefinedBehaviorSanitizer instead (build/asan).
# The emulated GPU has a sanitizer preset too (cuda-emu-asan; see docs/GPU.md, "The emulated GPU").
set -euo pipefail
cd "$(dirname "$0")/../.."
presets=(release cuda-emu)
[[ ${1:-} == --asan ]] && presets=(asan)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# The slurm test's packages (optional: it skips, saying why, where they cannot be installed).
launch/setup.sh --slurm || echo "run_tests: slurm-wlm and munge could not be installed: the slurm test will skip"
for preset in "${presets[@]}"; do
  echo "== run_tests: preset $preset"
  launch/scripts/build.sh "$preset"
  ctest --preset "$preset" -j "${AMP_TEST_JOBS:-2}"
  # The GPU step's modeled H100 time from the emulated GPU's dry run: printed, never asserted.
  if [[ $preset == cuda-emu ]]; then tests/scripts/gpu_cost_report.sh build/cuda-emu; fi
  # The installed package: examples/ built against it alone, trained on 2 ranks; the docs' C++ blocks.
  if [[ $preset == release ]]; then
    tests/scripts/install_check.sh build/release
    tests/scripts/docs_check.sh --build build/release
  fi
done
if [[ ${1:-} != --asan ]]; then
  tests/scripts/simd_clones_match.sh
  tests/scripts/fuzz_safetensors.sh "${AMP_FUZZ_SECONDS:-60}"
  if command -v nvcc >/dev/null || [[ -x /usr/local/cuda/bin/nvcc ]]; then
    echo "== run_tests: the GPU bundle"
    launch/scripts/gpu_bundle.sh
    tests/scripts/bundle_check.sh
  fi
fi
