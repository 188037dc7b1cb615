#!/usr/bin/env bash
# Session 60, run 316: review 340's step_meta program tests on a GPU (random steps and int32/int64 edges against the
# reference), then the final tree's demo on a GPU (review 337's verdict: a sidecar fault fails the run; a sidecar
# that ended mid-run fails it), over the doorbell and over the gRPC stream.
set -uo pipefail
rm -rf /tmp/dspark-site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl 2>/dev/null
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/new-pkg:/tmp/dspark-site:$PWD/tests
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe14 CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log14
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
trap 'echo quit | nvidia-cuda-mps-control' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
timeout 200 python3 -m pytest -v -p no:cacheprovider -m gpu --timeout 120 --timeout-method thread \
  tests/kernels/triton/test_step_meta.py > "$OUT"/step-meta-tests.log 2>&1
echo "step_meta gpu tests rc $? in $(( $(date +%s) - t0 )) s"; grep -E "FAILED|ERROR|passed|failed" "$OUT"/step-meta-tests.log | tail -12
for transport in doorbell grpc; do
  t0=$(date +%s)
  timeout 150 python3 -m dspark_sidecar demo --device cuda --tp 1 --required-tp 1 --transport "$transport" \
    --dtype bf16 --rounds 60 > "$OUT/demo-$transport.log" 2>&1
  echo "demo $transport rc $? in $(( $(date +%s) - t0 )) s"; tail -12 "$OUT/demo-$transport.log" | cut -c1-220
done
