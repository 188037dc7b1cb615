#!/usr/bin/env bash
# Run 263: helper 74's fixes on a GPU: the data-plane gpu tests that mix gRPC steps with pre-launched doorbell steps.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl 2>/dev/null
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
PYTHONPATH=/tmp/new-pkg:/tmp/dspark-site:$PWD/tests timeout -k 10 150 python3 -m pytest -q -m gpu --timeout 120 \
  --timeout-method thread -p no:cacheprovider tests/server/test_dataplane_gpu.py \
  -k "equals_grpc or prelaunched_steps or grpc_answer_naming or released_buffers" > $OUT/t.log 2>&1
echo "tests rc $?"; grep -E "passed|failed|FAILED|^E  " $OUT/t.log | head -20
echo quit | nvidia-cuda-mps-control
