#!/usr/bin/env bash
# Session 64, run 323: this session's GPU-side changes: the CUDA handle's offset-past-the-allocation refusal (proto
# gpu tests), the doorbell step's deadline counted from its ring (review 373: RankLoop.answer_now's seen_ns) and its
# error answer clipped, through the data-plane gpu test and the demo over the doorbell. No bench.
# shellcheck source=bench-results/scripts/device-env.sh
source "$(dirname "$0")/device-env.sh"
t0=$(date +%s)
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu --timeout 80 --timeout-method thread \
  tests/proto tests/server/test_dataplane_gpu.py > "$OUT"/gpu-tests.log 2>&1
echo "gpu tests rc $? in $(( $(date +%s) - t0 )) s"; grep -E "FAILED|ERROR|passed|failed" "$OUT"/gpu-tests.log | tail -8
t0=$(date +%s)
timeout 80 python3 -m dspark_sidecar demo --device cuda --tp 1 --required-tp 1 --transport doorbell --dtype bf16 \
  --rounds 30 > "$OUT/demo-bf16.log" 2>&1
echo "demo rc $? in $(( $(date +%s) - t0 )) s"; tail -6 "$OUT/demo-bf16.log" | cut -c1-220
