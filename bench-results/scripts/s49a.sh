#!/usr/bin/env bash
# Run 289 (session 49): issue 8's line again (bench --modes c,h at R 1 and 8, context 4096, 100 repeats, shim
# phases), the demo over the doorbell at --max-reqs 64 (s45a's, never run), then s48b.sh (the real shapes from
# start to SERVING, a GetStatus, a clean SIGTERM) under the same MPS daemon.
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
  --shim-phases --out-dir /tmp/b289 > $OUT/bench.log 2>&1; echo "bench rc $?"
grep -v ' INFO ' $OUT/bench.log | grep -E "floor|GPU backend|via the shim|shim phases|^\|" | cut -c1-220 | head -40
cp -r /tmp/b289 $OUT/ 2>/dev/null
PYTHONPATH=$NEW timeout 120 python3 -m dspark_sidecar demo --device cuda --transport doorbell --tp 1 --required-tp 1 \
  --dtype bf16 --rounds 20 --max-reqs 64 > $OUT/demo64.log 2>&1; echo "demo64 rc $?"
grep -E "forwarded to|relative|agree|warm-up|fell back|fallback|Error" $OUT/demo64.log | cut -c1-300 | head -12
timeout 240 bash bench-results/scripts/s48b.sh; echo "s48b rc $?"
echo quit | nvidia-cuda-mps-control
