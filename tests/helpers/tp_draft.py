"""Per-rank body of the TP-equivalence test (importable by spawned processes)."""

from __future__ import annotations

import torch

from dspark_sidecar.drafter import scenario
from dspark_sidecar.drafter.checkpoint import CheckpointReader
from dspark_sidecar.drafter.config import PRESETS
from dspark_sidecar.drafter.kv_cache import allocate_kv_cache
from dspark_sidecar.drafter.model import DSparkDrafter
from dspark_sidecar.drafter.parallel import DistExchange, LocalExchange, ParallelContext
from dspark_sidecar.kernels.ops import REFERENCE_OPS

PAGE, PAGES = 16, 800
LENS = [5, 130, 4096 + 50, 33, 700, 1, 64, 9, 300]  # R = 9: two launches


def _committed(model: DSparkDrafter, world: int, embed: torch.Tensor, dtype: torch.dtype, lens: list[int]):
    """A step of requests with `lens` committed rows, their context K/V committed into a fresh cache."""
    cfg = model.cfg
    kv = allocate_kv_cache(cfg, world, PAGES, PAGE, dtype)
    step = scenario.random_step(cfg, lens, PAGE, PAGES, embed, seed=7)
    pos, slots = scenario.context_rows(step.meta, PAGE)
    model.commit_context(scenario.random_taps(cfg, pos.numel(), seed=8), pos, slots, kv)
    return step, kv


def draft(rank: int, world: int, dspark_dir: str, embed: torch.Tensor, dtype: torch.dtype):
    exchange = DistExchange(None) if world > 1 else LocalExchange()
    par = ParallelContext(rank, world, exchange)
    model = DSparkDrafter(PRESETS["tiny"], par, REFERENCE_OPS, dtype).load(CheckpointReader(dspark_dir, dtype))
    step, kv = _committed(model, world, embed, dtype, LENS)
    return model.draft_step(step.inputs_embeds, step.positions, step.meta, kv)


class CountingExchange:
    """An exchange that counts its all-reduces (which lane summed what) and hands them on."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.inner.all_reduce(t)


def draft_through_lanes(rank: int, world: int, dspark_dir: str, embed: torch.Tensor, dtype: torch.dtype):
    """One launch group (R = 8) summed through the world group (lane 0) and through a lane of its own
    (a second gloo group made the way server/app.exchange_lanes makes it) -> (out lane 0, out lane 1,
    all-reduces per lane in each run, whether each layer's K/V came out the same through both lanes)."""
    import torch.distributed as dist

    from dspark_sidecar.server.app import exchange_lanes

    (lane,) = exchange_lanes(2, world, torch.device("cpu"))
    ex0, ex1 = CountingExchange(DistExchange(None)), CountingExchange(lane)
    par = ParallelContext(rank, world, ex0, (ex1,))
    model = DSparkDrafter(PRESETS["tiny"], par, REFERENCE_OPS, dtype).load(CheckpointReader(dspark_dir, dtype))
    step, kv = _committed(model, world, embed, dtype, LENS[:8])
    kv0 = [t.clone() for t in kv]
    out0 = model.forward(step.inputs_embeds, step.positions, step.meta, kv, lane=0)
    calls0 = (ex0.calls, ex1.calls)
    out1 = model.forward(step.inputs_embeds, step.positions, step.meta, kv0, lane=1)
    calls1 = (ex0.calls - calls0[0], ex1.calls - calls0[1])
    assert dist.get_world_size(lane.group) == world
    return out0, out1, calls0, calls1, [torch.equal(a, b) for a, b in zip(kv, kv0)]


def sum_in_halves(rank: int, world: int):
    """Each rank's (rank + 1) summed by a DistExchange over its half of the world (ranks [0, w/2) and
    [w/2, w), groups made on every rank alike): what the exchange's group, not the world's, sums."""
    import torch.distributed as dist

    from dspark_sidecar.drafter.parallel import DistExchange

    half = world // 2
    groups = [dist.new_group(list(range(half))), dist.new_group(list(range(half, world)))]
    t = torch.full((3,), float(rank + 1))
    return DistExchange(groups[rank // half]).all_reduce(t)
