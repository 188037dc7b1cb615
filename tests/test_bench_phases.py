"""bench_phases.ShimPhases: the shim's host time before the ring, split at the wrapped methods."""

from __future__ import annotations

import time
from types import SimpleNamespace

from dspark_sidecar.bench_phases import EXTRA, PHASES, ShimPhases


class _Clock:
    """time.monotonic_ns that advances only when a stand-in says how long it took."""

    def __init__(self) -> None:
        self.now = 1_000

    def __call__(self) -> int:
        return self.now


def _rig(monkeypatch, gpu_word: bool = True):
    clock = _Clock()
    monkeypatch.setattr(time, "monotonic_ns", clock)
    # The thread's CPU time: half the wall clock's pace (descheduled half the time).
    monkeypatch.setattr(time, "thread_time_ns", lambda: 1_000 + (clock.now - 1_000) // 2)

    def takes(ns):
        def fn(*args, **kwargs):
            clock.now += ns
            return ns
        return fn

    ops = SimpleNamespace(write=takes(7_000), record=takes(11_000)) if gpu_word else None
    bell = SimpleNamespace(_ops=ops, rung_mono_ns=0)
    buffers = SimpleNamespace(stage=takes(40_000))

    def send_bytes(data, key):
        clock.now += 2_000
        if ops is not None:
            ops.write(0, 0, 0)
            ops.record(None, 0)
        clock.now += 3_000
        bell.rung_mono_ns = clock.now

    bell.send_bytes = send_bytes
    transport = SimpleNamespace(bell=bell, buffers=buffers)

    def run_step():
        clock.now += 5_000  # the request built
        transport.buffers.stage()
        clock.now += 13_000  # serialized
        transport.bell.send_bytes(b"", 1)

    shim = SimpleNamespace(_prepare=takes(60_000), _run_step=run_step)
    phases = ShimPhases(shim, transport)

    def maybe_forward():
        began = phases.start()
        t0 = clock.now
        clock.now += 100_000  # checks
        shim._prepare()
        clock.now += 20_000  # agreements
        shim._run_step()
        phases.step(t0, bell.rung_mono_ns, began)

    return phases, maybe_forward


def test_each_phase_is_the_time_between_its_seams(monkeypatch):
    phases, step = _rig(monkeypatch)
    step()
    step()
    assert phases.rows[-1] == (100_000, 60_000, 20_000, 5_000, 40_000, 13_000, 7_000, 11_000, 5_000)
    med = phases.medians_us(10)
    assert list(med) == [*PHASES, *EXTRA] and med["stage"] == 40.0 and med["ring"] == 5.0
    assert med["on_cpu_share"] == 0.5 and med["preempted"] >= 0


def test_without_a_gpu_word_the_driver_phases_are_zero_and_a_step_that_never_rang_leaves_no_row(monkeypatch):
    phases, step = _rig(monkeypatch, gpu_word=False)
    step()
    assert phases.rows == [(100_000, 60_000, 20_000, 5_000, 40_000, 13_000, 0, 0, 5_000)]
    phases.step(0, 0)  # a fallback: nothing was stamped since
    assert len(phases.rows) == 1
