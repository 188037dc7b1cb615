#!/usr/bin/env bash
# Run 288 (prepared in session 44, NOT RUN: no device was lent that session): the review fixes on a GPU: gpu_word's stream-0 calls under this device's context and the
# probe's synchronize (helper 178), the model's step-shape checks (164), the doorbell's absolute FIFO path (174):
# the gpu tests of tests/client, tests/proto, tests/drafter, the data-plane, graph and pre-launch server tests and
# test_bench.py, the demo, and a bench of c,h (does (h) move with the stream-0 context check?).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl 2>/dev/null
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
NEW=/tmp/new-pkg:/tmp/dspark-site
PYTHONPATH=$NEW:$PWD/tests timeout -k 10 400 python3 -m pytest -q -m gpu --timeout 200 \
  --timeout-method thread -p no:cacheprovider --basetemp=/tmp/bt tests/client tests/proto tests/drafter \
  tests/server/test_dataplane_gpu.py tests/server/test_graphs_gpu.py tests/server/test_prelaunch.py \
  tests/test_bench.py --durations=8 > $OUT/t.log 2>&1
echo "tests rc $?"; grep -E "passed|failed|FAILED|^E  |^[0-9.]+s call" $OUT/t.log | cut -c1-1500 | head -40
PYTHONPATH=$NEW timeout 100 python3 -m dspark_sidecar demo --device cuda --transport doorbell --tp 1 --required-tp 1 \
  --dtype bf16 --rounds 20 > $OUT/demo.log 2>&1; echo "demo rc $?"; grep -E "forwarded to|relative|agree" $OUT/demo.log
PYTHONPATH=$NEW timeout 90 python3 -m dspark_sidecar bench --modes c,h --reqs 1,8 --contexts 4096 --repeats 100 \
  --shim-phases --out-dir /tmp/b288 2>&1 | grep -v ' INFO ' > $OUT/bench.log; echo "bench rc $?"
grep -E "GPU backend|via the shim|shim phases" $OUT/bench.log
echo quit | nvidia-cuda-mps-control
