#!/usr/bin/env bash
# Session 59, run 316: the final tree's demo on a GPU (review 337's verdict: a sidecar fault fails the run; a sidecar
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
for transport in doorbell grpc; do
  t0=$(date +%s)
  timeout 150 python3 -m dspark_sidecar demo --device cuda --tp 1 --required-tp 1 --transport "$transport" \
    --dtype bf16 --rounds 60 > "$OUT/demo-$transport.log" 2>&1
  echo "demo $transport rc $? in $(( $(date +%s) - t0 )) s"; tail -12 "$OUT/demo-$transport.log" | cut -c1-220
done
