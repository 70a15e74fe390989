#!/usr/bin/env bash
# Installs the Debian packages that a fresh machine lacks. Idempotent, and quiet when nothing is missing.
# On another distribution (a user's Ubuntu 22.04/24.04 GPU box) a name may not exist: each package that
# the distribution has is installed, the others are named at the end, with what they are for; the exit
# status is 1 only when one of them is needed to build (the fuzz target, ccache, the corpus and Slurm are not).
# Everything the build, the tests and the main job read comes from this one list; check it with
# the CI host's fresh-machine tools, outside this repository (docs/BUILD.md): ../shared/tools/fresh-machine-diff
# (lists nothing) and ../shared/tools/fresh-machine-ci (a clean root). Those tools read this file's packages=(...)
# list at this path, so it stays in launch/ rather than launch/scripts/ with the other scripts.
#   ocl-icd-opencl-dev  Debian's oneDNN is built with its OpenCL GPU runtime, so dnnl-config.cmake
#                       calls find_package(OpenCL REQUIRED); libdnnl-dev only recommends it.
#   libboost-context-dev libboost-fiber-dev  the emulated GPU's block threads (preset cuda-emu).
#   clang libclang-rt-14-dev  the safetensors fuzz target (libFuzzer; tests/scripts/fuzz_safetensors.sh).
#   ccache              optional: CMake uses it when present, and rebuilds get much faster.
#   bible-kjv           the main job's corpus: the King James Bible (public domain), 4.4 MB of English
#                       that `bible -f "Genesis1:1-Revelation22:21"` prints (launch/scripts/run_example.sh).
#   .deps/cudnn-frontend-VERSION  cudnn-frontend's headers from PyPI's wheel, pinned (below).
#   --plot              installs only python3-matplotlib, for launch/scripts/plot_metrics.py (launch/scripts/run_example.sh
#                       draws its run with it): kept out of the list above, which the build, the tests and
#                       CI install, so that nothing they check depends on it; optional (exit 0 without it).
#   --slurm             installs only slurm-wlm and munge, for the slurm test (tests/scripts/slurm_check.sh: amp_train
#                       under a real Slurm on this machine, on loopback; it skips without them): the test suite
#                       (launch/scripts/run_tests.sh) asks for them, the build and the main job do not, since on a
#                       machine with systemd installing them also enables Slurm's services. Optional (exit 0 without).
set -euo pipefail
plot=false slurm=false
case ${1:-} in
  --plot) plot=true ;;
  --slurm) slurm=true ;;
  "") ;;
  *) echo "usage: launch/setup.sh [--plot | --slurm]" >&2; exit 2 ;;
esac
packages=(openmpi-bin libopenmpi-dev libboost-program-options-dev libdnnl-dev
          ocl-icd-opencl-dev nlohmann-json3-dev cmake make g++ libgtest-dev libboost-context-dev libboost-fiber-dev
          clang libclang-rt-14-dev ccache bible-kjv)
# What a package is for when it is not needed to build and test the project.
declare -A optional=([clang]="the safetensors fuzz target" [libclang-rt-14-dev]="the safetensors fuzz target"
                     [ccache]="faster rebuilds" [bible-kjv]="the main job's corpus (launch/scripts/run_example.sh)"
                     [slurm-wlm]="the slurm test (tests/scripts/slurm_check.sh)" [munge]="the slurm test (tests/scripts/slurm_check.sh)"
                     [python3-matplotlib]="drawing a metrics file (launch/scripts/plot_metrics.py)")
$plot && packages=(python3-matplotlib)
# cuDNN's fused attention (--attention cudnn) is built against cudnn-frontend's headers, which PyPI's
# nvidia-cudnn-frontend wheel carries: the release made for cuDNN 9.19 (the toolkit's), pinned by its
# hash, unpacked into .deps/ once. A build time input only: the library itself, libcudnn, is loaded at
# run time from the node. Optional: without it the build says so and --attention cudnn is refused.
fe_version=1.19.1
fe_wheel=nvidia_cudnn_frontend-1.19.1-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl
fe_sha256=241fba15057135fed04223c5e7171a44bb407cb67d706255f072192553984792
fetch_cudnn_frontend() {
  local root dest tmp
  root=$(cd "$(dirname "$0")/.." && pwd)
  dest=$root/.deps/cudnn-frontend-$fe_version
  [[ -f $dest/include/cudnn_frontend.h ]] && return 0
  tmp=$(mktemp -d)
  # The headers are the same in every wheel of the release: this one is asked for by name, whatever
  # the local Python.
  if ! python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
         --platform manylinux_2_28_x86_64 "nvidia-cudnn-frontend==$fe_version" -d "$tmp" >/dev/null 2>&1 ||
     [[ ! -f $tmp/$fe_wheel ]]; then
    echo "setup: could not download nvidia-cudnn-frontend==$fe_version from PyPI (optional: --attention cudnn)" >&2
    rm -rf "$tmp"; return 0
  fi
  if [[ $(sha256sum "$tmp/$fe_wheel" | cut -d' ' -f1) != "$fe_sha256" ]]; then
    echo "setup: $fe_wheel does not have the pinned sha256 $fe_sha256: not used" >&2
    rm -rf "$tmp"; return 0
  fi
  python3 - "$tmp/$fe_wheel" "$tmp/unpacked" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith("include/")])
PY
  mkdir -p "$root/.deps"
  rm -rf "$dest.partial" && mkdir -p "$dest.partial" && mv "$tmp/unpacked/include" "$dest.partial/include"
  mv "$dest.partial" "$dest"  # whole, or not there: a build never sees half of it
  rm -rf "$tmp"
  echo "setup: cudnn-frontend $fe_version's headers in .deps/cudnn-frontend-$fe_version" >&2
}
$plot || $slurm || fetch_cudnn_frontend
$slurm && packages=(slurm-wlm munge)
# Other distributions' names for the same thing, tried when a name does not exist there.
declare -A alternative=([libclang-rt-14-dev]="libclang-rt-dev libclang-common-14-dev")
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
missing=()
for p in "${packages[@]}"; do installed "$p" || missing+=("$p"); done
((${#missing[@]} == 0)) && exit 0
echo "setup: installing ${missing[*]}" >&2
sudo=""
if [[ $(id -u) -ne 0 ]]; then
  command -v sudo >/dev/null || { echo "setup: need root (or sudo) to install: ${missing[*]}" >&2; exit 1; }
  sudo="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
# A name this distribution's package lists know (a candidate version), or one of its alternatives.
available() { local c; c=$(apt-cache policy "$1" 2>/dev/null | sed -n 's/^ *Candidate: *//p'); [[ -n $c && $c != "(none)" ]]; }
want=() absent=()
for p in "${missing[@]}"; do
  if available "$p"; then want+=("$p"); continue; fi
  alt=""
  for a in ${alternative[$p]:-}; do available "$a" && { alt=$a; break; }; done
  if [[ -n $alt ]]; then echo "setup: $p is called $alt here" >&2; installed "$alt" || want+=("$alt")
  else absent+=("$p"); fi
done
install() { $sudo apt-get install -y -qq --no-install-recommends "$@" >/dev/null; }
# One transaction when it works (the usual case); package by package when one of them fails.
if ((${#want[@]})) && ! install "${want[@]}"; then
  for p in "${want[@]}"; do install "$p" || absent+=("$p"); done
fi
((${#absent[@]} == 0)) && exit 0
needed=0
for p in "${absent[@]}"; do
  if [[ -n ${optional[$p]:-} ]]; then echo "setup: could not install $p (optional: ${optional[$p]})" >&2
  else echo "setup: could not install $p (needed to build)" >&2; needed=1; fi
done
((needed == 0)) || echo "setup: install the packages above by other means (or their equivalents), then run this again" >&2
exit $needed
