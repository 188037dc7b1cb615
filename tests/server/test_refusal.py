"""The seed's deployment checks, in the seed's order and words."""

from __future__ import annotations

import pytest

from dspark_sidecar.server.refusal import EngineFacts, HostFacts, fast_path_refusal

GOOD_HOST = HostFacts(on_gfx950=True, flydsl_available=True, tp_size=4)
GOOD = dict(tp_size=4, dp_size=1, pp_size=1, speculative_method="dspark", num_speculative_tokens=7)


@pytest.mark.parametrize("host,engine,reason", [
    (HostFacts(False, True, 4), GOOD, "not gfx950"),
    (HostFacts(False, False, 2), GOOD | {"tp_size": 2}, "not gfx950"),  # first failing check wins
    (HostFacts(True, False, 4), GOOD, "FlyDSL not installed"),
    (GOOD_HOST, GOOD | {"tp_size": 2}, "TP 2 != 4"),
    (GOOD_HOST, GOOD | {"dp_size": 2}, "DP > 1"),
    (GOOD_HOST, GOOD | {"pp_size": 3}, "PP > 1"),
    (GOOD_HOST, GOOD | {"speculative_method": "eagle"}, "no DSpark draft"),
    (GOOD_HOST, GOOD | {"num_speculative_tokens": 5}, "7 speculative tokens required"),
    (GOOD_HOST, GOOD, None),
])
def test_each_refusal_reason(host, engine, reason):
    assert fast_path_refusal(host, EngineFacts(**engine)) == reason


def test_before_bind_host_checks_then_waiting_for_engine():
    assert fast_path_refusal(HostFacts(False, True, 4), None) == "not gfx950"
    assert fast_path_refusal(HostFacts(True, True, 2), None) == "TP 2 != 4"
    assert fast_path_refusal(GOOD_HOST, None).startswith("no engine bound yet")
