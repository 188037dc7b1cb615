#!/usr/bin/env bash
# Session 66, run 323: sessions 64-65's GPU-side changes in one call (s64a never ran): the CUDA handle's
# offset-past-the-allocation refusal (tests/proto), the doorbell step's deadline counted from its ring and its error
# answer clipped (the data-plane gpu tests), the engine lease's fork lock and the empty release that no longer
# quiesces the rank (tests/client, the lease tests), the serving ranks' SignalStop through the demo; then issue 8's
# (c)/(h) line on this card. TESTS_S, DEMO_S, BENCH_S bound the three parts (300, 100, 150 s).
# shellcheck source=bench-results/scripts/device-env.sh
source "$(dirname "$0")/device-env.sh"
t0=$(date +%s)
timeout "${TESTS_S:-300}" python3 -m pytest -v -p no:cacheprovider -m gpu --timeout 120 --timeout-method thread \
  tests/proto tests/server/test_dataplane_gpu.py tests/server/test_engine_lease.py tests/server/test_lease.py \
  tests/server/test_rank_quiesce.py tests/client > "$OUT"/gpu-tests.log 2>&1
echo "gpu tests rc $? in $(( $(date +%s) - t0 )) s"; grep -E "FAILED|ERROR|passed|failed" "$OUT"/gpu-tests.log | tail -12
t0=$(date +%s)
timeout "${DEMO_S:-100}" python3 -m dspark_sidecar demo --device cuda --tp 1 --required-tp 1 --transport doorbell --dtype bf16 \
  --rounds 40 > "$OUT"/demo.log 2>&1
echo "demo rc $? in $(( $(date +%s) - t0 )) s"; tail -8 "$OUT"/demo.log | cut -c1-220
t0=$(date +%s)
timeout "${BENCH_S:-150}" python3 -m dspark_sidecar bench --modes c,h --reqs 1,8 --contexts 4096 --repeats 100 --shim-phases \
  --out-dir "$OUT"/ch > "$OUT"/bench-ch.log 2>&1
echo "bench c,h rc $? in $(( $(date +%s) - t0 )) s"; grep -v " INFO " "$OUT"/bench-ch.log | tail -24 | cut -c1-240
