"""Run a function on W real processes joined in a gloo group (torch.multiprocessing, spawn)."""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world: int, store_path: str, fn: Callable, args: tuple, out_dir: str,
           timeout_s: float | None = None) -> None:
    torch.set_num_threads(1)
    kw = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world, **kw)
    try:
        result = fn(rank, world, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, fn: Callable, *args: Any, timeout_s: float | None = None) -> list[Any]:
    """fn(rank, world, *args) on `world` processes; returns each rank's (torch.save-able) result.
    timeout_s: a collective unmatched this long raises in its rank (gloo's default is 30 minutes),
    so a test whose ranks pair the wrong collectives fails instead of hanging."""
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        mp.start_processes(_entry, args=(world, store, fn, args, tmp, timeout_s), nprocs=world, join=True,
                           start_method="spawn")
        return [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(world)]
