#!/usr/bin/env bash
# Session 58, run 314: the final tree's gpu tests of the paths its last commits touch (client/binding.py's one bind
# deadline, AttachDoorbell, the teardown), under the same MPS set-up as run 311.
set -uo pipefail
rm -rf /tmp/dspark-site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl 2>/dev/null
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/new-pkg:/tmp/dspark-site:$PWD/tests
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe12 CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log12
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
trap 'echo quit | nvidia-cuda-mps-control' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
timeout ${TESTS_S:-280} python3 -m pytest -v -p no:cacheprovider -m gpu --timeout 120 --timeout-method thread \
  tests/server/test_dataplane_gpu.py tests/server/test_engine_lease.py tests/client > $OUT/gpu-tests.log 2>&1
echo "gpu tests rc $? in $(( $(date +%s) - t0 )) s"; grep -E "FAILED|ERROR|passed|failed" $OUT/gpu-tests.log | tail -12
