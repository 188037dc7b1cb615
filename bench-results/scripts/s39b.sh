#!/usr/bin/env bash
# Run 273: the session's fixes on a GPU, first half: the data plane (order_inputs on every step), IPC mapping,
# step metadata (the wrap test), graphs, the stress walks.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl 2>/dev/null
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
PYTHONPATH=/tmp/new-pkg:/tmp/dspark-site:$PWD/tests timeout -k 10 540 python3 -m pytest -q -s -m gpu --timeout 200 \
  --timeout-method thread -p no:cacheprovider --basetemp=/tmp/bt tests/proto/test_gpu_alloc.py tests/proto/test_memory.py \
  tests/server/test_dataplane_gpu_stress.py tests/kernels/triton/test_step_meta.py tests/server/test_dataplane_gpu.py \
  tests/server/test_graphs_gpu.py tests/client/test_dataplane_buffers.py --durations=10 > $OUT/t.log 2>&1
echo "tests rc $?"; grep -E "passed|failed|FAILED|^E  |^seed|^[0-9.]+s call" $OUT/t.log | cut -c1-1500 | head -50
echo quit | nvidia-cuda-mps-control
