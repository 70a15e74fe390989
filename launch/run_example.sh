#!/usr/bin/env bash
# The main job: install, build, and train the MLP on 2 MPI ranks with fp16 autocast and dynamic
# loss scaling. The loss falls from about 1.0; the metrics land in build/release/example_metrics.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
launch/build.sh release
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpirun -np 2 --oversubscribe build/release/launch/amp_train \
  --width 128 --steps 300 --lr 0.2 --amp fp16 --log-every 30 --metrics build/release/example_metrics.jsonl
echo "metrics: build/release/example_metrics.jsonl"
