"""The engine TP ranks' agreement on each step: an element-wise MIN over the engine's CPU group (gloo, or
shared memory on one node: client/shm_agreement.py)."""

from __future__ import annotations

import logging
from typing import Protocol

import torch
import torch.distributed as dist

log = logging.getLogger("dspark_sidecar.client")


class StepAgreement(Protocol):
    """Element-wise MIN of an int64 vector over the engine's TP ranks (MAX is MIN of the negation).

    Every engine rank must call it the same number of times in the same order: the shim only
    calls it after checks that read TP-replicated state, so either all ranks call or none does.
    """

    world_size: int

    def all_min(self, values: torch.Tensor) -> torch.Tensor: ...


class LocalAgreement:
    """One engine rank (TP 1, unit tests): nothing to agree with."""

    world_size = 1

    def all_min(self, values: torch.Tensor) -> torch.Tensor:
        return values


class DistAgreement:
    """A MIN all-reduce over a torch.distributed group; must be a CPU (gloo) group, since the values
    are host integers and a device collective would need a stream sync per step."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)

    def all_min(self, values: torch.Tensor) -> torch.Tensor:
        out = values.to(torch.int64).clone()
        dist.all_reduce(out, op=dist.ReduceOp.MIN, group=self.group)
        return out


def all_min_ints(agree: StepAgreement, values: list[int]) -> list[int]:
    """`agree.all_min` of host integers. One rank has nothing to agree with: its values come back
    without a tensor built or read (two of those cost several us of the shim's step on an H200 host)."""
    if agree.world_size == 1:
        return values
    ints = getattr(agree, "all_min_ints", None)  # ShmAgreement's own, without tensors
    if ints is not None:
        return ints(values)
    return agree.all_min(torch.tensor(values, dtype=torch.int64)).tolist()


def node_agreement(group: dist.ProcessGroup | None = None, timeout_s: float = 60.0) -> StepAgreement:
    """The agreement of a CPU group's ranks: through a shared-memory page when they all map it (one
    x86-64 host, one /dev/shm: shm_agreement.shared_page_agreement), else a gloo all-reduce (bounded by
    the group's own timeout), with the reason logged. Collective: every rank of the group calls it at
    the same point. timeout_s: how long a rank waits for its peers in the page
    (EngineConfig.agreement_timeout_s)."""
    from dspark_sidecar.client.shm_agreement import shared_page_agreement

    page, why = shared_page_agreement(group, timeout_s)
    if page is not None:
        return page
    # Over gloo an agreement takes hundreds of us instead of tens (BENCHMARKS.md runs 197-198): worth a line.
    log.info("engine ranks agree over gloo, not a shared-memory page: %s", why)
    return DistAgreement(group)


def agreement_from(par: object, timeout_s: float = 60.0) -> StepAgreement:
    """A StepAgreement from what the engine passes: one already, or a ParallelContext-like object
    (world_size, and an exchange whose `.group` is the CPU group)."""
    if hasattr(par, "all_min"):
        return par  # type: ignore[return-value]
    world = int(getattr(par, "world_size", 1))
    if world == 1:
        return LocalAgreement()
    exchange = getattr(par, "exchange", None)
    if exchange is None or not hasattr(exchange, "group"):
        raise TypeError(f"cannot build a step agreement from {type(par).__name__}: "
                        "pass a StepAgreement or a ParallelContext with a DistExchange")
    return node_agreement(exchange.group, timeout_s)
