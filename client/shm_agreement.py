"""The engine TP ranks' per-step agreement through a shared-memory page, for ranks on one x86-64 node.

The shim agrees twice per step (client/shim.py). Over gloo, a MIN all-reduce of 5 integers took
214-426 us at TP 2 and 505-893 us at TP 4 on an H200 host, more than the draft step itself; this
page took 12-27 and 52-106 us in the same processes (BENCHMARKS.md runs 197-198). Here each rank writes its values into its own slot and then its sequence number; once every
slot carries the sequence, each rank takes the element-wise minimum itself.

Two banks of slots, used by odd and even sequence numbers: a rank can start agreement s + 1 while
a slower one still reads s, but it cannot reach s + 2 (the same bank) before every rank has written
s + 1, which each does only after reading s. Three orders of x86-64's TSO carry this: a rank's stores
are seen in the order written (values, then the sequence), its loads in the order made (the sequences,
then the values), and its loads of s before its store of s + 1 (so a peer's values of s + 2, written
into the same bank once it sees that store, cannot reach the earlier load). Weakly ordered hosts
(aarch64, POWER) reorder all three: stores_in_order keeps them on gloo.
"""

from __future__ import annotations

import platform
import secrets
import time

import numpy as np
import torch
import torch.distributed as dist

from dspark_sidecar.proto import doorbell as bell
from dspark_sidecar.proto.memory import AttachedSegment, new_segment, unlink_segment

MAX_VALUES = 8  # integers per agreement (the shim's largest has 5)
SPIN_S = 30e-6  # poll without sleeping this long first: the ranks run the same step and arrive close together


class AgreementTimeout(RuntimeError):
    """A peer engine rank did not reach the agreement in time (it has died or stopped stepping)."""


class ShmAgreement:
    """StepAgreement (client/agreement.py) over a shared-memory page of the ranks of a group, built by
    shared_page_agreement (collectively); the group carried the page's name once, and nothing per step."""

    def __init__(self, seg, world_size: int, rank: int, timeout_s: float = 60.0) -> None:
        self.world_size, self.rank, self.timeout_s = world_size, rank, timeout_s
        self._seg = seg
        self._slots = np.ndarray((2, world_size, 1 + MAX_VALUES), np.int64, buffer=seg.buf)
        self._seq = 0
        # Set by a timeout: this rank gave up an agreement its peers may still take (its slot says it came), so its
        # sequence is no longer theirs. Agreeing on after it, a slow peer took this rank's next values (written
        # into the other bank) as the answer to its own next agreement: ranks on different branches, silently.
        self._lost: str | None = None

    def all_min_ints(self, values: list[int]) -> list[int]:
        """The element-wise minimum of every rank's `values` (the same length on every rank)."""
        n = len(values)
        if n > MAX_VALUES:
            raise ValueError(f"an agreement carries at most {MAX_VALUES} integers, got {n}")
        if self._lost is not None:  # nothing written: a peer's next agreement times out naming this rank
            raise AgreementTimeout(f"{self._lost} (no agreement on this page since)")
        seq = self._seq + 1
        bank = self._slots[seq & 1]
        mine = bank[self.rank]
        # Before the sequence moves: a value the page cannot hold raised after it, and this rank then waited in
        # the other bank while its peers waited for it in this one (both timed out naming the other as dead).
        # What a failed write left in the slot is read by no peer before this rank's next sequence covers it.
        try:
            mine[1 : 1 + n] = values
        except (OverflowError, TypeError, ValueError) as err:
            raise ValueError(f"an agreement carries int64 integers, got {values}: {err}") from None
        try:
            self._seq = seq
            mine[0] = seq  # last: a peer that sees the sequence sees the values
            seqs = bank[:, 0]
            arrived = lambda: int(seqs.min()) == seq  # noqa: E731  (no slot can be ahead: see the module docstring)
            start = time.perf_counter()
            while not arrived() and time.perf_counter() - start <= SPIN_S:
                pass  # the spin; then the doorbell's naps, up to the timeout
            if not arrived() and not bell.wait_until(arrived, start + self.timeout_s, start):
                missing = [r for r in range(self.world_size) if int(seqs[r]) != seq]
                # Read after the deadline: a peer that wrote its slot since the last poll has agreed, and takes
                # this minimum itself (it sees every slot); raising here instead left this rank alone out of a step
                # its peers go on with, naming no rank ("engine ranks []").
                if missing:
                    self._lost = (f"engine ranks {missing} did not reach step agreement {seq} within "
                                  f"{self.timeout_s:g} s: a peer engine rank has died or stopped stepping")
                    raise AgreementTimeout(self._lost)
            return bank[:, 1 : 1 + n].min(axis=0).tolist()
        except BaseException as err:
            # Any other way out once the sequence moved (KeyboardInterrupt, a signal handler's exception) gives the
            # agreement up as a timeout does: a slow peer still takes it, and a caller that went on answered that
            # peer's post-flight with its next pre-flight: the ranks decided apart, silently.
            if self._lost is None:
                self._lost = (f"step agreement {seq} was interrupted ({type(err).__name__}) after this rank came "
                              "to it: its peers may still take it")
            raise

    def all_min(self, values: torch.Tensor) -> torch.Tensor:
        return torch.tensor(self.all_min_ints([int(v) for v in values.tolist()]), dtype=torch.int64)

    def close(self) -> None:
        self._slots = None  # type: ignore[assignment]  # the view goes before the mapping
        self._seg.close()


def _write_page(buf, words: int, token: int) -> None:
    """Zero the slots and write the token in the last word (no view kept: the segment may be closed)."""
    page = np.ndarray((words,), np.int64, buffer=buf)
    page[:] = 0
    page[-1] = token


def _token(buf, words: int) -> int:
    return int(np.ndarray((words,), np.int64, buffer=buf)[-1])


def shared_page_agreement(group: dist.ProcessGroup | None = None,
                          timeout_s: float = 60.0) -> tuple[ShmAgreement | None, str]:
    """(the page's agreement, "") when every rank of `group` maps the one page rank 0 made and its host
    orders stores as written (x86-64: the protocol relies on it); else (None, why), and the caller keeps
    gloo. Collective: every rank of `group` (a CPU group) calls it at the same point.

    What is checked is what the page needs: not a host name (two containers, or two machines, may share
    one), but that each rank opens rank 0's segment by name and reads back the token rank 0 wrote in it.
    Ranks on other hosts, or in containers each with its own /dev/shm, fail that and keep gloo."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    words = 2 * world * (1 + MAX_VALUES) + 1  # the slots, then the token
    seg, offer, why = None, [None, 0], ""
    if not bell.stores_in_order():
        why = f"{platform.machine()} may show other processes its stores out of order"
    elif rank == 0:
        try:
            seg = new_segment(8 * words)  # its pages reserved: a full /dev/shm is ENOSPC, not a SIGBUS
        except OSError as err:  # /dev/shm full or missing: the peers still hear of it (None), no hang
            why = f"cannot create the page: {err}"
        else:
            offer = [seg.name, secrets.randbits(62) + 1]
            _write_page(seg.buf, words, offer[1])
    try:
        dist.broadcast_object_list(offer, src=dist.get_global_rank(group, 0) if group is not None else 0,
                                   group=group)
        name, token = offer
        if rank != 0 and not why and name is not None:  # (name None: rank 0 gives its own reason)
            try:
                seg = AttachedSegment(name)
            except (OSError, ValueError) as err:  # another host, or another /dev/shm: FileNotFoundError
                why = f"cannot open rank 0's page {name}: {err}"
            else:
                if seg.size < 8 * words or _token(seg.buf, words) != token:
                    why = f"{name} here is not rank 0's page (another /dev/shm with a segment of that name)"
        verdicts: list = [None] * world
        dist.all_gather_object(verdicts, why, group=group)  # also: every rank has mapped it, or given up
    except BaseException:
        # A peer gone during the set-up fails these collectives here: rank 0's page was left in /dev/shm for as
        # long as the process lived (its resource tracker unlinks it only at exit), as each rank's mapping was.
        if seg is not None:
            if rank == 0:
                unlink_segment(seg, "engine ranks' agreement page")
            seg.close()
        raise
    if rank == 0 and seg is not None:
        # The name is no longer needed, and nothing can leak it. Removed by someone else meanwhile (an operator
        # cleaning /dev/shm, systemd's RemoveIPC): a warning, not FileNotFoundError out of the set-up (the drafter's
        # first forward) while the peers, which have mapped the page, go on with it.
        unlink_segment(seg, "engine ranks' agreement page")
    refusals = [f"rank {r}: {w}" for r, w in enumerate(verdicts) if w]
    if refusals:
        if seg is not None:
            seg.close()
        return None, "; ".join(refusals)
    return ShmAgreement(seg, world, rank, timeout_s), ""
