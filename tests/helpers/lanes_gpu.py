"""Per-rank body of the TP-2 exchange-lanes GPU test: NCCL ranks on their own GPUs (spawned processes)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dspark_sidecar.drafter import scenario
from dspark_sidecar.drafter.checkpoint import CheckpointReader
from dspark_sidecar.drafter.config import PRESETS
from dspark_sidecar.drafter.kv_cache import allocate_kv_cache
from dspark_sidecar.drafter.model import DSparkDrafter
from dspark_sidecar.drafter.parallel import DistExchange, ParallelContext
from dspark_sidecar.kernels.weights import prepare_layer_weights
from helpers.side_by_side import side_by_side_against_in_order

PAGE = 16


def side_by_side_step(rank: int, world: int, dspark_dir: str, embed: torch.Tensor, streams: int) -> dict:
    """17 requests (launch groups 8 + 8 + 1) on `streams` streams, each with its own exchange lane
    (server/app.exchange_lanes), eagerly and replayed from a CUDA graph, against the same step in
    order: hidden states and block K/V (CPU copies) and whether they are the same bits."""
    from dspark_sidecar.kernels.triton.ops import TRITON_OPS
    from dspark_sidecar.server.app import exchange_lanes

    dev = torch.device("cuda", rank)
    cfg = PRESETS["tiny"]
    par = ParallelContext(rank, world, DistExchange(None), exchange_lanes(streams, world, dev))
    model = DSparkDrafter(cfg, par, TRITON_OPS, torch.bfloat16, dev).load(
        CheckpointReader(dspark_dir, torch.bfloat16, device=dev))
    prepare_layer_weights(model, "bf16", cfg.quant_block, fold=True)
    gen = torch.Generator().manual_seed(17)
    contexts = torch.randint(1, 40, (17,), generator=gen).tolist()
    pages = sum(scenario.pages_needed(c + 7, PAGE) for c in contexts)
    step = scenario.random_step(cfg, contexts, PAGE, pages, embed, seed=5)
    pos, slots = scenario.context_rows(step.meta, PAGE)
    kv0 = allocate_kv_cache(cfg, world, pages, PAGE, torch.bfloat16, dev)
    model.commit_context(scenario.random_taps(cfg, pos.numel(), seed=6).to(dev), pos.to(dev), slots.to(dev), kv0)
    embeds, positions, meta = step.inputs_embeds.to(dev, torch.bfloat16), step.positions.to(dev), step.meta.to(dev)
    got = side_by_side_against_in_order(model, embeds, positions, meta, kv0,
                                        [torch.cuda.Stream(dev) for _ in range(streams)])
    return {"want": got["want"].cpu(), "eager_same": got["eager"], "graph_same": got["graph"], "kv_same": got["kv"],
            "lanes": par.num_lanes}


def _entry(rank: int, world: int, store_path: str, fn, args: tuple, out_dir: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    try:
        torch.save(fn(rank, world, *args), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_nccl_ranks(world: int, fn, *args) -> list:
    """fn(rank, world, *args) on `world` processes, rank r on GPU r, joined over NCCL."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_entry, args=(world, os.path.join(tmp, "store"), fn, args, tmp), nprocs=world, join=True,
                           start_method="spawn")
        return [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(world)]
