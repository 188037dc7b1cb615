"""The rank loop's use of a fast path: whole steps go to it when it is ready and the positions fit its tables."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from dspark_sidecar.drafter.kv_cache import StepMetadata
from dspark_sidecar.server.rank import RankLoop
from dspark_sidecar.server.validate import Step


class FakeFast:
    max_positions = 100

    def __init__(self, ready: bool) -> None:
        self._ready, self.calls = ready, 0

    def ready(self, kv) -> bool:
        return self._ready

    def forward(self, embeds, positions, meta):
        self.calls += 1
        return torch.full_like(embeds, 1.0)


class FakeModel:
    device, dtype = torch.device("cpu"), torch.float32

    def __init__(self) -> None:
        self.calls = 0

    def draft_step(self, embeds, positions, meta, kv):
        self.calls += 1
        return torch.full_like(embeds, 2.0)


def _step(first_position: int) -> Step:
    pos = torch.arange(first_position, first_position + 7)
    meta = StepMetadata(torch.tensor([first_position + 7], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32),
                        pos.clone())
    kv = SimpleNamespace(layers=[])
    return Step(1, 1, pos, torch.zeros(7, 4), None, meta, kv, None)


def _loop(fast) -> SimpleNamespace:
    return SimpleNamespace(ctx=SimpleNamespace(model=FakeModel(), fast=fast, embed=None), graphs=None)


def test_ready_fast_path_runs_steps_within_its_positions():
    loop = _loop(FakeFast(ready=True))
    out = RankLoop._execute(loop, _step(50))
    assert torch.all(out == 1.0) and loop.ctx.fast.calls == 1 and loop.ctx.model.calls == 0


def test_positions_past_the_fast_paths_table_take_the_portable_layers():
    loop = _loop(FakeFast(ready=True))
    out = RankLoop._execute(loop, _step(94))  # rows at 94..100: the last is outside [0, 100)
    assert torch.all(out == 2.0) and loop.ctx.fast.calls == 0 and loop.ctx.model.calls == 1


def test_refused_binding_takes_the_portable_layers():
    loop = _loop(FakeFast(ready=False))
    out = RankLoop._execute(loop, _step(0))
    assert torch.all(out == 2.0) and loop.ctx.model.calls == 1
