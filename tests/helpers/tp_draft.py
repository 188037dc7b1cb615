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


def draft(rank: int, world: int, dspark_dir: str, embed: torch.Tensor, dtype: torch.dtype):
    cfg = PRESETS["tiny"]
    exchange = DistExchange(None) if world > 1 else LocalExchange()
    par = ParallelContext(rank, world, exchange)
    model = DSparkDrafter(cfg, par, REFERENCE_OPS, dtype).load(CheckpointReader(dspark_dir, dtype))
    kv = allocate_kv_cache(cfg, world, PAGES, PAGE, dtype)
    step = scenario.random_step(cfg, LENS, PAGE, PAGES, embed, seed=7)
    pos, slots = scenario.context_rows(step.meta, PAGE)
    model.commit_context(scenario.random_taps(cfg, pos.numel(), seed=8), pos, slots, kv)
    return model.draft_step(step.inputs_embeds, step.positions, step.meta, kv)
