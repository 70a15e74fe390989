#!/usr/bin/env bash
# The layering rule (docs/CONTRIBUTING.md), checked twice:
#  1. includes: a file includes only its own folder and the folders below it (the table below);
#  2. symbols (with a build directory): no static library of ours uses a symbol that only a library
#     outside its own link dependencies defines, so that the linker, not a reader, holds the layers.
# Usage: tests/scripts/layers.sh [BUILD_DIR]. Exit 1 naming each violation.
set -euo pipefail
. "$(dirname "$0")/usage.sh"
usage_check "tests/scripts/layers.sh [BUILD_DIR]" 0 1 -- "$@"
build=${1:+$(usage_path "$1")}
[[ -z $build || -d $build ]] || { echo "layers: BUILD_DIR $build: no such directory" >&2; exit 2; }
cd "$(dirname "$0")/../.."

# folder: the folders its files may include (its own first). Longest folder prefix wins.
declare -A allowed=(
  [runtime/core]="runtime/core"
  [tests/gpu_emulator]="tests/gpu_emulator runtime/core"  # the toolkit's stand-in: below the runtime
  [runtime/kernels]="runtime/kernels runtime/core"
  [runtime/kernels/cuda]="runtime/kernels/cuda runtime/kernels runtime/core"
  [runtime/ops]="runtime/ops runtime/kernels runtime/core"
  [runtime/nn]="runtime/nn runtime/ops runtime/kernels runtime/core"
  [runtime/optim]="runtime/optim runtime/ops runtime/kernels runtime/core"
  [comm]="comm runtime"
  [amp]="amp comm runtime"
  [jd]="jd runtime"
  [models]="models amp comm jd runtime"
  [launch]="launch models amp comm jd runtime"
)
folder_of() {
  local f=$1 best=""
  for k in "${!allowed[@]}"; do
    [[ $f == "$k"/* && ${#k} -gt ${#best} ]] && best=$k
  done
  echo "$best"
}
bad=0
while IFS= read -r file; do
  folder=$(folder_of "$file")
  [[ -z $folder ]] && continue
  while IFS= read -r inc; do
    ok=0
    for a in ${allowed[$folder]}; do
      # runtime/kernels may not reach into runtime/kernels/cuda, the layer above it.
      if [[ $inc == "$a"/* ]] && ! [[ $folder == runtime/kernels && $inc == runtime/kernels/cuda/* ]]; then ok=1; fi
    done
    if (( !ok )); then echo "layers: $file includes $inc (a folder above $folder or beside it)"; bad=1; fi
  done < <(grep -oE '^#include "(runtime|comm|amp|jd|models|launch|tests)/[^"]+"' "$file" | sed -E 's/#include "(.*)"/\1/')
done < <(git ls-files 'runtime/*' 'comm/*' 'amp/*' 'jd/*' 'models/*' 'launch/*' 'tests/gpu_emulator/*' | grep -E '\.(h|cuh|cpp|cu)$')

if [[ -n $build ]]; then
  # target: the libraries of ours it links (directly or not); the static archives are found by name.
  declare -A deps=(
    [amp_core]=""
    [amp_kernels]="amp_core"
    [amp_kernels_cuda]="amp_kernels amp_core"
    [amp_ops]="amp_kernels_cuda amp_kernels amp_core"
    [amp_nn]="amp_ops amp_kernels_cuda amp_kernels amp_core"
    [amp_optim]="amp_ops amp_kernels_cuda amp_kernels amp_core"
  )
  declare -A lib
  for t in "${!deps[@]}"; do
    lib[$t]=$(find "$build" -name "lib$t.a" | head -1)
    [[ -n ${lib[$t]} ]] || { echo "layers: lib$t.a not found under $build"; exit 1; }
  done
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  for t in "${!deps[@]}"; do
    # Strong definitions (text, data, bss), not weak or inline ones that several libraries may hold.
    nm -C --defined-only "${lib[$t]}" 2>/dev/null | awk '$2 ~ /^[TDBR]$/ { $1 = ""; $2 = ""; sub(/^  /, ""); print }' |
      sort -u > "$tmp/$t.def"
    nm -C -u "${lib[$t]}" 2>/dev/null | awk '{ $1 = ""; sub(/^ /, ""); print }' | sort -u > "$tmp/$t.undef"
  done
  for t in "${!deps[@]}"; do
    : > "$tmp/$t.reach"
    for d in $t ${deps[$t]}; do cat "$tmp/$d.def" >> "$tmp/$t.reach"; done
    sort -u -o "$tmp/$t.reach" "$tmp/$t.reach"
    for other in "${!deps[@]}"; do
      [[ " $t ${deps[$t]} " == *" $other "* ]] && continue
      # used by t, defined by a library above or beside it, and not by any it may use
      comm -12 "$tmp/$t.undef" "$tmp/$other.def" | comm -23 - "$tmp/$t.reach" > "$tmp/hits"
      if [[ -s $tmp/hits ]]; then
        echo "layers: $t uses symbols of $other, which it does not link (first ones):"
        head -5 "$tmp/hits" | sed 's/^/  /'
        bad=1
      fi
    done
  done
fi
if (( bad )); then exit 1; fi
echo "layers: every include and every library keeps to the layers"
