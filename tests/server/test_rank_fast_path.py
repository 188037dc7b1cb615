"""The rank loop's use of a fast path: a rank offers it when ready and the positions fit its tables; it runs only
when the rendezvous says every rank can (its kernels exchange partial sums with their peers' kernels)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from dspark_sidecar.drafter.kv_cache import StepMetadata
from dspark_sidecar.server.rank import RankLoop
from dspark_sidecar.server.validate import Step, host_meta
from helpers.rank_fakes import FakeModel


class FakeFast:
    max_positions = 100

    def __init__(self, ready: bool) -> None:
        self._ready, self.calls = ready, 0

    def ready(self, kv) -> bool:
        return self._ready

    def forward(self, embeds, positions, meta):
        self.calls += 1
        return torch.full_like(embeds, 1.0)


def _step(first_position: int) -> Step:
    pos = torch.arange(first_position, first_position + 7)
    meta = StepMetadata(torch.tensor([first_position + 7], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32),
                        pos.clone())
    return Step(1, 1, pos, torch.zeros(7, 4), None, meta, SimpleNamespace(layers=[]), None, host_meta(pos, meta))


def _loop(fast) -> SimpleNamespace:
    return SimpleNamespace(ctx=SimpleNamespace(model=FakeModel(), fast=fast, embed=None), graphs=None)


def test_a_rank_offers_the_fast_path_only_when_ready_and_within_its_positions():
    assert RankLoop._fast_ready(_loop(FakeFast(ready=True)), _step(50))
    assert RankLoop._fast_ready(_loop(FakeFast(ready=True)), _step(93))  # rows 93..99: the table's last row
    assert not RankLoop._fast_ready(_loop(FakeFast(ready=True)), _step(94))  # rows 94..100: 100 is outside
    assert not RankLoop._fast_ready(_loop(FakeFast(ready=False)), _step(0))
    assert not RankLoop._fast_ready(_loop(None), _step(0))


def test_the_agreed_verdict_picks_the_path():
    loop = _loop(FakeFast(ready=True))
    assert torch.all(RankLoop._execute(loop, _step(50), fast=True) == 1.0) and loop.ctx.fast.calls == 1
    # Ready here, but a peer was not: this rank takes the portable layers like every other.
    assert torch.all(RankLoop._execute(loop, _step(50), fast=False) == 2.0) and loop.ctx.model.calls == 1
    assert loop.ctx.fast.calls == 1
