"""The engine's local stock layers at TP w, for comparing against the sidecar (spawned rank bodies)."""

from __future__ import annotations

import torch

from dspark_sidecar.drafter.checkpoint import CheckpointReader
from dspark_sidecar.drafter.config import PRESETS
from dspark_sidecar.drafter.model import DSparkDrafter
from dspark_sidecar.drafter.parallel import DistExchange, LocalExchange, ParallelContext
from dspark_sidecar.kernels.ops import REFERENCE_OPS


def shard_model(rank: int, world: int, dspark_dir: str, dtype: torch.dtype, distributed: bool) -> DSparkDrafter:
    par = ParallelContext(rank, world, DistExchange(None) if distributed and world > 1 else LocalExchange())
    return DSparkDrafter(PRESETS["tiny"], par, REFERENCE_OPS, dtype).load(CheckpointReader(dspark_dir, dtype))


def local_step(rank: int, world: int, dspark_dir: str, dtype: torch.dtype, kv_shards, step):
    """Rank body for helpers.ranks.run_ranks: the stock draft step on this rank's cache copy."""
    model = shard_model(rank, world, dspark_dir, dtype, distributed=True)
    kv = [t.clone() for t in kv_shards[rank]]
    hidden = model.draft_step(step.inputs_embeds.to(dtype), step.positions, step.meta, kv)
    return hidden, kv
