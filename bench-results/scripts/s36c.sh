#!/usr/bin/env bash
# Run 260: the engine shim's host time before the ring, phase by phase (bench --shim-phases), four fresh processes.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl 2>/dev/null
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
for i in 1 2 3 4; do
  PYTHONPATH=/tmp/new-pkg:/tmp/dspark-site timeout 90 python3 -m dspark_sidecar bench --modes c,h --reqs 1,8 \
    --contexts 4096 --repeats 100 --shim-phases --out-dir /tmp/p$i 2>&1 | grep -v ' INFO ' > $OUT/phases-$i.log
  echo "== $i"; grep -E "via the shim|shim phases" $OUT/phases-$i.log
done
tar -cf $OUT/phases-json.tar /tmp/p[0-9]* 2>/dev/null
echo quit | nvidia-cuda-mps-control
