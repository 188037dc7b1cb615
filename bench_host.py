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


PEER_TIMEOUT_S = 300  # the peer's two timed calls take well under a second; its start (a CUDA context) seconds


def _peer(handle: bytes) -> None:
    """The second process: what the other end of the data plane pays for the shared event."""
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    ev = torch.cuda.Event.from_ipc_handle(dev, handle)
    s = torch.cuda.current_stream()
    timed("peer: stream.wait_event(IPC event)", lambda: s.wait_event(ev))
    own = torch.cuda.Event(interprocess=True)
    timed("peer: interprocess event.record", lambda: own.record(s))


def _joined(p, timeout_s: float) -> int:
    """0 once the peer process exited cleanly within timeout_s, else 1 with why on stderr (a peer that
    raised printed its traceback there). Waiting on its exit, not on a queue it fills at the end: a peer
    that died (no IPC events on this driver, MPS not reachable) left the queue empty, and the bench waited
    out the whole timeout and then ended in a bare `_queue.Empty` traceback, its status ignored."""
    p.join(timeout_s)
    if p.exitcode is None:
        p.terminate()
        p.join()
        print(f"bench_host: the peer process did not finish within {timeout_s:.0f} s", file=sys.stderr)
        return 1
    if p.exitcode != 0:
        print(f"bench_host: the peer process failed (exit status {p.exitcode}); its lines are missing",
              file=sys.stderr)
        return 1
    return 0


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
    p = mp.get_context("spawn").Process(target=_peer, args=(ipc.ipc_handle(),))
    p.start()
    return _joined(p, PEER_TIMEOUT_S)


if __name__ == "__main__":
    sys.exit(main())
