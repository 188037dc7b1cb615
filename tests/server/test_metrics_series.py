"""Every series deploy/OPERATIONS.md lists is on the endpoint from a rank's start, at 0 until counted."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from dspark_sidecar.server.metrics import Metrics


def test_binds_and_serving_read_0_before_the_first_bind_and_serving():
    # OPERATIONS.md: "`dspark_kv_binds_total` stays at 0" when bindings fail, and the alert
    # `min_over_time(dspark_serving[5m]) == 0` for a rank that never serves. A labelled series that
    # was never touched is absent, not 0: neither query matched before the first bind / SERVING.
    text = generate_latest(Metrics(2).registry).decode()
    assert 'dspark_kv_binds_total{rank="2"} 0.0' in text
    assert 'dspark_serving{rank="2"} 0.0' in text


def test_binds_and_serving_move_as_before():
    m = Metrics(0)
    m.bound()
    m.set_serving(True)
    text = generate_latest(m.registry).decode()
    assert 'dspark_kv_binds_total{rank="0"} 1.0' in text
    assert 'dspark_serving{rank="0"} 1.0' in text
    m.set_serving(False)
    assert 'dspark_serving{rank="0"} 0.0' in generate_latest(m.registry).decode()


def test_get_status_percentiles_are_nearest_rank_as_the_bench_s():
    """latencies_pb took p50 = xs[n // 2] and p99 = xs[int(0.99 n)]: one rank high wherever 0.99 n (or
    n / 2) is whole. 100 samples gave their maximum as the p99, 200 the 199th smallest, and 2 samples
    their larger one as the median. Nearest rank, as bench._latency_fields' p99: the ceil(q n)-th smallest."""
    import math

    def summary(n):
        m = Metrics(0)
        for i in range(1, n + 1):  # sample i is i ns
            m.step("ok", {"total": i})
        (lat,) = m.latencies_pb()
        return lat.count, lat.p50_ns, lat.p99_ns

    assert summary(100) == (100, 50, 99)
    assert summary(200) == (200, 100, 198)
    assert summary(2) == (2, 1, 2)
    assert summary(1) == (1, 1, 1)
    m = Metrics(0)
    for n in range(1, 2049):  # the whole window, one sample more each time
        m.step("ok", {"total": n})
        (lat,) = m.latencies_pb()
        assert (lat.p50_ns, lat.p99_ns) == (math.ceil(n / 2), -(-99 * n // 100)), n


def test_a_bracketed_ipv6_metrics_host_the_start_up_check_passes_is_served(tmp_path):
    """`--metrics-host [::1]`, as --tcp-host and the parent's port check (preflight.check_port) take an IPv6
    literal: the check passed, then every rank failed to start (exit 2, "Name or service not known"), since
    the HTTP server looked the bracketed text up as a host name."""
    import socket
    import urllib.request

    from dspark_sidecar.server.preflight import check_port

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
            port = s.getsockname()[1]
    except OSError:
        pytest.skip("no IPv6 loopback on this host")
    check_port("--metrics-port", "[::1]", port)  # the parent's check: passes
    m = Metrics(3)
    m.serve_http("[::1]", port)
    with urllib.request.urlopen(f"http://[::1]:{port}/", timeout=5) as resp:
        assert 'dspark_serving{rank="3"} 0.0' in resp.read().decode()


def _value(m: Metrics, name: str, **labels: str) -> float | None:
    """One sample's value on the rank's endpoint (None: no such series)."""
    return m.registry.get_sample_value(name, labels)


def test_get_status_counters_count_each_result_in_its_own_field():
    """Each Counters field from its own count: requests, rows (7 per request) and launches from `ok` steps alone,
    so an aborted or refused step's size is not read as drafted work."""
    m = Metrics(0)
    for result, times in (("ok", 1), ("aborted", 2), ("invalid", 3), ("refused", 4), ("failed", 5)):
        for _ in range(times):
            m.step(result, {"total": 10} if result == "ok" else {}, num_reqs=3, launches=2)
    m.bound()
    c = m.counters_pb()
    assert (c.steps_ok, c.steps_aborted, c.steps_invalid, c.steps_refused, c.steps_failed) == (1, 2, 3, 4, 5)
    assert (c.requests, c.rows, c.launches, c.kv_binds) == (3, 21, 2, 1)
    for result, times in (("ok", 1), ("aborted", 2), ("invalid", 3), ("refused", 4), ("failed", 5)):
        assert _value(m, "dspark_steps_total", rank="0", result=result) == times


def test_prelaunch_hits_and_misses_are_counted_apart():
    m = Metrics(1)
    m.prelaunch(True)
    m.prelaunch(False)
    m.prelaunch(False)
    c = m.counters_pb()
    assert (c.steps_prelaunched, c.prelaunch_misses) == (1, 2)
    assert _value(m, "dspark_prelaunch_total", rank="1", outcome="hit") == 1
    assert _value(m, "dspark_prelaunch_total", rank="1", outcome="miss") == 2


def test_latencies_come_from_ok_steps_only_and_the_latest_window():
    """No summary for a phase with no sample yet (GetStatus before the first step); a refused or aborted
    step's timings are not latencies; the window holds the latest samples only."""
    m = Metrics(0, window=4)
    assert m.latencies_pb() == []
    m.step("aborted", {"total": 10**9})
    m.step("refused", {"total": 10**9})
    assert m.latencies_pb() == []
    for ns in (10**9, 10**9, 1, 2, 3, 4):  # the first two leave the window
        m.step("ok", {"total": ns, "queue": ns})
    lat = {s.name: s for s in m.latencies_pb()}
    assert set(lat) == {"total", "queue"}
    assert (lat["total"].count, lat["total"].p50_ns, lat["total"].p99_ns) == (4, 2, 4)


def test_the_latency_histogram_is_in_seconds_and_of_ok_steps_only():
    m = Metrics(0)
    m.step("ok", {"compute": 2_000_000})  # 2 ms
    m.step("aborted", {"compute": 5_000_000_000})
    assert _value(m, "dspark_step_seconds_count", rank="0", phase="compute") == 1
    assert _value(m, "dspark_step_seconds_sum", rank="0", phase="compute") == pytest.approx(2e-3)
    assert _value(m, "dspark_step_seconds_bucket", rank="0", phase="compute", le="0.0025") == 1
    assert _value(m, "dspark_step_seconds_bucket", rank="0", phase="compute", le="0.001") == 0


def test_get_status_counters_are_read_as_one_snapshot():
    """counters_pb reads under the lock step() counts under: read without it, a GetStatus could give a step's
    steps_ok without its requests and rows (a rate of requests per step that no step had)."""
    import threading

    m = Metrics(0)
    got = []
    with m._lock:  # a step being counted
        reader = threading.Thread(target=lambda: got.append(m.counters_pb()))
        reader.start()
        reader.join(0.2)
        assert reader.is_alive() and not got  # waits for the step's counts
    reader.join(5)
    assert len(got) == 1


def test_latencies_are_summarised_outside_the_lock_steps_count_under(monkeypatch):
    """latencies_pb sorted every phase's window (~2.8 ms for full windows) under the lock that each step's
    `step` takes: a GetStatus delayed the steps. The windows are copied under it and summarised after."""
    from dspark_sidecar.server import metrics

    m = Metrics(0, window=8)
    for ns in (5, 1, 3):
        m.step("ok", {"total": ns})
    held = []
    real = metrics.percentile

    def watched(xs, q):
        held.append(m._lock.locked())
        return real(xs, q)

    monkeypatch.setattr(metrics, "percentile", watched)
    (lat,) = m.latencies_pb()
    assert held == [False, False], held
    assert (lat.count, lat.p50_ns, lat.p99_ns) == (3, 3, 5)


def test_latencies_read_every_phase_s_window_as_one_snapshot():
    """latencies_pb copies the windows under the lock step() appends a step's phases under: copied without it, a
    GetStatus could hold a step's `total` sample without its `queue` one (phases' counts that no set of steps gave)."""
    import threading

    m = Metrics(0, window=8)
    m.step("ok", {"total": 5, "queue": 1})
    got = []
    with m._lock:  # a step's phases being appended
        reader = threading.Thread(target=lambda: got.append(m.latencies_pb()))
        reader.start()
        reader.join(0.2)
        assert reader.is_alive() and not got  # waits for the step's samples
    reader.join(5)
    assert [(s.name, s.count) for s in got[0]] == [("queue", 1), ("total", 1)], got
