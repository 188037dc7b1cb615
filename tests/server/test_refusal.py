"""The seed's deployment checks, in the seed's order and words."""

from __future__ import annotations

import pytest

from dspark_sidecar.server.refusal import EngineFacts, HostFacts, fast_path_refusal, probe_host, shared_host

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
    # The seed asks for equality: above the required value is refused as well as below it.
    (HostFacts(True, True, 8), GOOD | {"tp_size": 8}, "TP 8 != 4"),
    (GOOD_HOST, GOOD | {"num_speculative_tokens": 8}, "7 speculative tokens required"),
    # The method as the seed compares it, whole: "" is an engine without speculative decoding (proto EngineFacts),
    # and a part of "dspark" is another method.
    (GOOD_HOST, GOOD | {"speculative_method": ""}, "no DSpark draft"),
    (GOOD_HOST, GOOD | {"speculative_method": "spark"}, "no DSpark draft"),
    (GOOD_HOST, GOOD | {"speculative_method": "dspark_mtp"}, "no DSpark draft"),  # nor one whose name holds it
    (GOOD_HOST, GOOD, None),
])
def test_each_refusal_reason(host, engine, reason):
    assert fast_path_refusal(host, EngineFacts(**engine)) == reason


# The seed's order: each check failing together with the one after it. The table above pins only "not gfx950"
# as first, so swapping any later pair of checks (FlyDSL vs TP, DP vs PP, ...) went unnoticed.
ORDER = [
    ({"on_gfx950": False}, {}, "not gfx950"),
    ({"flydsl_available": False}, {}, "FlyDSL not installed"),
    ({}, {"tp_size": 2}, "TP 2 != 4"),
    ({}, {"dp_size": 2}, "DP > 1"),
    ({}, {"pp_size": 3}, "PP > 1"),
    ({}, {"speculative_method": "eagle"}, "no DSpark draft"),
    ({}, {"num_speculative_tokens": 5}, "7 speculative tokens required"),
]


@pytest.mark.parametrize("first, then", list(zip(ORDER, ORDER[1:])), ids=[r for _, _, r in ORDER[:-1]])
def test_of_two_failing_checks_the_earlier_in_the_seed_order_is_reported(first, then):
    host = dict(on_gfx950=True, flydsl_available=True, tp_size=4) | first[0] | then[0]
    engine = GOOD | first[1] | then[1]
    assert fast_path_refusal(HostFacts(**host), EngineFacts(**engine)) == first[2]


def test_before_bind_host_checks_then_waiting_for_engine():
    assert fast_path_refusal(HostFacts(False, True, 4), None) == "not gfx950"
    assert fast_path_refusal(HostFacts(True, False, 2), None) == "FlyDSL not installed"
    assert fast_path_refusal(HostFacts(True, True, 2), None) == "TP 2 != 4"
    assert fast_path_refusal(HostFacts(True, True, 8), None) == "TP 8 != 4"
    assert fast_path_refusal(GOOD_HOST, None).startswith("no engine bound yet")


def test_the_groups_host_facts_fail_a_check_that_fails_on_any_rank():
    """on_gfx950 asks each rank's own GPU: the group's facts, which every rank chooses its backend from, pass a
    check only where every rank passes it (server/app.py gathers them at start-up)."""
    assert shared_host([GOOD_HOST] * 4) == GOOD_HOST
    assert shared_host([GOOD_HOST, GOOD_HOST, HostFacts(False, True, 4), GOOD_HOST]) == HostFacts(False, True, 4)
    assert shared_host([HostFacts(True, False, 4), GOOD_HOST, GOOD_HOST, GOOD_HOST]) == HostFacts(True, False, 4)
    # Not rank 0's word alone: a later rank that cannot import FlyDSL fails the check for the group.
    assert shared_host([GOOD_HOST, GOOD_HOST, GOOD_HOST, HostFacts(True, False, 4)]) == HostFacts(True, False, 4)


@pytest.mark.parametrize("gfx950, flydsl, in_order", [(True, False, False), (False, True, True)])
def test_the_host_probe_reports_each_probe_s_own_answer(monkeypatch, gfx950, flydsl, in_order):
    """Each fact from its own probe: swapped, a gfx950 host without FlyDSL read "FlyDSL not installed" as "not
    gfx950"; a fixed stores_in_order attached the shared-memory doorbell on a host whose stores may reorder."""
    from dspark_sidecar.kernels.flydsl import toolchain
    from dspark_sidecar.proto import doorbell

    monkeypatch.setattr(toolchain, "on_gfx950", lambda: gfx950)
    monkeypatch.setattr(toolchain, "flydsl_available", lambda: flydsl)
    monkeypatch.setattr(doorbell, "stores_in_order", lambda: in_order)
    assert probe_host(2) == HostFacts(on_gfx950=gfx950, flydsl_available=flydsl, tp_size=2, stores_in_order=in_order)


@pytest.mark.parametrize("name", ["dp_size", "pp_size", "num_speculative_tokens"])
def test_an_engine_fact_left_0_never_passes(name):
    """The seed asks for equality: an engine fact of 0 (proto3's "not set") is refused, not served. BindKV refuses
    a DP or PP size of 0 before this (server/kv_binding.py); a check read as "at most 1" let it through here."""
    assert fast_path_refusal(GOOD_HOST, EngineFacts(**GOOD | {name: 0})) is not None


def test_the_reason_before_any_bind_is_the_operator_guide_s_word_for_word():
    """deploy/OPERATIONS.md lists each reason verbatim ("alert on them verbatim"), this one as no refusal to alert
    on: reworded here and not there, the guide's row matched no status."""
    from pathlib import Path

    from dspark_sidecar.server import refusal

    guide = (Path(refusal.__file__).resolve().parents[1] / "deploy" / "OPERATIONS.md").read_text()
    assert f"| `{refusal.AWAITING_BIND}` |" in guide
