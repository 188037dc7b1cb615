"""Probe (session 51): does an engine's exported GPU memory stay allocated after the engine dies, while the
sidecar still holds its mapping? (A KV cache the sidecar keeps mapped would keep a restarted engine's start-up
memory check from passing.) Run on a GPU host: `python3 bench-results/scripts/ipc_orphan.py [GiB] [exit|kill]`.

The exporter (a child process) allocates GiB of device memory as the engine's KV cache, exports it with
proto.memory.export_handle, and then exits cleanly or is SIGKILLed; the importer (this process) maps it with
MappedMemory as BindKV does and reads the device's free memory (cudaMemGetInfo) before, after the death, after
closing its mapping.
"""

import os
import signal
import subprocess
import sys
import tempfile
import time

import torch

from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.proto.memory import MappedMemory, export_handle

GIB = 1 << 30


def exporter(gib: int, path: str) -> None:
    t = torch.ones(gib * GIB, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    with open(path + ".tmp", "wb") as f:
        f.write(export_handle(t).SerializeToString())
    os.rename(path + ".tmp", path)
    while not os.path.exists(path + ".exit"):
        time.sleep(0.01)
    os._exit(0)


def free_gib() -> float:
    return torch.cuda.mem_get_info()[0] / GIB


def main() -> None:
    gib = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    how = sys.argv[2] if len(sys.argv) > 2 else "exit"
    torch.cuda.init()
    base = free_gib()
    path = os.path.join(tempfile.mkdtemp(), "handle")
    child = subprocess.Popen([sys.executable, __file__, "--export", str(gib), path])
    while not os.path.exists(path):
        time.sleep(0.01)
    handle = pb.MemoryHandle.FromString(open(path, "rb").read())
    mapped = MappedMemory(handle, "kv", torch.device("cuda", 0))
    view = mapped.view(torch.uint8, (gib * GIB,), (1,), 0, "kv")
    print(f"[{how}] free before the engine's death: {free_gib():.2f} GiB (baseline {base:.2f}, "
          f"engine holds {gib} GiB); mapped sum of 1 MiB = {int(view[:1 << 20].sum())}")
    if how == "kill":
        child.send_signal(signal.SIGKILL)
    else:
        open(path + ".exit", "w").close()
    child.wait()
    for _ in range(30):  # give the driver time to reclaim
        time.sleep(0.1)
    print(f"[{how}] engine exited rc={child.returncode}; free while the sidecar still maps it: "
          f"{free_gib():.2f} GiB; mapped sum of 1 MiB still reads {int(view[:1 << 20].sum())}")
    del view
    mapped.close()
    del mapped
    torch.cuda.synchronize()
    time.sleep(1)
    print(f"[{how}] free after the sidecar closed its mapping: {free_gib():.2f} GiB")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--export"]:
        exporter(int(sys.argv[2]), sys.argv[3])
    else:
        main()
