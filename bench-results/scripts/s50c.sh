#!/usr/bin/env bash
# Runs 293-295 (session 50): the copy-out's host time (clone_cost.py) and the doorbell waits spinning against
# napping in the engine process (spin_ab.py), alternated, modes c,h at R 1 and 8, context 4096, 100 repeats.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl 2>/dev/null
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
NEW=/tmp/new-pkg:/tmp/dspark-site
nvidia-smi --query-gpu=name --format=csv,noheader
PYTHONPATH=$NEW python3 bench-results/scripts/clone_cost.py 2>&1 | grep -v CudaIPCTypes
for way in nap spin nap spin; do
  PYTHONPATH=$NEW timeout 150 python3 bench-results/scripts/spin_ab.py $way bench --modes c,h --reqs 1,8 --contexts 4096 \
    --repeats 100 --shim-phases --out-dir /tmp/b295-$way > $OUT/bench-$way.log 2>&1; echo "== $way rc $?"
  grep -v ' INFO ' $OUT/bench-$way.log | grep -E "via the shim|shim phases|after the answer" | cut -c1-240 | head -8
done
echo quit | nvidia-cuda-mps-control
