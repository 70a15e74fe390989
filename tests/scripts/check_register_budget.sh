#!/usr/bin/env bash
# Every kernel fits its launch: registers per thread x threads per block <= 65536 (the register file
# of one SM on sm_80 and sm_90). A kernel launched with more than 256 threads must cap its registers
# with __launch_bounds__, or ptxas may give it more than the launch can have and the launch fails
# with cudaErrorLaunchOutOfResources on the GPU (never here: nothing here runs device code).
# Compiles the kernel files with ptxas's resource report (sm_90) and checks each kernel against the
# largest block it is launched with (the table below; kernels not named use kBlock = 256 threads).
# Usage: check_register_budget.sh NVCC SOURCE_DIR
set -euo pipefail
. "$(dirname "$0")/usage.sh"
usage_check "tests/scripts/check_register_budget.sh NVCC SOURCE_DIR" 2 2 -- "$@"
nvcc=$1 src=$2
declare -A threads=([sum_partials_kernel]=1024 [nll_loss_kernel]=1024 [norm_finish_kernel]=1024
                    [multi_tensor_kernel]=512 [sum_columns_kernel]=256)
fail=0 checked=0
# Every kernel file of the backend (a new one is checked without being listed here).
for path in "$src"/runtime/kernels/cuda/*.cu; do
  f=$(basename "$path")
  report=$("$nvcc" -std=c++20 --fmad=false --resource-usage -arch=sm_90 -I"$src" -c "$src/runtime/kernels/cuda/$f" -o /dev/null 2>&1) || {
    echo "$f: nvcc failed:"; echo "$report"; exit 1; }
  kernel=""
  while IFS= read -r line; do
    if [[ $line =~ Compiling\ entry\ function\ \'([^\']+)\' ]]; then
      kernel=${BASH_REMATCH[1]}
    elif [[ -n $kernel && $line =~ Used\ ([0-9]+)\ registers ]]; then
      regs=${BASH_REMATCH[1]} block=256
      for name in "${!threads[@]}"; do [[ $kernel == *"$name"* ]] && block=${threads[$name]}; done
      checked=$((checked + 1))
      if ((regs * block > 65536)); then
        echo "FAIL $f: $kernel uses $regs registers x $block threads = $((regs * block)) > 65536"
        fail=1
      fi
      kernel=""
    fi
  done <<<"$report"
done
((checked > 0)) || { echo "no kernel found in ptxas's report"; exit 1; }
echo "$checked kernels checked against their block sizes"
exit $fail
