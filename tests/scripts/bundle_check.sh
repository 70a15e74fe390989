#!/usr/bin/env bash
# Checks launch/scripts/gpu_bundle.sh's archive: that it carries every library its programs load, except glibc,
# the driver and the CUDA toolkit's (which the GPU node has), and that it runs from where it unpacks.
#
#   tests/scripts/bundle_check.sh [ARCHIVE]        (default: build/amp_gpu_bundle.tar.xz)
#
# 1. needed: every ELF in the archive (programs, libraries, Open MPI's and PMIx's plugins): each
#    library it names (readelf NEEDED) is in the archive or is the node's (gpu_bundle.sh's node_libs_re).
#    Then the same check on a copy with one needed library removed must fail: the check can fail.
# 2. runs: unpacked, with the archive's environment: each program's libraries resolve inside it
#    (ldd); amp_train --device cpu, 2 ranks under the archive's mpirun, whose plugins must load from
#    the archive (LD_DEBUG), the CPU test binaries, test_cuda (its device tests skip without a GPU), and
#    gpu_check.sh --bundle, up to its "no NVIDIA driver" stop (exit 2) where there is no driver.
# 3. fresh: where ../shared/tools/fresh-machine-ci exists and we are root, step 2 again on a new
#    machine of this project's kind, from which every package this project installs is purged: proof
#    that nothing the archive needs comes from them. (Inside that tool, as CI runs, step 3 is left out:
#    there the project's packages are installed, and steps 1 and 2 are what can be checked.)
# --inside ARCHIVE: step 2 alone (what step 3 runs on the new machine).
set -euo pipefail   # (so no pipeline here may end early: SIGPIPE would fail it)
. "$(dirname "$0")/usage.sh"
usage_check "tests/scripts/bundle_check.sh [--inside] [ARCHIVE]" 0 1 --inside -- "$@"
inside=0 archive=
for a in "$@"; do
  if [[ $a == --inside ]]; then inside=1; else archive=$(usage_path "$a"); fi
done
cd "$(dirname "$0")/../.."
top=$PWD
archive=$(realpath -m "${archive:-build/amp_gpu_bundle.tar.xz}")
[[ -f $archive ]] || { echo "bundle_check: no $archive (make it: launch/scripts/gpu_bundle.sh)" >&2; exit 2; }
say() { echo "bundle_check: $*"; }
fail() { echo "bundle_check: FAIL: $*" >&2; exit 1; }
work=$(mktemp -d /tmp/bundle_check.XXXXXX)
trap 'rm -rf "$work"' EXIT
tar -xf "$archive" -C "$work"
root=$work/amp_gpu_bundle
[[ -f $root/MANIFEST ]] || fail "$archive holds no amp_gpu_bundle/MANIFEST"
# The libraries a GPU node has: glibc, the driver's, the CUDA toolkit's (the archive's own definition).
node_libs_re=$(sed -n "s/^node_libs_re='\(.*\)'$/\1/p" "$root/launch/scripts/gpu_bundle.sh" 2>/dev/null || true)
[[ -n $node_libs_re ]] || node_libs_re=$(sed -n "s/^node_libs_re='\(.*\)'$/\1/p" "$top/launch/scripts/gpu_bundle.sh")
[[ -n $node_libs_re ]] || fail "cannot read node_libs_re from launch/scripts/gpu_bundle.sh"

# --- 1. every NEEDED of every ELF is in the archive or the node's
elfs() { find "$1" -type f \( -path '*/libexec/*' -o -name '*.so*' \) | while read -r f; do
           [[ $(head -c4 "$f" | od -An -c | tr -d ' ') == 177ELF ]] && echo "$f"; done; }
check_needed() {   # check_needed DIR: prints what is missing; exit 1 if anything is
  local dir=$1 f n bad=0
  local have; have=$(find "$dir/lib" -maxdepth 2 -type f -printf '%f\n' | sort -u)
  while read -r f; do
    while read -r n; do
      [[ $n =~ $node_libs_re ]] && continue
      grep -qxF "$n" <<<"$have" && continue
      echo "  ${f#"$dir"/} needs $n: not in the archive"
      bad=1
    done < <(readelf -d "$f" | sed -n 's/.*(NEEDED).*Shared library: \[\(.*\)\]/\1/p')
  done < <(elfs "$dir")
  return $bad
}
if [[ $inside == 0 ]]; then
  n_elf=$(elfs "$root" | wc -l)
  check_needed "$root" || fail "the archive leaves out libraries that its programs load (above)"
  say "needed: all libraries of $n_elf ELF files are in the archive or the node's (glibc, driver, CUDA)"
  for p in $(sed -n 's/^\(programs\|gpu_tests\|cpu_tests\)=//p' "$root/MANIFEST") mpirun orted; do
    [[ -x $root/libexec/$p && -x $root/bin/$p ]] || fail "the archive lacks $p (libexec/ and its bin/ wrapper)"
  done
  # The check itself must fail on an archive without one of amp_train's libraries.
  drop=$(readelf -d "$root/libexec/amp_train" | sed -n 's/.*(NEEDED).*Shared library: \[\(.*\)\]/\1/p' |
         grep -Ev "$node_libs_re" | sed -n 1p)
  cp -a "$root" "$work/dropped"
  rm "$work/dropped/lib/$drop"
  if out=$(check_needed "$work/dropped"); then fail "with $drop removed the needed check still passes"; fi
  grep -q "libexec/amp_train needs $drop" <<<"$out" || fail "with $drop removed the check did not name it: $out"
  say "needed: with $drop removed it fails, as it must:"; head -n3 <<<"$out"
  rm -rf "$work/dropped"
fi

# --- 2. it runs from where it unpacks
# shellcheck source=/dev/null
. "$root/env.sh"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
say "runs: unpacked in $root; CUDA libraries from this machine: ${AMP_BUNDLE_CUDA_LIBS# }"
for e in "$root"/libexec/* "$root"/lib/{openmpi,pmix,hwloc}/*.so; do
  [[ -e $e ]] || continue
  while read -r name _ path _; do
    [[ $name =~ $node_libs_re || $name == linux-vdso* || $name == /* ]] && continue
    # libstdc++ and libgcc_s: the node's own where they are new enough (env.sh decides).
    [[ $name == libstdc++.so.6 || $name == libgcc_s.so.1 ]] && continue
    [[ $path == "$root"/* ]] || fail "${e#"$root"/} loads $name from $path, not from the archive"
  done < <(ldd "$e" | sed 's/^[[:space:]]*//')
done
say "runs: every program's and plugin's libraries resolve inside the archive (ldd)"
run() { echo "  \$ ${*#"$root"/}"; "$@" >"$work/out.txt" 2>&1 || { cat "$work/out.txt"; fail "'$*' failed"; }; }
run "$root/bin/amp_train" --help
run "$root/bin/amp_train" --device cpu --steps 5 --width 64 --layers 2 --batch-size 8 --log-every 5 --threads 1
tail -n2 "$work/out.txt"
# Two ranks under the archive's mpirun; every plugin it opens must come from the archive.
LD_DEBUG=files LD_DEBUG_OUTPUT=$work/lddebug run "$root/bin/mpirun" -np 2 --oversubscribe "$root/bin/amp_train" \
  --device cpu --steps 3 --width 64 --layers 2 --batch-size 8 --log-every 3 --threads 1
tail -n1 "$work/out.txt"
opened=$(cat "$work"/lddebug.* | sed -n 's/.*file=\([^ ]*\) .*dynamically loaded by.*/\1/p' | sort -u)
[[ -n $opened ]] || fail "LD_DEBUG saw no plugin loaded under mpirun"
# A plugin opened by path must be the archive's. A library opened by name alone (libcuda.so.1 by the
# CUDA runtime, oneDNN's optional profiling hook) must be the node's, the archive's, or absent here.
outside=""
for f in $opened; do
  [[ $f == "$root"/* ]] && continue
  n=$(basename "$f")
  if [[ $f != */* ]]; then
    [[ $n =~ $node_libs_re || -e $root/lib/$n ]] && continue
    /sbin/ldconfig -p | awk '{print $1}' | grep -xF "$n" >/dev/null || continue
  fi
  outside+=" $f"
done
[[ -z $outside ]] || fail "mpirun loaded plugins from outside the archive: $outside"
say "runs: mpirun -np 2 loaded $(wc -l <<<"$opened") plugins, all from the archive"
read -ra cpu_tests <<<"$(sed -n 's/^cpu_tests=//p' "$root/MANIFEST")"
for t in "${cpu_tests[@]}"; do
  run "$root/bin/$t"; tail -n1 "$work/out.txt"
done
run "$root/bin/test_cuda"; grep -m2 -E '^\[  (PASSED|SKIPPED) ' "$work/out.txt"
set +e
# Its arguments are checked before anything runs: exit 2, naming the flag.
for bad in "--budget 0" "--budget soon" "--stages test_cuda;env" "--stages sanitise" "--ranks 0"; do
  # shellcheck disable=SC2086  # the flag and its value, split on purpose
  "$root/launch/scripts/gpu_check.sh" --bundle "$archive" --out "$work/gc_bad" $bad >"$work/gc_bad.txt" 2>&1 && rc=0 || rc=$?
  ((rc == 2)) && grep -q -- "${bad%% *}" "$work/gc_bad.txt" || fail "gpu_check.sh $bad: exit $rc, not 2 naming ${bad%% *}"
done
say "runs: gpu_check.sh refuses a bad --budget, --stages or --ranks (exit 2, naming it)"
# --stages: a stage's whole name selects that stage only, a prefix every stage it begins.
plan=$("$root/launch/scripts/gpu_check.sh" --bundle "$archive" --stages bench_gpt2_small,sanitize --plan)
grep -qx 'bench_gpt2_small: runs' <<<"$plan" && grep -qx 'bench_gpt2_small_composite: skipped' <<<"$plan" &&
  grep -qx 'sanitize_racecheck: runs' <<<"$plan" && grep -qx 'test_cuda: skipped' <<<"$plan" ||
  fail "gpu_check.sh --stages bench_gpt2_small,sanitize --plan: $(tr '\n' ' ' <<<"$plan")"
say "runs: gpu_check.sh --stages takes a whole name as that stage only, a prefix as every stage it begins"
"$root/launch/scripts/gpu_check.sh" --bundle "$archive" --out "$work/gpu_check" >"$work/gc.txt" 2>&1
rc=$?
set -e
sed 's/^/  | /' "$work/gc.txt" | tail -n 8
[[ -s $work/gpu_check/gpu_check.json ]] || fail "gpu_check.sh --bundle wrote no gpu_check.json"
grep -q '"name": "bundle", "result": "pass"' "$work/gpu_check/gpu_check.json" || fail "gpu_check.sh's bundle stage did not pass"
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  say "runs: gpu_check.sh --bundle on a machine with a driver: exit $rc"
  ((rc <= 1)) || fail "gpu_check.sh --bundle stopped (exit $rc) on a machine with a driver"
else
  ((rc == 2)) || fail "gpu_check.sh --bundle exits $rc without a driver (2 expected)"
  grep -q 'no NVIDIA driver' "$work/gc.txt" || fail "gpu_check.sh --bundle did not say 'no NVIDIA driver'"
  say "runs: gpu_check.sh --bundle stops with 'no NVIDIA driver' (exit 2), its bundle stage passed, JSON written"
fi
[[ $inside == 1 ]] && { say "inside a fresh machine: passed"; exit 0; }

# --- 3. the same on a new machine without this project's packages
tool=$top/../shared/tools/fresh-machine-ci
if [[ -x $tool && $(id -u) -eq 0 && -d /work/.library ]]; then
  # The tool keeps / (less /tmp, /var/tmp, /work) under its overlay: the archive travels in /srv.
  carry=$(mktemp -d /srv/amp_bundle_check.XXXXXX)
  trap 'rm -rf "$work" "$carry"' EXIT
  cp "$archive" "$carry/"
  say "fresh: running step 2 on a new machine ($tool; it purges this project's packages first)"
  "$tool" "for p in openmpi-bin libopenmpi3 libboost-program-options1.74.0 libdnnl3 libgomp1; do
             dpkg-query -W -f='\${Status}' \$p 2>/dev/null | grep -q 'install ok installed' && echo \"present: \$p\"
           done; echo 'bundle_check: fresh: packages above (if any) are on the new machine';
           bash tests/scripts/bundle_check.sh --inside $carry/$(basename "$archive")" ||
    fail "the archive does not run on a new machine (above)"
  say "fresh: passed"
else
  say "fresh: skipped (needs ../shared/tools/fresh-machine-ci and root; inside it, steps 1 and 2 are the check)"
fi
say "passed"
