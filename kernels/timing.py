"""GPU time of a call, as the benchmarks measure it (bench's modes b and c, the kernels' microbench)."""

from __future__ import annotations

import torch


def gpu_times(fn, device: torch.device, repeats: int, spin_cycles: int = 100_000) -> list[float]:
    """ms of GPU time per call: CUDA events around it, queued behind a short spin of the stream so that
    the host's launch latency falls inside the spin, not between the events (the floor is GPU time too).
    spin_cycles: the spin's length (the default, ~50 us at 2 GHz, is longer than a graph launch from
    the host; bench mode g spins for the engine's lead)."""
    out = []
    with torch.cuda.device(device):
        for _ in range(repeats):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(spin_cycles)
            s.record()
            fn()
            e.record()
            e.synchronize()
            out.append(s.elapsed_time(e))
    return out
