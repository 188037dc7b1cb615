"""`python -m dspark_sidecar.bench_host`: host time of each CUDA call on the data plane's path, two processes on one GPU.

The sidecar's per-step overhead is a sum of such calls (copies, event records and waits, a graph
replay, a stream lookup); this prints the median host time of each on this machine, so the
breakdown in BENCHMARKS.md can be re-derived. Run it under MPS, as the sidecar runs.
"""

from __future__ import annotations

import mmap
import statistics
import sys
import time

import numpy as np
import torch
import torch.multiprocessing as mp

from dspark_sidecar.proto.gpu_word import GpuWordOps, RegisteredPage


def timed(name: str, fn, n: int = 200) -> float:
    """Median host microseconds of fn() (the GPU drained before and after, never inside)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    xs = []
    for _ in range(n):
        a = time.perf_counter_ns()
        fn()
        xs.append(time.perf_counter_ns() - a)
    torch.cuda.synchronize()
    us = statistics.median(xs) / 1e3
    print(f"{name:44s} {us:8.1f} us", flush=True)
    return us


def _peer(handle: bytes, done) -> None:
    """The second process: what the other end of the data plane pays for the shared event."""
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    ev = torch.cuda.Event.from_ipc_handle(dev, handle)
    s = torch.cuda.current_stream()
    timed("peer: stream.wait_event(IPC event)", lambda: s.wait_event(ev))
    own = torch.cuda.Event(interprocess=True)
    timed("peer: interprocess event.record", lambda: own.record(s))
    done.put(True)


def _gpu_word_calls(dev: torch.device, s: torch.cuda.Stream) -> None:
    """The doorbell's GPU-word calls as the engine makes them per step, each with its context check."""
    ops = GpuWordOps.load(dev)
    if ops is None:
        print("GPU word unavailable: its calls are not timed", flush=True)
        return
    buf = mmap.mmap(-1, mmap.PAGESIZE)
    word = torch.frombuffer(buf, dtype=torch.int64, count=1)
    page = RegisteredPage(ops, word.data_ptr())
    try:
        ev = torch.cuda.Event()
        ev.record(s)  # torch creates the event at its first record; before that it has no handle
        n = iter(range(1, 1 << 30))
        timed("GpuWordOps._any_context (per-step check)", ops._any_context)
        timed("GpuWordOps.write (cuStreamWriteValue64)", lambda: ops.write(s.cuda_stream, page.device_ptr, next(n)))
        timed("GpuWordOps.record (cuEventRecord)", lambda: ops.record(ev, s.cuda_stream))
        torch.cuda.synchronize()
    finally:
        del word
        page.close()
        buf.close()


def main() -> int:
    if not torch.cuda.is_available():
        print("bench_host needs a CUDA/ROCm GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    s = torch.cuda.current_stream()
    a = torch.zeros(7 * 6144, dtype=torch.bfloat16, device=dev)  # one request's hidden states
    b = torch.empty_like(a)
    timed("D2D copy_ 86 KB, non_blocking", lambda: b.copy_(a, non_blocking=True))
    pinned = torch.zeros(4096, dtype=torch.uint8, pin_memory=True)
    pageable = torch.zeros(4096, dtype=torch.uint8)
    d = torch.empty(4096, dtype=torch.uint8, device=dev)
    timed("H2D copy_ 4 KB from pinned", lambda: d.copy_(pinned, non_blocking=True))
    timed("H2D copy_ 4 KB from pageable", lambda: d.copy_(pageable, non_blocking=True))
    ev = torch.cuda.Event()
    ev.record(s)
    timed("event.record", lambda: ev.record(s))
    timed("event.synchronize (already done)", ev.synchronize)
    ipc = torch.cuda.Event(interprocess=True)
    timed("interprocess event.record", lambda: ipc.record(s))
    timed("stream.wait_event(own event)", lambda: s.wait_event(ev))
    timed("torch.cuda.current_stream(dev)", lambda: torch.cuda.current_stream(dev))
    g = torch.cuda.CUDAGraph()
    x = torch.zeros(16, device=dev)
    with torch.cuda.graph(g):
        for _ in range(50):
            x.add_(1)
    timed("graph.replay (50 tiny kernels)", g.replay)
    _gpu_word_calls(dev, s)
    arr = np.arange(64)
    timed("NumPy: (arr == arr).all(), for scale", lambda: (arr == arr).all())
    ctx = mp.get_context("spawn")
    done = ctx.Queue()
    p = ctx.Process(target=_peer, args=(ipc.ipc_handle(), done))
    p.start()
    done.get(timeout=300)
    p.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
