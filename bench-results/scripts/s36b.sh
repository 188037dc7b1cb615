#!/usr/bin/env bash
# Run 259: does CPU placement explain the engine shim's host-time spread between processes (issue 8 (h))?
# bench c,h at R=1,8, ctx 4096, alternated: unpinned, and the whole bench (engine + sidecar) pinned to four
# CPUs of four distinct physical cores (no hyper-thread siblings shared), three fresh processes each.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl || exit 1
mkdir -p /tmp/new-pkg && ln -sfn "$PWD" /tmp/new-pkg/dspark_sidecar
export PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/dspark-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dspark-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up"
lscpu | grep -E "Model name|Thread\(s\) per core|NUMA node" ; lscpu -e=CPU,CORE,SOCKET,NODE | head -20 > $OUT/topology.txt
CPUS=$(python3 - <<'PY'
import glob, os
seen, pick = set(), []
for d in sorted(glob.glob("/sys/devices/system/cpu/cpu[0-9]*"), key=lambda p: int(p.rsplit("cpu", 1)[1])):
    cpu = int(d.rsplit("cpu", 1)[1])
    if cpu not in os.sched_getaffinity(0):
        continue
    sib = open(f"{d}/topology/thread_siblings_list").read().strip()
    if sib not in seen:
        seen.add(sib); pick.append(cpu)
print(",".join(map(str, pick[2:6])))
PY
)
echo "pinned set: $CPUS"
for i in 1 2 3; do for v in free pin; do
  pre=""; [ $v = pin ] && pre="taskset -c $CPUS"
  PYTHONPATH=/tmp/new-pkg:/tmp/dspark-site timeout 90 $pre python3 -m dspark_sidecar bench --modes c,h --reqs 1,8 \
    --contexts 4096 --repeats 100 --out-dir /tmp/b-$v$i 2>&1 | grep -v ' INFO ' > $OUT/bench-$v$i.log
  echo "== $v$i"; grep -E "GPU backend|via the shim" $OUT/bench-$v$i.log
done; done
tar -cf $OUT/bench-json.tar /tmp/b-* 2>/dev/null
echo quit | nvidia-cuda-mps-control
