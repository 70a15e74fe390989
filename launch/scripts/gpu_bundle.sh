#!/usr/bin/env bash
# One archive for a GPU node on which nothing can be installed (an air-gapped cluster node, a locked
# container): it needs there only an NVIDIA driver, the CUDA toolkit's libraries (cuBLAS; NCCL from the
# toolkit or from PyTorch's nvidia-nccl package) and, for the PyTorch comparison, Python with PyTorch.
#
#   launch/scripts/gpu_bundle.sh [--no-build] [--out FILE]      (default FILE: build/amp_gpu_bundle.tar.xz)
#
# Builds the `cuda` preset (nvcc; sm_80 and sm_90, warnings are errors), then packs
#   bin/       one wrapper per program: it sources env.sh, then runs the real one from libexec/
#   libexec/   amp_train, bench_mlp, the GPU test binaries (test_cuda, test_nccl, test_emu_train), two
#              CPU test binaries, and Open MPI's orterun (mpirun) and orted, all stripped
#   lib/       every shared library they load, found from the binaries (ldd: the whole closure), that
#              is neither glibc nor the CUDA toolkit's/driver's; Open MPI's and PMIx's plugins
#              (lib/openmpi, lib/pmix), hwloc's PCI plugin (lib/hwloc) and what those load; lib/gcc: libstdc++ and libgcc_s, used only
#              where the node's own are older than what the binaries need
#   share/ etc/  Open MPI's and PMIx's help texts and parameter files (mpirun reads them at run time)
#   env.sh     PATH, LD_LIBRARY_PATH, OPAL_*/PMIX_* for the relocated Open MPI, and the node's cuBLAS
#              and NCCL (found on the node: the loader's cache, CUDA_HOME, /usr/local/cuda, PyTorch's
#              nvidia-* wheels), and cuDNN's libcudnn.so.9 with the NVRTC it compiles its kernels with,
#              where the node has them (dlopened by --attention auto|cudnn, never packed; PyTorch's
#              nvidia-cudnn and nvidia-cuda-nvrtc wheels have them)
#   launch/scripts/gpu_check.sh, launch/bench/bench_vs_pytorch.py, tests/data (the tests' fixtures), MANIFEST
# and checks the size (at most AMP_BUNDLE_MAX_MIB, default 48). tests/scripts/bundle_check.sh checks
# the archive: every library each ELF in it needs is in it or allowed from the node, and it runs on a
# machine without any of this project's packages. Use on the node: see README, "On a GPU node".
set -euo pipefail
here=$PWD   # a relative --out is the caller's, not the repository's
cd "$(dirname "$0")/../.."
top=$PWD
build=build/cuda
out=$top/build/amp_gpu_bundle.tar.xz
do_build=1
while (($#)); do
  case $1 in
    --no-build) do_build=0 ;;
    --out)
      [[ $# -ge 2 && -n $2 && $2 != -* ]] || { echo "gpu_bundle: --out needs a file name (.tar.xz or .tar.zst)${2:+, not $2}" >&2; exit 2; }
      out=$(cd "$here" && realpath -m -- "$2"); shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_bundle: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
# The name says the compression (gpu_check unpacks by it), and its folder can be written: found now,
# not after the build.
[[ $out == *.tar.xz || $out == *.tar.zst ]] || { echo "gpu_bundle: --out $out: the name must end in .tar.xz or .tar.zst" >&2; exit 2; }
mkdir -p "$(dirname "$out")" 2>/dev/null && [[ ! -d $out ]] && : 2>/dev/null >"$out.probe.$$" && rm -f "$out.probe.$$" ||
  { echo "gpu_bundle: --out $out: cannot write there (its folder cannot be made or written, or it is a directory)" >&2; exit 2; }
max_mib=${AMP_BUNDLE_MAX_MIB:-48}
programs=(amp_train bench_mlp)
gpu_tests=(test_cuda test_nccl test_emu_train)
cpu_tests=(test_grad_scaler test_casts)
# Libraries the node provides: glibc, the driver, the CUDA toolkit. Everything else is packed.
# (Shared with tests/scripts/bundle_check.sh, which reads this line.)
node_libs_re='^(ld-linux-x86-64\.so\.2|linux-vdso\.so\.1|libc\.so\.6|libm\.so\.6|libpthread\.so\.0|libdl\.so\.2|librt\.so\.1|libutil\.so\.1|libresolv\.so\.2|libanl\.so\.1|libcuda\.so\.1|libnvidia-ml\.so\.1|libcudart\.so\.[0-9]+|libcublas\.so\.[0-9]+|libcublasLt\.so\.[0-9]+|libnccl\.so\.[0-9]+|libnvrtc\.so\.[0-9.]+|libnvJitLink\.so\.[0-9]+)$'
gcc_libs_re='^(libstdc\+\+\.so\.6|libgcc_s\.so\.1)$'

if ((do_build)); then
  command -v nvcc >/dev/null || [[ -x /usr/local/cuda/bin/nvcc ]] ||
    { echo "gpu_bundle: nvcc not found: the archive is built where the CUDA toolkit is installed" >&2; exit 2; }
  [[ -d /usr/local/cuda/bin ]] && export PATH=$PATH:/usr/local/cuda/bin
  launch/setup.sh
  cmake --preset cuda >/dev/null
  cmake --build --preset cuda -j "${AMP_BUILD_JOBS:-2}" --target "${programs[@]}" "${gpu_tests[@]}" "${cpu_tests[@]}"
fi
if ! grep -q '^AMP_CUDA_EMU:BOOL=OFF' $build/CMakeCache.txt || ! grep -q '^AMP_WITH_CUDA:BOOL=ON' $build/CMakeCache.txt; then
  echo "gpu_bundle: $build is not an nvcc build of the CUDA backend" >&2; exit 1
fi

stage=$top/build/bundle
root=$stage/amp_gpu_bundle
rm -rf "$stage"
mkdir -p "$root"/{bin,libexec,lib/gcc,lib/openmpi,lib/pmix,lib/hwloc,share/openmpi,share/pmix,etc,launch,tests}

exes=()
for p in "${programs[@]}"; do exes+=("$build/launch/$p"); done
for t in "${gpu_tests[@]}" "${cpu_tests[@]}"; do exes+=("$build/tests/$t"); done
mpirun_real=$(readlink -f "$(command -v mpirun)")
orted_real=$(readlink -f "$(command -v orted)")
exes+=("$mpirun_real" "$orted_real")

# Open MPI's own directories, as it was built (ompi_info knows them).
ompi_path() { ompi_info --path "$1" --parsable | sed -n "s/^path:$1:\(.*\)/\1/p"; }
ompi_pkglib=$(ompi_path pkglibdir)
ompi_pkgdata=$(ompi_path pkgdatadir)
ompi_sysconf=$(ompi_path sysconfdir)
plugins=("$ompi_pkglib"/*.so)
# PMIx is Open MPI's external one on Debian: libpmix.so.2 with its plugins in pmix/ beside it.
# (awk reads to the end in these pipelines: an early exit would kill the writer with SIGPIPE, and
# pipefail would fail the script.)
pmix_lib=$(ldd "$ompi_pkglib"/mca_pmix_*.so 2>/dev/null | awk '$1 ~ /^libpmix\.so/ && !p {print $3; p = 1}')
pmix_plugins=() pmix_share=""
if [[ -n $pmix_lib ]]; then
  pmix_dir=$(dirname "$(readlink -f "$pmix_lib")")
  [[ -d $pmix_dir/pmix ]] && pmix_plugins=("$pmix_dir"/pmix/*.so)
  [[ -d $pmix_dir/../share ]] && pmix_share=$(readlink -f "$pmix_dir/../share")
fi

# hwloc (Open MPI's topology) loads plugins of its own: the PCI one, which places GPUs and NICs on
# their NUMA nodes. Its XML (libxml2 pulls 30 MB of ICU data; hwloc parses XML itself without it),
# OpenCL and X11 ones are left out on purpose.
hwloc_lib=$(ldd "$(command -v orted)" | awk '$1 ~ /^libhwloc\.so/ && !p {print $3; p = 1}')
hwloc_plugins=()
[[ -n $hwloc_lib && -f $(dirname "$(readlink -f "$hwloc_lib")")/hwloc/hwloc_pci.so ]] &&
  hwloc_plugins=("$(dirname "$(readlink -f "$hwloc_lib")")/hwloc/hwloc_pci.so")

# The whole closure of what every ELF loads, from the loader itself (ldd), less the node's part.
copy_deps() {
  local f line name path
  for f in "$@"; do
    while read -r line; do
      name=${line%% *}
      [[ $name =~ $node_libs_re ]] && continue
      [[ $line == *"=> not found"* ]] && { echo "gpu_bundle: $f needs $name, which is not found here" >&2; return 1; }
      path=$(awk '{for (i = 1; i < NF; ++i) if ($i == "=>") print $(i + 1)}' <<<"$line")
      [[ -z $path ]] && continue
      if [[ $name =~ $gcc_libs_re ]]; then dest=$root/lib/gcc/$name; else dest=$root/lib/$name; fi
      [[ -e $dest ]] || { cp -L "$path" "$dest"; chmod u+w "$dest"; }
    done < <(ldd "$f" | sed 's/^[[:space:]]*//; s/ (0x[0-9a-f]*)$//')
  done
}
for e in "${exes[@]}"; do
  [[ -x $e ]] || { echo "gpu_bundle: $e is missing (build it first)" >&2; exit 1; }
  cp -L "$e" "$root/libexec/$(basename "$e")"
done
cp -L "${plugins[@]}" "$root/lib/openmpi/"
((${#pmix_plugins[@]})) && cp -L "${pmix_plugins[@]}" "$root/lib/pmix/"
((${#hwloc_plugins[@]})) && cp -L "${hwloc_plugins[@]}" "$root/lib/hwloc/"
# Open MPI's plugins load its libmca_common_* from its libdir: ldd finds them there.
copy_deps "${exes[@]}" "${plugins[@]}" "${pmix_plugins[@]}" "${hwloc_plugins[@]}"
chmod -R u+w "$root"
strip --strip-unneeded "$root"/libexec/* "$root"/lib/*.so* "$root"/lib/{openmpi,pmix,hwloc}/*.so 2>/dev/null || true
mv "$root/libexec/$(basename "$mpirun_real")" "$root/libexec/mpirun"
[[ $(basename "$orted_real") == orted ]] || mv "$root/libexec/$(basename "$orted_real")" "$root/libexec/orted"

cp -r "$ompi_pkgdata"/. "$root/share/openmpi/"
cp "$ompi_sysconf"/openmpi-mca-params.conf "$ompi_sysconf"/openmpi-default-hostfile "$root/etc/" 2>/dev/null || true
if [[ -n $pmix_share ]]; then
  cp -r "$pmix_share"/pmix/. "$root/share/pmix/" 2>/dev/null || true
  cp "$pmix_share"/pmix-mca-params.conf "$root/etc/" 2>/dev/null || true
fi
mkdir -p "$root/launch/bench" "$root/launch/scripts"
cp launch/scripts/gpu_check.sh launch/scripts/gpu_bundle.sh "$root/launch/scripts/"
cp launch/bench/bench_vs_pytorch.py "$root/launch/bench/"
cp -r tests/data "$root/tests/"   # the test binaries' fixtures (AMP_TEST_DATA_DIR)

# A wrapper per program, so that `env -i PATH=...` (as the CLI tests run amp_train) still works.
for e in "$root"/libexec/*; do
  n=$(basename "$e")
  cat >"$root/bin/$n" <<EOF
#!/bin/sh
# $n from the bundle: its environment (env.sh), then the program itself.
AMP_BUNDLE=\$(cd "\$(dirname "\$0")/.." && pwd); export AMP_BUNDLE
. "\$AMP_BUNDLE/env.sh"
exec "\$AMP_BUNDLE/libexec/$n" "\$@"
EOF
  chmod +x "$root/bin/$n"
done

# The highest versions of glibc's and libstdc++'s symbols that anything packed asks for.
need_ver() { objdump -T "$root"/libexec/* "$root"/lib/*.so* "$root"/lib/openmpi/*.so 2>/dev/null |
               grep -o "$1_[0-9.]*" | sort -uV | tail -n1; }
glibc_need=$(need_ver GLIBC)
glibcxx_need=$(need_ver GLIBCXX)
cuda_libs=$(for e in "$root"/libexec/*; do readelf -d "$e" | sed -n 's/.*Shared library: \[\(.*\)\]/\1/p'; done |
            grep -E "$node_libs_re" | grep -E '^lib(cudart|cublas|cublasLt|nccl|nvrtc|nvJitLink)\.' | sort -u | tr '\n' ' ')
nvcc_bin=$(grep '^CMAKE_CUDA_COMPILER:' $build/CMakeCache.txt | cut -d= -f2)
cuda_version=$("$nvcc_bin" --version | sed -n 's/.*release \([0-9.]*\),.*/\1/p')
# What nvcc generated: SASS (sm_XX) and PTX (compute_XX) per architecture, as the build's flags say.
archs=$(grep -o 'arch=compute_[0-9]*,code=[^ ]*' $build/runtime/kernels/cuda/CMakeFiles/amp_kernels_cuda.dir/flags.make |
        sed 's/.*code=//; s/[][]//g' | tr ',' '\n' | sort -u | paste -sd, || true)

cat >"$root/env.sh" <<'EOF'
# Sourced (sh or bash): the bundle's environment. Sets AMP_BUNDLE, PATH, LD_LIBRARY_PATH, Open MPI's
# and PMIx's relocation variables, and finds on this node the CUDA libraries the binaries load
# (AMP_BUNDLE_CUDA_LIBS: name=path or name=MISSING, each). Safe to source twice, and from a script
# under set -e and pipefail: no command here fails, no pipeline ends early.
if [ -z "${AMP_BUNDLE_ENV:-}" ]; then
  # The wrappers in bin/ set AMP_BUNDLE; a user's `source env.sh` (bash) finds it from its own path.
  [ -n "${AMP_BUNDLE:-}" ] && [ -f "$AMP_BUNDLE/MANIFEST" ] || AMP_BUNDLE=$(cd "$(dirname "${BASH_SOURCE:-$0}")" && pwd)
  export AMP_BUNDLE
  _b=$AMP_BUNDLE
  _ld=$_b/lib
  # libstdc++/libgcc_s from the bundle only where the node's lack a version the binaries use.
  _need=$(sed -n 's/^glibcxx_needed=//p' "$_b/MANIFEST")
  _sys=$(ldconfig -p 2>/dev/null | awk '/libstdc\+\+\.so\.6 .*x86-64/ && !p {print $NF; p = 1}' || true)
  if [ -n "$_need" ] && { [ -z "$_sys" ] || ! grep -q "$_need" "$_sys" 2>/dev/null; }; then _ld=$_ld:$_b/lib/gcc; fi
  # The node's CUDA libraries: where the loader looks, then the toolkit's directories, then PyTorch's
  # nvidia-* wheels (nvidia/nccl/lib, nvidia/cublas/lib, nvidia/cu13/lib).
  PATH=$PATH:/sbin:/usr/sbin   # ldconfig
  _py=$(command -v python3 2>/dev/null || true)
  _site=""
  AMP_BUNDLE_CUDA_LIBS=""
  # optional_libs: what the binaries dlopen where it is there (libcudnn.so.9: --attention cudnn/auto).
  for _lib in $(sed -n 's/^cuda_libs=//p' "$_b/MANIFEST") $(sed -n 's/^optional_libs=//p' "$_b/MANIFEST"); do
    # In the loader's order: LD_LIBRARY_PATH (a `module load cuda`), its cache, then the usual places.
    _found=""
    for _d in $(printf '%s' "${LD_LIBRARY_PATH:-}" | tr ':' ' '); do
      [ -e "$_d/$_lib" ] && { _found=$_d/$_lib; break; }
    done
    [ -n "$_found" ] ||
      _found=$(ldconfig -p 2>/dev/null | awk -v n="$_lib" '$1 == n && /x86-64/ && !p {print $NF; p = 1}' || true)
    [ -e "$_found" ] || _found=""   # the cache can name a file that is gone
    if [ -z "$_found" ]; then
      for _d in ${CUDA_HOME:+$CUDA_HOME/lib64} ${CUDA_HOME:+$CUDA_HOME/lib} ${CUDA_PATH:+$CUDA_PATH/lib64} \
                /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib; do
        [ -e "$_d/$_lib" ] && { _found=$_d/$_lib; break; }
      done
    fi
    if [ -z "$_found" ] && [ -n "$_py" ]; then
      [ -n "$_site" ] || _site=$("$_py" -c 'import site, sys; print(" ".join(site.getsitepackages() + [site.getusersitepackages()] + sys.path))' 2>/dev/null || true)
      for _s in $_site; do
        for _d in "$_s"/nvidia/*/lib; do
          [ -e "$_d/$_lib" ] && { _found=$_d/$_lib; break 2; }
        done
      done
    fi
    if [ -n "$_found" ]; then
      case ":$_ld:" in *":$(dirname "$_found"):"*) ;; *) _ld=$_ld:$(dirname "$_found") ;; esac
      AMP_BUNDLE_CUDA_LIBS="$AMP_BUNDLE_CUDA_LIBS $_lib=$(readlink -f "$_found")"
    else
      AMP_BUNDLE_CUDA_LIBS="$AMP_BUNDLE_CUDA_LIBS $_lib=MISSING"
    fi
  done
  export AMP_BUNDLE_CUDA_LIBS
  export LD_LIBRARY_PATH=$_ld${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export PATH=$_b/bin:$PATH
  # Open MPI and PMIx were built for /usr: these move every directory they read into the bundle.
  export OPAL_PREFIX=$_b OPAL_EXEC_PREFIX=$_b OPAL_BINDIR=$_b/libexec OPAL_LIBDIR=$_b/lib OPAL_PKGLIBDIR=$_b/lib/openmpi
  export OPAL_DATADIR=$_b/share OPAL_PKGDATADIR=$_b/share/openmpi OPAL_SYSCONFDIR=$_b/etc
  export PMIX_PREFIX=$_b PMIX_LIBDIR=$_b/lib PMIX_PKGLIBDIR=$_b/lib/pmix PMIX_DATADIR=$_b/share
  export PMIX_PKGDATADIR=$_b/share/pmix PMIX_SYSCONFDIR=$_b/etc
  export OMPI_MCA_mca_base_component_path=$_b/lib/openmpi PMIX_MCA_mca_base_component_path=$_b/lib/pmix
  export HWLOC_PLUGINS_PATH=$_b/lib/hwloc
  # mpirun refuses to start, even on one node, when its remote agent (ssh, then rsh) is not found:
  # a container or a GPU node often has neither. One node never calls it; `false` stands in.
  if [ -z "${OMPI_MCA_plm_rsh_agent:-}" ] && ! command -v ssh >/dev/null 2>&1 && ! command -v rsh >/dev/null 2>&1; then
    export OMPI_MCA_plm_rsh_agent=false
  fi
  export AMP_TEST_DATA_DIR=$_b/tests/data
  export AMP_BUNDLE_ENV=1
  unset _b _ld _need _sys _py _site _lib _found _d _s
fi
EOF

{
  echo "built=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit=$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . ':!build' || echo -dirty)"
  echo "cuda_version=$cuda_version"
  echo "cuda_architectures=$archs"
  echo "cuda_libs=$cuda_libs"
  # cuDNN compiles its attention kernels at run time with NVRTC (of its CUDA major: 13 here).
  echo "optional_libs=libcudnn.so.9 libnvrtc.so.13 libnvrtc-builtins.so.13.0"
  echo "glibc_needed=$glibc_need"
  echo "glibcxx_needed=$glibcxx_need"
  echo "open_mpi=$(ompi_info --version 2>/dev/null | sed -n 's/^Open MPI v//p')"
  echo "programs=${programs[*]}"
  echo "gpu_tests=${gpu_tests[*]}"
  echo "cpu_tests=${cpu_tests[*]}"
} >"$root/MANIFEST"

# Written beside it and renamed: a failed or killed compression never leaves a partial archive
# under the name, nor does an archive over the size limit (it is kept as NAME.too-large).
part=$out.partial.$$
trap 'rm -f "$part"' EXIT
case $out in
  *.tar.zst) tar -C "$stage" -cf - amp_gpu_bundle | zstd -q -19 -T1 -f -o "$part" ;;
  *) tar -C "$stage" -cf - amp_gpu_bundle | xz -9 -T1 >"$part" ;;
esac
bytes=$(stat -c %s "$part")
rm -f "$out" "$out.too-large"
if ((bytes > max_mib * 1048576)); then
  mv "$part" "$out.too-large"
  echo "gpu_bundle: the archive is $bytes bytes, larger than ${max_mib} MiB (AMP_BUNDLE_MAX_MIB): kept as $out.too-large, not as $out" >&2
  exit 1
fi
mv "$part" "$out"
mib=$(awk -v b="$bytes" 'BEGIN {printf "%.1f", b / 1048576}')
echo "gpu_bundle: $out: $mib MiB ($bytes bytes; unpacked $(du -sh "$root" | cut -f1)); CUDA $cuda_version, sm $archs;" \
     "from the node: $cuda_libs"

