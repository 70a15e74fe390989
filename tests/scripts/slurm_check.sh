#!/usr/bin/env bash
# amp_train under a real Slurm on this one machine: munged, slurmctld and slurmd started here on the
# loopback with a generated slurm.conf (everything in a temporary folder, stopped and removed at the end).
#  1. srun -n 2 amp_train (Slurm starts the MPI ranks through PMIx): the same param_checksum as one
#     process with --micro-batches 2 (the same samples per step, README "The same training on any
#     number of ranks"); srun --mpi=none refused by each task (each would train alone), and one
#     process straight from a batch script of 2 tasks a run of 1 rank;
#  2. an sbatch job that runs mpirun -np 2 inside its allocation (sbatch --wait): the same checksum;
#  3. what a time limit does, without waiting for one: SIGTERM to a running job (scancel --signal=TERM),
#     which stops after a step and says so; the same command again with --resume and 3 more steps
#     ends with the checksum and the weights of an uninterrupted run, bit for bit;
#  4. README's job script for real: SIGUSR1 to the job, which saves its step, exits 138, requeues
#     itself (scontrol requeue) and resumes to --steps: COMPLETED after 1 restart, the uninterrupted
#     run's bits;
#  5. a real time limit (--time=1: a minute or so; SLURM_CHECK_TIME_LIMIT=0 skips it): TIMEOUT after a
#     step that is saved, and a requeue with --resume that ends as the uninterrupted run.
# Without Slurm or munge installed (launch/setup.sh lists them as optional), or where a daemon cannot
# start here (not root, a container without what it needs), it prints "slurm_check: skipped: REASON"
# and exits 0. Usage: tests/scripts/slurm_check.sh BUILD_DIR. Exit 1 naming the first failure;
# SLURM_CHECK_KEEP=1 keeps the temporary folder (logs, slurm.conf, each run's output) for a look.
set -euo pipefail
. "$(dirname "$0")/usage.sh"
usage_check "tests/scripts/slurm_check.sh BUILD_DIR" 1 1 -- "$@"
[[ -d $1 ]] || { echo "slurm_check: BUILD_DIR $1: no such directory" >&2; exit 2; }
amp_train=$(realpath -e "$1/launch/amp_train" 2>/dev/null || true)
[[ -x $amp_train ]] || { echo "slurm_check: FAIL: no $1/launch/amp_train (build amp_train first)" >&2; exit 1; }

say() { echo "slurm_check: $*"; }
skip() { say "skipped: $*"; exit 0; }
fail() { echo "slurm_check: FAIL: $*" >&2; exit 1; }
since() {  # since T: the seconds from $EPOCHREALTIME T to now, to 0.1 s
  local now=${EPOCHREALTIME/[.,]/} start=${1/[.,]/}
  local ds=$(((10#$now - 10#$start) / 100000))
  echo "$((ds / 10)).$((ds % 10)) s"
}
t_all=$EPOCHREALTIME

for tool in munged mungekey slurmctld slurmd srun sbatch scancel squeue sinfo scontrol mpirun; do
  command -v "$tool" >/dev/null || skip "$tool is not installed (launch/setup.sh installs slurm-wlm and munge)"
done
# slurmd runs the jobs' processes as their users, and slurmctld and munged check who owns their files.
(($(id -u) == 0)) || skip "not root: slurmd and the test's slurm.conf (SlurmUser=root) need root"

# A job of an outer Slurm or MPI launch must not leak into this cluster's commands (this script's own
# knobs, SLURM_CHECK_*, are read first: they share the prefix).
keep=${SLURM_CHECK_KEEP:-} time_limit=${SLURM_CHECK_TIME_LIMIT:-1}
while IFS= read -r v; do unset "$v"; done < <(compgen -e | grep -E '^(SLURM_|SBATCH_|SRUN_|SALLOC_|PMIX_|PMI_)' || true)
unset CUDA_VISIBLE_DEVICES  # the emulated GPU reads it: each task here sets its own
# A sanitizer build (build/asan): Open MPI leaks by design, as the multi-rank suites say (tests/CMakeLists.txt).
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0}

# Everything lives here. munged insists that every folder above its socket is searchable by all.
tmp=$(mktemp -d /tmp/slurm_check.XXXXXX)
chmod 711 "$tmp"
mkdir -m 755 "$tmp/munge" && mkdir -m 700 "$tmp/state" "$tmp/spool" "$tmp/run"
export SLURM_CONF=$tmp/slurm.conf

pid_of() { if [[ -s $tmp/$1.pid ]]; then cat "$tmp/$1.pid"; fi; }
alive() { local pid; pid=$(pid_of "$1"); [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null; }
stop() {  # stop DAEMON...: SIGTERM to each (they take ~2 s), then SIGKILL to those left after 10 s
  local pids=() left=() d pid
  for d in "$@"; do
    pid=$(pid_of "$d")
    if [[ -n $pid ]] && kill "$pid" 2>/dev/null; then pids+=("$pid"); fi
  done
  ((${#pids[@]})) || return 0
  for _ in $(seq 100); do
    left=()
    for pid in "${pids[@]}"; do if kill -0 "$pid" 2>/dev/null; then left+=("$pid"); fi; done
    ((${#left[@]})) || return 0
    sleep 0.1
  done
  kill -KILL "${left[@]}" 2>/dev/null || true
}
cleanup() {
  # Jobs first, so that no slurmstepd (it outlives slurmd) or amp_train is left behind.
  if alive slurmctld; then  # (without it, squeue waits 10 s for an answer)
    local jobs=()
    read -ra jobs <<<"$(squeue -h -o %i 2>/dev/null | tr '\n' ' ')" || true
    ((${#jobs[@]} == 0)) || scancel --quiet --full --signal=KILL "${jobs[@]}" 2>/dev/null || true
    for _ in $(seq 100); do [[ -z $(squeue -h -o %i 2>/dev/null) ]] && break; sleep 0.1; done
  fi
  stop slurmd slurmctld munged
  if [[ -n $keep ]]; then echo "slurm_check: kept $tmp" >&2; else rm -rf "$tmp"; fi
}
trap cleanup EXIT
trap 'exit 129' HUP; trap 'exit 130' INT; trap 'exit 143' TERM  # (a signal alone skips the EXIT trap)

# The last 3 errors a daemon wrote (without their times), for a skip's reason.
last_error() {
  cat "$tmp/$1.log" "$tmp/$1.err" 2>/dev/null | grep -iE 'fatal|error' | sed 's/^\[[^]]*\] *//' |
    awk '!seen[$0]++' | tail -n 3 | cut -c1-200 | paste -sd '|' | sed 's/|/; /g' || true
}

# Set-up. munged, with its own key and socket: the machine's munged (if any) and key stay untouched.
mungekey --create --keyfile="$tmp/munge/munge.key" 2>"$tmp/munged.err" || skip "mungekey: $(last_error munged)"
munged --key-file="$tmp/munge/munge.key" --socket="$tmp/munge/munge.socket" --pid-file="$tmp/munged.pid" \
       --log-file="$tmp/munged.log" --seed-file="$tmp/munge/munged.seed" 2>"$tmp/munged.err" ||
  skip "munged does not start here: $(last_error munged)"

# slurm.conf: one node (this machine, on 127.0.0.1) in one partition, no cgroups, no accounting.
free_port() {  # the first port from $1 on that nothing listens
  local p=$1
  while (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; do p=$((p + 1)); done
  echo "$p"
}
ctld_port=$(free_port 16817)
slurmd_port=$(free_port $((ctld_port + 1)))
host=$(hostname -s)
mem=$(slurmd -C 2>/dev/null | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' | head -n 1 || true)
cat >"$SLURM_CONF" <<EOF
ClusterName=ampcheck
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$tmp/munge/munge.socket
CredType=cred/munge
StateSaveLocation=$tmp/state
SlurmdSpoolDir=$tmp/spool
TmpFS=$tmp/run
SlurmctldPidFile=$tmp/slurmctld.pid
SlurmdPidFile=$tmp/slurmd.pid
SlurmctldLogFile=$tmp/slurmctld.log
SlurmdLogFile=$tmp/slurmd.log
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
KillWait=10
MinJobAge=600
NodeName=$host NodeAddr=127.0.0.1 CPUs=$(nproc)${mem:+ RealMemory=$mem} State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
# Slurm starts MPI ranks itself only through its PMIx plugin (Debian's Open MPI is built with PMIx).
mpi_list=$(srun --mpi=list 2>&1 | sed -n 's/^[[:space:]]\{1,\}\([[:alnum:]_]\{1,\}\)$/\1/p' | tr '\n' ' ' || true)
pmix=false
if grep -qw pmix <<<"$mpi_list"; then pmix=true; sed -i 's/^MpiDefault=none$/MpiDefault=pmix/' "$SLURM_CONF"; fi

t=$EPOCHREALTIME
slurmctld 2>"$tmp/slurmctld.err" || skip "slurmctld does not start here: $(last_error slurmctld)"
for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.1; done
scontrol ping 2>/dev/null | grep -q UP || skip "slurmctld is not answering after 10 s: $(last_error slurmctld)"
slurmd -N "$host" 2>"$tmp/slurmd.err" || skip "slurmd does not start here: $(last_error slurmd)"
state=""
for _ in $(seq 300); do
  state=$(sinfo -h -n "$host" -o %T 2>/dev/null || true)
  [[ $state == idle ]] && break
  sleep 0.1
done
[[ $state == idle ]] ||
  skip "node $host is '${state:-unknown}' after 30 s, not idle: $(scontrol show node "$host" 2>/dev/null | grep -o 'Reason=.*' || true) $(last_error slurmd)"
# A job step that runs nothing of ours (and no MPI plugin): where it fails, Slurm cannot run jobs here
# (slurmstepd's plugins, its privileges), which is not amp_train's doing. (srun exits 0 when a launch
# fails, hence the output.)
timeout 60 srun --mpi=none -n 1 echo step-ran >"$tmp/step.out" 2>&1 || true
grep -qx step-ran "$tmp/step.out" ||
  skip "Slurm cannot run a job step here (srun -n 1 echo: $(tail -n 1 "$tmp/step.out")): $(last_error slurmd)"
say "munged, slurmctld (port $ctld_port), slurmd: node $host idle, $(nproc) CPUs, a job step runs ($(since "$t"))"

# The training every step runs, and its results.
small=(--device cpu --width 8 --layers 2 --batch-size 4 --threads 1)
end_record() { tail -n 1 "$1" 2>/dev/null | grep '"event":"end"' || true; }
field() { sed -n "s/.*\"$1\":\"\{0,1\}\([^\",}]*\).*/\1/p" <<<"$2"; }
checksum_of() {  # checksum_of NAME METRICS: the end record's param_checksum, or fail
  local end; end=$(end_record "$2")
  [[ -n $end ]] || fail "$1: $2 does not end with an end record: $(tail -n 2 "$2" 2>/dev/null | cut -c1-300)"
  field param_checksum "$end"
}
active() { squeue -h -j "$1" -t PD,CF,R,CG,S -o %i 2>/dev/null || true; }  # the job while it runs
run_dir() { rm -rf "$tmp/run/$1"; mkdir -p "$tmp/run/$1"; echo "$tmp/run/$1"; }

# The control: one process, 2 micro-batches of 4 (the 8 samples per step of 2 ranks x 1 micro-batch).
d=$(run_dir control)
(cd "$d" && timeout 120 "$amp_train" "${small[@]}" --steps 6 --micro-batches 2 --metrics m1.jsonl >out 2>&1) ||
  fail "the control run (one process): $(tail -n 3 "$d/out")"
control=$(checksum_of control "$d/m1.jsonl")

# Job scripts: `job_script NAME LAUNCHER...` writes $tmp/NAME.sh, which runs LAUNCHER amp_train with
# the small training and the job's own arguments.
job_script() {
  local name=$1; shift
  {
    echo '#!/bin/bash'
    echo 'export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1'
    printf 'exec'; printf ' %q' "$@" "$amp_train" "${small[@]}"; echo ' "$@"'
  } >"$tmp/$name.sh"
  chmod +x "$tmp/$name.sh"
}
# sbatch_wait NAME DIR SCRIPT ARGS...: the job, waited for (its exit status is the job's).
sbatch_wait() {
  local name=$1 dir=$2; shift 2
  timeout 300 sbatch --wait --quiet -n 2 --overcommit --time=5 -J "$name" -D "$dir" -o "$dir/out" "$@"
}

# 1. srun -n 2: the two tasks must join one world of 2 ranks, not start alone each.
srun_mpi=false
d=$(run_dir srun)
t=$EPOCHREALTIME
rc=0
(cd "$d" && timeout 120 srun -n 2 --overcommit "$amp_train" "${small[@]}" --steps 6 --metrics m2.jsonl >out 2>&1) || rc=$?
singletons=$(grep -c 'amp_train: 1 rank(s)' "$d/out" || true)
if grep -q 'amp_train: 2 rank(s)' "$d/out"; then
  ((rc == 0)) || fail "srun -n 2 amp_train: exit $rc: $(grep -v '^step ' "$d/out" | tail -n 3)"
  got=$(checksum_of "srun -n 2" "$d/m2.jsonl")
  [[ $got == "$control" ]] || fail "srun -n 2: param_checksum $got, one process with 2 micro-batches: $control"
  srun_mpi=true
  say "srun -n 2 (MpiDefault=$($pmix && echo pmix || echo none)): 2 ranks, param_checksum $got = 1 rank x 2 micro-batches ($(since "$t"))"
elif ((singletons > 0)); then
  fail "srun -n 2 amp_train: the tasks trained alone, each a world of 1 rank ('amp_train: 1 rank(s)' from $singletons of the 2 tasks)"
elif grep -q 'a world of its own' "$d/out"; then
  # Not faked: Slurm's MPI plugins here cannot wire up Open MPI's ranks, so each one is alone (refused).
  say "srun -n 2 cannot start MPI ranks: each task refused to train alone (srun --mpi=list: ${mpi_list% }); the jobs below run mpirun inside sbatch instead"
elif grep -q 'launch failed' "$d/out"; then  # the MPI plugin itself fails (the plain step above ran)
  say "srun -n 2 cannot start MPI ranks: $(grep -m 1 'launch failed' "$d/out") (slurmd: $(last_error slurmd)); the jobs below run mpirun inside sbatch instead"
else
  fail "srun -n 2 amp_train: exit $rc, no start line: $(tail -n 3 "$d/out")"
fi

# 1a. srun without an MPI plugin: each task would be a world of 1 rank, training alone and writing the
# same files. Both refuse, exit 2, saying how to launch. One process run straight from a batch script
# of 2 tasks is a run of 1 rank, as asked.
d=$(run_dir srun-none)
t=$EPOCHREALTIME
rc=0
(cd "$d" && timeout 120 srun -n 2 --overcommit --mpi=none "$amp_train" "${small[@]}" --steps 6 --metrics m.jsonl \
   >out 2>&1) || rc=$?
[[ $(grep -c 'a world of its own' "$d/out") == 2 && $(grep -c 'srun --mpi=pmix' "$d/out") == 2 ]] ||
  fail "srun -n 2 --mpi=none: not refused by both tasks (exit $rc): $(grep -v '^step ' "$d/out" | tail -n 3)"
[[ ! -e $d/m.jsonl ]] || fail "srun -n 2 --mpi=none: a task wrote $d/m.jsonl"
job_script direct
rc=0
timeout 300 sbatch --wait --quiet -n 2 --overcommit --time=5 -J direct -D "$d" -o "$d/out-direct" "$tmp/direct.sh" \
  --steps 6 --micro-batches 2 --metrics m1.jsonl || rc=$?
((rc == 0)) && grep -q 'amp_train: 1 rank(s)' "$d/out-direct" ||
  fail "amp_train straight from a batch script of 2 tasks: exit $rc: $(tail -n 3 "$d/out-direct")"
[[ $(checksum_of "a batch script of 2 tasks, no srun" "$d/m1.jsonl") == "$control" ]] ||
  fail "amp_train straight from a batch script: not the control's checksum"
say "srun -n 2 --mpi=none: both tasks refuse to train alone (exit 2, naming srun --mpi=pmix); one process in a batch script of 2 tasks trains as 1 rank ($(since "$t"))"

# 1b. On the emulated GPU (a cuda-emu build): one GPU per task, as --gpus-per-task=1 gives it (each
# task's CUDA_VISIBLE_DEVICES names its own; AMP_EMU_DEVICES is the node's count), bit for bit the
# control on one emulated GPU; and two tasks given the same GPU refused, naming them (issue 42).
if $srun_mpi && grep -q '^AMP_CUDA_EMU:BOOL=ON' "$1/CMakeCache.txt" 2>/dev/null; then
  gpu=(--device cuda --width 8 --layers 2 --batch-size 4 --threads 1 --steps 6)
  d=$(run_dir emu)
  t=$EPOCHREALTIME
  (cd "$d" && AMP_EMU_DEVICES=1 timeout 120 "$amp_train" "${gpu[@]}" --micro-batches 2 --metrics m1.jsonl >out1 2>&1) ||
    fail "the emulated GPU's control: $(tail -n 3 "$d/out1")"
  (cd "$d" && AMP_EMU_DEVICES=2 timeout 120 srun -n 2 --overcommit sh -c \
     'CUDA_VISIBLE_DEVICES=$SLURM_LOCALID exec "$0" "$@"' "$amp_train" "${gpu[@]}" --metrics m2.jsonl >out2 2>&1) ||
    fail "srun -n 2 on one emulated GPU each: $(grep -v '^step ' "$d/out2" | tail -n 3)"
  [[ $(checksum_of "emulated GPU, srun -n 2" "$d/m2.jsonl") == $(checksum_of "emulated GPU, control" "$d/m1.jsonl") ]] ||
    fail "srun -n 2 on one emulated GPU each: not the control's checksum"
  rc=0
  (cd "$d" && AMP_EMU_DEVICES=2 CUDA_VISIBLE_DEVICES=1 timeout 120 srun -n 2 --overcommit "$amp_train" "${gpu[@]}" \
     >out3 2>&1) || rc=$?
  grep -q 'ranks 0 and 1 were given the same GPU' "$d/out3" ||
    fail "two tasks on one emulated GPU were not refused by name (exit $rc): $(tail -n 3 "$d/out3")"
  say "emulated GPU: srun -n 2 with a GPU per task (CUDA_VISIBLE_DEVICES=\$SLURM_LOCALID) = 1 GPU x 2 micro-batches; two tasks on one GPU refused ($(since "$t"))"
fi

# 2. sbatch: mpirun inside the allocation (it reads the allocation from the job's environment).
job_script mpirun mpirun -np 2 --oversubscribe
d=$(run_dir sbatch)
t=$EPOCHREALTIME
rc=0
sbatch_wait sbatch-mpirun "$d" "$tmp/mpirun.sh" --steps 6 --metrics m2.jsonl || rc=$?
((rc == 0)) || fail "sbatch (mpirun -np 2): exit $rc: $(grep -v '^step ' "$d/out" | tail -n 3)"
grep -q 'amp_train: 2 rank(s)' "$d/out" || fail "sbatch (mpirun -np 2): not 2 ranks: $(head -n 3 "$d/out")"
got=$(checksum_of "sbatch (mpirun -np 2)" "$d/m2.jsonl")
[[ $got == "$control" ]] || fail "sbatch (mpirun -np 2): param_checksum $got, one process with 2 micro-batches: $control"
say "sbatch --wait (mpirun -np 2): param_checksum $got = 1 rank x 2 micro-batches ($(since "$t"))"

# 3. A time limit, without waiting a minute for one: SIGTERM to the running job. Under srun the
# tasks are signalled (scancel's default: the job's steps, as sbatch --signal=TERM@... does before a
# limit; srun itself, signalled, kills its step at once). Under mpirun, the batch step must be
# signalled too (--full): mpirun is in it.
if $srun_mpi; then
  job_script long srun; cancel=(scancel --signal=TERM); how="srun, scancel --signal=TERM"
else
  cancel=(scancel --signal=TERM --full); how="mpirun -np 2, scancel --signal=TERM --full"
  cp "$tmp/mpirun.sh" "$tmp/long.sh"
fi
long=(--checkpoint-dir ck --checkpoint-every 1 --save-weights w.st --metrics m.jsonl)
d=$(run_dir interrupted)
t=$EPOCHREALTIME
job=$(sbatch --parsable -n 2 --overcommit --time=5 -J long -D "$d" -o "$d/out" "$tmp/long.sh" "${long[@]}" --steps 100000000) ||
  fail "sbatch of the long job"
job=${job%%;*}
steps=0
for _ in $(seq 600); do
  steps=$(grep -c '"step"' "$d/m.jsonl" 2>/dev/null || true)
  ((steps >= 3)) && break
  [[ -n $(active "$job") ]] || break
  sleep 0.1
done
((steps >= 3)) || fail "the long job $job wrote ${steps:-0} steps in 60 s: $(tail -n 3 "$d/out" 2>/dev/null)"
"${cancel[@]}" "$job" || fail "${cancel[*]} $job"
for _ in $(seq 600); do [[ -z $(active "$job") ]] && break; sleep 0.1; done
[[ -z $(active "$job") ]] || fail "the long job $job is still running 60 s after SIGTERM"
end=$(end_record "$d/m.jsonl")
[[ $end == *'"interrupted_by":"SIGTERM"'* ]] ||
  fail "after SIGTERM, $d/m.jsonl ends without \"interrupted_by\":\"SIGTERM\": $(tail -n 1 "$d/m.jsonl" | cut -c1-300); job output: $(grep -v '^step \|checkpoint of' "$d/out" | tail -n 4)"
n=$(field steps "$end")
exit_code=$(scontrol show job "$job" 2>/dev/null | grep -o ' ExitCode=[0-9:]*' | cut -d= -f2 || true)
if $srun_mpi; then
  grep -q 'interrupted by SIGTERM after step' "$d/out" ||
    fail "the interrupted job's output does not say 'interrupted by SIGTERM': $(grep -v '^step \|checkpoint of' "$d/out" | tail -n 4)"
  [[ $exit_code == 143:0 ]] || fail "the interrupted job's exit code is '$exit_code', not 143 (128 + SIGTERM)"
elif ! grep -q 'interrupted by SIGTERM after step' "$d/out"; then
  # Seen with Open MPI 4.1: under Slurm, mpirun (its plm/slurm) stops relaying its ranks' output once
  # it is signalled; they still stop after a step and close the metrics, which is what is checked.
  say "note: the job's output lacks the ranks' 'interrupted by SIGTERM' (mpirun under Slurm drops their output after a signal); the metrics' end record has it"
fi
say "SIGTERM to job $job ($how): stopped after step $n, exit code ${exit_code:-?}, end record \"interrupted_by\":\"SIGTERM\" ($(since "$t"))"

# The requeued command: the same job with --resume and 3 more steps, against a run never interrupted.
t=$EPOCHREALTIME
mv "$d/out" "$d/out.interrupted"
rc=0
sbatch_wait resumed "$d" "$tmp/long.sh" "${long[@]}" --resume --steps $((n + 3)) || rc=$?
((rc == 0)) || fail "the resumed job: exit $rc: $(grep -v '^step \|checkpoint of' "$d/out" | tail -n 3)"
grep -q "resuming from ck/step-$(printf %08d "$n")" "$d/out" ||
  fail "the resumed job did not resume from step $n: $(grep -v '^step \|checkpoint of' "$d/out" | head -n 3)"
end=$(end_record "$d/m.jsonl")
[[ $(field steps "$end") == $((n + 3)) ]] || fail "the resumed job ended at $(field steps "$end"), not step $((n + 3))"
resumed=$(checksum_of resumed "$d/m.jsonl")
c=$(run_dir uninterrupted)
(cd "$c" && timeout 300 "$amp_train" "${small[@]}" --steps $((n + 3)) --micro-batches 2 --metrics m.jsonl --save-weights w.st >out 2>&1) ||
  fail "the uninterrupted run: $(tail -n 3 "$c/out")"
whole=$(checksum_of uninterrupted "$c/m.jsonl")
[[ $resumed == "$whole" ]] ||
  fail "interrupted at $n and resumed to $((n + 3)): param_checksum $resumed; uninterrupted $((n + 3)) steps: $whole"
cmp -s "$d/w.st" "$c/w.st" || fail "interrupted and resumed: the weights differ from the uninterrupted run's (cmp $d/w.st $c/w.st)"
say "resumed to step $((n + 3)): param_checksum $resumed and the weights = an uninterrupted run's ($(since "$t"))"
# 4. README's job script, for real: a stop signal before the limit (SIGUSR1 here, as --signal=USR1@120
# sends it; scancel sends it now), the ranks save the step and exit 138 (128 + SIGUSR1), the script
# requeues its own job, which runs the same command again: --resume continues to --steps. One job,
# Restarts=1, COMPLETED, the uninterrupted run's bits.
if $srun_mpi; then
  {
    echo '#!/bin/bash'
    printf 'srun'; printf ' %q' "$amp_train" "${small[@]}"; echo ' "$@"'
    echo 'rc=$?'
    echo 'if ((rc == 143 || rc == 138)); then scontrol requeue "$SLURM_JOB_ID"; fi'
    echo 'exit $rc'
  } >"$tmp/requeue.sh"
  chmod +x "$tmp/requeue.sh"
  d=$(run_dir requeue)
  t=$EPOCHREALTIME
  total=2000
  job=$(sbatch --parsable --requeue --open-mode=append -n 2 --overcommit --time=5 -J requeue -D "$d" -o "$d/out" \
        "$tmp/requeue.sh" "${long[@]}" --resume --steps $total) || fail "sbatch of the requeueing job"
  job=${job%%;*}
  steps=0
  for _ in $(seq 600); do
    steps=$(grep -c '"step"' "$d/m.jsonl" 2>/dev/null || true)
    ((steps >= 3)) && break
    sleep 0.1
  done
  ((steps >= 3)) || fail "the requeueing job $job wrote ${steps:-0} steps in 60 s: $(tail -n 3 "$d/out" 2>/dev/null)"
  scancel --signal=USR1 "$job" || fail "scancel --signal=USR1 $job"
  # Slurm holds a requeued job (Reason=BeginTime) for a couple of minutes; the test lets it start now.
  released=false
  for _ in $(seq 3000); do
    [[ -z $(active "$job") ]] && break
    if ! $released && squeue -h -j "$job" -t PD -o %r 2>/dev/null | grep -q BeginTime; then
      scontrol update JobId="$job" StartTime=now >/dev/null 2>&1 || true
      released=true
    fi
    sleep 0.1
  done
  [[ -z $(active "$job") ]] || fail "the requeueing job $job still runs (or waits) 5 minutes after SIGUSR1"
  info=$(scontrol show job "$job" 2>/dev/null || true)
  state=$(grep -o 'JobState=[A-Z_]*' <<<"$info" | cut -d= -f2 || true)
  restarts=$(grep -o 'Restarts=[0-9]*' <<<"$info" | cut -d= -f2 || true)
  [[ $state == COMPLETED && $restarts == 1 ]] ||
    fail "the requeueing job ended $state after ${restarts:-?} restarts, not COMPLETED after 1: $(grep -v '^step \|checkpoint of' "$d/out" | tail -n 4)"
  grep -q '"interrupted_by":"SIGUSR1"' "$d/m.jsonl" || fail "the requeueing job's metrics have no stop by SIGUSR1"
  grep -q '"event":"resume"' "$d/m.jsonl" || fail "the requeued job's metrics have no resume record"
  end=$(end_record "$d/m.jsonl")
  [[ $(field steps "$end") == "$total" ]] || fail "the requeued job ended at $(field steps "$end"), not step $total"
  c=$(run_dir requeue-control)
  (cd "$c" && timeout 300 "$amp_train" "${small[@]}" --steps $total --micro-batches 2 --metrics m.jsonl >out 2>&1) ||
    fail "the uninterrupted run: $(tail -n 3 "$c/out")"
  [[ $(checksum_of requeued "$d/m.jsonl") == $(checksum_of uninterrupted "$c/m.jsonl") ]] ||
    fail "stopped by SIGUSR1, requeued by its script and resumed to $total: not the uninterrupted run's param_checksum"
  say "README's job script: SIGUSR1 (scancel --signal=USR1), exit 138, scontrol requeue, resumed: COMPLETED, Restarts=1, step $total = the uninterrupted run ($(since "$t"))"
fi

# 5. A real time limit (SLURM_CHECK_TIME_LIMIT=0 skips it: it waits a minute or so): a job of one
# minute that runs mpirun. At the limit Slurm sends SIGTERM to every process of the job, mpirun and
# its ranks (which then get it twice: one request), and SIGKILL KillWait (10 s) later: the ranks stop
# after a step and save it; the same command with --resume continues to the uninterrupted run's bits.
if [[ $time_limit != 0 ]]; then
  d=$(run_dir time-limit)
  t=$EPOCHREALTIME
  job=$(sbatch --parsable -n 2 --overcommit --time=1 -J limit -D "$d" -o "$d/out" "$tmp/mpirun.sh" "${long[@]}" \
        --steps 100000000) || fail "sbatch of the time-limited job"
  job=${job%%;*}
  for _ in $(seq 1800); do [[ -z $(active "$job") ]] && break; sleep 0.1; done
  [[ -z $(active "$job") ]] || fail "the job with --time=1 ($job) still runs after 3 minutes"
  state=$(scontrol show job "$job" 2>/dev/null | grep -o 'JobState=[A-Z_]*' | cut -d= -f2 || true)
  [[ $state == TIMEOUT ]] || fail "the job with --time=1 ended $state, not TIMEOUT: $(tail -n 3 "$d/out")"
  end=$(end_record "$d/m.jsonl")
  [[ $end == *'"interrupted_by":"SIGTERM"'* ]] ||
    fail "at its time limit, $d/m.jsonl ends without \"interrupted_by\":\"SIGTERM\": $(tail -n 1 "$d/m.jsonl" | cut -c1-300)"
  n=$(field steps "$end")
  for e in "$d"/ck/* "$d"/ck/.[!.]*; do
    [[ -e $e && $(basename "$e") != step-* ]] && fail "left in the checkpoint directory at the time limit: $e"
  done
  mv "$d/out" "$d/out.limit"
  rc=0
  sbatch_wait requeued "$d" "$tmp/mpirun.sh" "${long[@]}" --resume --steps $((n + 3)) || rc=$?
  ((rc == 0)) || fail "the requeued job: exit $rc: $(grep -v '^step \|checkpoint of' "$d/out" | tail -n 3)"
  resumed=$(checksum_of requeued "$d/m.jsonl")
  c=$(run_dir time-limit-control)
  (cd "$c" && timeout 300 "$amp_train" "${small[@]}" --steps $((n + 3)) --micro-batches 2 --metrics m.jsonl >out 2>&1) ||
    fail "the uninterrupted run: $(tail -n 3 "$c/out")"
  [[ $resumed == $(checksum_of uninterrupted "$c/m.jsonl") ]] ||
    fail "stopped by the time limit at step $n and requeued to $((n + 3)): not the uninterrupted run's param_checksum"
  say "time limit (--time=1, mpirun): TIMEOUT after step $n with the step saved; requeued with --resume to step $((n + 3)) = the uninterrupted run ($(since "$t"))"
fi
say "passed ($(since "$t_all"))"
