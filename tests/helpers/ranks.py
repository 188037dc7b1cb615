"""Run a function on W TP ranks: real processes in a gloo group (spawn), or threads summing among themselves."""

from __future__ import annotations

import os
import tempfile
import threading
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


class ThreadSum:
    """An all-reduce (sum) among ranks that are threads of this process; every rank gets the same bits."""

    def __init__(self, world: int, timeout_s: float = 60) -> None:
        self.barrier = threading.Barrier(world, timeout=timeout_s)
        self.parts: list[torch.Tensor | None] = [None] * world

    def member(self, rank: int) -> _ThreadSumMember:
        return _ThreadSumMember(self, rank)


class _ThreadSumMember:
    def __init__(self, group: ThreadSum, rank: int) -> None:
        self.group, self.rank = group, rank

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        g = self.group
        g.parts[self.rank] = t.clone()
        g.barrier.wait()
        total = g.parts[0].clone()  # rank order on every rank: the same sum, bit for bit
        for p in g.parts[1:]:
            total += p
        g.barrier.wait()  # nobody posts its next partial before every rank has summed this one
        return t.copy_(total)


def run_rank_threads(world: int, fn: Callable, *args: Any) -> list[Any]:
    """fn(rank, world, exchange, *args) on `world` threads whose exchanges sum among them; each rank's result.

    For rank bodies that need only a partial-sum exchange: no processes to spawn and no torch import
    per rank, so TP 2 and 4 cost about what TP 1 does. A rank that raises breaks the barrier, so the
    others stop waiting, and its exception is raised here.
    """
    group, results, errors = ThreadSum(world), [None] * world, []

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank, world, group.member(rank), *args)
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    return results
