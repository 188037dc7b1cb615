"""bench_phases.ShimPhases: the shim's host time before the ring, split at the wrapped methods."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from dspark_sidecar.bench_phases import AFTER, EXTRA, PHASES, ShimPhases


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
    polls = []

    def wait(step_id, timeout_s):
        # Two polls: the first sees nothing (the stamps it leaves must not count), the second the answer.
        polls.append(step_id)
        clock.now += 50_000
        if len(polls) % 2:
            return None
        bell.answer_seen_mono_ns = clock.now
        clock.now += 9_000  # the page read and decoded
        return "answer"

    bell.wait = wait
    transport = SimpleNamespace(bell=bell, buffers=buffers, check_answer=takes(2_000), hidden=takes(6_000))

    def run_step():
        clock.now += 5_000  # the request built
        transport.buffers.stage()
        clock.now += 13_000  # serialized
        transport.bell.send_bytes(b"", 1)
        while transport.bell.wait(1, 0.05) is None:
            pass
        clock.now += 1_000  # the transport's wait returning
        transport.check_answer()
        transport.hidden()
        clock.now += 4_000  # shape and dtype checks, the breaker

    shim = SimpleNamespace(_prepare=takes(60_000), _run_step=run_step)
    phases = ShimPhases(shim, transport)

    def maybe_forward():
        began = phases.start()
        t0 = clock.now
        clock.now += 100_000  # checks
        shim._prepare()
        clock.now += 20_000  # agreements
        shim._run_step()
        clock.now += 8_000  # the post-flight agreement, the stats
        phases.step(t0, bell.rung_mono_ns, began, bell.answer_seen_mono_ns, clock.now)

    return phases, maybe_forward


def test_each_phase_is_the_time_between_its_seams(monkeypatch):
    phases, step = _rig(monkeypatch)
    step()
    step()
    assert phases.rows[-1] == (100_000, 60_000, 20_000, 5_000, 40_000, 13_000, 7_000, 11_000, 5_000)
    # After the answer: the decode, the wait's return with the check, the clone, the step's end, the post-flight.
    assert phases.after[-1] == (9_000, 3_000, 6_000, 4_000, 8_000)
    med = phases.medians_us(10)
    assert list(med) == [*PHASES, *AFTER, *EXTRA] and med["stage"] == 40.0 and med["ring"] == 5.0
    assert med["copy"] == 6.0 and med["post"] == 8.0
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
    assert len(phases.rows) == 1 and len(phases.after) == 1


def test_a_step_without_its_answer_times_leaves_no_after_row(monkeypatch):
    """The bench passes when the data plane saw the answer and when maybe_forward returned; without them (0)
    the before-ring row still counts, and the after-answer medians are not made up from other steps' stamps."""
    phases, step = _rig(monkeypatch)
    step()
    assert not phases._t  # emptied by the step
    phases.rows.clear()
    phases.after.clear()
    phases._t.update({"prepare0": 1, "prepare1": 2, "run0": 3, "stage0": 4, "stage1": 5, "send0": 6})
    phases.step(0, 10)
    assert len(phases.rows) == 1 and phases.after == []
    assert not set(AFTER) & set(phases.medians_us(10)), phases.medians_us(10)


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
    transport = SimpleNamespace(buffers=buffers, bell=SimpleNamespace(_ops=None, send_bytes=lambda *a: None,
                                                                      wait=lambda *a: None),
                                check_answer=lambda *a: None, hidden=lambda: None)
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
        assert list(bench.phase_fields("h")["shim_phases_p50_us"])[:len(PHASES) + len(AFTER)] == [*PHASES, *AFTER]
        for obj, name in ((bench.bufs, "stage"), (bench.bell, "send_bytes"), (bench.shim, "_prepare"),
                          (bench.shim, "_run_step"), (bench.bell, "wait"), (bench.shim.doorbell, "check_answer"),
                          (bench.shim.doorbell, "hidden")):
            assert name not in vars(obj), f"{name} still wrapped after mode h"
        assert not isinstance(bench.measure("d", case), str) and bench.phases is None
    finally:
        bench.close()
