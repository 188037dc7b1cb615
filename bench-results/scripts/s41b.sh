#!/usr/bin/env bash
# Run 276 (session 41): the review fixes of helpers 95-98 on a GPU: the data-plane, stress, IPC-mapping and
# buffer gpu tests (the doorbell's FIFO and closed-page checks), the bench's gpu tests (the shim rows' data-plane
# check), then the demo over the doorbell and a bench of (c), (d), (e) and (h) at R=1 and 8, context 4096.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl 2>/dev/null
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
NEW=/tmp/new-pkg:/tmp/dspark-site
PYTHONPATH=$NEW:$PWD/tests timeout -k 10 430 python3 -m pytest -q -m gpu --timeout 200 --timeout-method thread \
  -p no:cacheprovider --basetemp=/tmp/bt tests/proto/test_gpu_alloc.py tests/proto/test_memory.py \
  tests/server/test_dataplane_gpu.py tests/server/test_dataplane_gpu_stress.py tests/client/test_dataplane_buffers.py \
  tests/test_bench.py --durations=6 > $OUT/t.log 2>&1
echo "tests rc $?"; grep -E "passed|failed|FAILED|^E  |^[0-9.]+s call" $OUT/t.log | cut -c1-1500 | head -40
PYTHONPATH=$NEW timeout 60 python3 -m dspark_sidecar demo --device cuda --transport doorbell --tp 1 --required-tp 1 \
  --dtype bf16 --rounds 20 > $OUT/demo.log 2>&1; echo "demo rc $?"; grep -E "forwarded to|relative|agree" $OUT/demo.log
PYTHONPATH=$NEW timeout 90 python3 -m dspark_sidecar bench --modes c,d,e,h --reqs 1,8 --contexts 4096 --repeats 100 \
  --out-dir /tmp/b276 2>&1 | grep -v ' INFO ' > $OUT/bench.log; echo "bench rc $?"
grep -E "ctx= 4096" $OUT/bench.log
echo quit | nvidia-cuda-mps-control
