#!/usr/bin/env bash
# Session 62, run 319: reviews 358-361's changes on a GPU (the servicer's GetStatus and BindKV verdicts, the shim's link
# close hand-off, the data plane's step numbering), with the gpu tests of the server's lease and data plane and
# the client, then the demo over the doorbell.
set -uo pipefail
rm -rf /tmp/dspark-site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl 2>/dev/null
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/new-pkg:/tmp/dspark-site:$PWD/tests
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe17 CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log17
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
trap 'echo quit | nvidia-cuda-mps-control' EXIT
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t0=$(date +%s)
timeout "${TESTS_S:-280}" python3 -m pytest -v -p no:cacheprovider -m gpu --timeout 120 --timeout-method thread \
  tests/proto tests/server/test_dataplane_gpu.py tests/server/test_graphs_gpu.py tests/server/test_engine_lease.py tests/server/test_lease.py \
  tests/client > "$OUT"/gpu-tests.log 2>&1
echo "gpu tests rc $? in $(( $(date +%s) - t0 )) s"; grep -E "FAILED|ERROR|passed|failed" "$OUT"/gpu-tests.log | tail -12
t0=$(date +%s)
timeout 120 python3 -m dspark_sidecar demo --device cuda --tp 1 --required-tp 1 --transport doorbell --dtype bf16 \
  --rounds 40 > "$OUT"/demo.log 2>&1
echo "demo rc $? in $(( $(date +%s) - t0 )) s"; tail -14 "$OUT"/demo.log | cut -c1-220
