#!/usr/bin/env bash
# Run 262: the review fixes on a GPU: the same gpu tests and demo as s36a, then one bench c,h process.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl 2>/dev/null
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
NEW=/tmp/new-pkg:/tmp/dspark-site
PYTHONPATH=$NEW:$PWD/tests timeout -k 10 330 python3 -m pytest -q -m gpu --timeout 150 --timeout-method thread -p no:cacheprovider \
  tests/client/test_dataplane_buffers.py tests/server/test_dataplane_gpu.py tests/server/test_graphs_gpu.py \
  tests/kernels/triton/test_step_meta.py > $OUT/t.log 2>&1; echo "tests rc $?"; grep -E "passed|failed|FAILED|^E  " $OUT/t.log | head -20
PYTHONPATH=$NEW timeout 150 python3 -m dspark_sidecar demo --device cuda --transport doorbell --tp 1 --required-tp 1 \
  --dtype bf16 --rounds 20 > $OUT/demo.log 2>&1; echo "demo rc $?"; grep -E "forwarded to|relative|agree" $OUT/demo.log
PYTHONPATH=$NEW timeout 90 python3 -m dspark_sidecar bench --modes c,h --reqs 1,8 --contexts 4096 --repeats 100 \
  --shim-phases --out-dir /tmp/b262 2>&1 | grep -v ' INFO ' > $OUT/bench.log; echo "bench rc $?"
grep -E "GPU backend|via the shim|shim phases" $OUT/bench.log
echo quit | nvidia-cuda-mps-control
