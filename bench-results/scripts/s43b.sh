#!/usr/bin/env bash
# Run 286 (session 43): the second wave of review fixes (helpers 144-159) on a GPU: the attention's and prelude's int64
# cache offsets and RoPE checks (144), the GEMMs' NaN-keeping clamps and dtype checks (158), the harness's starter
# watch (152): the kernel, client, graph and bench gpu tests, the demo, and a bench of c,h (does (c) move?).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl 2>/dev/null
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
NEW=/tmp/new-pkg:/tmp/dspark-site
PYTHONPATH=$NEW:$PWD/tests timeout -k 10 400 python3 -m pytest -q -m gpu --timeout 200 \
  --timeout-method thread -p no:cacheprovider --basetemp=/tmp/bt tests/kernels tests/client \
  tests/server/test_graphs_gpu.py tests/test_bench.py --durations=8 > $OUT/t.log 2>&1
echo "tests rc $?"; grep -E "passed|failed|FAILED|^E  |^[0-9.]+s call" $OUT/t.log | cut -c1-1500 | head -40
PYTHONPATH=$NEW timeout 100 python3 -m dspark_sidecar demo --device cuda --transport doorbell --tp 1 --required-tp 1 \
  --dtype bf16 --rounds 20 > $OUT/demo.log 2>&1; echo "demo rc $?"; grep -E "forwarded to|relative|agree" $OUT/demo.log
PYTHONPATH=$NEW timeout 90 python3 -m dspark_sidecar bench --modes c,h --reqs 1,8 --contexts 4096 --repeats 100 \
  --shim-phases --out-dir /tmp/b286 2>&1 | grep -v ' INFO ' > $OUT/bench.log; echo "bench rc $?"
grep -E "GPU backend|via the shim|shim phases" $OUT/bench.log
echo quit | nvidia-cuda-mps-control
