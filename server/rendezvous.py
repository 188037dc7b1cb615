"""Node-local step agreement between the sidecar's TP ranks, through a shared-memory board with a deadline.

Why: a rank that launches a step's collectives while a peer does not waits forever. So before any
launch every rank posts what it received (step id, R, binding generation, a digest of the step's
metadata, whether its inputs were valid) and one coordinator (a thread of rank 0) writes a single
verdict for that set of posts: GO, or ABORT with a reason code. Every rank formats its answer from
that one record, so all ranks give the same answer. A rank commits to waiting for the verdict once
it has posted; the coordinator always decides within the deadline of the first post it saw, so a
missing peer costs at most the deadline, and a collective is entered only after GO.

Layout (int64 words): header [magic, world, closed]; per rank a post slot
[seq, step_id, generation, num_reqs, valid, digest, expires_ns, offers]; a ring of verdict records
[seq, step_id, verdict, reason, rank_mask, launch_seq, agreed, covered_seq[0..world)]; per rank a
heartbeat (time.monotonic_ns of its last beat, 0 before the first); per rank its pid (0 before it
set it: Rendezvous); per rank its process's start time (process_start; 0 where not known), which
tells a peer's exit from another process that took its pid (PeerProcesses). `seq` words
are seqlocks: odd while the writer fills the record, even when it is complete. `offers` and
`agreed` are bit sets of FAST, QUEUED and QUEUE_NEXT: what each rank could do, and what every
rank will do (a bit is agreed only when every rank offered it, and only with GO).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
import zlib
from dataclasses import dataclass
from multiprocessing import shared_memory

import numpy as np

# Polling (with 1 us timer slack, see proto/doorbell.py): a rank waiting for its verdict naps, and sleeps
# longer once it has waited a while; the coordinator naps while steps flow and sleeps longer once the
# ranks have been quiet a while.
from dspark_sidecar.proto.doorbell import NAP_S, lower_timer_slack, pause
from dspark_sidecar.proto.memory import AttachedSegment, new_segment, unlink_segment
# A peer's exit, told from another process that took its pid; `_exited` by this name so tests can count the looks.
from dspark_sidecar.server.processes import exited as _exited, process_start

log = logging.getLogger("dspark_sidecar.rendezvous")

MAGIC = 0x44535052  # "DSPR"
SLOT = 8
RING = 64
GO, ABORT = 1, 2
# Offers, agreed only when every rank makes them: the kernel fast path (FlyDSL); the pre-launched
# copy of this step that ran on the GPU (server/prelaunch.py); queueing the next step on the GPU.
FAST, QUEUED, QUEUE_NEXT = 1, 2, 4
# Abort reasons
MISSING, STEP_ID, NUM_REQS, GENERATION, DIGEST, INVALID, DEADLINE, EXITED, SOME_COPIES = range(1, 10)
# Header words: magic, world, and CLOSED, set once rank 0's coordinator has stopped for good (its
# thread joined): no verdict comes after it, so a post without one was launched by no rank.
HEADER, CLOSED = 3, 2
# How often a rank waiting for its verdict looks whether rank 0 (the coordinator) still exists, and
# the coordinator whether the peers a step waits for still do.
GONE_CHECK_S = 0.1
# A post that has waited this long for the other copies of its step when the last one comes: its rank's
# process is looked at before the GO (Coordinator.poll_once). A look is ~25 us a peer (a signal and a
# /proc read), so the steps whose copies come together (the steady flow: a rendezvous of 3.6 us median,
# ~175 us in BENCHMARKS' slow rows) make none, and a step that waited pays a few percent of its wait.
POSTED_LOOK_S = 0.005


def _word(value: int) -> int:
    """A uint64 request field (step_id, binding_generation) as the int64 word with its bits: every rank
    maps the same value to the same word, and any value fits (an engine may send up to 2^64 - 1)."""
    return value - (1 << 64) if value >= 1 << 63 else value


@dataclass(frozen=True)
class Post:
    step_id: int
    generation: int
    num_reqs: int
    digest: int
    valid: bool
    expires_ns: int = 0  # time.monotonic_ns() (one clock for the whole node) past which it must not launch; 0: none
    fast: bool = False  # this rank can run the step on its kernel fast path (FlyDSL)
    queued: bool = False  # this rank's pre-launched copy of this step ran (server/prelaunch.py)
    queue_next: bool = False  # this rank would pre-launch the next step if this one goes

    @property
    def offers(self) -> int:
        return FAST * self.fast | QUEUED * self.queued | QUEUE_NEXT * self.queue_next


@dataclass(frozen=True)
class Verdict:
    go: bool
    reason: str  # empty on GO; identical text on every rank
    launch_seq: int
    # Every rank runs the fast path, or none does: its kernels exchange partial sums with their
    # peers' kernels, so one rank on the portable layers would leave the others waiting forever.
    fast: bool = False
    # Every rank answers from its pre-launched copy, or none does: the copies exchanged partial
    # sums with each other, and the ordinary run that replaces refused copies exchanges them again.
    # Copies that ran on some ranks only abort the step (SOME_COPIES).
    queued: bool = False
    # Every rank pre-launches the next step, or none does: one rank's queued step alone would
    # pair its collectives with a peer's ordinary step.
    queue_next: bool = False

    @staticmethod
    def agreed(go: bool, reason: str, launch_seq: int, bits: int) -> Verdict:
        return Verdict(go, reason, launch_seq, bool(bits & FAST), bool(bits & QUEUED), bool(bits & QUEUE_NEXT))


def digest(*arrays) -> int:
    """crc32 over the step's metadata bytes (positions, seq lens, block tables, slots)."""
    c = 0
    for a in arrays:
        c = zlib.crc32(memoryview(np.ascontiguousarray(a)).cast("B"), c)
    return c


def _ranks(mask: int) -> str:
    return ", ".join(str(r) for r in range(64) if mask >> r & 1)


def format_reason(step_id: int, reason: int, mask: int, deadline_ms: int) -> str:
    if reason == MISSING:
        return f"step {step_id}: rank(s) {_ranks(mask)} did not receive it within {deadline_ms} ms"
    if reason == INVALID:
        return f"step {step_id}: rank(s) {_ranks(mask)} rejected their copy of the step's inputs"
    if reason == DEADLINE:
        return f"step {step_id}: its deadline_ms passed on rank(s) {_ranks(mask)} before every rank had it"
    if reason == SOME_COPIES:
        return (f"step {step_id}: its pre-launched copy ran on rank(s) {_ranks(mask)} but not on every rank; those "
                "ranks checked its indices on the GPU only, on the bytes read there, so none runs it the ordinary "
                "way (the engine's own layers do)")
    if reason == EXITED:
        return (f"step {step_id}: rank(s) {_ranks(mask)} exited; no rank ran it, and the sidecar group cannot run "
                "steps until it is restarted")
    what = {STEP_ID: "the step id", NUM_REQS: "num_requests", GENERATION: "the KV binding generation",
            DIGEST: "the step's metadata (positions, seq lens, block tables, slots)"}[reason]
    return f"step {step_id}: ranks disagree on {what} (rank(s) {_ranks(mask)} differ from rank 0's view)"


class Board:
    """The shared-memory board; rank 0 creates it, the others attach by name.

    The name is random (`Board(None, ...)`), and rank 0 removes it once every rank has the board
    mapped (`unlink`): another local user can neither take the name first (a predictable name let
    them stop rank 0 from starting) nor open the board while the group runs, and a rank killed
    while serving leaves nothing in /dev/shm."""

    def __init__(self, name: str | None, world: int, create: bool) -> None:
        self.world = world
        self.rec_len = 7 + world
        words = HEADER + world * SLOT + RING * self.rec_len + 3 * world
        if create:
            self.shm = _create(name, words * 8)
        else:
            self.shm = AttachedSegment(name)  # rank 0 owns (and unlinks) the board; attaching claims nothing
        self.owner = create
        self.words = np.ndarray((words,), dtype=np.int64, buffer=self.shm.buf)
        if create:
            self.words[:] = 0
            self.words[0], self.words[1] = MAGIC, world
        elif self.words[0] != MAGIC or self.words[1] != world:
            raise RuntimeError(f"rendezvous board {name}: not a board for {world} ranks")
        self.slots = self.words[HEADER : HEADER + world * SLOT].reshape(world, SLOT)
        ring_end = HEADER + world * SLOT + RING * self.rec_len
        self.ring = self.words[HEADER + world * SLOT : ring_end].reshape(RING, self.rec_len)
        self.beats = self.words[ring_end : ring_end + world]
        self.pids = self.words[ring_end + world : ring_end + 2 * world]
        self.starts = self.words[ring_end + 2 * world :]

    @property
    def name(self) -> str:
        return self.shm.name

    def beat(self, rank: int) -> None:
        """This rank is alive and can take part in steps (its main thread, every half second)."""
        self.beats[rank] = time.monotonic_ns()

    def silent(self, rank: int, after_s: float) -> dict[int, float]:
        """{peer: seconds since its last beat} for the peers silent longer than after_s. A stopped or
        wedged peer never posts its copies, so every step would abort after the rendezvous deadline:
        this is how its peers can say so before an engine learns it one aborted step at a time.
        A peer that has not beaten yet (still starting) is not counted."""
        now = time.monotonic_ns()
        return {r: (now - int(b)) / 1e9 for r, b in enumerate(self.beats)
                if r != rank and b and now - int(b) > after_s * 1e9}

    def close(self) -> None:
        self.slots = self.ring = self.words = self.beats = self.pids = self.starts = None  # type: ignore[assignment]
        self.shm.close()
        self.unlink()

    def unlink(self) -> None:
        """Remove the board's name, if this rank made it and has not removed it yet: once every rank
        has it mapped (start-up), or when a rank stops while starting. The mappings stay valid."""
        if not self.owner:
            return
        self.owner = False
        unlink_segment(self.shm, "rendezvous board")


def _create(name: str | None, size: int) -> shared_memory.SharedMemory:
    """A new segment, created exclusively (O_EXCL): `name`, or a random one (retried on the unlikely
    collision with an existing entry). Never an existing segment, whoever made it. Its pages are reserved
    (new_segment): on a full /dev/shm the board's first store was a SIGBUS that killed rank 0 without a
    line; now OSError ENOSPC, and no segment left behind."""
    while True:
        try:
            return new_segment(size, name if name is not None else f"dspark-rdv-{secrets.token_hex(8)}")
        except FileExistsError:
            if name is not None:
                raise


class Rendezvous:
    """One rank's handle: `agree(post)` blocks until the coordinator's verdict for this post."""

    def __init__(self, board: Board, rank: int, deadline_ms: int, fatal_after_s: float = 30.0,
                 nap_s: float = NAP_S) -> None:
        self.board, self.rank, self.deadline_ms = board, rank, deadline_ms
        self.fatal_after_s, self.nap_s = fatal_after_s, nap_s  # nap_s: proto.doorbell.nap_for(device)
        self._seq = 0
        self._coordinator: Coordinator | None = None
        self._coordinator_gone = False
        # agree() calls under way: the rank loop's lock serializes them, close() (another thread) only reads.
        self._waiting = 0
        # Whether rank 0's process has exited (PeerProcesses: only once it was seen alive from here).
        self._peers = PeerProcesses(board, rank)
        # Before any step: the ranks' start-up barrier follows (server/app.py). The start time first: a
        # peer that reads a pid reads the start time that goes with it.
        board.starts[rank] = process_start(os.getpid())
        board.pids[rank] = os.getpid()
        if rank == 0 and board.world > 1:  # one rank agrees with itself (see agree)
            self._coordinator = Coordinator(board, deadline_ms, nap_s)
            self._coordinator.start()

    def peers_started(self) -> None:
        """Every rank is past the start-up barrier, so alive (server/app.py): rank 0's process is looked at
        now. Left to this rank's first step, a rank 0 that exited before it (killed or crashed while the
        group was idle) was never seen alive, so never judged exited (PeerProcesses), and that step waited
        out deadline + fatal_after_s for a verdict that could not come, unanswered until the launcher's kill.
        Before this rank's steps: its PeerProcesses is the rank loop's from then on. On rank 0 its coordinator's
        looks at the peers, for the same reason: those come every GONE_CHECK_S between steps, and a start-up
        shorter than that (--no-warmup) served before the look that sees a peer alive. A peer that exited
        then was never judged exited, and every step waited out --rendezvous-ms for its copy ("did not
        receive it") instead of being aborted at once, naming it."""
        if self.rank != 0:
            self._peers.gone(0)
        elif self._coordinator is not None:
            self._coordinator.peers_started()

    def agree(self, post: Post) -> Verdict:
        self._waiting += 1
        try:
            return self._agree(post)
        finally:
            self._waiting -= 1

    def _agree(self, post: Post) -> Verdict:
        if self.board.world == 1:  # nobody to disagree with
            late = post.expires_ns and time.monotonic_ns() > post.expires_ns
            reason = INVALID if not post.valid else DEADLINE if late else 0
            return Verdict.agreed(not reason, format_reason(post.step_id, reason, 1, self.deadline_ms) if reason else "",
                                  0, 0 if reason else post.offers)
        slot = self.board.slots[self.rank]
        self._seq += 2
        seq = self._seq
        slot[0] = seq - 1  # seqlock: writing
        slot[1:8] = (_word(post.step_id), _word(post.generation), post.num_reqs, int(post.valid), post.digest,
                     post.expires_ns, post.offers)
        slot[0] = seq
        col = 7 + self.rank
        posted = time.monotonic()
        give_up = posted + self.deadline_ms / 1e3 + self.fatal_after_s
        ring, words = self.board.ring, self.board.words
        next_look = posted + GONE_CHECK_S
        if self.rank != 0 and not self._peers.seen(0):  # until seen alive (PeerProcesses: once per posted pid)
            self._peers.gone(0)
        lower_timer_slack()
        while True:
            # Read before the ring: a verdict written before the coordinator stopped is found below.
            closed = words[CLOSED]
            hits = np.flatnonzero(ring[:, col] == seq)
            for i in hits:
                before = ring[i, 0]
                rec = ring[i].copy()
                if before == ring[i, 0] == rec[0] and rec[0] % 2 == 0 and rec[col] == seq:
                    go = rec[2] == GO
                    return Verdict.agreed(bool(go),
                                          "" if go else format_reason(int(rec[1]) % (1 << 64), int(rec[3]), int(rec[4]),
                                                                      self.deadline_ms),
                                          int(rec[5]), int(rec[6]))
            if closed:
                # Rank 0's coordinator stopped (its shutdown) with no verdict for this post: a GO would
                # cover every rank's post, this one included, so no rank launched it. Aborted at once,
                # instead of waiting out give_up and exiting (a clean stop of the group read as a crash).
                return Verdict(False, f"step {post.step_id}: rank 0's coordinator has stopped (the sidecar is "
                                      "shutting down); no rank ran it", 0)
            if self._coordinator_gone or self.rank != 0 and time.monotonic() > next_look:
                next_look = time.monotonic() + GONE_CHECK_S
                if self._coordinator_gone or self._peers.gone(0):
                    # Rank 0 died (SIGKILL, a crash) with this post pending: no verdict will ever come,
                    # and no GO for it was in the ring just above (a GO written in the instant before
                    # the death launches collectives that cannot complete without rank 0 anyway, so
                    # nothing is lost by not joining them). Without this the step went unanswered until
                    # give_up (30 s past the deadline) or the launcher's kill ended the engine's stream
                    # ~10 s later. Aborted now, and every later step at once: the group is going down.
                    self._coordinator_gone = True
                    return Verdict(False, f"step {post.step_id}: rank 0 (the rendezvous coordinator) has exited; "
                                          "no verdict can come and the sidecar group is going down", 0)
            if time.monotonic() > give_up:
                # The coordinator (rank 0) is gone or stuck; this rank cannot know whether its
                # peers launched, so it must not go on serving.
                raise RuntimeError(f"rank {self.rank}: no verdict from rank 0's coordinator in "
                                   f"{self.fatal_after_s + self.deadline_ms / 1e3:.1f} s")
            # Never a busy spin (see proto/doorbell.py), and a nap only for WARM_S: a verdict long in coming (a
            # peer missing: up to --rendezvous-ms, 60 s; a stalled coordinator: fatal_after_s more) is looked for
            # every SLEEP_S after that. Napping all along took about half a core per waiting rank on a GPU host.
            pause(time.monotonic() - posted, self.nap_s)

    def close(self, wait_s: float = 0.5) -> bool:
        """Stop rank 0's coordinator; whether the board may now be unmapped (Board.close).

        Not while a step still waits in agree(): the rank's teardown leaves a step it gave up on to the
        process exit, and that thread reads the board every nap, so unmapping under it was a segfault
        at what should be a clean stop (a --rendezvous-ms past the teardown's ~15 s, or a wedged
        coordinator). Rank 0's waiters see CLOSED and leave within a nap; a peer's wait only ends with
        rank 0's. Nor while the coordinator thread outlived its join. The caller then only unlinks,
        and the mapping goes with the process."""
        if self._coordinator is not None:
            self._coordinator.stop()
        until = time.monotonic() + wait_s
        while self._waiting and time.monotonic() < until:
            time.sleep(0.005)
        busy = [what for what, yes in (("a step waiting for its verdict", self._waiting),
                                       ("the coordinator thread", self._coordinator is not None
                                        and self._coordinator.is_alive())) if yes]
        if busy:
            log.warning("rank %d: the rendezvous board stays mapped until this process exits: %s still reads it",
                        self.rank, " and ".join(busy))
        return not busy


class PeerProcesses:
    """Which peer ranks' processes have exited, from the pids and start times on the board.

    A peer is judged only once its process was seen alive from here, with the start time it posted: a
    rank in a pid namespace of its own (sharing /dev/shm) posts a pid that names no process here, or
    another one, and must not read as exited (that would abort every step, or report a live group
    down). An exit is for good: a rank never comes back to a running group. One look at a time (a lock):
    rank 0's coordinator thread shares its instance with rank 0's main thread at the start-up barrier
    (Rendezvous.peers_started)."""

    def __init__(self, board: Board, rank: int) -> None:
        self.board, self.rank = board, rank
        self._seen: set[int] = set()
        self._gone: dict[int, int] = {}  # peer rank -> the pid it had
        # Peer rank -> the (pid, start time) it posted that a look found not to be a live process here
        # (a rank in a pid namespace of its own, or one already gone). That stays so for the pair: an
        # exited process does not come back, and one that takes the pid later is not the peer. Without
        # this, every step on ranks 1..3 looked at such a rank 0 again (a signal and a /proc read).
        self._not_here: dict[int, tuple[int, int]] = {}
        self._lock = threading.Lock()

    def gone(self, peer: int) -> bool:
        """Whether `peer`'s process has exited (False until it was seen alive from here once)."""
        with self._lock:
            return self._look(peer)

    def _look(self, peer: int) -> bool:
        if peer in self._gone:
            return True
        if peer == self.rank:  # this process: never a peer (and never counted among those seen)
            return False
        pid, start = int(self.board.pids[peer]), int(self.board.starts[peer])
        if pid <= 0:
            return False
        if peer not in self._seen:
            if self._not_here.get(peer) == (pid, start):  # looked at already: another pair on the board looks again
                return False
            if _exited(pid, start):
                self._not_here[peer] = (pid, start)
            else:
                self._seen.add(peer)
            return False
        if _exited(pid, start):
            self._gone[peer] = pid
            return True
        return False

    def seen(self, peer: int) -> bool:
        """Whether `peer`'s process was seen alive from here (no look made)."""
        return peer in self._seen

    def exited(self) -> dict[int, int]:
        """{peer rank: its pid} for every peer whose process has exited."""
        for r in range(self.board.world):
            if r != self.rank:
                self.gone(r)
        return dict(self._gone)

    @property
    def all_seen(self) -> bool:
        """Every peer was seen alive (or has exited): looks at the board's pids now only find exits."""
        return len(self._seen) == self.board.world - 1


class Coordinator(threading.Thread):
    """Rank 0's decider: watches every rank's slot and writes exactly one verdict per set of posts."""

    def __init__(self, board: Board, deadline_ms: int, nap_s: float = NAP_S) -> None:
        super().__init__(name="dspark-rendezvous", daemon=True)
        self.nap_s = nap_s
        self.board, self.deadline_s, self.deadline_ms = board, deadline_ms / 1e3, deadline_ms
        self._halt = threading.Event()
        self._handled = [0] * board.world
        self._first_seen: dict[int, float] = {}  # rank -> when its pending post was first seen
        self._next_rec = 0
        self._launch_seq = 0
        self._peers = PeerProcesses(board, 0)  # whose missing post will never come: its process exited
        self._next_look = 0.0

    def peers_started(self) -> None:
        """Every peer is past the start-up barrier, so alive: each is looked at now (Rendezvous.peers_started),
        on the caller's thread (PeerProcesses takes one look at a time)."""
        self._peers.exited()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=1.0)
        # Only once the thread has ended: a verdict it wrote after the mark could be a GO that the
        # peers who saw the mark would not follow.
        if not self.is_alive():
            self.board.words[CLOSED] = 1

    def run(self) -> None:
        try:
            self._decide()
        except Exception:  # noqa: BLE001  (one line and the exit: nothing else can stand in for rank 0's decider)
            # Without it no post of any rank gets a verdict: every step would wait out its deadline + fatal_after_s
            # and each rank raise then, one by one, while health still said SERVING. The launcher (or torchrun)
            # ends the other ranks when one exits, and the service restarts them all.
            log.exception("rank 0: the rendezvous coordinator failed; no step can be decided, exiting (3)")
            os._exit(3)

    def _decide(self) -> None:
        lower_timer_slack()
        last_busy = time.perf_counter()
        while not self._halt.is_set():
            seen = len(self._first_seen)
            if self.poll_once() or len(self._first_seen) > seen:  # a verdict, or a new post: more may follow
                last_busy = time.perf_counter()
            pause(time.perf_counter() - last_busy, self.nap_s)

    def _pending(self) -> dict[int, np.ndarray]:
        out = {}
        for r in range(self.board.world):
            slot = self.board.slots[r]
            rec = slot.copy()
            # The seqlock's re-check: word 0 read again after the copy. A post begun during the copy (a rank
            # that gave up on its step posting the next) changed it, and the copy may mix two posts; it is
            # read whole at the next poll. x86's in-order loads make word 0 read twice enough (helper 78).
            if rec[0] % 2 == 0 and rec[0] > self._handled[r] and slot[0] == rec[0]:
                out[r] = rec
        return out

    def poll_once(self) -> bool:
        """Decide if a decision is due; True when a verdict was written."""
        pending = self._pending()
        now = time.monotonic()
        for r in list(self._first_seen):
            if r not in pending:
                del self._first_seen[r]
        for r in pending:
            self._first_seen.setdefault(r, now)
        if not pending:
            if not self._peers.all_seen and now >= self._next_look:
                # Between steps, until every peer has been seen alive (their pids come with their
                # Rendezvous): only a peer seen alive is ever judged exited (PeerProcesses).
                self._next_look = now + GONE_CHECK_S
                self._peers.exited()
            return False
        world = self.board.world
        if len(pending) < world:
            if now - min(self._first_seen.values()) >= GONE_CHECK_S and now >= self._next_look:
                # A rank whose process has exited never posts: the step is aborted now, not at its
                # deadline (up to 60 s of --rendezvous-ms per step while the group goes down). Only
                # for a post that has waited a while: the look (a signal and a /proc read per rank)
                # stays off the path of the steps whose copies all come in time.
                self._next_look = now + GONE_CHECK_S
                gone = sum(1 << r for r in range(world) if r not in pending and self._peers.gone(r))
                if gone:
                    self._write(pending, int(pending[min(pending)][1]), ABORT, EXITED, gone)
                    return True
            if now - min(self._first_seen.values()) < self.deadline_s:
                return False
            missing = sum(1 << r for r in range(world) if r not in pending)
            step = int(pending[min(pending)][1])
            self._write(pending, step, ABORT, MISSING, missing)
            return True
        first = pending[0]
        step = int(first[1])
        for field, reason in ((1, STEP_ID), (3, NUM_REQS), (2, GENERATION)):
            mask = sum(1 << r for r in range(world) if pending[r][field] != first[field])
            if mask:
                self._write(pending, step, ABORT, reason, mask)
                return True
        # Before the digests: a rank that refused its copy posts digest 0, which would otherwise be
        # reported as a metadata disagreement instead of naming the rank that refused.
        invalid = sum(1 << r for r in range(world) if pending[r][4] == 0)
        if invalid:
            self._write(pending, step, ABORT, INVALID, invalid)
            return True
        mask = sum(1 << r for r in range(world) if pending[r][5] != first[5])
        if mask:
            self._write(pending, step, ABORT, DIGEST, mask)
            return True
        if now - min(self._first_seen.values()) >= POSTED_LOOK_S:
            # A rank that posted, then exited (killed, crashed) while its copy waited for the others: a GO
            # would send its peers into collectives it never joins (gloo fails them, and the rank exits
            # with the step unanswered; NCCL waits out --dist-timeout-s). Only the posts that waited are
            # looked at (POSTED_LOOK_S); an exit after that look, or after the GO, is not caught here.
            gone = sum(1 << r for r in range(world) if now - self._first_seen[r] >= POSTED_LOOK_S
                       and self._peers.gone(r))
            if gone:
                self._write(pending, step, ABORT, EXITED, gone)
                return True
        now = time.monotonic_ns()
        late = sum(1 << r for r in range(world) if 0 < pending[r][6] < now)
        if late:  # a step queued behind a stall must not launch (and write K/V) after the engine gave up
            self._write(pending, step, ABORT, DEADLINE, late)
            return True
        agreed = FAST | QUEUED | QUEUE_NEXT
        for r in range(world):
            agreed &= int(pending[r][7])
        # A rank whose own copy ran skipped the host's index checks (server/rank.py): without QUEUED agreed it
        # would run the ordinary way on a host copy of the metadata that nobody checked.
        ran = sum(1 << r for r in range(world) if int(pending[r][7]) & QUEUED)
        if ran and not agreed & QUEUED:
            self._write(pending, step, ABORT, SOME_COPIES, ran)
            return True
        self._launch_seq += 1
        self._write(pending, step, GO, 0, 0, agreed)
        return True

    def _write(self, pending: dict[int, np.ndarray], step: int, verdict: int, reason: int, mask: int,
               agreed: int = 0) -> None:
        rec = self.board.ring[self._next_rec % RING]
        self._next_rec += 1
        seq = int(rec[0]) + 2 if rec[0] % 2 == 0 else int(rec[0]) + 1
        rec[0] = seq - 1
        # The mask as its int64 word (_word; _ranks reads the bits of either): at --tp 64 (layout.MAX_TP) rank 63's
        # bit is the sign bit, and 2^63 itself raised OverflowError here, which ended this thread without a word
        # (every rank then waited out its give-up and exited).
        rec[1:7] = (step, verdict, reason, _word(mask), self._launch_seq, agreed)
        rec[7:] = [int(pending[r][0]) if r in pending else 0 for r in range(self.board.world)]
        rec[0] = seq
        for r, post in pending.items():
            self._handled[r] = int(post[0])
            self._first_seen.pop(r, None)
