#!/usr/bin/env bash
# Run 268: first GPU run of session 37's last fixes (collector paused in captures and frozen after start-up,
# HANDLE_UNCHECKED, the metadata closure and the rank's error-cycle fix): the whole stress file (three walk
# seeds, the deadlock on purpose, attach during capture), the gpu_alloc queries, the data-plane, graph and
# step-metadata gpu tests.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl 2>/dev/null
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
PYTHONPATH=/tmp/new-pkg:/tmp/dspark-site:$PWD/tests timeout -k 10 540 python3 -m pytest -q -s -m gpu --timeout 200 \
  --timeout-method thread -p no:cacheprovider --basetemp=/tmp/bt tests/proto/test_gpu_alloc.py \
  tests/server/test_dataplane_gpu_stress.py tests/kernels/triton/test_step_meta.py tests/server/test_dataplane_gpu.py \
  tests/server/test_graphs_gpu.py --durations=15 > $OUT/t.log 2>&1
echo "tests rc $?"; grep -E "passed|failed|FAILED|^E  .*op |^seed|status 201|slowest|^[0-9.]+s call" $OUT/t.log | head -60
for f in /tmp/bt/*/sidecar.log; do d=$(basename $(dirname $f)); cp $f $OUT/$d.sidecar.log; done
echo quit | nvidia-cuda-mps-control
