#!/usr/bin/env bash
# Session 58, run 312: which processes leave /dev/shm/cuda.shm.* files behind in the demo on a GPU (run 311: 4 more
# after a normal demo and a SIGTERMed one). The CUDA driver names them cuda.shm.<uid>.<pid in hex>.<n>.
set -uo pipefail
rm -rf /tmp/dspark-site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl 2>/dev/null
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/new-pkg:/tmp/dspark-site:$PWD/tests
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe10 CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log10
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
trap 'echo quit | nvidia-cuda-mps-control' EXIT
pids() { ps -eo pid,ppid,args | grep -E "dspark_sidecar|multiprocessing|nvidia-cuda-mps" | grep -v grep |
         awk '{printf "%s(%x) %s %s %s %s\n", $1, $1, $2, $4, $5, $6}'; }
ls -la /dev/shm; ls /dev/shm > /tmp/shm0
for mode in normal term; do
  python3 -m dspark_sidecar demo --device cuda --tp 1 --required-tp 1 --transport doorbell --dtype bf16 \
    --rounds $([ $mode = normal ] && echo 60 || echo 100000) > $OUT/demo-$mode.log 2>&1 & dp=$!
  sleep 20; echo "== $mode: processes"; pids
  if [ $mode = term ]; then kill -TERM $dp; fi
  wait $dp; echo "$mode rc $?"; sleep 3
  echo "== $mode: new in /dev/shm"; ls /dev/shm > /tmp/shm1; comm -13 /tmp/shm0 /tmp/shm1 | while read -r f; do
    ls -la "/dev/shm/$f"; done; cp /tmp/shm1 /tmp/shm0
done
echo "== MPS server's log tail"; tail -5 $CUDA_MPS_LOG_DIRECTORY/server.log 2>/dev/null
