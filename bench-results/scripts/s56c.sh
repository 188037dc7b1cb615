#!/usr/bin/env bash
# Session 56, run 311 (device time short after failed starts): the gpu tests of the code this session changed that
# has any: proto/memory.py (ShmTensor.close, the board's reserved pages), BindKV's facts (the data plane), the graphs.
set -uo pipefail
rm -rf /tmp/dspark-site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl 2>/dev/null
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/new-pkg:/tmp/dspark-site:$PWD/tests
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe8 CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log8
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
trap 'echo quit | nvidia-cuda-mps-control' EXIT
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t0=$(date +%s)
timeout ${TESTS_S:-240} python3 -m pytest -v -p no:cacheprovider -m gpu --timeout 120 --timeout-method thread \
  tests/proto tests/server/test_dataplane_gpu.py tests/server/test_graphs_gpu.py > $OUT/gpu-tests.log 2>&1
echo "gpu tests rc $? in $(( $(date +%s) - t0 )) s"; grep -E "FAILED|ERROR|passed|failed" $OUT/gpu-tests.log | tail -12
grep -cE " PASSED" $OUT/gpu-tests.log
