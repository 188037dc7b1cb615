#!/usr/bin/env bash
# Session 52, second call: dead_event.py with its spin calibrated after a warm-up (s52a's first timing included the
# spin kernel's lazy load, so its 5 s spins lasted about 60 ms), without then with MPS; 20 s spins, and the set-up time printed.
set -uo pipefail
export PYTHONUNBUFFERED=1
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
NEW=/tmp/new-pkg
for how in alive exit kill; do
  PYTHONPATH=$NEW timeout 90 python3 bench-results/scripts/dead_event.py $how 20 2>&1 | tail -5; echo "rc ${PIPESTATUS[0]}"
done
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
for how in kill exit; do
  echo "under MPS:"; PYTHONPATH=$NEW timeout 90 python3 bench-results/scripts/dead_event.py $how 20 2>&1 | tail -5; echo "rc ${PIPESTATUS[0]}"
done
echo quit | nvidia-cuda-mps-control
