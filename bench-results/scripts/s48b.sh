#!/usr/bin/env bash
# Run 289 (session 48): the real shapes (rank 0's shard of TP 4, random weights) from start to SERVING, its warm-up
# line, a GetStatus (instance, state) and a clean SIGTERM; s45a's last part, left out of run 288 for device time.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl 2>/dev/null
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
NEW=/tmp/new-pkg:/tmp/dspark-site
d=/tmp/dsp-serve8; rm -rf $d; t0=$(date +%s.%N)
PYTHONPATH=$NEW python3 -m dspark_sidecar serve --tp 1 --shard-of 4 --preset minimax-m3.1 --random-weights \
  --device cuda --max-reqs 8 --socket-dir $d > $OUT/serve8.log 2>&1 & sp=$!
for i in $(seq 1 150); do
  PYTHONPATH=$NEW python3 -m dspark_sidecar.server.healthcheck --socket-dir $d --tp 1 --timeout 1 > /tmp/hc 2>&1 && break
  kill -0 $sp 2>/dev/null || break; sleep 1; done
echo "serve: $(cat /tmp/hc) after $(python3 -c "import time; print(round(time.time()-$t0, 1))") s"
PYTHONPATH=$NEW python3 -m dspark_sidecar status --socket-dir $d --tp 1 2>&1 | grep -E "state|instance|backend" | head -5
kill -TERM $sp; wait $sp; echo "serve rc $?"
grep -E "warm-up|ERROR|Traceback|stopped" $OUT/serve8.log | cut -c1-300 | head -8
