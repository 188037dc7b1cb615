#!/usr/bin/env bash
# Run 251: the session's merged code on a GPU: the demo, bench c,h OLD (a5f0cfc) vs NEW alternated, gpu tests.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl || exit 1
mkdir -p /tmp/new-pkg /tmp/old-pkg /tmp/old
ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
tar -xf .notes/old.tar -C /tmp/old && ln -sfn /tmp/old /tmp/old-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
nproc; nvidia-smi --query-gpu=name,clocks.sm --format=csv
NEW=/tmp/new-pkg:/tmp/dspark-site
PYTHONPATH=$NEW timeout 150 python3 -m dspark_sidecar demo --device cuda --transport doorbell --tp 1 --required-tp 1 \
  --dtype bf16 --rounds 20 > $OUT/demo.log 2>&1; echo "demo rc $?"; tail -12 $OUT/demo.log
for i in 1 2; do for v in old new; do
  PYTHONPATH=/tmp/$v-pkg:/tmp/dspark-site timeout 150 python3 -m dspark_sidecar bench --modes c,h --reqs 1,8 \
    --contexts 4096 --repeats 100 --out-dir /tmp/b-$v$i 2>&1 | grep -v ' INFO ' > $OUT/bench-$v$i.log
  echo "== $v$i"; grep -E "^ *\(?[ch]\)?|shim|R=" $OUT/bench-$v$i.log | head -20
done; done
tar -cf $OUT/bench-json.tar /tmp/b-* 2>/dev/null
PYTHONPATH=$NEW timeout -k 10 330 python3 -m pytest -q -m gpu --timeout 200 --timeout-method thread -p no:cacheprovider \
  tests/server/test_dataplane_gpu.py tests/client > $OUT/t.log 2>&1; echo "tests rc $?"; tail -6 $OUT/t.log
echo quit | nvidia-cuda-mps-control
