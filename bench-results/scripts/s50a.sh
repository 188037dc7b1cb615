#!/usr/bin/env bash
# Run 291 (session 50): the tree of session 49's last commits on a GPU: the gpu tests of tests/server and
# tests/client (the start-up's shared host facts, 6ddaa54; the teardown, 7ec74bb), s48b.sh (the real shapes from
# start to SERVING through the new all-gather, a clean SIGTERM), then issue 8's line again (bench c,h at R 1 and 8,
# context 4096, 100 repeats, shim phases), all under one MPS daemon.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl 2>/dev/null
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
NEW=/tmp/new-pkg:/tmp/dspark-site
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
t0=$(date +%s)
PYTHONPATH=$NEW:$PWD/tests timeout 330 python3 -m pytest -q -p no:cacheprovider -m gpu tests/server tests/client \
  > $OUT/gputests.log 2>&1; echo "gpu tests rc $? in $(( $(date +%s) - t0 )) s"
tail -5 $OUT/gputests.log
timeout 120 bash bench-results/scripts/s48b.sh; echo "s48b rc $?"
PYTHONPATH=$NEW timeout 150 python3 -m dspark_sidecar bench --modes c,h --reqs 1,8 --contexts 4096 --repeats 100 \
  --shim-phases --out-dir /tmp/b291 > $OUT/bench.log 2>&1; echo "bench rc $?"
grep -v ' INFO ' $OUT/bench.log | grep -E "floor|GPU backend|via the shim|shim phases|^\|" | cut -c1-220 | head -40
cp -r /tmp/b291 $OUT/ 2>/dev/null
echo quit | nvidia-cuda-mps-control
