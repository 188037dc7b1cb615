#!/usr/bin/env bash
# Session 63, run 321: this session's kernel change on a GPU (runtime.same_device on every Triton op: attention,
# attn_prelude, qk_norm_rope, write_kv, rms_norm), with every gpu test of tests/kernels/triton; the warm-up's move
# to server/warmup.py and review 364's graph test with the server's gpu tests of both; the demo over the doorbell.
# (No bench: nothing of this session is on the graphed step's or the shim's timed path.)
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
timeout "${TESTS_S:-300}" python3 -m pytest -q -p no:cacheprovider -m gpu --timeout 150 --timeout-method thread \
  tests/kernels/triton > "$OUT"/triton-gpu-tests.log 2>&1
echo "triton gpu tests rc $? in $(( $(date +%s) - t0 )) s"; grep -E "FAILED|ERROR|passed|failed" "$OUT"/triton-gpu-tests.log | tail -12
t0=$(date +%s)
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu --timeout 120 --timeout-method thread \
  tests/server/test_warmup.py tests/server/test_graphs_gpu.py > "$OUT"/server-gpu-tests.log 2>&1
echo "server gpu tests rc $? in $(( $(date +%s) - t0 )) s"; grep -E "FAILED|ERROR|passed|failed" "$OUT"/server-gpu-tests.log | tail -8
t0=$(date +%s)
timeout 90 python3 -m dspark_sidecar demo --device cuda --tp 1 --required-tp 1 --transport doorbell --dtype bf16 \
  --rounds 30 > "$OUT/demo-bf16.log" 2>&1
echo "demo rc $? in $(( $(date +%s) - t0 )) s"; tail -6 "$OUT/demo-bf16.log" | cut -c1-220
