#!/usr/bin/env bash
# Run 269: the rest of the gpu suite (the files run 268 left: engine, buffers, metadata, Triton kernels, fast
# path, bench), and what a gc.callbacks idle-stream hook would cost per collection (gc_hook_cost.py).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl 2>/dev/null
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
PYTHONPATH=/tmp/new-pkg:/tmp/dspark-site python3 bench-results/scripts/gc_hook_cost.py 2>&1 | tail -3
PYTHONPATH=/tmp/new-pkg:/tmp/dspark-site:$PWD/tests timeout -k 10 500 python3 -m pytest -q -m gpu --timeout 200 \
  --timeout-method thread -p no:cacheprovider --basetemp=/tmp/bt tests/client tests/kernels tests/drafter \
  tests/server/test_fast_path.py tests/server/test_prelaunch_multi_gpu.py tests/test_bench.py --durations=8 > $OUT/t.log 2>&1
echo "tests rc $?"; grep -E "passed|failed|FAILED|^E  |slowest|^[0-9.]+s call" $OUT/t.log | head -40
echo quit | nvidia-cuda-mps-control
