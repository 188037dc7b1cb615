#!/usr/bin/env bash
# Run 261: run 260 again with the on-CPU share and preemptions of the shim thread before its send (GIL or scheduler vs slow CPU).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl 2>/dev/null
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
for i in 1 2 3 4; do
  python3 -c "import time; t=time.perf_counter(); sum(range(3_000_000)); print('py loop %.1f ms' % ((time.perf_counter()-t)*1e3))"
  PYTHONPATH=/tmp/new-pkg:/tmp/dspark-site timeout 90 python3 -m dspark_sidecar bench --modes c,h --reqs 1,8 \
    --contexts 4096 --repeats 100 --shim-phases --out-dir /tmp/q$i 2>&1 | grep -v ' INFO ' > $OUT/cpu-$i.log
  echo "== $i"; grep -E "via the shim|shim phases" $OUT/cpu-$i.log
done
tar -cf $OUT/cpu-json.tar /tmp/q[0-9]* 2>/dev/null
echo quit | nvidia-cuda-mps-control
