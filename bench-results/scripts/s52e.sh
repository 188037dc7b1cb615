#!/usr/bin/env bash
# Session 52, run 302: the gone-engine device check on a GPU (the rank's stream waiting on a killed engine's event
# its GPU never recorded), without then under MPS; then the rest of run 300 (`pytest -m gpu tests/server`) under MPS.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl 2>/dev/null
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1
NEW=/tmp/new-pkg:/tmp/dspark-site
T=tests/server/test_engine_lease.py::test_a_rank_whose_stream_waits_on_a_killed_engine_s_event_exits_for_a_restart
t0=$(date +%s)
PYTHONPATH=$NEW:$PWD/tests timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu $T > $OUT/stuck-nomps.log 2>&1
echo "without MPS: rc $? in $(( $(date +%s) - t0 )) s"; grep -E "passed|failed|has not got|device failed" $OUT/stuck-nomps.log | head -5
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe3 CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log3
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
t0=$(date +%s)
PYTHONPATH=$NEW:$PWD/tests timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu $T > $OUT/stuck-mps.log 2>&1
echo "under MPS: rc $? in $(( $(date +%s) - t0 )) s"; grep -E "passed|failed|has not got|device failed" $OUT/stuck-mps.log | head -5
echo quit | nvidia-cuda-mps-control; sleep 2
nvidia-cuda-mps-control -d && echo "MPS up again"
t0=$(date +%s)
PYTHONPATH=$NEW:$PWD/tests timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/server \
  --deselect $T > $OUT/gputests.log 2>&1; echo "gpu tests rc $? in $(( $(date +%s) - t0 )) s"
grep -E "passed|failed|FAILED|ERROR" $OUT/gputests.log | tail -12
echo quit | nvidia-cuda-mps-control
