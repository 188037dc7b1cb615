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
