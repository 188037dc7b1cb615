#!/usr/bin/env bash
# Run 288 (session 46): sessions 44-45's review fixes on a GPU: the gpu tests of tests/kernels/triton, tests/client,
# tests/proto (the CUDA IPC counter-file check, review 222), tests/drafter, the fast-path, pre-launch (229), data-plane
# and graph server tests and test_bench_host.py; then the demo over the doorbell twice, at --max-reqs 8 and 64, for
# the sidecar's "warm-up steps" line (every launch shape warmed at start-up, review 220) and no first-step fallback.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl 2>/dev/null
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
NEW=/tmp/new-pkg:/tmp/dspark-site
PYTHONPATH=$NEW:$PWD/tests timeout -k 10 420 python3 -m pytest -q -m gpu --timeout 200 \
  --timeout-method thread -p no:cacheprovider --basetemp=/tmp/bt tests/kernels/triton tests/client tests/proto \
  tests/drafter tests/server/test_fast_path.py tests/server/test_prelaunch.py tests/server/test_dataplane_gpu.py \
  tests/server/test_graphs_gpu.py tests/test_bench_host.py --durations=8 > $OUT/t.log 2>&1
echo "tests rc $?"; grep -E "passed|failed|FAILED|^E  |^[0-9.]+s call" $OUT/t.log | cut -c1-1500 | head -40
for m in 8 64; do
  PYTHONPATH=$NEW timeout 120 python3 -m dspark_sidecar demo --device cuda --transport doorbell --tp 1 --required-tp 1 \
    --dtype bf16 --rounds 20 --max-reqs $m > $OUT/demo$m.log 2>&1; echo "demo max-reqs $m rc $?"
  grep -E "forwarded to|relative|agree|warm-up|fell back|fallback" $OUT/demo$m.log | cut -c1-300 | head -12
done
# The real shapes (rank 0's shard of TP 4, random weights): start-up time to SERVING and the warm-up line.
for m in 8 64; do
  d=/tmp/dsp-serve$m; rm -rf $d; t0=$(date +%s.%N)
  PYTHONPATH=$NEW python3 -m dspark_sidecar serve --tp 1 --shard-of 4 --preset minimax-m3.1 --random-weights \
    --device cuda --max-reqs $m --socket-dir $d > $OUT/serve$m.log 2>&1 & sp=$!
  for i in $(seq 1 180); do
    PYTHONPATH=$NEW python3 -m dspark_sidecar.server.healthcheck --socket-dir $d --tp 1 --timeout 1 > /tmp/hc 2>&1 && break
    kill -0 $sp 2>/dev/null || break; sleep 1; done
  echo "serve max-reqs $m: $(cat /tmp/hc) after $(python3 -c "import time; print(round(time.time()-$t0, 1))") s"
  kill -TERM $sp; wait $sp; echo "serve rc $?"
  grep -E "warm-up|ERROR|Traceback" $OUT/serve$m.log | cut -c1-300 | head -6
done
echo quit | nvidia-cuda-mps-control
