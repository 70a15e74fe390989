#!/usr/bin/env bash
# The docs' C++ compiles as shown: every ```cpp / ```c++ block of README.md and docs/*.md is built
# against the installed package (find_package(amp_runtime), linking amp::amp_launch, -Wall -Wextra
# -Werror, as examples/ is built), one executable per block, and the whole programs are run.
#  - A block with `int main` is a whole program: compiled as it stands, then run (under mpirun -np 1
#    when it uses MPI).
#  - A fragment says so on the line just before its fence:
#      <!-- docs_check: fragment -->           its #include lines go first, the rest becomes the body
#                                              of int main(); compiled and run.
#      <!-- docs_check: fragment(PARAMS) -->   the same, but the body of void docs_fragment(PARAMS):
#                                              PARAMS declares the names the fragment takes as given
#                                              (the reader's model, data); compiled and linked, not run.
#    The block's own #include lines must declare what it uses, PARAMS' types included.
#  - A block with neither is an error.
# Diagnostics name the markdown's file and line (the generated sources carry #line). Exit 1 naming
# every block that failed (file:line).
# Usage: tests/scripts/docs_check.sh [--build DIR | --prefix DIR | DIR]
#   --build DIR   install DIR (default build/release) into a temporary prefix first (cmake --install)
#   --prefix DIR  use a package already installed at DIR
#   DIR           a build directory (has CMakeCache.txt) or an install prefix
set -euo pipefail
cd "$(dirname "$0")/../.."
build=build/release
prefix=
usage() { echo "usage: tests/scripts/docs_check.sh [--build DIR | --prefix DIR | DIR]" >&2; exit 2; }
while (($#)); do
  case $1 in
    --build) (($# >= 2)) || usage; build=$2; shift 2 ;;
    --prefix) (($# >= 2)) || usage; prefix=$2; shift 2 ;;
    -h | --help) usage ;;
    -*) usage ;;
    *) if [[ -f $1/CMakeCache.txt ]]; then build=$1; else prefix=$1; fi; shift ;;
  esac
done
work=$(mktemp -d /tmp/amp_docs.XXXXXX)
trap 'rm -rf "$work"' EXIT
if [[ -z $prefix ]]; then
  [[ -f $build/CMakeCache.txt ]] || { echo "docs_check: $build is not a build directory" >&2; exit 2; }
  prefix=$work/prefix
  echo "== docs_check: cmake --install $build --prefix $prefix"
  cmake --install "$build" --prefix "$prefix" >/dev/null
fi
[[ -d $prefix/lib/cmake/amp_runtime || -d $prefix/lib64/cmake/amp_runtime ]] ||
  { echo "docs_check: no amp_runtime package under $prefix" >&2; exit 2; }
prefix=$(cd "$prefix" && pwd)

# Extract: $work/blocks/NAME.txt holds a block's lines; manifest: NAME \t FILE \t FENCE_LINE \t MARKER
# (MARKER: the line before the fence).
mkdir -p "$work/blocks" "$work/src" "$work/run"
docs=(README.md docs/*.md)
awk -v out="$work/blocks" '
  function unterminated() { if (inblock) printf "%s\t%s\t%d\tUNTERMINATED\n", name, file, start; inblock = 0 }
  FNR == 1 { unterminated(); prev = ""; file = FILENAME }
  !inblock && /^[ \t]*```[ \t]*(cpp|c\+\+)([ \t].*)?$/ {
    inblock = 1; start = FNR
    name = FILENAME "_L" FNR; gsub(/[^A-Za-z0-9_]/, "_", name)
    body = out "/" name ".txt"; printf "" > body
    marker = prev; sub(/^[ \t]+/, "", marker); sub(/[ \t]+$/, "", marker)
    next
  }
  inblock && /^[ \t]*```[ \t]*$/ {
    inblock = 0; close(body); prev = $0
    printf "%s\t%s\t%d\t%s\n", name, file, start, marker
    next
  }
  inblock { print > body; next }
  { prev = $0 }
  END { unterminated() }
' "${docs[@]}" >"$work/manifest"

failed=()
fail() { echo "docs_check: FAIL $1: $2" >&2; failed+=("$1 ($2)"); }
targets=() runs=() mpis=()
declare -A where
re_fragment='^<!--[[:space:]]*docs_check:[[:space:]]*fragment[[:space:]]*-->$'
re_fragment_params='^<!--[[:space:]]*docs_check:[[:space:]]*fragment\((.*)\)[[:space:]]*-->$'
while IFS=$'\t' read -r name file line marker; do
  at=$file:$line
  where[$name]=$at
  blk=$work/blocks/$name.txt
  out=$work/src/$name.cpp
  has_main=0
  grep -Eq '(^|[^A-Za-z0-9_])int[[:space:]]+main[[:space:]]*\(' "$blk" && has_main=1
  frag=0 params=
  if [[ $marker == UNTERMINATED ]]; then fail "$at" "the block has no closing fence"; continue
  elif [[ $marker =~ $re_fragment ]]; then frag=1
  elif [[ $marker =~ $re_fragment_params ]]; then
    frag=1 params=${BASH_REMATCH[1]}
  elif [[ $marker == *docs_check* ]]; then fail "$at" "unknown marker '$marker' (docs_check: fragment or fragment(PARAMS))"; continue
  fi
  if ((frag && has_main)); then fail "$at" "marked as a fragment but defines main"; continue; fi
  if ((!frag && !has_main)); then
    fail "$at" "no int main and no '<!-- docs_check: fragment -->' on the line before the fence"; continue
  fi
  if ((!frag)); then
    { echo "#line $((line + 1)) \"$file\""; cat "$blk"; } >"$out"
  else
    {
      n=$line
      while IFS= read -r l; do
        n=$((n + 1))
        if [[ $l =~ ^[[:space:]]*#[[:space:]]*include ]]; then printf '#line %d "%s"\n%s\n' "$n" "$file" "$l"; fi
      done <"$blk"
      if [[ -n $params ]]; then echo "void docs_fragment($params) {"; else echo "int main() {"; fi
      echo "#line $((line + 1)) \"$file\""
      # The #include lines were hoisted: blank there, so that the lines keep their numbers.
      sed -E 's/^[[:space:]]*#[[:space:]]*include.*$//' "$blk"
      echo "}"
      if [[ -n $params ]]; then echo "int main() { return 0; }"; fi
    } >"$out"
  fi
  targets+=("$name")
  # Run: whole programs and fragments without PARAMS; under mpirun when the block uses MPI.
  if ((!frag)) || [[ -z $params ]]; then
    runs+=("$name")
    if grep -Eq 'MPI_|Mpi(Session|Communicator)|mpi_session\.h' "$blk"; then mpis+=("$name"); fi
  fi
done <"$work/manifest"
echo "== docs_check: $(wc -l <"$work/manifest") C++ block(s) in README.md docs/*.md, ${#targets[@]} to build"

if ((${#targets[@]})); then
  {
    echo "cmake_minimum_required(VERSION 3.22)"
    echo "project(amp_docs_check LANGUAGES CXX)"
    echo "set(CMAKE_CXX_STANDARD 20)"
    echo "set(CMAKE_CXX_STANDARD_REQUIRED ON)"
    echo "find_package(amp_runtime 0.1 REQUIRED)"
    echo "foreach(name IN ITEMS ${targets[*]})"
    echo "  add_executable(\${name} \${name}.cpp)"
    echo "  target_link_libraries(\${name} PRIVATE amp::amp_launch)"
    echo "  target_compile_options(\${name} PRIVATE -Wall -Wextra -Werror)"
    echo "endforeach()"
  } >"$work/src/CMakeLists.txt"
  # The blocks see the installed headers only: not this source tree.
  if ! cmake -S "$work/src" -B "$work/build" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release \
      >"$work/configure.log" 2>&1; then
    cat "$work/configure.log" >&2
    for name in "${targets[@]}"; do fail "${where[$name]}" "configure failed"; done
    targets=() runs=()
  fi
fi
built=()
for name in "${targets[@]}"; do
  if cmake --build "$work/build" --target "$name" -j "${AMP_BUILD_JOBS:-1}" >"$work/$name.log" 2>&1; then
    built+=("$name")
    echo "docs_check: ${where[$name]}: built"
  else
    grep -Ev '^g?make(\[[0-9]+\])?: ' "$work/$name.log" | head -n 60 >&2 || true
    fail "${where[$name]}" "does not compile against the installed package"
  fi
done
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
for name in "${runs[@]}"; do
  [[ " ${built[*]} " == *" $name "* ]] || continue
  launcher=()
  [[ " ${mpis[*]-} " == *" $name "* ]] && launcher=(mpirun -np 1)
  rc=0
  (cd "$work/run" && timeout "${AMP_DOCS_TIMEOUT:-300}" "${launcher[@]}" "$work/build/$name") \
    >"$work/$name.run.log" 2>&1 || rc=$?
  if ((rc == 0)); then
    echo "docs_check: ${where[$name]}: ran${launcher:+ under ${launcher[*]}}"
  else
    tail -n 20 "$work/$name.run.log" >&2
    fail "${where[$name]}" "exit $rc when run$( ((rc == 124)) && echo " (timed out)")"
  fi
done
if ((${#failed[@]})); then
  echo "docs_check: ${#failed[@]} block(s) failed:" >&2
  printf '  %s\n' "${failed[@]}" >&2
  exit 1
fi
echo "== docs_check: passed (${#built[@]} block(s) built against the installed package, ${#runs[@]} run)"
