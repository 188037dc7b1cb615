#!/usr/bin/env bash
# Run 298 (session 50): the gpu tests of tests/server, tests/client, tests/proto and tests/test_bench.py on the
# session's last code (the driver's copy-out, the after-answer phases), under MPS.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl 2>/dev/null
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
NEW=/tmp/new-pkg:/tmp/dspark-site
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
PYTHONPATH=$NEW:$PWD/tests timeout 420 python3 -m pytest -q -p no:cacheprovider -m gpu tests/server tests/client \
  tests/proto tests/test_bench.py > $OUT/gputests.log 2>&1; echo "gpu tests rc $? in $(( $(date +%s) - t0 )) s"
grep -E "passed|failed|FAILED|ERROR|SKIPPED" $OUT/gputests.log | tail -12
echo quit | nvidia-cuda-mps-control
