#!/usr/bin/env bash
# Session 58, run 313: when the CUDA driver leaves /dev/shm/cuda.shm.<uid>.<pid hex>.<n> behind (run 312: one per
# sidecar rank and engine rank of every demo, 80 KiB each). One process per case, with and without MPS.
set -uo pipefail
case_py() {
python3 - "$1" <<'PY'
import os, sys, torch
how = sys.argv[1]
torch.zeros(1, device="cuda")  # a context
ev = None
if "event" in how:
    ev = torch.cuda.Event(interprocess=True); ev.record(); h = ev.ipc_handle()
if "mem" in how:
    t = torch.zeros(1 << 20, device="cuda"); t.untyped_storage()._share_cuda_()
if "del" in how:
    ev = None; torch.cuda.synchronize()
if "exit" in how:
    sys.stdout.flush(); os._exit(0)
PY
}
run_all() {
  for how in plain event event-del event-exit mem mem-exit event-del-mem; do
    before=$(ls /dev/shm | wc -l); case_py $how; after=$(ls /dev/shm | wc -l)
    echo "$1 $how: /dev/shm $before -> $after"
  done
}
run_all "no MPS"
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe11 CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log11
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
trap 'echo quit | nvidia-cuda-mps-control' EXIT
run_all "MPS"
ls -la /dev/shm | tail -4
