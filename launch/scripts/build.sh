#!/usr/bin/env bash
# Installs what is missing, then configures and builds a preset (default: release) into build/<preset>.
set -euo pipefail
cd "$(dirname "$0")/../.."
preset=${1:-release}
launch/setup.sh
cmake --preset "$preset" >/dev/null
cmake --build --preset "$preset" -j "${AMP_BUILD_JOBS:-2}"
