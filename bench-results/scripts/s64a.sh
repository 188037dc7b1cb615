#!/usr/bin/env bash
# Session 64, run 323: this session's GPU-side changes: the CUDA handle's offset-past-the-allocation refusal (proto
# gpu tests), the doorbell step's deadline counted from its ring (review 373: RankLoop.answer_now's seen_ns) and its
# error answer clipped, through the data-plane gpu test and the demo over the doorbell. No bench.
set -uo pipefail
rm -rf /tmp/dspark-site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl 2>/dev/null
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/new-pkg:/tmp/dspark-site:$PWD/tests
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe16 CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log16
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
trap 'echo quit | nvidia-cuda-mps-control' EXIT
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t0=$(date +%s)
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu --timeout 80 --timeout-method thread \
  tests/proto tests/server/test_dataplane_gpu.py > "$OUT"/gpu-tests.log 2>&1
echo "gpu tests rc $? in $(( $(date +%s) - t0 )) s"; grep -E "FAILED|ERROR|passed|failed" "$OUT"/gpu-tests.log | tail -8
t0=$(date +%s)
timeout 80 python3 -m dspark_sidecar demo --device cuda --tp 1 --required-tp 1 --transport doorbell --dtype bf16 \
  --rounds 30 > "$OUT/demo-bf16.log" 2>&1
echo "demo rc $? in $(( $(date +%s) - t0 )) s"; tail -6 "$OUT/demo-bf16.log" | cut -c1-220
