#!/usr/bin/env bash
# Session 52, third call: under MPS, where a waiting process met "an illegal memory access" in s52b: the whole log
# of that case, the same kill without the wait (the event opened, never waited on), and the live engine's control.
set -uo pipefail
export PYTHONUNBUFFERED=1
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
for args in "kill 10" "kill 10 nowait" "alive 10" "exit 10 nowait"; do
  f=$OUT/mps-$(echo $args | tr ' ' '-').log
  PYTHONPATH=/tmp/new-pkg timeout 60 python3 bench-results/scripts/dead_event.py $args > $f 2>&1; echo "[$args] rc $?"
  grep -v "^  " $f | tail -8
done
echo quit | nvidia-cuda-mps-control
cp $CUDA_MPS_LOG_DIRECTORY/server.log $OUT/mps-server.log 2>/dev/null; tail -15 $OUT/mps-server.log
