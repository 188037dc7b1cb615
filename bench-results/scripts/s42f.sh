#!/usr/bin/env bash
# Run 284 (session 42): the pre-launch's step_meta imported when a Prelaunch is built, not with the module (helper
# 134): the graph gpu tests (pre-launch among them) and the demo over the doorbell.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl 2>/dev/null
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
NEW=/tmp/new-pkg:/tmp/dspark-site
PYTHONPATH=$NEW:$PWD/tests timeout -k 10 170 python3 -m pytest -q -m gpu --timeout 150 --timeout-method thread \
  -p no:cacheprovider --basetemp=/tmp/bt tests/server/test_graphs_gpu.py > $OUT/t.log 2>&1
echo "tests rc $?"; grep -E "passed|failed|FAILED|^E  " $OUT/t.log | cut -c1-1500 | head -30
PYTHONPATH=$NEW timeout 90 python3 -m dspark_sidecar demo --device cuda --transport doorbell --tp 1 --required-tp 1 \
  --dtype bf16 --rounds 20 > $OUT/demo.log 2>&1; echo "demo rc $?"; grep -E "forwarded to|relative|agree|pre-launch" $OUT/demo.log
echo quit | nvidia-cuda-mps-control
