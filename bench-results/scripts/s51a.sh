#!/usr/bin/env bash
# Run 299 (session 51): does a dead engine's exported KV cache stay allocated while the sidecar maps it
# (ipc_orphan.py, without and under MPS); the gpu tests of tests/client, tests/proto and tests/test_bench.py on the
# session's code; issue 8's line (bench c,h at R 1 and 8, context 4096, 100 repeats, shim phases) under MPS.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl 2>/dev/null
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1
NEW=/tmp/new-pkg:/tmp/dspark-site
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for how in exit kill; do PYTHONPATH=$NEW timeout 40 python3 bench-results/scripts/ipc_orphan.py 16 $how; echo "orphan $how rc $?"; done
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
PYTHONPATH=$NEW timeout 40 python3 bench-results/scripts/ipc_orphan.py 16 kill; echo "orphan kill (MPS) rc $?"
t0=$(date +%s)
PYTHONPATH=$NEW:$PWD/tests timeout 290 python3 -m pytest -q -p no:cacheprovider -m gpu tests/client tests/proto \
  tests/test_bench.py > $OUT/gputests.log 2>&1; echo "gpu tests rc $? in $(( $(date +%s) - t0 )) s"
grep -E "passed|failed|FAILED|ERROR" $OUT/gputests.log | tail -12
PYTHONPATH=$NEW timeout 140 python3 -m dspark_sidecar bench --modes c,h --reqs 1,8 --contexts 4096 --repeats 100 \
  --shim-phases --out-dir /tmp/b299 > $OUT/bench.log 2>&1; echo "bench rc $?"
grep -v ' INFO ' $OUT/bench.log | grep -E "floor|GPU backend|via the shim|shim phases|^\|" | cut -c1-220 | head -40
cp -r /tmp/b299 $OUT/ 2>/dev/null
echo quit | nvidia-cuda-mps-control
