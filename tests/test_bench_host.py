"""`python -m dspark_sidecar.bench_host`: prints each call's host time on a GPU, refuses clearly without one."""

from __future__ import annotations

import ast
import multiprocessing
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dspark_sidecar import bench_host

# Lines bench_host prints, each "<name> <median> us": 9 data-plane calls, the GPU word's 3 (only where the
# driver has them), NumPy's scale line, and the peer process's 2.
WORD_CALLS = 3
TIMED_LINES = 15


def _run() -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dspark_sidecar.bench_host"], capture_output=True, text=True,
                          timeout=300)


def test_the_expected_line_count_is_bench_hosts():
    # Every timed(...) call site prints one line once (none sits in a loop): the GPU test's count is theirs.
    tree = ast.parse(Path(bench_host.__file__).read_text())
    sites = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "timed"]
    assert len(sites) == TIMED_LINES


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: test_bench_host_runs_on_a_gpu runs it")
def test_bench_host_says_it_needs_a_gpu():
    r = _run()
    assert r.returncode == 2 and "needs a CUDA/ROCm GPU" in r.stderr


def test_a_peer_that_dies_or_hangs_ends_the_bench_with_a_status_not_a_wait(capsys):
    """The peer process signalled with a queue it filled at its end: one that died (no IPC events on the
    driver) left the bench waiting out 300 s, then a bare `_queue.Empty` traceback. Its exit is awaited now."""
    ctx = multiprocessing.get_context("spawn")

    def started(target, *args):
        p = ctx.Process(target=target, args=args)
        p.start()
        return p

    t = time.monotonic()
    assert bench_host._joined(started(sys.exit, 3), 120) == 1
    assert time.monotonic() - t < 60 and "exit status 3" in capsys.readouterr().err  # at its exit, not the timeout
    hung = started(time.sleep, 120)
    t = time.monotonic()
    assert bench_host._joined(hung, 1) == 1 and not hung.is_alive()
    assert time.monotonic() - t < 60  # stopped at the timeout, not waited for to the end of its sleep
    assert "did not finish within 1 s" in capsys.readouterr().err
    assert bench_host._joined(started(time.sleep, 0), 120) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
def test_bench_host_runs_on_a_gpu():
    r = _run()
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.rstrip().endswith(" us")]
    word = "GPU word unavailable" not in r.stdout  # its three calls are timed where the driver has them
    assert len(lines) == (TIMED_LINES if word else TIMED_LINES - WORD_CALLS)
    assert any(ln.startswith("peer: stream.wait_event") for ln in lines)
    assert all(float(ln.split()[-2]) > 0 for ln in lines)


def test_each_line_is_the_median_host_time_in_microseconds(monkeypatch, capsys):
    """timed() prints and returns the median of its calls' host times in us (perf_counter_ns over 1e3), the warm-up
    calls left out. A fake clock: each call takes 2.5 us but the warm-up's, which take 1 ms; no GPU needed."""
    clock = {"ns": 0, "calls": 0}

    def call():
        clock["calls"] += 1
        clock["ns"] += 1_000_000 if clock["calls"] <= 20 else 2_500 + clock["calls"] % 3  # 2500..2502 ns

    monkeypatch.setattr(bench_host.time, "perf_counter_ns", lambda: clock["ns"])
    monkeypatch.setattr(bench_host.torch.cuda, "synchronize", lambda: None)
    assert bench_host.timed("fake call", call, n=9) == pytest.approx(2.501)
    assert capsys.readouterr().out.split() == ["fake", "call", "2.5", "us"]


def test_one_slow_call_does_not_move_a_line(monkeypatch, capsys):
    """A line is the median, not the mean: one call of nine held up 1 ms (a page fault, a preemption) leaves it at the
    others' 2 us, where a mean read 113 us. Fake clock, no GPU."""
    clock = {"ns": 0, "calls": 0}

    def call():
        clock["calls"] += 1
        clock["ns"] += 1_000_000 if clock["calls"] == 25 else 2_000

    monkeypatch.setattr(bench_host.time, "perf_counter_ns", lambda: clock["ns"])
    monkeypatch.setattr(bench_host.torch.cuda, "synchronize", lambda: None)
    assert bench_host.timed("fake call", call, n=9) == 2.0
    assert capsys.readouterr().out.split() == ["fake", "call", "2.0", "us"]
