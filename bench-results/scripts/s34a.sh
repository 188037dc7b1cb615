#!/usr/bin/env bash
# Run 250: the gRPC-region answer test, then run 249's remainder (proto, bench gpu tests).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl || exit 1
mkdir -p /tmp/dspark-pkg && ln -sfn "$PWD" /tmp/dspark-pkg/dspark_sidecar
export PYTHONPATH=/tmp/dspark-pkg:/tmp/dspark-site PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
git log --oneline -1 | tee $OUT/head.log
nvidia-smi --query-gpu=name,clocks.sm --format=csv | tee -a $OUT/head.log
T=(--timeout 200 --timeout-method thread -p no:cacheprovider)
timeout -k 10 150 python3 -m pytest -q -m gpu "${T[@]}" tests/server/test_dataplane_gpu.py -k grpc_answer_naming 2>&1 | tee $OUT/t1.log
timeout -k 10 380 python3 -m pytest -q -m gpu "${T[@]}" tests/proto tests/test_bench.py tests/test_bench_tp.py tests/test_bench_host.py 2>&1 | tee $OUT/t2.log
echo quit | nvidia-cuda-mps-control
