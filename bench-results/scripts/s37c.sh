#!/usr/bin/env bash
# Run 266: the fix for run 265's deadlock (a layout's first queued launches compiled and loaded before the wait)
# on a GPU: the seeded walks, the deadlock provoked on purpose, the warm launches, the scripted data-plane tests;
# step graphs captured in thread_local mode while another client registers and attaches (and the graph tests).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl 2>/dev/null
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
PYTHONPATH=/tmp/new-pkg:/tmp/dspark-site:$PWD/tests timeout -k 10 480 python3 -m pytest -q -s -m gpu --timeout 200 \
  --timeout-method thread -p no:cacheprovider --basetemp=/tmp/bt tests/server/test_dataplane_gpu_stress.py \
  tests/kernels/triton/test_step_meta.py tests/server/test_dataplane_gpu.py tests/server/test_graphs_gpu.py \
  -k "stress or step_meta or graphs_gpu or prelaunched or back_to_back or grpc_answer_naming" > $OUT/t.log 2>&1
echo "tests rc $?"; grep -E "passed|failed|FAILED|^E  .*op |^seed" $OUT/t.log | head -40
for f in /tmp/bt/*/sidecar.log; do d=$(basename $(dirname $f)); cp $f $OUT/$d.sidecar.log; done
echo quit | nvidia-cuda-mps-control
