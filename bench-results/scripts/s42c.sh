#!/usr/bin/env bash
# Run 281 (session 42): the data-plane, stress and graph gpu tests of tests/server on the second wave of fixes (the
# engine segments now viewed through a mapping of their own, helper 110; the rank's failed steps letting go of their
# views, helper 103).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl 2>/dev/null
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
NEW=/tmp/new-pkg:/tmp/dspark-site
PYTHONPATH=$NEW:$PWD/tests timeout -k 10 560 python3 -m pytest -q -m gpu --timeout 200 \
  --timeout-method thread -p no:cacheprovider --basetemp=/tmp/bt tests/server/test_dataplane_gpu.py tests/server/test_dataplane_gpu_stress.py \
  tests/server/test_graphs_gpu.py --durations=8 > $OUT/t.log 2>&1
echo "tests rc $?"; grep -E "passed|failed|FAILED|^E  |^[0-9.]+s call" $OUT/t.log | cut -c1-1500 | head -40
echo quit | nvidia-cuda-mps-control
