#!/usr/bin/env bash
# Session 67, run 326: this session's reviews on a GPU. The Triton kernels' parity tests (reviews 398-399 read the
# reference twins and the attention, norm and RoPE kernels), the GPU word's tests (review 396: its library lookup),
# the doorbell's gpu tests (the error answer's text, internal_message), then the demo over the doorbell.
# KERNELS_S, OTHER_S, DEMO_S bound the three parts (300, 150, 90 s).
# shellcheck source=bench-results/scripts/device-env.sh
source "$(dirname "$0")/device-env.sh"
t0=$(date +%s)
timeout "${KERNELS_S:-300}" python3 -m pytest -q -p no:cacheprovider -m gpu --timeout 200 --timeout-method thread \
  tests/kernels/triton > "$OUT"/triton-gpu-tests.log 2>&1
echo "triton gpu tests rc $? in $(( $(date +%s) - t0 )) s"; grep -E "FAILED|ERROR|passed|failed" "$OUT"/triton-gpu-tests.log | tail -8
t0=$(date +%s)
timeout "${OTHER_S:-150}" python3 -m pytest -v -p no:cacheprovider -m gpu --timeout 120 --timeout-method thread \
  tests/proto tests/server/test_dataplane_gpu.py > "$OUT"/gpu-tests.log 2>&1
echo "proto + dataplane gpu tests rc $? in $(( $(date +%s) - t0 )) s"; grep -E "FAILED|ERROR|passed|failed" "$OUT"/gpu-tests.log | tail -8
t0=$(date +%s)
timeout "${DEMO_S:-90}" python3 -m dspark_sidecar demo --device cuda --tp 1 --required-tp 1 --transport doorbell --dtype bf16 \
  --rounds 40 > "$OUT"/demo.log 2>&1
echo "demo rc $? in $(( $(date +%s) - t0 )) s"; tail -8 "$OUT"/demo.log | cut -c1-220
