#!/usr/bin/env bash
# Session 54, run 307: the whole gpu suite in ONE pytest process under MPS (as deploy/gpu-check.sh runs it), to check
# that the ends_mps_clients test (the gone-engine kill, which poisons this process's CUDA context under MPS) now runs
# after every other CUDA test and nothing collected after it fails.
set -uo pipefail
rm -rf /tmp/dspark-site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl 2>/dev/null
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe4 CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log4
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
trap 'echo quit | nvidia-cuda-mps-control' EXIT
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t0=$(date +%s)
PYTHONPATH=/tmp/new-pkg:/tmp/dspark-site:$PWD/tests timeout ${SUITE_S:-540} python3 -m pytest -v -p no:cacheprovider -m gpu \
  --timeout 200 --timeout-method thread tests > $OUT/gpu-suite.log 2>&1
echo "gpu suite rc $? in $(( $(date +%s) - t0 )) s"
grep -E " (PASSED|FAILED|ERROR)" $OUT/gpu-suite.log | tail -4
grep -E "FAILED|ERROR|passed|failed" $OUT/gpu-suite.log | tail -15
