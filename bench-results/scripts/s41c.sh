#!/usr/bin/env bash
# Run 277 (session 41): the session's later fixes on a GPU (the GPU word's registration undone on failure, the
# bench's and demo's sidecars configured from argv alone): the client and bench gpu tests, the demo over the
# doorbell, then the whole bench at its defaults (modes a-i, R 1/8/32, contexts 512/4096, 100 repeats).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl 2>/dev/null
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
NEW=/tmp/new-pkg:/tmp/dspark-site
PYTHONPATH=$NEW:$PWD/tests timeout -k 10 200 python3 -m pytest -q -m gpu --timeout 150 --timeout-method thread \
  -p no:cacheprovider --basetemp=/tmp/bt tests/client tests/test_bench.py tests/proto/test_gpu_alloc.py \
  --durations=5 > $OUT/t.log 2>&1
echo "tests rc $?"; grep -E "passed|failed|FAILED|^E  |^[0-9.]+s call" $OUT/t.log | cut -c1-1500 | head -30
PYTHONPATH=$NEW timeout 60 python3 -m dspark_sidecar demo --device cuda --transport doorbell --tp 1 --required-tp 1 \
  --dtype bf16 --rounds 20 > $OUT/demo.log 2>&1; echo "demo rc $?"; grep -E "forwarded to|relative|agree" $OUT/demo.log
PYTHONPATH=$NEW timeout 260 python3 -m dspark_sidecar bench --out-dir $OUT/b 2>&1 | grep -v ' INFO ' > $OUT/bench.log
echo "bench rc $?"; grep -E "ctx=|bandwidth|floor" $OUT/bench.log | cut -c1-260 | head -70
echo quit | nvidia-cuda-mps-control
