"""kernels/timing.gpu_times, the GPU time the bench's figures and its floor's bandwidth are read in: CUDA faked."""

from __future__ import annotations

import contextlib

import torch

from dspark_sidecar.kernels.timing import gpu_times


def test_each_call_is_timed_between_two_events_queued_behind_the_spin(monkeypatch):
    """The spin goes on the stream before the start event, so that the host's launch of the call falls inside the
    spin, not between the events (the floor's copy and b/c's replays: GPU time, no launch latency); the end event
    is waited on, and each call gives its own figure."""
    calls = []

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing
            self.at = None

        def record(self) -> None:
            calls.append(("record", self))
            self.at = len(calls)

        def synchronize(self) -> None:
            calls.append(("synchronize", self))

        def elapsed_time(self, end: Event) -> float:
            return float(end.at - self.at)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: calls.append(("spin", cycles)))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    out = gpu_times(lambda: calls.append(("call", None)), torch.device("cuda", 0), 2, spin_cycles=7)
    assert [c[0] for c in calls] == ["spin", "record", "call", "record", "synchronize"] * 2
    assert calls[0] == ("spin", 7) and calls[4][1] is calls[3][1] and calls[3][1] is not calls[1][1]
    assert out == [2.0, 2.0]  # from the start event to the end one: the call alone
