#!/usr/bin/env bash
# Run 265: run 264's failing walk (seed 0: a gRPC step unanswered for 60 s) again, the sidecar's stacks dumped
# (SIGUSR1) and its whole log kept; seed 2 beside it.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl 2>/dev/null
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
PYTHONPATH=/tmp/new-pkg:/tmp/dspark-site:$PWD/tests timeout -k 10 300 python3 -m pytest -q -s -m gpu --timeout 200 \
  --timeout-method thread -p no:cacheprovider --basetemp=/tmp/bt tests/server/test_dataplane_gpu_stress.py \
  -k "0 or 2" > $OUT/t.log 2>&1
echo "tests rc $?"; grep -E "passed|failed|FAILED|^E  .*op |^seed" $OUT/t.log | head -40
for f in /tmp/bt/*/sidecar.log; do d=$(basename $(dirname $f)); cp $f $OUT/$d.sidecar.log; done
echo quit | nvidia-cuda-mps-control
