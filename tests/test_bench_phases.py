"""bench_phases.ShimPhases: the shim's host time before the ring, split at the wrapped methods."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

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


def test_the_medians_are_over_the_last_steps_only_not_the_warm_up(monkeypatch):
    """bench.py asks for the last --repeats steps: the warm-up before them (first touches, a graph's capture)
    is slower by design and must not move the figures (review 262: medians over every row passed)."""
    phases, step = _rig(monkeypatch)
    for _ in range(3):
        step()
    phases.rows[:0] = [tuple(10**9 for _ in PHASES)] * 4  # four slow warm-up steps, stamped first
    phases.extra[:0] = [(1.0, 50)] * 4
    med = phases.medians_us(3)
    assert med["stage"] == 40.0 and med["checks"] == 100.0 and med["on_cpu_share"] == 0.5, med
    assert med["preempted"] < 50, med


def test_without_a_gpu_word_the_driver_phases_are_zero_and_a_step_that_never_rang_leaves_no_row(monkeypatch):
    phases, step = _rig(monkeypatch, gpu_word=False)
    step()
    assert phases.rows == [(100_000, 60_000, 20_000, 5_000, 40_000, 13_000, 0, 0, 5_000)]
    phases.step(0, 0)  # a fallback: nothing was stamped since
    assert len(phases.rows) == 1


def test_close_unwraps_every_method_and_later_steps_add_no_row(monkeypatch):
    phases, step = _rig(monkeypatch)
    step()
    wrapped = phases.rows[:]
    phases.close()
    step()  # as d, f and g after h: the data plane's own methods, no stamps
    assert phases.rows == wrapped and phases.medians_us(10)["stage"] == 40.0

    class Buffers:  # a method the class has, no instance attribute: unwrapped, the class's is found again
        def stage(self):
            return "class"

    buffers = Buffers()
    transport = SimpleNamespace(buffers=buffers, bell=SimpleNamespace(_ops=None, send_bytes=lambda *a: None))
    ShimPhases(SimpleNamespace(_prepare=lambda: None, _run_step=lambda: None), transport).close()
    assert "stage" not in vars(buffers) and buffers.stage() == "class"


def test_only_mode_h_runs_wrapped(tmp_path):
    """--shim-phases wraps the data plane's stage and send_bytes, which modes d, f and g call too: made once
    at connect, the wrappers (and the send's getrusage) stayed on for every mode after it, though the flag
    adds them to mode h. A real sidecar on CPU: h's row has its phases, and d after it runs unwrapped."""
    from dspark_sidecar.bench import Bench, BenchConfig, Case

    bench = Bench(BenchConfig(preset="tiny", reqs=(1,), contexts=(40,), modes=("d", "h"), repeats=3,
                              shim_phases=True, out_dir=tmp_path), torch.device("cpu"))
    try:
        assert bench.no_sidecar is None, bench.no_sidecar
        case = Case(bench.cfg, 1, 40, 16, bench.pages, bench.embed, bench.device, seed=0)
        assert not isinstance(bench.measure("h", case), str)
        assert list(bench.phase_fields("h")["shim_phases_p50_us"])[:len(PHASES)] == list(PHASES)
        for obj, name in ((bench.bufs, "stage"), (bench.bell, "send_bytes"), (bench.shim, "_prepare"),
                          (bench.shim, "_run_step")):
            assert name not in vars(obj), f"{name} still wrapped after mode h"
        assert not isinstance(bench.measure("d", case), str) and bench.phases is None
    finally:
        bench.close()
