#!/usr/bin/env bash
# GPU checks and the benchmark on one NVIDIA host, in a checkout without an install step:
# gpu-marked tests, then `dspark-sidecar bench` and `bench_host`, with the CUDA MPS daemon running
# (two processes sharing a GPU otherwise pay a context switch per step). Logs and bench.json go to $OUT.
set -uo pipefail
out=${OUT:-/tmp/dspark-gpu-check}
mkdir -p "$out"
if [[ -d .whl ]]; then  # packages the host lacks, carried as wheels
  # Into an empty folder: `--target` skips every package already there, so on a warm machine a newer
  # wheel than the last run's was not installed, and that run's package was imported instead.
  rm -rf /tmp/dspark-site
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/dspark-site
fi
mkdir -p /tmp/dspark-pkg && ln -sfn "$PWD" /tmp/dspark-pkg/dspark_sidecar
export PYTHONPATH=/tmp/dspark-pkg${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
mps=0
if command -v nvidia-cuda-mps-control >/dev/null; then
  if echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1; then
    # A daemon already answers on this pipe directory (one a killed run left: `-d` detaches it): every
    # CUDA process below is its client, so say so, and leave it to whoever started it. `-d` would refuse
    # to start a second one, and the logs said "MPS daemon: 0" for steps that ran under MPS.
    mps=1
  elif nvidia-cuda-mps-control -d; then
    mps=1
    # Quit the daemon this run started on any exit, a `timeout` or Ctrl-C included (bash runs the EXIT trap
    # on SIGTERM and SIGINT): the detached daemon outlived a killed run, and its MPS server with it.
    trap 'echo quit | nvidia-cuda-mps-control' EXIT
  fi
fi
echo "MPS daemon: $mps" | tee "$out/env.log"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv >>"$out/env.log" 2>&1
python3 -c 'import torch, triton, grpc; print(torch.__version__, triton.__version__, grpc.__version__)' >>"$out/env.log" 2>&1
rc=0
read -r -a pytest_args <<<"${PYTEST_ARGS:-}"
read -r -a bench_args <<<"${BENCH_ARGS:-}"
# A test that hangs on a GPU (a wait across streams or ranks that never ends) ends the run after
# TEST_TIMEOUT_S with every thread's stack in the log, instead of holding the machine
# (pytest-timeout, where it is installed; its thread method also stops waits inside CUDA or NCCL).
timeout_args=()
if python3 -c 'import pytest_timeout' 2>/dev/null; then
  timeout_args=(--timeout "${TEST_TIMEOUT_S:-300}" --timeout-method thread)
fi
python3 -m pytest -q -m gpu -p no:cacheprovider "${timeout_args[@]}" tests "${pytest_args[@]}" 2>&1 \
  | tee "$out/gpu-tests.log" || rc=1
python3 -m dspark_sidecar bench --out-dir "$out" "${bench_args[@]}" 2>&1 | grep -v ' INFO ' | tee "$out/bench.log" || rc=1
# The host cost of each CUDA call on the data plane's path, on this machine (BENCHMARKS.md).
python3 -m dspark_sidecar.bench_host 2>&1 | tee "$out/bench-host.log" || rc=1
exit $rc
