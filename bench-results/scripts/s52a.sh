#!/usr/bin/env bash
# Session 52, first call: does a wait on a dead engine's input event ever end (dead_event.py, without then with
# MPS), then run 300's lease gpu test (a killed engine's CUDA cache freed while the sidecar serves on).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl 2>/dev/null
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1
NEW=/tmp/new-pkg:/tmp/dspark-site
nvidia-smi --query-gpu=name --format=csv,noheader
for how in alive exit kill; do
  PYTHONPATH=$NEW timeout 90 python3 bench-results/scripts/dead_event.py $how 5 2>&1 | tail -4; echo "rc ${PIPESTATUS[0]}"
done
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
for how in kill exit; do
  echo "under MPS:"; PYTHONPATH=$NEW timeout 90 python3 bench-results/scripts/dead_event.py $how 5 2>&1 | tail -4; echo "rc ${PIPESTATUS[0]}"
done
t0=$(date +%s)
PYTHONPATH=$NEW:$PWD/tests timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/server/test_engine_lease.py \
  > $OUT/lease.log 2>&1; echo "lease gpu test rc $? in $(( $(date +%s) - t0 )) s"; tail -15 $OUT/lease.log
echo quit | nvidia-cuda-mps-control
tail -20 $CUDA_MPS_LOG_DIRECTORY/server.log > $OUT/mps-server.log 2>/dev/null
