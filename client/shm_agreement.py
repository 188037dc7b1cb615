"""The engine TP ranks' per-step agreement through a shared-memory page, for ranks on one x86-64 node.

The shim agrees twice per step (client/shim.py). Over gloo, a MIN all-reduce of 5 integers took
214-426 us at TP 2 and 505-893 us at TP 4 on an H200 host, more than the draft step itself; this
page took 12-27 and 52-106 us in the same processes (BENCHMARKS.md runs 197-198). Here each rank writes its values into its own slot and then its sequence number; once every
slot carries the sequence, each rank takes the element-wise minimum itself.

Two banks of slots, used by odd and even sequence numbers: a rank can start agreement s + 1 while
a slower one still reads s, but it cannot reach s + 2 (the same bank) before every rank has written
s + 1, which each does only after reading s. Stores are ordered as written (x86-64's TSO): values,
then the sequence.
"""

from __future__ import annotations

import socket
import time
from multiprocessing import shared_memory

import numpy as np
import torch
import torch.distributed as dist

from dspark_sidecar.proto import doorbell as bell
from dspark_sidecar.proto.memory import AttachedSegment

MAX_VALUES = 8  # integers per agreement (the shim's largest has 5)
SPIN_S = 30e-6  # poll without sleeping this long first: the ranks run the same step and arrive close together


class AgreementTimeout(RuntimeError):
    """A peer engine rank did not reach the agreement in time (it has died or stopped stepping)."""


class ShmAgreement:
    """StepAgreement (client/agreement.py) over a shared-memory page of the ranks of `group`.

    Built collectively: every rank of `group` (a CPU group) constructs it at the same point; the
    group carries the page's name once, and nothing per step.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, timeout_s: float = 60.0) -> None:
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.timeout_s = timeout_s
        words = 2 * self.world_size * (1 + MAX_VALUES)
        name = [None]
        seg = None
        if self.rank == 0:
            seg = shared_memory.SharedMemory(create=True, size=8 * words)
            np.ndarray((words,), np.int64, buffer=seg.buf)[:] = 0
            name = [seg.name]
        dist.broadcast_object_list(name, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        if seg is None:
            seg = AttachedSegment(name[0])  # rank 0's, which it unlinks below
        dist.barrier(group)
        if self.rank == 0:
            seg.unlink()  # every rank has it mapped: the name is no longer needed, and nothing can leak it
        self._seg = seg
        self._slots = np.ndarray((2, self.world_size, 1 + MAX_VALUES), np.int64, buffer=seg.buf)
        self._seq = 0

    def all_min_ints(self, values: list[int]) -> list[int]:
        """The element-wise minimum of every rank's `values` (the same length on every rank)."""
        n = len(values)
        if n > MAX_VALUES:
            raise ValueError(f"an agreement carries at most {MAX_VALUES} integers, got {n}")
        self._seq += 1
        seq, bank = self._seq, self._slots[self._seq & 1]
        mine = bank[self.rank]
        mine[1 : 1 + n] = values
        mine[0] = seq  # last: a peer that sees the sequence sees the values
        seqs = bank[:, 0]
        arrived = lambda: int(seqs.min()) == seq  # noqa: E731  (no slot can be ahead: see the module docstring)
        start = time.perf_counter()
        while not arrived() and time.perf_counter() - start <= SPIN_S:
            pass  # the spin; then the doorbell's naps, up to the timeout
        if not arrived() and not bell.wait_until(arrived, start + self.timeout_s, start):
            missing = [r for r in range(self.world_size) if int(seqs[r]) != seq]
            raise AgreementTimeout(f"engine ranks {missing} did not reach step agreement {seq} within "
                                   f"{self.timeout_s:g} s: a peer engine rank has died or stopped stepping")
        return bank[:, 1 : 1 + n].min(axis=0).tolist()

    def all_min(self, values: torch.Tensor) -> torch.Tensor:
        return torch.tensor(self.all_min_ints([int(v) for v in values.tolist()]), dtype=torch.int64)

    def close(self) -> None:
        self._slots = None  # type: ignore[assignment]  # the view goes before the mapping
        self._seg.close()


def one_node(group: dist.ProcessGroup | None = None) -> bool:
    """Whether every rank of `group` runs on this host, and the host orders stores as written
    (x86-64, which this page's protocol relies on). Collective: every rank must call it."""
    hosts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, (socket.gethostname(), bell.stores_in_order()), group=group)
    return len(set(hosts)) == 1 and hosts[0][1]
