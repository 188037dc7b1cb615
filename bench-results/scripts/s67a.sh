#!/usr/bin/env bash
# Session 67, run 325: run 323 found every shim phase ~1.6x run 317's on another H100 host with the GPU time equal.
# Is that the host or the code? Run 317's tree (4ccac46, unpacked in .base317 and carried) and this tree's bench
# alternate on one warm machine: base, new, base, new, the same flags as run 317's line.
# shellcheck source=bench-results/scripts/device-env.sh
source "$(dirname "$0")/device-env.sh"
mkdir -p /tmp/base-pkg && ln -sfn "$PWD/.base317" /tmp/base-pkg/dspark_sidecar
flags=(bench --modes "c,h" --reqs "1,8" --contexts 4096 --repeats 100 --shim-phases)
for round in 1 2; do
  for tree in base new; do
    if [ "$tree" = base ]; then pp=/tmp/base-pkg:/tmp/dspark-site; else pp=/tmp/new-pkg:/tmp/dspark-site; fi
    t0=$(date +%s)
    PYTHONPATH=$pp timeout "${BENCH_S:-120}" python3 -m dspark_sidecar "${flags[@]}" --out-dir "$OUT/$tree$round" \
      > "$OUT/bench-$tree$round.log" 2>&1
    echo "== $tree round $round rc $? in $(( $(date +%s) - t0 )) s"
    grep -E "sidecar via the shim|shim phases|after the answer|GPU backend graphed" "$OUT/bench-$tree$round.log" | cut -c1-200
  done
done
