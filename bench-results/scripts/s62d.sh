#!/usr/bin/env bash
# Session 62, run 320: the rest of run 319's gpu tests, which its 280 s bound ended inside test_engine_lease.py
# (16 passed, none failed before it): the engine lease's gpu tests and the client's, a per-test bound of 150 s.
set -uo pipefail
rm -rf /tmp/dspark-site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl 2>/dev/null
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/new-pkg:/tmp/dspark-site:$PWD/tests
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe18 CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log18
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
trap 'echo quit | nvidia-cuda-mps-control' EXIT
t0=$(date +%s)
timeout "${TESTS_S:-270}" python3 -m pytest -v -p no:cacheprovider -m gpu --timeout 150 --timeout-method thread \
  --durations=0 tests/client tests/server/test_engine_lease.py > "$OUT"/gpu-tests.log 2>&1
echo "gpu tests rc $? in $(( $(date +%s) - t0 )) s"; grep -E "PASSED|FAILED|ERROR|passed|failed|Timeout" "$OUT"/gpu-tests.log | tail -14 | cut -c1-200
grep -E "^[0-9.]+s (call|setup)" "$OUT"/gpu-tests.log | head -8
