#!/usr/bin/env bash
# Run 252: bench c,h OLD (a5f0cfc) vs NEW alternated three times, to size the shim's host-path trims.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl || exit 1
mkdir -p /tmp/new-pkg /tmp/old-pkg /tmp/old
ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
tar -xf .notes/old.tar -C /tmp/old && ln -sfn /tmp/old /tmp/old-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
nproc; lscpu | grep -E "Model name|MHz" | head -3
for i in 1 2 3; do for v in old new; do
  PYTHONPATH=/tmp/$v-pkg:/tmp/dspark-site timeout 100 python3 -m dspark_sidecar bench --modes c,h --reqs 1,8 \
    --contexts 4096 --repeats 100 --out-dir /tmp/b-$v$i 2>&1 | grep -v ' INFO ' > $OUT/bench-$v$i.log
  echo "== $v$i"; grep -E "GPU backend|via the shim" $OUT/bench-$v$i.log
done; done
echo quit | nvidia-cuda-mps-control
