#!/usr/bin/env bash
# Installs the Debian packages that a fresh machine lacks. Idempotent, and quiet when nothing is missing.
# Everything the build, the tests and the main job read comes from this one list; check it with
# ../shared/tools/fresh-machine-diff (lists nothing) and ../shared/tools/fresh-machine-ci (a clean root).
#   ocl-icd-opencl-dev  Debian's oneDNN is built with its OpenCL GPU runtime, so dnnl-config.cmake
#                       calls find_package(OpenCL REQUIRED); libdnnl-dev only recommends it.
#   libboost-context-dev libboost-fiber-dev  the emulated GPU's block threads (preset cuda-emu).
#   clang libclang-rt-14-dev  the safetensors fuzz target (libFuzzer; tests/scripts/fuzz_safetensors.sh).
#   ccache              optional: CMake uses it when present, and rebuilds get much faster.
#   bible-kjv           the main job's corpus: the King James Bible (public domain), 4.4 MB of English
#                       that `bible -f "Genesis1:1-Revelation22:21"` prints (launch/run_example.sh).
set -euo pipefail
packages=(openmpi-bin libopenmpi-dev libboost-program-options-dev libdnnl-dev
          ocl-icd-opencl-dev nlohmann-json3-dev cmake make g++ libgtest-dev libboost-context-dev libboost-fiber-dev
          clang libclang-rt-14-dev ccache bible-kjv)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
((${#missing[@]} == 0)) && exit 0
echo "setup: installing ${missing[*]}" >&2
sudo=""
if [[ $(id -u) -ne 0 ]]; then
  command -v sudo >/dev/null || { echo "setup: need root (or sudo) to install: ${missing[*]}" >&2; exit 1; }
  sudo="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
