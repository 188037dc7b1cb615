"""Every series deploy/OPERATIONS.md lists is on the endpoint from a rank's start, at 0 until counted."""

from __future__ import annotations

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

    import pytest

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
