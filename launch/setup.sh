#!/usr/bin/env bash
# Installs the Debian packages that a fresh machine lacks. Idempotent, and quiet when nothing is missing.
set -euo pipefail
packages=(openmpi-bin libopenmpi-dev libboost-program-options-dev libopenblas-dev libopenblas-openmp-dev libdnnl-dev
          nlohmann-json3-dev cmake g++ libgtest-dev)
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
