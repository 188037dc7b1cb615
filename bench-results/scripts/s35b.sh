#!/usr/bin/env bash
# Run 254: the metadata-flip GPU test on NEW and OLD (08d8237); bench c,h OLD vs NEW alternated twice
# (the private copy's cost on the answer's path).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl || exit 1
mkdir -p /tmp/new-pkg /tmp/old-pkg /tmp/old
ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
tar -xf .notes/old35.tar -C /tmp/old && ln -sfn /tmp/old /tmp/old-pkg/dspark_sidecar
cp tests/server/test_dataplane_gpu.py /tmp/old/tests/server/
export PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
nproc; lscpu | grep -E "Model name" | head -1
for v in new old; do
  (cd /tmp/$v-pkg/dspark_sidecar && PYTHONPATH=/tmp/$v-pkg:/tmp/dspark-site timeout -k 10 120 python3 -m pytest -q -m gpu \
    --timeout 100 --timeout-method thread -p no:cacheprovider tests/server/test_dataplane_gpu.py -k rewritten_while_steps_run \
    > $OUT/t-flip-$v.log 2>&1; echo "flip test $v rc $?"; grep -E "^E  +(grpc|Assert|status|details)" $OUT/t-flip-$v.log | head -4; tail -1 $OUT/t-flip-$v.log)
done
for i in 1 2; do for v in old new; do
  PYTHONPATH=/tmp/$v-pkg:/tmp/dspark-site timeout 100 python3 -m dspark_sidecar bench --modes c,h --reqs 1,8 \
    --contexts 4096 --repeats 100 --out-dir /tmp/b-$v$i 2>&1 | grep -v ' INFO ' > $OUT/bench-$v$i.log
  echo "== $v$i"; grep -E "GPU backend|via the shim" $OUT/bench-$v$i.log
done; done
tar -cf $OUT/bench-json.tar /tmp/b-* 2>/dev/null
echo quit | nvidia-cuda-mps-control
