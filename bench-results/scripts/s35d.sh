#!/usr/bin/env bash
# Run 256: the microbench's new step_meta row (per-op times, no 5-layer step), R = 1, 8, 32.
set -uo pipefail
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1
PYTHONPATH=/tmp/new-pkg timeout 420 python3 -m dspark_sidecar.kernels.triton.microbench --rows 7 56 224 --no-step \
  --json $OUT/microbench.json > $OUT/microbench.log 2>&1; echo "microbench rc $?"
grep -E "copy bandwidth|step_meta|rms_norm|Error|error" $OUT/microbench.log | head -20
