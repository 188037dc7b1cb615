#!/usr/bin/env bash
# Session 68, run 327: what runs 323-326 left unrun on a GPU. Review 399's gpu variants of the Triton attention, RoPE
# and prelude parity tests (written after run 326's tree), then the proto and data plane gpu tests with the time they
# need (run 326's 140 s bound stopped them at 8 passed; run 323 passed them all in a longer run).
# TRITON_S and OTHER_S bound the two parts (200, 320 s).
# shellcheck source=bench-results/scripts/device-env.sh
source "$(dirname "$0")/device-env.sh"
t0=$(date +%s)
timeout "${TRITON_S:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu --timeout 150 --timeout-method thread \
  tests/kernels/triton/test_attention.py tests/kernels/triton/test_rope.py tests/kernels/triton/test_prelude.py \
  > "$OUT"/triton-gpu-tests.log 2>&1
echo "triton gpu tests rc $? in $(( $(date +%s) - t0 )) s"; grep -E "FAILED|ERROR|passed|failed" "$OUT"/triton-gpu-tests.log | tail -8
t0=$(date +%s)
timeout "${OTHER_S:-320}" python3 -m pytest -v -p no:cacheprovider -m gpu --timeout 200 --timeout-method thread \
  --durations=0 tests/proto tests/server/test_dataplane_gpu.py > "$OUT"/gpu-tests.log 2>&1
echo "proto + dataplane gpu tests rc $? in $(( $(date +%s) - t0 )) s"; grep -E "FAILED|ERROR|passed|failed" "$OUT"/gpu-tests.log | tail -8
