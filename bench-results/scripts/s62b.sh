#!/usr/bin/env bash
# Session 62, run 318: review 357's GEMM changes on a GPU (activation dtype, device and empty-shape checks on the
# launch path; fp32 activations' stage size in plan), with every gpu test of tests/kernels/triton, then the demo
# at --dtype fp32 (the planner's changed case: fp32 x through the dense GEMM) and bf16 over the doorbell.
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
timeout "${TESTS_S:-330}" python3 -m pytest -q -p no:cacheprovider -m gpu --timeout 150 --timeout-method thread \
  tests/kernels/triton > "$OUT"/triton-gpu-tests.log 2>&1
echo "triton gpu tests rc $? in $(( $(date +%s) - t0 )) s"; grep -E "FAILED|ERROR|passed|failed" "$OUT"/triton-gpu-tests.log | tail -12
for dtype in fp32 bf16; do
  t0=$(date +%s)
  timeout 100 python3 -m dspark_sidecar demo --device cuda --tp 1 --required-tp 1 --transport doorbell --dtype "$dtype" \
    --rounds 30 > "$OUT/demo-$dtype.log" 2>&1
  echo "demo $dtype rc $? in $(( $(date +%s) - t0 )) s"; tail -6 "$OUT/demo-$dtype.log" | cut -c1-220
done
