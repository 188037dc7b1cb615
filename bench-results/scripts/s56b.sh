#!/usr/bin/env bash
# Session 56, run 311: run 310 again on an H200 if one comes (issue 8 names it); then the gpu tests of the graphs
# of tests/client, tests/proto and the data plane (review 304-312 changes: memory.py's close, BindKV's facts, the board's pages).
set -uo pipefail
rm -rf /tmp/dspark-site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl 2>/dev/null
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/new-pkg:/tmp/dspark-site:$PWD/tests
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe7 CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log7
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
trap 'echo quit | nvidia-cuda-mps-control' EXIT
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
nproc; lscpu | grep -E 'Model name' | head -1
# The whole bench only where an H200 came (run 310 has it on an H100); the c,h line and the tests either way.
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
t0=$(date +%s)
timeout 170 python3 -m dspark_sidecar bench --out-dir $OUT/b > $OUT/bench-defaults.log 2>&1
echo "bench defaults rc $? in $(( $(date +%s) - t0 )) s"; grep -v " INFO " $OUT/bench-defaults.log | grep -E "ctx=|bandwidth|floor" | cut -c1-260 | head -70
fi
t0=$(date +%s)
timeout 120 python3 -m dspark_sidecar bench --modes c,h --reqs 1,8 --contexts 4096 --repeats 100 --shim-phases \
  --out-dir $OUT/ch > $OUT/bench-ch.log 2>&1
echo "bench c,h rc $? in $(( $(date +%s) - t0 )) s"; grep -v " INFO " $OUT/bench-ch.log | tail -30
t0=$(date +%s)
timeout 330 python3 -m pytest -q -p no:cacheprovider -m gpu --timeout 150 --timeout-method thread \
  tests/client tests/proto tests/server/test_dataplane_gpu.py tests/server/test_graphs_gpu.py > $OUT/gpu-tests.log 2>&1
echo "gpu tests rc $? in $(( $(date +%s) - t0 )) s"; grep -E "FAILED|ERROR|passed|failed" $OUT/gpu-tests.log | tail -12
