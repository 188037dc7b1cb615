#!/usr/bin/env bash
# Run 268: the collector off during captures (run 267: a rank aborted inside a capture); seed 1 walk, the fresh-thread query.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl 2>/dev/null
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
PYTHONPATH=/tmp/new-pkg:/tmp/dspark-site:$PWD/tests timeout -k 10 100 python3 -m pytest -q -s -m gpu --timeout 200 \
  --timeout-method thread -p no:cacheprovider --basetemp=/tmp/bt tests/proto/test_gpu_alloc.py \
  tests/server/test_dataplane_gpu_stress.py -k "fresh_thread or walks and 1" > $OUT/t.log 2>&1
echo "tests rc $?"; grep -E "passed|failed|FAILED|^E  .*op |^seed|status 201" $OUT/t.log | head -40
echo quit | nvidia-cuda-mps-control
