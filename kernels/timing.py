"""GPU time of a call, as the benchmarks measure it (bench's modes b and c, the kernels' microbench)."""

from __future__ import annotations

import torch


def gpu_times(fn, device: torch.device, repeats: int) -> list[float]:
    """ms of GPU time per call: CUDA events around it, queued behind a short spin of the stream so that
    the host's launch latency falls inside the spin, not between the events (the floor is GPU time too)."""
    out = []
    with torch.cuda.device(device):
        for _ in range(repeats):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(100_000)  # ~50 us at 2 GHz: longer than a graph launch from the host
            s.record()
            fn()
            e.record()
            e.synchronize()
            out.append(s.elapsed_time(e))
    return out
