#!/usr/bin/env bash
# Session 54, run 308: session 54's changes on a GPU (the step metadata and doorbell page in reserved shared memory,
# UnbindKV refused before a section, handles given back, the socket-folder checks), then issue 8's line again.
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
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu --timeout 150 --timeout-method thread \
  tests/client tests/proto tests/server/test_dataplane_gpu.py tests/server/test_engine_lease.py > $OUT/gpu-tests.log 2>&1
echo "gpu tests rc $? in $(( $(date +%s) - t0 )) s"; grep -E "FAILED|ERROR|passed|failed" $OUT/gpu-tests.log | tail -8
t0=$(date +%s)
timeout 240 python3 -m dspark_sidecar bench --modes c,h --reqs 1,8 --contexts 4096 --repeats 60 --shim-phases \
  --out-dir $OUT > $OUT/bench.log 2>&1
echo "bench rc $? in $(( $(date +%s) - t0 )) s"; grep -v " INFO " $OUT/bench.log | tail -30
