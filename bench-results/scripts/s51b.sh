#!/usr/bin/env bash
# Run 300 (session 51): engine leases on a GPU (a killed engine's CUDA cache freed while the sidecar serves on),
# then every gpu test of tests/server (BindKV and the data plane under the lease code), under MPS.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl 2>/dev/null
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1
NEW=/tmp/new-pkg:/tmp/dspark-site
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
PYTHONPATH=$NEW:$PWD/tests timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/server/test_engine_lease.py \
  > $OUT/lease.log 2>&1; echo "lease gpu test rc $? in $(( $(date +%s) - t0 )) s"; tail -15 $OUT/lease.log
t0=$(date +%s)
PYTHONPATH=$NEW:$PWD/tests timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu tests/server \
  --deselect tests/server/test_engine_lease.py > $OUT/gputests.log 2>&1; echo "gpu tests rc $? in $(( $(date +%s) - t0 )) s"
grep -E "passed|failed|FAILED|ERROR" $OUT/gputests.log | tail -12
echo quit | nvidia-cuda-mps-control
