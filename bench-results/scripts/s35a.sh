#!/usr/bin/env bash
# Run 253: the private copy on GPU ranks: every gpu test of tests/server and tests/client (the new
# metadata-flip test among them), the demo over the doorbell (pre-launched steps on the region).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl || exit 1
mkdir -p /tmp/new-pkg
ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
nproc; nvidia-smi --query-gpu=name,clocks.sm --format=csv
NEW=/tmp/new-pkg:/tmp/dspark-site
PYTHONPATH=$NEW timeout -k 10 120 python3 -m pytest -q -m gpu --timeout 100 --timeout-method thread -p no:cacheprovider \
  tests/server/test_dataplane_gpu.py -k rewritten_while_steps_run > $OUT/t-flip.log 2>&1; echo "flip test rc $?"; tail -4 $OUT/t-flip.log
# The same test on the tree before the fix (08d8237), the new test file copied in: it should fail there.
mkdir -p /tmp/old-pkg /tmp/old && tar -xf .notes/old35.tar -C /tmp/old && ln -sfn /tmp/old /tmp/old-pkg/dspark_sidecar
cp tests/server/test_dataplane_gpu.py /tmp/old/tests/server/
(cd /tmp/old && PYTHONPATH=/tmp/old-pkg:/tmp/dspark-site timeout -k 10 120 python3 -m pytest -q -m gpu --timeout 100 \
  --timeout-method thread -p no:cacheprovider tests/server/test_dataplane_gpu.py -k rewritten_while_steps_run \
  > $OUT/t-flip-old.log 2>&1; echo "flip test on OLD rc $?"; grep -E "^E .*(Error|assert|code|exited)" $OUT/t-flip-old.log | head -5; tail -2 $OUT/t-flip-old.log)
PYTHONPATH=$NEW timeout 150 python3 -m dspark_sidecar demo --device cuda --transport doorbell --tp 1 --required-tp 1 \
  --dtype bf16 --rounds 20 > $OUT/demo.log 2>&1; echo "demo rc $?"; tail -12 $OUT/demo.log
PYTHONPATH=$NEW timeout -k 10 360 python3 -m pytest -q -m gpu --timeout 200 --timeout-method thread -p no:cacheprovider \
  tests/server tests/client --deselect "tests/server/test_dataplane_gpu.py::test_gpu_metadata_rewritten_while_steps_run_never_reaches_the_kernels" \
  > $OUT/t.log 2>&1; echo "tests rc $?"; tail -8 $OUT/t.log
echo quit | nvidia-cuda-mps-control
