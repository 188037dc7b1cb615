#!/usr/bin/env bash
# Session 52, fourth call: under MPS, does a process that holds nothing of the engine's fault too when the engine
# is killed with GPU work queued (noopen), against the same without MPS.
set -uo pipefail
export PYTHONUNBUFFERED=1
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
echo "without MPS:"; PYTHONPATH=/tmp/new-pkg timeout 60 python3 bench-results/scripts/dead_event.py kill 10 noopen 2>&1 | grep -v "^  " | tail -5
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe2 CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log2
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
for args in "kill 10 noopen" "exit 10 noopen"; do
  echo "under MPS [$args]:"; PYTHONPATH=/tmp/new-pkg timeout 60 python3 bench-results/scripts/dead_event.py $args 2>&1 | grep -v "^  " | tail -5
done
echo quit | nvidia-cuda-mps-control
grep -E "fatal|torn down|reset|sticky" $CUDA_MPS_LOG_DIRECTORY/server.log | tail -12
