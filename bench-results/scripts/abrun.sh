#!/bin/bash
# abrun.sh BASE_REV N TAG: A = BASE_REV exported, B = the working tree; N processes of shimh.py --ab (paired blocks).
set -e
cd /work/wt-a
A=/tmp/ab/rev-$1; if [ ! -d $A ]; then mkdir -p $A/dspark_sidecar; git archive $1 | tar -x -C $A/dspark_sidecar; fi
B=/tmp/ab/wt; rm -rf $B; mkdir -p $B/dspark_sidecar; git ls-files | grep -v '^tests/' | tar -cf - -T - | tar -xf - -C $B/dspark_sidecar
for i in $(seq 1 $2); do
  PYTHONPATH=$A timeout 600 python3 .notes/shimh.py --fake --ab $B --tag $3 2>&1 | grep "^JSON"
done > /tmp/ab/$3.jsonl
python3 - /tmp/ab/$3.jsonl <<'PY'
import json, sys, statistics as st
rows = [json.loads(l[5:]) for l in open(sys.argv[1])]
for R in ("1", "8"):
    for k in ("before", "after", "total"):
        d = [r["ab"][R]["paired"][k][0] for r in rows]
        a = [r["ab"][R]["A"][k][0] for r in rows]
        print(f"R={R} {k:6s} A median {st.median(a):6.1f} us; paired B-A per run: " + " ".join(f"{x:+.1f}" for x in d)
              + f"  -> median {st.median(d):+.2f} (range {min(d):+.1f}..{max(d):+.1f})")
PY
