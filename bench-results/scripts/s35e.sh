#!/usr/bin/env bash
# Run 257: the session's final tree on a GPU: the demo, the prelaunch + flip + step_meta gpu tests, the microbench's step_meta row.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl || exit 1
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
NEW=/tmp/new-pkg:/tmp/dspark-site
PYTHONPATH=$NEW timeout 150 python3 -m dspark_sidecar demo --device cuda --transport doorbell --tp 1 --required-tp 1 \
  --dtype bf16 --rounds 20 > $OUT/demo.log 2>&1; echo "demo rc $?"; grep -E "forwarded to|relative|agree" $OUT/demo.log
PYTHONPATH=$NEW timeout -k 10 240 python3 -m pytest -q -m gpu --timeout 150 --timeout-method thread -p no:cacheprovider \
  tests/kernels/triton/test_step_meta.py tests/server/test_dataplane_gpu.py tests/server/test_graphs_gpu.py \
  > $OUT/t.log 2>&1; echo "tests rc $?"; tail -4 $OUT/t.log
PYTHONPATH=/tmp/new-pkg timeout 120 python3 -m dspark_sidecar.kernels.triton.microbench --rows 7 56 224 --no-step \
  > $OUT/microbench.log 2>&1; echo "microbench rc $?"; grep -E "step_meta" $OUT/microbench.log
echo quit | nvidia-cuda-mps-control
