#!/usr/bin/env bash
# The runtime as a library: installs build/<preset> into a prefix (cmake --install), then builds
# examples/ (a project of its own: find_package(amp_runtime)) against that prefix alone, and trains
# its model on 2 ranks. Fails when a header, a library, a dependency of the package config or an
# imported target is missing from the installed package.
#   tests/scripts/install_check.sh [build/release]
set -euo pipefail
. "$(dirname "$0")/usage.sh"
usage_check "tests/scripts/install_check.sh [BUILD_DIR]   (default build/release)" 0 1 -- "$@"
build=${1:+$(usage_path "$1")}
cd "$(dirname "$0")/../.."
build=${build:-build/release}
[[ -d $build ]] || { echo "install_check: BUILD_DIR $build: no such directory (build it: launch/scripts/build.sh release)" >&2; exit 2; }
prefix=$(mktemp -d /tmp/amp_install.XXXXXX)
work=$(mktemp -d /tmp/amp_examples.XXXXXX)
trap 'rm -rf "$prefix" "$work"' EXIT
echo "== install_check: cmake --install $build --prefix $prefix"
cmake --install "$build" --prefix "$prefix" >/dev/null
# The examples see the installed headers only: not this source tree.
cp -r examples/. "$work/src"
cmake -S "$work/src" -B "$work/build" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$work/build" -j "${AMP_BUILD_JOBS:-2}" >/dev/null
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
timeout 300 mpirun -np 2 --oversubscribe "$work/build/layernorm_mlp"
echo "== install_check: passed (examples/ built against the installed package and trained on 2 ranks)"
