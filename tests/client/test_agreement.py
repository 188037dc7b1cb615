"""What client/agreement.py builds from what the engine passes, and which agreement node_agreement picks."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

from dspark_sidecar.client import agreement, shm_agreement
from dspark_sidecar.client.agreement import (
    DistAgreement, LocalAgreement, agreement_from, all_min_ints, node_agreement,
)


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_single_rank_context_agrees_with_nobody_and_needs_no_group():
    """TP 1: no exchange to agree over, and no page made for nothing (a collective of one)."""
    got = agreement_from(type("Par", (), {"world_size": 1})())
    assert isinstance(got, LocalAgreement) and got.all_min([3, -1]) == [3, -1]


def test_a_step_agreement_passed_in_is_used_as_it_is():
    class Member:
        world_size = 4

        def all_min(self, values):
            return values

    member = Member()
    assert agreement_from(member) is member


def test_a_context_without_an_exchange_is_refused_by_name():
    with pytest.raises(TypeError, match="cannot build a step agreement from Par"):
        agreement_from(type("Par", (), {"world_size": 2})())


def test_an_exchange_without_a_group_is_refused_by_name():
    """The engine harness's thread exchange (helpers/ranks.py) sums partials but has no CPU group: a TypeError
    naming the context, not an AttributeError from inside node_agreement."""
    par = type("Par", (), {"world_size": 2, "exchange": type("ThreadExchange", (), {})()})()
    with pytest.raises(TypeError, match="cannot build a step agreement from Par"):
        agreement_from(par)


def test_a_parallel_context_agrees_over_its_exchange_s_group_for_as_long_as_the_engine_config_says(monkeypatch):
    """The group is the engine's TP CPU group (vLLM's of a second DP or PP replica is not the default group), and the
    wait is EngineConfig.agreement_timeout_s: the default group's page agreed with ranks of other replicas, and one
    built with the default 60 s gave a live, slow peer up for dead."""
    group, calls = object(), []
    monkeypatch.setattr(agreement, "node_agreement", lambda g, t: calls.append((g, t)) or LocalAgreement())
    par = type("Par", (), {"world_size": 2, "exchange": type("X", (), {"group": group})()})()
    agreement_from(par, timeout_s=431.5)
    assert len(calls) == 1 and calls[0][0] is group and calls[0][1] == 431.5, calls


def test_the_page_waits_for_its_peers_as_long_as_the_engine_config_says(one_rank_group, monkeypatch):
    """EngineConfig.agreement_timeout_s follows the step's deadlines (a 60 s step deadline allows more than 60 s
    between two agreements); a page built with the default 60 s had the peers of a live, slow rank give it up
    for dead and raise AgreementTimeout into the engine."""
    monkeypatch.setattr(shm_agreement.bell, "stores_in_order", lambda: True)
    page = node_agreement(None, timeout_s=431.5)
    try:
        assert isinstance(page, shm_agreement.ShmAgreement) and page.timeout_s == 431.5
    finally:
        page.close()


def test_ranks_that_cannot_share_a_page_keep_gloo_and_say_why(one_rank_group, monkeypatch, caplog):
    monkeypatch.setattr(shm_agreement.bell, "stores_in_order", lambda: False)
    with caplog.at_level(logging.INFO, logger=agreement.log.name):
        got = node_agreement(None, timeout_s=5.0)
    assert isinstance(got, DistAgreement) and got.all_min(torch.tensor([4, -2])).tolist() == [4, -2]
    assert "engine ranks agree over gloo, not a shared-memory page: rank 0: " in caplog.text, caplog.text


def test_one_rank_s_values_come_back_as_they_are_with_nothing_asked_of_its_agreement():
    """all_min_ints at TP 1 (a one-rank page or gloo group, as vLLM's TP 1 group builds): nothing to agree with, so
    neither a collective nor a tensor built and read (two of those cost several us of the shim's step)."""
    class OneRank:
        world_size = 1

        def all_min(self, values):
            raise AssertionError("a tensor agreement asked of one rank")

        def all_min_ints(self, values):
            raise AssertionError("an agreement asked of one rank")

    assert all_min_ints(OneRank(), [1, -0, 1 << 62, -(1 << 63)]) == [1, 0, 1 << 62, -(1 << 63)]


def test_an_agreement_s_own_integer_path_is_taken_at_tp_above_one():
    """ShmAgreement (and the plug-in's context) agree on host integers themselves: all_min_ints hands the values to
    it, building and reading no tensor (two of those cost several us of the shim's step)."""
    class Page:
        world_size = 2

        def all_min(self, values):
            raise AssertionError("a tensor agreement asked of one that agrees on integers")

        def all_min_ints(self, values):
            return [v - 1 for v in values]

    assert all_min_ints(Page(), [5, -(1 << 63) + 1, (1 << 63) - 1]) == [4, -(1 << 63), (1 << 63) - 2]


def test_a_gloo_agreement_reduces_over_its_own_group_not_the_world():
    """vLLM's TP group of one DP replica is not the default group: each rank's MIN and world size are its group's.
    Two ranks, a group each, all-reducing at once: over the default group they would pair up and take each other's
    values (timeout_s: a collective unmatched fails the test instead of hanging it)."""
    from helpers.agreement_ranks import own_group
    from helpers.ranks import run_ranks

    assert run_ranks(2, own_group, timeout_s=60) == [(1, [0, 0]), (1, [1, -1])]
