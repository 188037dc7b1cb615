#!/usr/bin/env bash
# Run 288 (session 48): s45a's gpu tests (sessions 44-48's fixes on a GPU) in one call with the issue-8 bench line,
# the device budget allowing one call: the gpu tests of tests/kernels/triton, tests/client, tests/proto,
# tests/drafter, the fast-path, pre-launch, data-plane and graph server tests and test_bench_host.py; then
# `bench --modes c,h --reqs 1,8 --contexts 4096 --repeats 100 --shim-phases` under MPS; then the demo over the
# doorbell at --max-reqs 8 (the warm-up line, no first-step fallback).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl 2>/dev/null
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
NEW=/tmp/new-pkg:/tmp/dspark-site
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
PYTHONPATH=$NEW timeout 150 python3 -m dspark_sidecar bench --modes c,h --reqs 1,8 --contexts 4096 --repeats 100 \
  --shim-phases --out-dir /tmp/b288 > $OUT/bench.log 2>&1; echo "bench rc $?"
grep -v ' INFO ' $OUT/bench.log | grep -E "floor|GPU backend|via the shim|shim phases|^\|" | cut -c1-220 | head -40
cp -r /tmp/b288 $OUT/ 2>/dev/null
PYTHONPATH=$NEW:$PWD/tests timeout -k 10 300 python3 -m pytest -q -m gpu --timeout 150 \
  --timeout-method thread -p no:cacheprovider --basetemp=/tmp/bt tests/kernels/triton tests/client tests/proto \
  tests/drafter tests/server/test_fast_path.py tests/server/test_prelaunch.py tests/server/test_dataplane_gpu.py \
  tests/server/test_graphs_gpu.py tests/test_bench_host.py --durations=8 > $OUT/t.log 2>&1
echo "tests rc $?"; grep -E "passed|failed|FAILED|^E  |^[0-9.]+s call" $OUT/t.log | cut -c1-1500 | head -40
PYTHONPATH=$NEW timeout 60 python3 -m dspark_sidecar demo --device cuda --transport doorbell --tp 1 --required-tp 1 \
  --dtype bf16 --rounds 20 --max-reqs 8 > $OUT/demo8.log 2>&1; echo "demo rc $?"
grep -E "forwarded to|relative|agree|warm-up|fell back|fallback" $OUT/demo8.log | cut -c1-300 | head -12
echo quit | nvidia-cuda-mps-control
