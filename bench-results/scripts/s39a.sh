#!/usr/bin/env bash
# Run 272: the GPU walks after their cases moved to tests/helpers/walk_cases.py (the whole stress file, seeds
# 1 and 3 under the cycle probe), and the IPC mapping's GPU tests with the misaligned-offset one (helper 81).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl 2>/dev/null
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
PYTHONPATH=/tmp/new-pkg:/tmp/dspark-site:$PWD/tests timeout -k 10 120 python3 -m pytest -q -m gpu --timeout 100 \
  -p no:cacheprovider tests/proto/test_gpu_alloc.py tests/proto/test_memory.py > $OUT/m.log 2>&1
echo "memory tests rc $?"; grep -E "passed|failed|FAILED|^E  " $OUT/m.log | cut -c1-600 | head -12
PYTHONPATH=/tmp/new-pkg:/tmp/dspark-site:$PWD/tests timeout -k 10 420 python3 -m pytest -q -s -m gpu --timeout 200 \
  --timeout-method thread -p no:cacheprovider --basetemp=/tmp/bt tests/server/test_dataplane_gpu_stress.py \
  --durations=8 > $OUT/t.log 2>&1
echo "stress tests rc $?"; grep -E "passed|failed|FAILED|^E  |^seed|^[0-9.]+s call" $OUT/t.log | cut -c1-2000 | head -30
cp /tmp/bt/*/cycles.* $OUT/ 2>/dev/null
echo quit | nvidia-cuda-mps-control
