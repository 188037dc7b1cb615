#!/usr/bin/env bash
# Run 292 (session 50): where the shim's time after the answer goes (bench --shim-phases now splits it too), at
# issue 8's line (modes c,h, R 1 and 8, context 4096, 100 repeats); then mode h with the step's metadata on the
# GPU as vLLM's forward context holds it (--shim-inputs device), last measured in runs 200-203.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl 2>/dev/null
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
NEW=/tmp/new-pkg:/tmp/dspark-site
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
for inputs in host device; do
  PYTHONPATH=$NEW timeout 200 python3 -m dspark_sidecar bench --modes c,h --reqs 1,8 --contexts 4096 --repeats 100 \
    --shim-phases --shim-inputs $inputs --out-dir /tmp/b292-$inputs > $OUT/bench-$inputs.log 2>&1; echo "bench $inputs rc $?"
  grep -v ' INFO ' $OUT/bench-$inputs.log | grep -E "floor|GPU backend|via the shim|shim phases|after the answer|^\|" | cut -c1-240 | head -20
  cp -r /tmp/b292-$inputs $OUT/ 2>/dev/null
done
echo quit | nvidia-cuda-mps-control
