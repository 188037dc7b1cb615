#!/usr/bin/env bash
# Session 63, run 322: reviews 368-370 on a GPU (the engine lease's take under a fork, the launcher's ownership check,
# --exit-with-pid's own child): every gpu test of tests/client and tests/server/test_engine_lease.py.
set -uo pipefail
rm -rf /tmp/dspark-site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl 2>/dev/null
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/new-pkg:/tmp/dspark-site:$PWD/tests
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe16 CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log16
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
trap 'echo quit | nvidia-cuda-mps-control' EXIT
t0=$(date +%s)
timeout "${TESTS_S:-300}" python3 -m pytest -q -p no:cacheprovider -m gpu --timeout 150 --timeout-method thread \
  tests/client tests/server/test_engine_lease.py --durations=0 > "$OUT"/client-gpu-tests.log 2>&1
echo "client gpu tests rc $? in $(( $(date +%s) - t0 )) s"; grep -E "FAILED|ERROR|passed|failed" "$OUT"/client-gpu-tests.log | tail -12
