#!/usr/bin/env bash
# Runs 296-297 (session 50): the driver's copy of the answer's rows (and of the engine's input rows) on a GPU:
# the gpu tests that cross it, then OLD (.notes/old50.tar: git archive of the commit before it) against NEW,
# alternated in fresh processes, bench --modes c,h at R 1 and 8, context 4096, 100 repeats, shim phases, with
# the engine's rows copied into the input region each step (--engine-copy, as an engine's embedding does).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl 2>/dev/null
mkdir -p /tmp/new-pkg /tmp/old-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
rm -rf /tmp/oldtree && mkdir -p /tmp/oldtree && tar -xf .notes/old50.tar -C /tmp/oldtree && ln -sfn /tmp/oldtree/old /tmp/old-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
NEW=/tmp/new-pkg:/tmp/dspark-site
OLD=/tmp/old-pkg:/tmp/dspark-site
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
PYTHONPATH=$NEW:$PWD/tests timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_bench.py \
  tests/server/test_dataplane_gpu.py -k "shim_s_step or equals_grpc or back_to_back or prelaunched_steps_equal" \
  > $OUT/gputests.log 2>&1; echo "gpu tests rc $? in $(( $(date +%s) - t0 )) s"
tail -4 $OUT/gputests.log
for way in OLD NEW OLD NEW; do
  pp=$NEW; [ $way = OLD ] && pp=$OLD
  PYTHONPATH=$pp timeout 120 python3 -m dspark_sidecar bench --modes c,h --reqs 1,8 --contexts 4096 --repeats 100 \
    --shim-phases --engine-copy --out-dir /tmp/b296-$way > $OUT/bench-$way.log 2>&1; echo "== $way rc $?"
  grep -v ' INFO ' $OUT/bench-$way.log | grep -E "via the shim|shim phases|after the answer" | cut -c1-240 | head -8
done
echo quit | nvidia-cuda-mps-control
