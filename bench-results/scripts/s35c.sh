#!/usr/bin/env bash
# Run 255: step_meta's distinct-slots check on a GPU: its gpu tests, the prelaunch tests, the demo; its GPU time OLD vs NEW.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl || exit 1
mkdir -p /tmp/new-pkg /tmp/old-pkg /tmp/old
ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
tar -xf .notes/old35.tar -C /tmp/old && ln -sfn /tmp/old /tmp/old-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
NEW=/tmp/new-pkg:/tmp/dspark-site
for v in old new; do PYTHONPATH=/tmp/$v-pkg:/tmp/dspark-site timeout 120 python3 .notes/stepmeta_time.py $v 2>&1 | grep -v Warn; done
PYTHONPATH=$NEW timeout -k 10 200 python3 -m pytest -q -m gpu --timeout 150 --timeout-method thread -p no:cacheprovider \
  tests/kernels/triton/test_step_meta.py tests/server/test_dataplane_gpu.py::test_gpu_prelaunched_steps_equal_ordinary_ones \
  > $OUT/t.log 2>&1; echo "tests rc $?"; tail -4 $OUT/t.log
PYTHONPATH=$NEW timeout 150 python3 -m dspark_sidecar demo --device cuda --transport doorbell --tp 1 --required-tp 1 \
  --dtype bf16 --rounds 20 > $OUT/demo.log 2>&1; echo "demo rc $?"; grep -E "forwarded to|relative|agree" $OUT/demo.log
PYTHONPATH=$NEW timeout 100 python3 -m dspark_sidecar bench --modes c,h --reqs 1,8 --contexts 4096 --repeats 100 \
  --out-dir /tmp/b-new 2>&1 | grep -E "GPU backend|via the shim"
echo quit | nvidia-cuda-mps-control
