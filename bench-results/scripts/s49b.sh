#!/usr/bin/env bash
# Run 290 (session 49): the whole bench at its defaults (modes a-i, R 1/8/32, contexts 512/4096, 100 repeats)
# on the tree of session 49, under MPS: the first full table since run 277.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl 2>/dev/null
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
NEW=/tmp/new-pkg:/tmp/dspark-site
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
PYTHONPATH=$NEW timeout 300 python3 -m dspark_sidecar bench --out-dir $OUT/b 2>&1 | grep -v ' INFO ' > $OUT/bench.log
echo "bench rc ${PIPESTATUS[0]}"; grep -E "ctx=|bandwidth|floor" $OUT/bench.log | cut -c1-260 | head -70
echo quit | nvidia-cuda-mps-control
