"""The shim's counters: the nearest-rank percentile its latency report uses, and a report read from another thread."""

from __future__ import annotations

import math

import pytest

from dspark_sidecar.client.stats import ShimStats
from dspark_sidecar.percentiles import percentile


@pytest.mark.parametrize("n", [1, 2, 3, 4, 6, 7, 10, 99, 100, 101, 200, 1000])
@pytest.mark.parametrize("q", [1, 50, 90, 99, 100])
def test_percentile_is_the_nearest_rank(n, q):
    """The smallest sample with at least q% of the samples at or below it: the ceil(q/100 * n)-th.
    Before, the rank was round(q/100 * n + 0.5), and Python rounds halves to even: where q/100 * n is
    a whole odd number it came out one rank high (the p99 of 100 samples was their maximum, the p50
    of 2 samples the larger one)."""
    samples = list(range(1, n + 1))[::-1]  # unsorted on purpose
    expected = max(1, math.ceil(q * n / 100))  # sample k is the value k
    assert percentile(samples, q) == expected


def test_percentile_of_nothing_is_nan():
    assert math.isnan(percentile([], 50))


def test_the_report_p99_of_100_steps_is_not_their_slowest():
    stats = ShimStats()
    stats.forward_ns.extend(1000 * k for k in range(1, 101))  # 1 .. 100 us
    out = stats.as_dict()
    assert out["forward_p50_us"] == 50.0 and out["forward_p99_us"] == 99.0


def test_a_report_from_another_thread_is_one_moment_of_the_shim_s_steps():
    """A metrics reader on another thread calls as_dict while the engine thread forwards. The shim updated
    the counters one by one (forwarded, then via_doorbell, then the latency), and the interpreter may switch
    threads between them: a report then counted the step as forwarded but not by the doorbell, when every step
    went by it, and had no latency sample for it. Here the reader asks at exactly that moment, when the shim
    reads the step's doorbell flag (the fake sidecar answers on the gRPC stream: each step is marked as the
    doorbell's, as _run_step marks a step sent by the doorbell), and waits for its report up to 0.2 s."""
    import threading

    from dspark_sidecar.client.config import EngineConfig
    from dspark_sidecar.client.forward_context import set_forward_context
    from dspark_sidecar.client.shim import DrafterShim
    from dspark_sidecar.drafter.parallel import ParallelContext
    from helpers.engine_fakes import FakeModel, FakeServer, FakeSidecar, shm_kv_cache, short_socket_dir, step_inputs

    server = FakeServer(FakeSidecar(max_reqs=4), short_socket_dir() / "rank0.sock").start()
    kv = shm_kv_cache()
    shim = DrafterShim(EngineConfig(endpoint=server.endpoint, tp_size=4, step_deadline_s=5.0),
                       FakeModel(), lambda: [s.tensor for s in kv], ParallelContext(0, 1))
    reports: list[dict] = []
    readers: list[threading.Thread] = []

    class ByTheDoorbell:
        """A true doorbell flag whose reading lets another thread's report in."""

        def __bool__(self) -> bool:
            return True

        def __index__(self) -> int:
            reader = threading.Thread(target=lambda: reports.append(shim.stats.as_dict()))
            readers.append(reader)
            reader.start()
            reader.join(0.2)  # done, or waiting for the step's counters to be whole
            return 1

    run_step = shim._run_step

    def marked(*args, **kw):
        out = run_step(*args, **kw)
        shim._via_doorbell = ByTheDoorbell()
        return out

    shim._run_step = marked
    try:
        ids, pos, meta = step_inputs(2)
        with set_forward_context(meta):
            for _ in range(3):
                assert shim.maybe_forward(ids, pos) is not None, dict(shim.stats.fallbacks)
    finally:
        for reader in readers:
            reader.join()
        shim.close()
        server.stop()
        for s in kv:
            s.close()
    assert len(reports) == 3
    for out in reports:
        assert out["via_doorbell"] == out["forwarded"] and not math.isnan(out["forward_p50_us"]), reports
    assert shim.stats.as_dict()["forwarded"] == 3 == len(shim.stats.forward_ns)


def test_the_operator_guide_names_the_report_call_the_stats_have():
    """deploy/OPERATIONS.md tells an operator where each engine rank counts its fallbacks by reason
    (`DrafterShim.stats.<call>()["fallbacks"]`). It named snapshot(), which ShimStats does not have: the
    call raised AttributeError. as_dict() is the one-moment report (also from another thread)."""
    import re
    from pathlib import Path

    guide = (Path(__file__).resolve().parents[2] / "deploy" / "OPERATIONS.md").read_text()
    calls = re.findall(r"DrafterShim\.stats\.(\w+)\(\)\[\"(\w+)\"\]", guide)
    assert calls, "OPERATIONS.md no longer says where the fallback counts are"
    stats = ShimStats()
    stats.record_fallback("rows not a multiple of 7")
    for call, key in calls:
        assert callable(getattr(stats, call, None)), f"OPERATIONS.md names ShimStats.{call}(), which does not exist"
        assert getattr(stats, call)()[key] == {"rows not a multiple of 7": 1}
