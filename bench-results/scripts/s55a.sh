#!/usr/bin/env bash
# Session 55, run 309: session 55's changes on a GPU (the timer-slack note under a lock, the rank's device-fault
# exit while a release is waited for, the serving loop's drain on failure, validate's page bound): the gpu tests
# of the client, proto, the data plane, the engine lease and the CUDA-graph rank.
set -uo pipefail
rm -rf /tmp/dspark-site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl 2>/dev/null
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/new-pkg:/tmp/dspark-site:$PWD/tests
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe5 CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log5
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
trap 'echo quit | nvidia-cuda-mps-control' EXIT
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t0=$(date +%s)
timeout 420 python3 -m pytest -q -p no:cacheprovider -m gpu --timeout 150 --timeout-method thread \
  tests/client tests/proto tests/server/test_dataplane_gpu.py tests/server/test_engine_lease.py \
  tests/server/test_graphs_gpu.py > $OUT/gpu-tests.log 2>&1
echo "gpu tests rc $? in $(( $(date +%s) - t0 )) s"; grep -E "FAILED|ERROR|passed|failed" $OUT/gpu-tests.log | tail -12
