"""The step agreement board: one verdict per set of posts, the same on every rank."""

from __future__ import annotations

import os
import threading
import time
import uuid

import pytest

from dspark_sidecar.server.processes import process_start
from dspark_sidecar.server.rendezvous import Board, Post, Rendezvous, _create
from helpers.waiting import wait_until

WORLD, DEADLINE_MS = 4, 150
# The `ranks` fixture's deadline, for steps every rank posts (a test that waits one out asks for DEADLINE_MS):
# agree_all starts the ranks' threads one after another, and a stall of 150 ms between two posts (a full
# collection late in the suite, a loaded 2-core box) aborted a step the test expects to go, or to abort for
# another reason. Below agree_all's join bound, so that a post that never comes still fails there.
ALL_POST_MS = 5000
SILENT_S = 5.0  # Board.silent's bound in the beat test: a fresh beat is read as silent only after a 5 s stall


@pytest.fixture()
def ranks(request):
    name = f"dspark-test-{uuid.uuid4().hex[:8]}"
    boards = [Board(name, WORLD, create=True)] + [Board(name, WORLD, create=False) for _ in range(WORLD - 1)]
    rdv = [Rendezvous(boards[r], r, getattr(request, "param", ALL_POST_MS)) for r in range(WORLD)]
    yield rdv
    for r in rdv:
        r.close()
    for b in boards[1:]:
        b.close()
    boards[0].close()


def agree_all(rdv, posts: dict[int, Post]):
    out = {}

    def one(r):
        t = time.monotonic()
        v = rdv[r].agree(posts[r])
        out[r] = (v, time.monotonic() - t)

    ts = [threading.Thread(target=one, args=(r,)) for r in posts]
    [t.start() for t in ts]
    [t.join(timeout=10) for t in ts]
    assert sorted(out) == sorted(posts), "a rank's agree() raised or hung"  # else all(...) on the rest passes
    return out


def test_go_when_every_rank_posts_the_same_step(ranks):
    out = agree_all(ranks, {r: Post(1, 1, 3, 99, True) for r in range(WORLD)})
    assert all(v.go and v.reason == "" for v, _ in out.values())
    assert len({v.launch_seq for v, _ in out.values()}) == 1
    # The next GO is the next launch (the ring's launch_seq word): one count per GO, the same on every rank.
    first = out[0][0].launch_seq
    out = agree_all(ranks, {r: Post(2, 1, 3, 99, True) for r in range(WORLD)})
    assert {v.launch_seq for v, _ in out.values()} == {first + 1}


def test_fast_path_only_when_every_rank_offers_it(ranks):
    """Its kernels exchange with their peers' kernels: all ranks on it, or none."""
    out = agree_all(ranks, {r: Post(11, 1, 3, 99, True, fast=True) for r in range(WORLD)})
    assert all(v.go and v.fast for v, _ in out.values())
    out = agree_all(ranks, {r: Post(12, 1, 3, 99, True, fast=r != 2) for r in range(WORLD)})
    assert all(v.go and not v.fast for v, _ in out.values())  # rank 2 could not: everyone goes portable


def test_each_offer_is_agreed_only_when_every_rank_makes_it(ranks):
    """Pre-launch at TP > 1 (server/prelaunch.py): answer from the queued copies, and queue the next
    step, on every rank or on none; each offer is agreed on its own."""
    out = agree_all(ranks, {r: Post(21, 1, 3, 99, True, queued=True, queue_next=True) for r in range(WORLD)})
    assert all(v.go and v.queued and v.queue_next and not v.fast for v, _ in out.values())
    out = agree_all(ranks, {r: Post(22, 1, 3, 99, True, queued=True, queue_next=r != 1) for r in range(WORLD)})
    assert all(v.go and v.queued and not v.queue_next for v, _ in out.values())
    out = agree_all(ranks, {r: Post(23, 1, 3, 99, True, queued=True, queue_next=r != 3, fast=True)
                            for r in range(WORLD)})
    assert all(v.go and v.queued and not v.queue_next and v.fast for v, _ in out.values())
    # An aborted step agrees to nothing, whatever every rank offered.
    out = agree_all(ranks, {r: Post(24 if r else 25, 1, 3, 99, True, queued=True, queue_next=True)
                            for r in range(WORLD)})
    assert all(not v.go and not v.queued and not v.queue_next for v, _ in out.values())


def test_a_copy_that_ran_on_some_ranks_only_aborts_the_step(ranks):
    """A rank whose own pre-launched copy ran skipped the host's index checks (its GPU checked the bytes it
    read; server/rank.py). Were the copies not agreed, it would run the step the ordinary way on a host copy
    of the metadata nobody checked (an engine write in between indexes past the cache inside the launch):
    the step is aborted on every rank, naming the ranks whose copy ran."""
    out = agree_all(ranks, {r: Post(22, 1, 3, 99, True, queued=r != 1, queue_next=True) for r in range(WORLD)})
    assert all(not v.go and not v.queued and not v.queue_next for v, _ in out.values())
    reasons = {v.reason for v, _ in out.values()}
    assert len(reasons) == 1 and "pre-launched copy ran on rank(s) 0, 2, 3 but not on every rank" in reasons.pop()
    out = agree_all(ranks, {r: Post(23, 1, 3, 99, True, queue_next=True) for r in range(WORLD)})  # none ran
    assert all(v.go and not v.queued and v.queue_next for v, _ in out.values())


def test_one_rank_agrees_with_itself_on_the_fast_path():
    name = f"dspark-test-{uuid.uuid4().hex[:8]}"
    board = Board(name, 1, create=True)
    rdv = Rendezvous(board, 0, DEADLINE_MS)
    try:
        assert rdv.agree(Post(1, 1, 1, 0, True, fast=True)).fast
        assert not rdv.agree(Post(2, 1, 1, 0, True, fast=False)).fast
        refused = rdv.agree(Post(3, 1, 1, 0, False, fast=True, queued=True, queue_next=True))
        assert not refused.go and not refused.fast and not refused.queued and not refused.queue_next
        both = rdv.agree(Post(4, 1, 1, 0, True, queued=True, queue_next=True))
        assert both.go and both.queued and both.queue_next
    finally:
        rdv.close()
        board.close()


def test_one_rank_refuses_a_step_whose_deadline_passed():
    """TP 1 agrees with itself, the step's deadline_ms included: a step queued behind a stall must not launch (and
    write K/V) after the engine gave up on it, as at TP > 1 (the coordinator's DEADLINE)."""
    board = Board(f"dspark-test-{uuid.uuid4().hex[:8]}", 1, create=True)
    rdv = Rendezvous(board, 0, DEADLINE_MS)
    try:
        late = rdv.agree(Post(8, 1, 1, 0, True, expires_ns=time.monotonic_ns() - 1, fast=True))
        assert not late.go and not late.fast and "step 8: its deadline_ms passed on rank(s) 0" in late.reason, late
        assert rdv.agree(Post(9, 1, 1, 0, True, expires_ns=time.monotonic_ns() + 60 * 10**9)).go
    finally:
        rdv.close()
        board.close()



def test_a_step_may_launch_at_its_deadline_s_own_nanosecond_on_one_rank_as_on_many(monkeypatch):
    """expires_ns is the instant past which a step must not launch: at it exactly, it still goes. TP 1 (agree's own
    check) and TP > 1 (the coordinator's DEADLINE) draw that edge alike, so a step's fate does not hang on --tp."""
    import dspark_sidecar.server.rendezvous as rendezvous_mod
    from dspark_sidecar.server.rendezvous import ABORT, DEADLINE, GO, Coordinator

    now = time.monotonic_ns()
    # The module's clock only (its other uses of `time` as they are): no other thread of this process sees it stop.
    frozen = type("Clock", (), {"__getattr__": lambda _, name: getattr(time, name), "monotonic_ns": lambda _: now})()
    monkeypatch.setattr(rendezvous_mod, "time", frozen)
    one = Board(f"dspark-test-{uuid.uuid4().hex[:8]}", 1, create=True)
    rdv = Rendezvous(one, 0, DEADLINE_MS)
    two = Board(f"dspark-test-{uuid.uuid4().hex[:8]}", 2, create=True)  # no pids posted: no process is looked at
    c = Coordinator(two, 3_600_000)  # not started: polled by hand
    try:
        assert rdv.agree(Post(8, 1, 1, 0, True, expires_ns=now)).go
        late = rdv.agree(Post(9, 1, 1, 0, True, expires_ns=now - 1))
        assert not late.go and "step 9: its deadline_ms passed on rank(s) 0" in late.reason, late
        for i, (expires, verdict) in enumerate(((now, GO), (now - 1, ABORT))):
            seq = 2 * (i + 1)
            two.slots[0][:] = (seq, 7, 1, 2, 1, 9, 0, 0)
            two.slots[1][:] = (seq, 7, 1, 2, 1, 9, expires, 0)
            assert c.poll_once()
            rec = two.ring[i]
            assert rec[2] == verdict and (verdict == GO or (rec[3], rec[4]) == (DEADLINE, 0b10)), rec
    finally:
        rdv.close()
        one.close()
        two.close()

@pytest.mark.parametrize("posts,words", [
    ({r: Post(2, 1, 3 if r != 2 else 4, 99, True) for r in range(WORLD)}, "disagree on num_requests"),
    ({r: Post(3, 1 if r != 1 else 2, 3, 99, True) for r in range(WORLD)}, "KV binding generation"),
    ({r: Post(4, 1, 3, 99 if r != 3 else 98, True) for r in range(WORLD)}, "metadata"),
    ({r: Post(5, 1, 3, 99, r != 0) for r in range(WORLD)}, "rank(s) 0 rejected"),
    # A refused copy posts digest 0 (RankLoop._run): named as refused, not as a metadata disagreement.
    ({r: Post(7, 1, 3, 99 if r != 2 else 0, r != 2) for r in range(WORLD)}, "rank(s) 2 rejected"),
    ({r: Post(6, 1, 3, 99, True, expires_ns=time.monotonic_ns() - 1 if r == 1 else 0) for r in range(WORLD)},
     "deadline_ms passed on rank(s) 1"),
])
def test_every_rank_aborts_with_one_reason(ranks, posts, words):
    out = agree_all(ranks, posts)
    reasons = {v.reason for v, _ in out.values()}
    assert not any(v.go for v, _ in out.values())
    assert len(reasons) == 1 and words in reasons.pop()


@pytest.mark.parametrize("ranks", [DEADLINE_MS], indirect=True)
def test_missing_rank_aborts_the_others_within_the_deadline(ranks):
    out = agree_all(ranks, {r: Post(7, 1, 3, 99, True) for r in range(WORLD - 1)})
    assert len(out) == WORLD - 1
    assert {v.reason for v, _ in out.values()} == {f"step 7: rank(s) 3 did not receive it within {DEADLINE_MS} ms"}
    assert max(dt for _, dt in out.values()) < DEADLINE_MS / 1e3 + 2.0
    # the late copy cannot launch alone either; it is answered on its own post (the ranks it waited for are
    # named), never by the record written for the others' copies, which does not cover it
    late = agree_all(ranks, {3: Post(7, 1, 3, 99, True)})
    assert not late[3][0].go
    assert late[3][0].reason == f"step 7: rank(s) 0, 1, 2 did not receive it within {DEADLINE_MS} ms", late[3][0]


def test_step_ids_and_generations_past_2_63_are_agreed_like_any_other(ranks):
    """Both are uint64 in the proto and the board holds int64 words: a value past 2^63 used to raise
    in agree(), which the rank loop takes for a failed launch, and the whole group exited."""
    big, gen = (1 << 64) - 1, 1 << 63
    out = agree_all(ranks, {r: Post(big, gen, 3, 99, True) for r in range(WORLD)})
    assert all(v.go for v, _ in out.values())
    out = agree_all(ranks, {r: Post(big - (r == 1), gen, 3, 99, True) for r in range(WORLD)})
    # named as the engine sent it, not as the board's int64 word (-1)
    assert all(not v.go and v.reason.startswith(f"step {big}: ranks disagree on the step id") for v, _ in out.values())


def test_a_post_rewritten_while_the_coordinator_copies_it_is_read_at_the_next_poll():
    """A seqlock's reader checks the sequence again after the copy: a rank that begins its next post while
    the coordinator copies its slot (word 0 still the old, even sequence when read first) would give a
    record mixing two posts, judged as one (helper 78). Stood in: the copy sees sequence 4 with half the
    new post, word 0 is 5 (being written) when read again."""
    from dspark_sidecar.server.rendezvous import Coordinator

    board = Board(f"dspark-test-{uuid.uuid4().hex[:8]}", 2, create=True)
    real = board.slots
    try:
        coord = Coordinator(board, DEADLINE_MS)
        torn = real[1].copy()
        torn[:2] = (4, 8)  # sequence 4, and the step id of the next post already there

        class Rewritten:
            def copy(self):
                return torn.copy()

            def __getitem__(self, i):
                return 5 if i == 0 else torn[i]

        board.slots = [real[0], Rewritten()]
        assert 1 not in coord._pending()
        board.slots = [real[0], torn]  # the post completed: read whole
        assert coord._pending()[1][1] == 8
    finally:
        board.slots = real
        board.close()


def test_a_post_still_being_written_is_not_judged():
    """The seqlock's reader half, its first check: a post whose sequence word is odd is still being written (its rank
    stores the fields between the odd word and the even one). Taken as it was, the coordinator judged fields half of
    the new post and half of the last, and its verdict covered a sequence its rank never waits for: the peers could
    go on a GO that the writing rank never saw, its own copy then judged again alone (and aborted). The TP-2 walk
    (test_dataplane_walk_tp.py) catches it only as timing falls; here it is stood in, polled by hand."""
    from dspark_sidecar.server.rendezvous import GO, Coordinator

    board = Board(f"dspark-test-{uuid.uuid4().hex[:8]}", 2, create=True)  # no pids posted: no process is looked at
    try:
        c = Coordinator(board, 3_600_000)  # not started; the deadline an hour away: nothing is due but a GO
        board.slots[0][:] = (2, 7, 1, 2, 1, 9, 0, 0)  # rank 0's copy of step 7
        board.slots[1][:] = (1, 7, 1, 2, 1, 9, 0, 0)  # rank 1's, its sequence word odd: still being written
        assert not c.poll_once(), f"a verdict over a post still being written: {board.ring[0]}"
        board.slots[1][0] = 2  # written whole
        assert c.poll_once()
        rec = board.ring[0]
        assert rec[2] == GO and list(rec[7:]) == [2, 2], rec  # it covers the sequence rank 1 waits for
    finally:
        board.close()


class _Recorded:
    """A slot or ring record whose writes are recorded with the sequence word they were made under."""

    def __init__(self, row, writes: list) -> None:
        self.row, self.writes = row, writes

    def __getitem__(self, key):
        return self.row[key]

    def __setitem__(self, key, value) -> None:
        self.writes.append(("seq", int(value)) if key == 0 else ("fields", int(self.row[0])))
        self.row[key] = value


def test_a_post_and_a_verdict_are_each_written_under_an_odd_sequence_word():
    """The writers' half of the seqlocks: a post's and a verdict's words are written while their sequence word is
    odd, and the even one comes last. Written under the old, even word, a coordinator (or a rank) copying the
    record meanwhile took half of one post (or verdict) and half of the next for one."""
    from dspark_sidecar.server.rendezvous import Coordinator

    name = f"dspark-test-{uuid.uuid4().hex[:8]}"
    boards = [Board(name, 2, create=True), Board(name, 2, create=False)]
    rank1 = Rendezvous(boards[1], 1, DEADLINE_MS, fatal_after_s=3600.0)  # no rank 0 Rendezvous: decided by hand
    real_slots, real_ring = boards[1].slots, boards[0].ring
    post_writes: list = []
    verdict_writes: list = []
    boards[1].slots = [real_slots[0], _Recorded(real_slots[1], post_writes)]
    c = Coordinator(boards[0], DEADLINE_MS)  # not started: polled by hand
    out: list = []
    th = threading.Thread(target=lambda: out.append(rank1.agree(Post(4, 1, 2, 9, True))), daemon=True)
    try:
        th.start()
        wait_until(lambda: real_slots[1][0] == 2, 10, "rank 1 posted", interval_s=0.005)
        assert post_writes == [("seq", 1), ("fields", 1), ("seq", 2)], post_writes
        boards[0].slots[0][:] = (2, 4, 1, 2, 1, 9, 0, 0)  # rank 0's copy of step 4
        boards[0].ring = type("Ring", (), {"__getitem__": lambda _, i: _Recorded(real_ring[i], verdict_writes)})()
        assert c.poll_once()
        assert verdict_writes == [("seq", 1), ("fields", 1), ("fields", 1), ("seq", 2)], verdict_writes
        th.join(10)
        assert out and out[0].go, out
    finally:
        boards[0].ring, boards[1].slots = real_ring, real_slots
        th.join(10)
        _close_unless_read(th, rank1, boards)


def test_a_copy_that_just_came_costs_no_look_at_the_missing_ranks_processes(monkeypatch):
    """The look at a missing rank's process (a signal and a /proc read a rank) is made only for a post that has
    waited GONE_CHECK_S: a step whose first copy the coordinator has just seen (its peers' come microseconds
    later in the steady flow) makes none, however long ago the last look was."""
    import dspark_sidecar.server.rendezvous as rendezvous_mod

    board = Board(f"dspark-test-{uuid.uuid4().hex[:8]}", 2, create=True)
    try:
        c = _idle_coordinator(board)
        looks: list[int] = []
        real = rendezvous_mod._exited
        monkeypatch.setattr(rendezvous_mod, "_exited", lambda pid, start=0: looks.append(pid) or real(pid, start))
        c._next_look = 0.0  # as if GONE_CHECK_S had passed since the last look
        board.slots[0][:] = (2, 7, 1, 2, 1, 9, 0, 0)  # rank 0's copy of step 7, seen now; rank 1's to come
        assert not c.poll_once()
        assert looks == [], "a look at the missing rank's process for a copy seen this very poll"
        board.slots[1][:] = (2, 7, 1, 2, 1, 9, 0, 0)
        assert c.poll_once() and looks == []
    finally:
        board.close()


@pytest.mark.parametrize("waiter", [0, 1])
def test_a_board_is_not_unmapped_under_a_step_still_waiting_for_its_verdict(waiter):
    """A rank's teardown leaves a step it gave up on to the process exit (rank.py); that thread still reads
    the board every nap, and unmapping it under the thread was a segfault at a clean stop. Rank 0's waiter
    leaves once its coordinator has stopped (CLOSED); a peer's wait ends only with rank 0's."""
    name = f"dspark-test-{uuid.uuid4().hex[:8]}"
    boards = [Board(name, 2, create=True), Board(name, 2, create=False)]
    rdv = [Rendezvous(boards[r], r, 30_000) for r in range(2)]  # a deadline past any teardown
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("v", rdv[waiter].agree(Post(5, 1, 1, 9, True))))
    t.start()
    # Posted (its slot's seqlock word even: its first post's) and waiting, its peer never posting. By state, not
    # by a nap: a close() that came first (a loaded box) found no step waiting, which is not this case.
    wait_until(lambda: rdv[waiter]._waiting and boards[waiter].slots[waiter][0] == 2, 10,
               "the step posted its copy and waits", interval_s=0.005)
    try:
        if waiter == 1:
            assert rdv[1].close(wait_s=0.2) is False  # its wait goes on: the board must stay mapped
            assert t.is_alive()
        assert rdv[0].close() is True  # the coordinator stopped; rank 0 has nobody waiting now
        t.join(5)
        assert not t.is_alive(), "the waiting step did not end with the coordinator"
        assert not out["v"].go and "rank 0's coordinator has stopped" in out["v"].reason, out["v"]
        assert rdv[1].close() is True
    finally:
        t.join(5)
        boards[1].close()
        boards[0].close()


def test_a_peer_that_stops_beating_is_seen_silent_by_the_others_and_back_when_it_beats(ranks):
    """Silence is judged past SILENT_S, far above any stall of this thread, and rank 1's last beat is made
    10 s old through its own mapping instead of slept for: with a 50 ms bound and a 0.1 s nap, a stall of
    50 ms between a fresh beat and the look (a full collection late in the suite, a descheduled thread on
    a loaded 2-core box) read the fresh beat as a silent peer."""
    boards = [r.board for r in ranks]
    for r in range(WORLD - 1):  # rank 3 has not beaten yet (still starting): not counted
        boards[r].beat(r)
    assert boards[0].silent(0, SILENT_S) == {}
    boards[1].beats[1] = time.monotonic_ns() - 10 * 10**9  # rank 1 stopped beating 10 s ago
    boards[0].beat(0)
    boards[2].beat(2)
    # Seen through rank 2's own mapping of the board: rank 1's last beat is 10 s old.
    silent = boards[2].silent(2, SILENT_S)
    assert list(silent) == [1] and 10 <= silent[1] < 60, silent
    assert list(boards[0].silent(0, SILENT_S)) == [1] and boards[1].silent(1, SILENT_S) == {}  # own beat never counts
    t0 = time.monotonic_ns()
    boards[1].beat(1)
    assert t0 <= boards[2].beats[1] <= time.monotonic_ns()  # the beat is the time now, seen by the peers
    assert boards[2].silent(2, SILENT_S) == {}


def test_a_board_s_name_is_random_and_never_an_existing_entry(caplog):
    """The name used to derive from the socket dir: another local user could create it first and stop
    rank 0 from starting, and rank 0 removed any board of that name it found (taking it for stale)."""
    a, b = Board(None, 2, create=True), Board(None, 2, create=True)
    try:
        assert a.name != b.name and a.name.startswith("dspark-rdv-") and len(a.name) == len("dspark-rdv-") + 16
        with pytest.raises(FileExistsError):
            Board(a.name, 2, create=True)  # created exclusively: never someone else's segment
        peer = Board(a.name, 2, create=False)
        a.unlink()  # every rank has it mapped: the name goes, the mappings stay
        assert not os.path.exists(f"/dev/shm/{a.name}")
        peer.beat(1)
        assert a.beats[1] == peer.beats[1] != 0
        with pytest.raises(FileNotFoundError):
            Board(a.name, 2, create=False)
        peer.close()
        a.close()  # no second unlink, no warning
        assert "was removed by another process" not in caplog.text, "the maker removed its board's name twice"
    finally:
        b.close()


def test_only_the_board_s_maker_removes_its_name_when_it_closes_it():
    """A peer's close unmaps its own view only (rank 0 owns the board); the maker's close removes a name it has
    not removed yet, so that a board closed before start-up's unlink leaves nothing in /dev/shm."""
    a = Board(None, 2, create=True)
    peer = Board(a.name, 2, create=False)
    try:
        peer.close()
        assert os.path.exists(f"/dev/shm/{a.name}"), "a peer's close removed rank 0's board"
    finally:
        a.close()
    assert not os.path.exists(f"/dev/shm/{a.name}"), "the maker's close left its board in /dev/shm"


def test_a_board_removed_by_someone_else_is_not_reported_leaked_at_exit(tmp_path):
    """An operator cleaning /dev/shm removed the board's name first: the maker's unlink says so, and takes the
    board off the resource tracker's books. Left on them, the tracker warned of a "leaked" segment at the
    process's exit and tried to remove it again."""
    import subprocess
    import sys

    probe = tmp_path / "probe.py"
    probe.write_text("import os\n"
                     "from dspark_sidecar.server.rendezvous import Board\n"
                     "b = Board(None, 2, create=True)\n"
                     "os.unlink(f'/dev/shm/{b.name}')\n"
                     "b.close()\n")
    proc = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "was removed by another process" in proc.stderr, proc.stderr[-2000:]
    assert "leaked shared_memory" not in proc.stderr, proc.stderr[-2000:]


def test_a_segment_that_is_not_a_board_for_this_many_ranks_is_refused_at_attach():
    """Every rank reads the words at the offsets its world gives: a board made for another world (or another
    segment) would be read as slots and verdicts that no coordinator wrote."""
    a = Board(None, 2, create=True)
    other = _create(None, 8 * 1024)  # zeroed: no magic word
    try:
        with pytest.raises(RuntimeError, match="not a board for 1 ranks"):
            Board(a.name, 1, create=False)  # a board for 2 ranks
        with pytest.raises(RuntimeError, match="not a board for 2 ranks"):
            Board(other.name, 2, create=False)
        # Its world word as a board's for 2 ranks, but no magic: still another segment, not a board.
        import numpy as np

        np.ndarray((2,), dtype=np.int64, buffer=other.buf)[1] = 2
        with pytest.raises(RuntimeError, match="not a board for 2 ranks"):
            Board(other.name, 2, create=False)
    finally:
        other.close()
        other.unlink()
        a.close()


def test_a_board_on_a_full_dev_shm_is_refused_with_enospc_not_a_bus_error(tmp_path):
    """Rank 0 makes the board at start-up on a /dev/shm that NCCL and the engine share (a container's 64 MiB
    default): ftruncate reserves no page, so the segment was still made and zeroing it was a SIGBUS that killed
    rank 0 without a line. Its pages are reserved now (as proto.memory.new_segment's): OSError ENOSPC, a reason
    the rank prints, and no segment left behind."""
    from helpers.full_shm import assert_refused_with_enospc

    assert_refused_with_enospc(tmp_path, "from dspark_sidecar.server.rendezvous import Board",
                               "Board(None, 4, create=True)")


def _close_unless_read(th: threading.Thread | None, rdv: Rendezvous, boards: list[Board]) -> None:
    """Close a test's rendezvous and boards, unless `th` still waits in agree() (the test failed: it waits for a
    give-up set an hour away, so that the wrong path shows as a hang guard's failure): unmapping the board under
    it would crash this process. Its name goes all the same; the mappings go with the process."""
    if th is not None and th.is_alive():
        boards[0].unlink()
        return
    rdv.close()
    for b in boards[1:]:
        b.close()
    boards[0].close()


@pytest.mark.parametrize("posted_first", [False, True])
def test_a_post_left_without_a_verdict_by_a_stopped_coordinator_is_aborted_at_once(posted_first):
    """Rank 0 shuts down its coordinator (server/teardown.py) while a peer still posts: a step left
    pending, or one queued behind the shutdown (refused copies are posted too). No verdict can come,
    and none covering the post was written, so no rank launched it: the peer aborts it. It used to
    wait out deadline + fatal_after_s (30 s), then exit 3 (a group's clean stop ended as a failure)."""
    name = f"dspark-test-{uuid.uuid4().hex[:8]}"
    boards = [Board(name, 2, create=True), Board(name, 2, create=False)]
    # The give-up an hour away: a peer that waited for it would still wait at the hang guard below. The
    # coordinator's deadline an hour away too: with DEADLINE_MS (150 ms) a stall of the test's thread between
    # the peer's post and the close (a loaded box) had the coordinator abort the post "did not receive it" first.
    rdv = [Rendezvous(boards[0], 0, 3_600_000), Rendezvous(boards[1], 1, DEADLINE_MS, fatal_after_s=3600.0)]
    out: list = []

    def peer():
        try:
            out.append(rdv[1].agree(Post(9, 1, 3, 99, True)))
        except Exception as exc:  # noqa: BLE001
            out.append(exc)

    try:
        th = threading.Thread(target=peer, daemon=True)
        if posted_first:  # posted, not yet decided (rank 0 never posts it) when the coordinator stops
            th.start()
            # By state, not by a nap: a close that came before the post is the other case.
            wait_until(lambda: rdv[1]._waiting and boards[1].slots[1][0] == 2, 10, "the peer posted its copy and waits",
                       interval_s=0.005)
            rdv[0].close()
        else:
            rdv[0].close()
            th.start()
        th.join(timeout=30)  # a hang guard only
        assert out, "the peer still waits for a verdict from a coordinator that has stopped"
        verdict = out[0]
        assert not isinstance(verdict, Exception), verdict
        # The reason names the path: the coordinator's stop, not its deadline's abort (MISSING) nor the give-up.
        assert not verdict.go and "step 9" in verdict.reason and "stopped" in verdict.reason, verdict.reason
    finally:
        th.join(timeout=10)
        _close_unless_read(th, rdv[1], boards)


def test_a_peer_waiting_on_a_coordinator_whose_process_exited_aborts_at_once_and_after(monkeypatch):
    """Rank 0 SIGKILLed with a peer's post pending: no verdict will ever come and no rank launched the
    step. The peer used to wait out deadline + fatal_after_s, its step unanswered (tests/server/
    test_coordinator_death.py has the real processes); a coordinator merely slow (alive) is still waited for."""
    import subprocess
    import sys

    from dspark_sidecar.server import rendezvous as rdv_mod

    name = f"dspark-test-{uuid.uuid4().hex[:8]}"
    boards = [Board(name, 2, create=True), Board(name, 2, create=False)]
    # No Rendezvous for rank 0: nothing decides, as with a coordinator that is gone. The deadline and the
    # give-up an hour away: a step left to them, not aborted by the exit, still waits at the hang guards below.
    peer = Rendezvous(boards[1], 1, 3_600_000, fatal_after_s=3600.0)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # exited and reaped: its pid names no process
    th = None
    try:
        # A pid never seen alive (rank 0 in a pid namespace of its own) is not read as rank 0 gone.
        boards[0].pids[0] = gone.pid
        blind = Rendezvous(boards[1], 1, 300, fatal_after_s=0.5)
        with pytest.raises(RuntimeError, match="no verdict from rank 0"):
            blind.agree(Post(2, 1, 2, 9, True))  # the old give-up, not an abort
        boards[0].pids[0] = os.getpid()  # alive: the peer keeps waiting (the deadline is the coordinator's)
        out: list = []
        th = threading.Thread(target=lambda: out.append(peer.agree(Post(3, 1, 2, 9, True))), daemon=True)
        th.start()
        # Its first look (made as it posts) saw rank 0's process alive: by state, not by the join below alone. A
        # step that had not looked yet when the pid changed (its thread late on a loaded box) never saw rank 0
        # alive, and waited at the hang guard for a give-up an hour away.
        wait_until(lambda: peer._peers.seen(0), 10, "the waiting peer saw rank 0's process alive", watch=th,
                   interval_s=0.005)
        th.join(timeout=0.6)
        assert th.is_alive() and not out
        boards[0].pids[0] = gone.pid
        th.join(timeout=30)  # a hang guard only
        assert out and not out[0].go and "rank 0 (the rendezvous coordinator) has exited" in out[0].reason, out
        # The next step at once: on the exit already seen, without waiting for the next look at rank 0's
        # process (an hour away now: a step that waited for it would still wait at the hang guard).
        monkeypatch.setattr(rdv_mod, "GONE_CHECK_S", 3600.0)
        th = threading.Thread(target=lambda: out.append(peer.agree(Post(4, 1, 2, 9, True))), daemon=True)
        th.start()
        th.join(timeout=30)
        assert len(out) == 2, "the next step waited for a look at rank 0's process, or its give-up"
        assert not out[1].go and "has exited" in out[1].reason, out[1]
    finally:
        if th is not None:
            th.join(timeout=1)
        _close_unless_read(th, peer, boards)


def test_a_rank_0_that_exits_before_a_peer_s_first_step_is_judged_exited_at_that_step():
    """The peer's rendezvous looks at rank 0 once every rank is past the start-up barrier (peers_started),
    not first at its first step: a rank 0 already gone then was never seen alive, and the step waited out
    deadline + fatal_after_s (tests/server/test_coordinator_death.py has the real processes)."""
    name = f"dspark-test-{uuid.uuid4().hex[:8]}"
    boards = [Board(name, 2, create=True), Board(name, 2, create=False)]
    peer = Rendezvous(boards[1], 1, 5000, fatal_after_s=5.0)  # no rank 0 Rendezvous: no verdict comes
    child = _child()
    try:
        _post_peer(boards[0], 0, child.pid, process_start(child.pid))
        peer.peers_started()  # past the barrier: rank 0 alive
        child.kill()
        child.wait()
        out = peer.agree(Post(2, 1, 2, 9, True))  # the give-up (no rank 0 Rendezvous) would raise instead
        assert not out.go and "rank 0 (the rendezvous coordinator) has exited" in out.reason, out
    finally:
        child.kill()
        child.wait()
        peer.close()
        boards[1].close()
        boards[0].close()


def _child(code: str = "import time; time.sleep(60)"):
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-c", code])


def _proc_state(pid: int) -> str:
    """The one-letter state of /proc/PID/stat ("Z": a zombie)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_a_coordinator_that_fails_ends_rank_0_at_once_saying_why(monkeypatch, caplog):
    """Rank 0's decider is a thread: an exception out of it ended the thread alone, after which no post of any rank
    got a verdict, each step waited out its deadline + fatal_after_s, and health said SERVING all along. The rank
    exits (3) with one line instead: the launcher ends its peers and the service restarts them."""
    import logging

    import dspark_sidecar.server.rendezvous as rendezvous_mod
    from dspark_sidecar.server.rendezvous import Coordinator

    exits = []

    class Exited(BaseException):
        pass

    def _exit(code):
        exits.append(code)
        raise Exited  # os._exit does not return: neither does this, out of run()

    monkeypatch.setattr(rendezvous_mod.os, "_exit", _exit)
    board = Board(f"dspark-test-{uuid.uuid4().hex[:8]}", 2, create=True)
    try:
        c = Coordinator(board, 5000)

        def broken():
            raise RuntimeError("slot 1 unreadable")

        monkeypatch.setattr(c, "poll_once", broken)
        with caplog.at_level(logging.ERROR, logger="dspark_sidecar.rendezvous"), pytest.raises(Exited):
            c.run()  # on this thread: what the thread would do
        assert exits == [3]
        assert "the rendezvous coordinator failed; no step can be decided, exiting (3)" in caplog.text
        assert "slot 1 unreadable" in caplog.text  # the traceback with it
    finally:
        board.close()


def _idle_coordinator(board: Board):
    """A Coordinator of `board`'s two ranks (both this process), not started (polled by hand), its first poll
    made: nothing posted, rank 1 seen alive."""
    from dspark_sidecar.server.rendezvous import Coordinator, process_start

    for r in range(2):
        _post_peer(board, r, os.getpid(), process_start(os.getpid()))
    c = Coordinator(board, 5000)
    assert not c.poll_once() and c._peers.all_seen
    return c


def _post_peer(board: Board, rank: int, pid: int, start: int) -> None:
    board.starts[rank] = start
    board.pids[rank] = pid


def test_peer_processes_tell_an_exit_a_zombie_and_a_reused_pid_from_a_stopped_or_foreign_peer():
    """PeerProcesses (server/health.py watch_peers, the coordinator): a peer is exited when its pid names no
    process, a zombie (kill(pid, 0) still succeeds on it), or a process with another start time (the pid
    reused). A stopped peer is alive (the silence timeout is for it); a pid never seen alive with its start
    time (a rank in a pid namespace of its own) is never judged."""
    import signal

    from dspark_sidecar.server.rendezvous import PeerProcesses, process_start

    name = f"dspark-test-{uuid.uuid4().hex[:8]}"
    board = Board(name, 5, create=True)
    kids = [_child() for _ in range(3)]
    try:
        stopped, zombie, killed = kids
        for r, k in ((1, stopped), (2, zombie), (3, killed)):
            _post_peer(board, r, k.pid, process_start(k.pid))
            assert process_start(k.pid) > 0
        # Rank 4 posted this process's pid with a start time that is not ours: another process here.
        _post_peer(board, 4, os.getpid(), process_start(os.getpid()) + 1)
        peers = PeerProcesses(board, 0)
        assert peers.exited() == {}  # all seen alive (but rank 4, never seen)
        os.kill(stopped.pid, signal.SIGSTOP)
        os.kill(zombie.pid, signal.SIGKILL)
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait()
        wait_until(lambda: _proc_state(zombie.pid) == "Z", 5,
                   lambda: f"the killed child a zombie: state {_proc_state(zombie.pid)}")
        assert peers.exited() == {2: zombie.pid, 3: killed.pid}
        # A pid reused by another process: same pid, another start time.
        board.starts[1] = process_start(stopped.pid) - 1
        assert 1 in peers.exited()
        # An exit is for good, whatever the board says later.
        board.pids[3] = os.getpid()
        board.starts[3] = process_start(os.getpid())
        assert 3 in peers.exited()
    finally:
        for k in kids:
            k.kill()  # SIGKILL ends a stopped process too
            k.wait()
        board.close()


@pytest.mark.parametrize("when", ["before_the_post", "while_the_post_waits"])
def test_the_coordinator_aborts_a_step_at_once_when_a_missing_rank_s_process_exited(when):
    """A rank killed while its peers' copies of a step wait for its post: it never comes. The coordinator
    waited out the whole deadline (up to 60 s of --rendezvous-ms, every step, while the group went down);
    now it aborts at once, naming the exited rank. A missing rank that is alive is still waited for."""
    from dspark_sidecar.server.rendezvous import process_start

    name = f"dspark-test-{uuid.uuid4().hex[:8]}"
    # The deadline an hour away: a step left to it, not aborted on the exit, still waits at the hang guard below.
    deadline_ms = 3_600_000
    boards = [Board(name, 2, create=True), Board(name, 2, create=False)]
    rank0 = Rendezvous(boards[0], 0, deadline_ms)
    peer = _child()
    try:
        _post_peer(boards[1], 1, peer.pid, process_start(peer.pid))
        # The ranks idle until the coordinator has seen rank 1's process alive (a look every GONE_CHECK_S
        # between steps): only a peer seen alive is ever judged exited, so a kill before that look would
        # leave the step to its deadline. Waited for, not slept for: a loaded box may run that look late.
        seen_by = time.monotonic() + 10
        while not rank0._coordinator._peers.seen(1):
            assert time.monotonic() < seen_by, "the coordinator never saw rank 1's process alive"
            time.sleep(0.01)
        out: list = []
        th = threading.Thread(target=lambda: out.append(rank0.agree(Post(7, 1, 2, 9, True))), daemon=True)
        if when == "before_the_post":  # the common case: a peer never missing until it died
            peer.kill()
            peer.wait()
            th.start()
        else:
            th.start()
            th.join(timeout=1.0)
            assert th.is_alive() and not out  # rank 1 alive: its post may still come
            peer.kill()
            peer.wait()
        th.join(timeout=30)  # a hang guard only: the abort comes GONE_CHECK_S (0.1 s) after the post waits
        assert out, "the step was left to its deadline, not aborted on the exit"
        assert not out[0].go, out
        # EXITED, not the deadline's MISSING ("did not receive it"): the abort came from the look at the process.
        assert "rank(s) 1 exited" in out[0].reason and "step 7" in out[0].reason, out[0].reason
    finally:
        peer.kill()
        peer.wait()
        rank0.close()
        boards[1].close()
        boards[0].close()


def test_a_rank_that_posted_and_then_exited_gets_no_go(monkeypatch):
    """Rank 1 posts its copy of a step, then its process is SIGKILLed before rank 0's copy comes. Every rank
    had posted, so the coordinator wrote GO, and rank 0 entered collectives no peer would join: with gloo
    its all-reduce failed ("Connection closed by peer") and the rank exited 3, the step unanswered; with
    NCCL it waits out the dist timeout. Now the step is aborted, naming the rank that exited. A post that
    waited is looked at (rank 1 alive: GO); copies that come together make no look (the steady flow)."""
    import dspark_sidecar.server.rendezvous as rendezvous_mod
    from dspark_sidecar.server.rendezvous import ABORT, EXITED, GO, POSTED_LOOK_S, Coordinator, format_reason, process_start

    board = Board(f"dspark-test-{uuid.uuid4().hex[:8]}", 2, create=True)
    peer = _child()
    looks: list[int] = []
    real = rendezvous_mod._exited
    monkeypatch.setattr(rendezvous_mod, "_exited", lambda pid, start=0: looks.append(pid) or real(pid, start))

    def post(rank: int, seq: int, step: int) -> None:
        board.slots[rank][:] = (seq, step, 1, 2, 1, 9, 0, 0)

    def waited(rank: int) -> None:  # rank's post waits, as one whose peer is late does
        time.sleep(max(0.0, c._first_seen[rank] + POSTED_LOOK_S - time.monotonic()))

    try:
        _post_peer(board, 0, os.getpid(), process_start(os.getpid()))
        _post_peer(board, 1, peer.pid, process_start(peer.pid))
        c = Coordinator(board, 8000)  # not started: polled by hand
        assert not c.poll_once() and c._peers.seen(1)  # idle: rank 1 seen alive
        looks.clear()
        post(1, 2, 7)
        post(0, 2, 7)
        assert c.poll_once() and board.ring[0][2] == GO
        assert looks == [], "a look at the peers for a step whose copies came together"
        post(1, 4, 8)
        assert not c.poll_once()
        waited(1)
        post(0, 4, 8)
        assert c.poll_once() and board.ring[1][2] == GO  # rank 1 alive
        assert looks == [peer.pid]
        post(1, 6, 9)
        assert not c.poll_once()  # rank 1's copy waits for rank 0's
        peer.kill()
        peer.wait()
        waited(1)
        post(0, 6, 9)
        assert c.poll_once()
        rec = board.ring[2]
        assert (rec[1], rec[2], rec[3], rec[4]) == (9, ABORT, EXITED, 0b10), rec
        assert "step 9: rank(s) 1 exited" in format_reason(9, int(rec[3]), int(rec[4]), 8000)
    finally:
        peer.kill()
        peer.wait()
        board.close()


def test_only_the_copies_that_waited_have_their_rank_s_process_looked_at_before_the_go(monkeypatch):
    """POSTED_LOOK_S is per copy: when the last copy of a step comes, the ranks whose copies waited are looked
    at, not the ones whose copies came just now (the steady flow's, which make no look at all)."""
    import dspark_sidecar.server.rendezvous as rendezvous_mod
    from dspark_sidecar.server.rendezvous import GO, POSTED_LOOK_S, Coordinator

    board = Board(f"dspark-test-{uuid.uuid4().hex[:8]}", 3, create=True)
    kids = [_child(), _child()]
    looks: list[int] = []
    real = rendezvous_mod._exited
    monkeypatch.setattr(rendezvous_mod, "_exited", lambda pid, start=0: looks.append(pid) or real(pid, start))
    try:
        _post_peer(board, 0, os.getpid(), process_start(os.getpid()))
        for r, k in enumerate(kids, 1):
            _post_peer(board, r, k.pid, process_start(k.pid))
        c = Coordinator(board, 3_600_000)  # not started: polled by hand
        assert not c.poll_once() and c._peers.all_seen  # idle: both peers seen alive
        looks.clear()
        board.slots[1][:] = (2, 7, 1, 2, 1, 9, 0, 0)  # rank 1's copy of step 7 comes first, and waits
        assert not c.poll_once()
        time.sleep(max(0.0, c._first_seen[1] + POSTED_LOOK_S - time.monotonic()))
        board.slots[2][:] = (2, 7, 1, 2, 1, 9, 0, 0)  # ranks 2's and 0's come together, seen in one poll
        board.slots[0][:] = (2, 7, 1, 2, 1, 9, 0, 0)
        assert c.poll_once() and board.ring[0][2] == GO
        assert looks == [kids[0].pid], f"looked at {looks}, not rank 1's {kids[0].pid} alone"
    finally:
        for k in kids:
            k.kill()
            k.wait()
        board.close()


def _count_looks_at_rank_0(monkeypatch) -> list[str]:
    """Record each look at a process (rendezvous._exited) by a rank's step, the coordinator's own aside."""
    import dspark_sidecar.server.rendezvous as rendezvous_mod

    looks: list[str] = []
    real = rendezvous_mod._exited

    def counted(pid, start=0):
        if threading.current_thread().name != "dspark-rendezvous":
            looks.append(threading.current_thread().name)
        return real(pid, start)

    monkeypatch.setattr(rendezvous_mod, "_exited", counted)
    return looks


def test_a_rank_s_step_looks_for_rank_0_s_process_only_until_it_was_seen_alive(ranks, monkeypatch):
    """agree() is on every step's path: once rank 0's process was seen alive, a step whose verdict comes
    in time makes no look at it (a signal and a /proc read: tens of microseconds a step on ranks 1..3).
    Only a step that waits GONE_CHECK_S looks again (made unreachable here, so nothing depends on timing)."""
    import dspark_sidecar.server.rendezvous as rendezvous_mod

    agree_all(ranks, {r: Post(1, 1, 3, 99, True) for r in range(WORLD)})  # rank 0 seen alive from each peer
    assert all(ranks[r]._peers.seen(0) for r in range(1, WORLD))
    monkeypatch.setattr(rendezvous_mod, "GONE_CHECK_S", 3600.0)
    looks = _count_looks_at_rank_0(monkeypatch)
    for step in range(2, 12):
        out = agree_all(ranks, {r: Post(step, 1, 3, 99, True) for r in range(WORLD)})
        assert all(v.go for v, _ in out.values())
    assert looks == [], f"{len(looks)} looks at rank 0's process in 10 steps"


def test_a_rank_waiting_for_its_verdict_looks_at_rank_0_s_process_once_per_gone_check_s(monkeypatch):
    """A verdict long in coming (a peer's copy missing: up to --rendezvous-ms, 60 s; a stalled coordinator:
    fatal_after_s more) is waited for with a look at rank 0's process every GONE_CHECK_S, not at every poll: a look
    is a signal and a /proc read, and the wait polls every nap while warm (~15 us), every SLEEP_S after. Counted
    against the time the wait took, so a slow box only makes fewer looks."""
    from dspark_sidecar.server.rendezvous import GONE_CHECK_S

    name = f"dspark-test-{uuid.uuid4().hex[:8]}"
    boards = [Board(name, 2, create=True), Board(name, 2, create=False)]
    _post_peer(boards[0], 0, os.getpid(), process_start(os.getpid()))  # rank 0's process: this one, alive
    rank1 = Rendezvous(boards[1], 1, 300, fatal_after_s=0.5)  # no rank 0 Rendezvous: no verdict; gives up at 0.8 s
    looks = _count_looks_at_rank_0(monkeypatch)
    try:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="no verdict from rank 0"):
            rank1.agree(Post(2, 1, 2, 9, True))
        waited = time.monotonic() - t0
        assert 1 <= len(looks) <= waited / GONE_CHECK_S + 2, f"{len(looks)} looks at rank 0's process in {waited:.2f} s"
    finally:
        rank1.close()
        boards[1].close()
        boards[0].close()


@pytest.mark.parametrize("rank_0_pid", ["names no process here", "names another process here"])
def test_a_rank_0_never_seen_alive_is_looked_at_once_per_posted_pid_not_every_step(ranks, monkeypatch, rank_0_pid):
    """Rank 0 in a pid namespace of its own posts a pid that names no process here, or another one: never
    seen alive, so each step on ranks 1..3 looked at it again (a signal, and a /proc read where the pid
    names a process), for the group's whole life. A pid and start time once found not to be rank 0's
    process stay so, so they are looked at once; another pair on the board is looked at anew."""
    import subprocess
    import sys

    import dspark_sidecar.server.rendezvous as rendezvous_mod
    from dspark_sidecar.server.rendezvous import process_start

    board = ranks[0].board
    if rank_0_pid == "names no process here":
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()  # reaped: its pid names no process
        board.starts[0], board.pids[0] = 0, gone.pid
    else:
        board.starts[0] = process_start(os.getpid()) + 1  # this pid, another start time: not rank 0's process
    monkeypatch.setattr(rendezvous_mod, "GONE_CHECK_S", 3600.0)  # only the per-step look, no timed ones
    looks = _count_looks_at_rank_0(monkeypatch)
    for step in range(1, 11):
        out = agree_all(ranks, {r: Post(step, 1, 3, 99, True) for r in range(WORLD)})
        assert all(v.go for v, _ in out.values())
    assert len(looks) == WORLD - 1, f"{len(looks)} looks at rank 0's process in 10 steps on {WORLD - 1} ranks"
    assert not any(ranks[r]._peers.seen(0) for r in range(1, WORLD))
    # Another pid and start time on the board (here: a process that runs) is looked at again, and seen.
    board.starts[0], board.pids[0] = process_start(os.getpid()), os.getpid()
    agree_all(ranks, {r: Post(11, 1, 3, 99, True) for r in range(WORLD)})
    assert len(looks) == 2 * (WORLD - 1) and all(ranks[r]._peers.seen(0) for r in range(1, WORLD))


def test_the_coordinator_stops_looking_between_steps_once_every_peer_was_seen_even_after_rank_0_was_late(
        monkeypatch):
    """Between steps the coordinator looks at the peers' processes (every GONE_CHECK_S) only until each was
    seen alive. A step that rank 0 itself was late for (rank 1's post waiting GONE_CHECK_S) had it look at
    rank 0's own process too, which counted as one more peer seen: from then on "every peer seen" never
    held again, and the coordinator thread looked at every peer every 0.1 s for the group's whole life."""
    import dspark_sidecar.server.rendezvous as rendezvous_mod

    board = Board(f"dspark-test-{uuid.uuid4().hex[:8]}", 2, create=True)
    try:
        c = _idle_coordinator(board)
        board.slots[1][:] = (2, 7, 1, 2, 1, 9, 0, 0)  # rank 1 posts step 7; rank 0 is late
        assert not c.poll_once()
        time.sleep(rendezvous_mod.GONE_CHECK_S + 0.05)
        assert not c.poll_once()  # the waiting post's look for exited ranks
        board.slots[0][:] = (2, 7, 1, 2, 1, 9, 0, 0)
        assert c.poll_once()  # GO
        looks: list[int] = []
        real = rendezvous_mod._exited
        monkeypatch.setattr(rendezvous_mod, "_exited", lambda pid, start=0: looks.append(pid) or real(pid, start))
        for _ in range(3):
            c._next_look = 0.0  # as if GONE_CHECK_S had passed
            assert not c.poll_once()
        assert looks == [], f"{len(looks)} looks at the peers between steps, every peer long seen"
    finally:
        board.close()


def test_a_rank_whose_verdict_is_long_in_coming_stops_napping_after_warm_s(monkeypatch):
    """README: waiting threads poll every ~15 us while steps flow and every 1 ms after 0.2 s of quiet. A rank
    waiting for its verdict napped NAP_S for the whole wait: a peer missing (up to --rendezvous-ms, 60 s) or a
    stalled coordinator (fatal_after_s more) cost about half a core per waiting rank on a GPU host."""
    from dspark_sidecar.proto.doorbell import NAP_S, SLEEP_S, WARM_S

    name = f"dspark-test-{uuid.uuid4().hex[:8]}"
    boards = [Board(name, 2, create=True), Board(name, 2, create=False)]
    deadline_ms = int((WARM_S + 0.4) * 1e3)  # rank 0 never posts: MISSING at its deadline, WARM_S and more
    rdv = [Rendezvous(boards[r], r, deadline_ms, nap_s=NAP_S) for r in range(2)]
    sleeps: list[tuple[float, float]] = []
    real = time.sleep

    def sleep(s: float) -> None:
        if threading.current_thread().name == "waiter":
            sleeps.append((time.monotonic(), s))
        real(s)

    monkeypatch.setattr(time, "sleep", sleep)
    out: list = []
    th = threading.Thread(target=lambda: out.append(rdv[1].agree(Post(3, 1, 1, 9, True))), name="waiter")
    try:
        th.start()
        th.join(timeout=30)
        assert out and "did not receive it" in out[0].reason, out
        posted_by = sleeps[0][0]  # the first sleep comes after the post: any later one waited at least this long
        late = [s for t, s in sleeps if t - posted_by > WARM_S]
        assert late, "no sleep past WARM_S: the wait ended too soon to tell"
        naps = sum(s < SLEEP_S for s in late)
        assert naps == 0, f"{naps} of {len(late)} sleeps past WARM_S were naps of {NAP_S * 1e6:.0f} us, not {SLEEP_S} s"
    finally:
        monkeypatch.undo()
        th.join(timeout=10)
        for r in rdv:
            r.close()
        boards[1].close()
        boards[0].close()


def test_a_peer_that_exits_before_the_coordinator_s_first_look_is_judged_exited_at_the_next_step(monkeypatch):
    """The coordinator looks at its peers' processes every GONE_CHECK_S between steps until each was seen alive,
    and only a peer seen alive is ever judged exited. A start-up shorter than that (--no-warmup) served before
    the look that would see a peer: one that exited then (killed or crashed while the group was idle) was never
    judged exited, and every step waited out --rendezvous-ms for its copy and said "did not receive it". Rank 0's
    peers_started (past the start-up barrier: every peer alive) has the coordinator look at once, as each peer
    looks at rank 0 (helper 139). The coordinator is polled by hand, so nothing depends on its thread's timing."""
    import dspark_sidecar.server.rendezvous as rendezvous_mod
    from dspark_sidecar.server.rendezvous import ABORT, EXITED, GONE_CHECK_S

    monkeypatch.setattr(rendezvous_mod.Coordinator, "start", lambda self: None)
    name = f"dspark-test-{uuid.uuid4().hex[:8]}"
    boards = [Board(name, 2, create=True), Board(name, 2, create=False)]
    rank0 = Rendezvous(boards[0], 0, 3_600_000)  # the deadline an hour away: MISSING never comes in this test
    c = rank0._coordinator
    peer = _child()
    try:
        assert not c.poll_once() and not c._peers.seen(1)  # idle: its first look, before rank 1 posted its pid
        _post_peer(boards[1], 1, peer.pid, process_start(peer.pid))  # rank 1's Rendezvous, then the barrier
        rank0.peers_started()
        peer.kill()
        peer.wait()
        boards[0].slots[0][:] = (2, 7, 1, 2, 1, 9, 0, 0)  # rank 0 posts step 7; rank 1's copy never comes
        assert not c.poll_once()
        time.sleep(GONE_CHECK_S + 0.05)  # the waiting post's look at the missing rank's process
        assert c.poll_once(), "the step was left to its deadline: rank 1 never seen alive, so never judged exited"
        rec = boards[0].ring[0]
        assert (rec[1], rec[2], rec[3], rec[4]) == (7, ABORT, EXITED, 0b10), rec
    finally:
        peer.kill()
        peer.wait()
        boards[1].close()
        boards[0].close()  # no coordinator thread reads it (never started)


def _stopped_clock(monkeypatch):
    """The coordinator's time.monotonic as a clock the test sets ([seconds]); its other clocks stay real."""
    import types

    import dspark_sidecar.server.rendezvous as rendezvous_mod

    now = [1000.0]
    monkeypatch.setattr(rendezvous_mod, "time", types.SimpleNamespace(
        monotonic=lambda: now[0], monotonic_ns=time.monotonic_ns, perf_counter=time.perf_counter, sleep=time.sleep))
    return now


def test_a_missing_copy_is_waited_for_from_the_step_s_first_post_and_each_step_s_copies_anew(monkeypatch):
    """The deadline runs from the first copy of the step the coordinator saw: a missing rank costs its peers
    --rendezvous-ms, not more for each copy that came later. And each post is timed from its own sighting: a
    rank that posts its next step before the coordinator's next poll does not inherit its last post's time (its
    step would be aborted "did not receive it within" before its peers had had the deadline to send theirs).
    Polled by hand on a clock the test sets: nothing here depends on timing."""
    from dspark_sidecar.server.rendezvous import ABORT, MISSING, Coordinator

    now = _stopped_clock(monkeypatch)
    board = Board(f"dspark-test-{uuid.uuid4().hex[:8]}", 3, create=True)  # no pids posted: no process is looked at
    try:
        c = Coordinator(board, 1000)  # not started: polled by hand

        def post(rank: int, seq: int, step: int) -> None:
            board.slots[rank][:] = (seq, step, 1, 2, 1, 9, 0, 0)

        t0 = now[0]
        post(0, 2, 7)
        assert not c.poll_once()
        now[0] = t0 + 0.6
        post(1, 2, 7)  # rank 2's copy never comes
        assert not c.poll_once()
        now[0] = t0 + 0.999
        assert not c.poll_once()
        now[0] = t0 + 1.0  # the deadline of rank 0's copy, the first seen
        assert c.poll_once(), "the step waited past the deadline of its first copy"
        rec = board.ring[0]
        assert (rec[1], rec[2], rec[3], rec[4]) == (7, ABORT, MISSING, 0b100), rec
        # Both answered: their next step's copies come before the coordinator's next poll.
        post(0, 4, 8)
        post(1, 4, 8)
        now[0] = t0 + 1.5
        assert not c.poll_once(), "step 8 aborted 0.5 s into its deadline: timed from step 7's copies"
        now[0] = t0 + 2.499
        assert not c.poll_once()
        now[0] = t0 + 2.5
        assert c.poll_once()
        rec = board.ring[1]
        assert (rec[1], rec[2], rec[3], rec[4]) == (8, ABORT, MISSING, 0b100), rec
    finally:
        board.close()


def test_a_rank_gives_up_on_its_verdict_only_past_the_deadline_and_fatal_after_s(monkeypatch):
    """A verdict may take the whole --rendezvous-ms (a peer's copy missing): the give-up (the rank exits, taking the
    coordinator for gone or stuck) counts from the deadline's end, so a --rendezvous-ms past fatal_after_s is
    waited out and answered ABORTED, not a rank lost. On a clock the test sets, the coordinator polled by hand:
    with the real clock (a 1 s deadline, fatal_after_s 0.5) a coordinator half a second late on a loaded box had
    the rank give up before the verdict came."""
    import types

    import dspark_sidecar.server.rendezvous as rendezvous_mod
    from dspark_sidecar.server.rendezvous import Coordinator

    now, reads = [1000.0], [0]

    def monotonic() -> float:
        if threading.current_thread().name == "rank 1":
            reads[0] += 1
        return now[0]

    monkeypatch.setattr(rendezvous_mod, "time", types.SimpleNamespace(
        monotonic=monotonic, monotonic_ns=time.monotonic_ns, perf_counter=time.perf_counter, sleep=time.sleep))

    def at(t: float) -> None:
        """The clock set to t, then seen by the waiting rank: a whole turn of its wait (the give-up's check in it)."""
        now[0] = t
        seen = reads[0]
        wait_until(lambda: reads[0] >= seen + 5, 10, f"the waiting rank read the clock at {t}", watch=th,
                   interval_s=0.001)

    name = f"dspark-test-{uuid.uuid4().hex[:8]}"
    boards = [Board(name, 2, create=True), Board(name, 2, create=False)]
    rank1 = Rendezvous(boards[1], 1, 1000, fatal_after_s=0.5)  # fatal_after_s under the deadline
    c = Coordinator(boards[0], 1000)  # not started: polled by hand; rank 0 never posts: MISSING at 1 s
    out: list = []

    def waits() -> None:
        try:
            out.append(rank1.agree(Post(3, 1, 2, 9, True)))
        except Exception as exc:  # noqa: BLE001
            out.append(exc)

    th = threading.Thread(target=waits, name="rank 1", daemon=True)
    try:
        th.start()
        wait_until(lambda: rank1._waiting and boards[1].slots[1][0] == 2, 10, "rank 1 posted", watch=th,
                   interval_s=0.005)
        assert not c.poll_once()  # rank 1's copy seen at 1000.0
        at(1000.7)  # past fatal_after_s, within the deadline
        assert not out, f"the rank gave up at fatal_after_s, before the deadline: {out}"
        assert not c.poll_once()
        at(1001.2)  # past the deadline, within deadline + fatal_after_s
        assert not out, f"the rank gave up at the deadline, before its verdict: {out}"
        assert c.poll_once()  # MISSING
        th.join(30)  # a hang guard only
        verdict = out[0]
        assert not isinstance(verdict, Exception), verdict
        assert not verdict.go and "rank(s) 0 did not receive it within 1000 ms" in verdict.reason, verdict
    finally:
        th.join(10)
        _close_unless_read(th, rank1, boards)


@pytest.mark.parametrize("first_words,covers", [((10, 11), True), ((11, 11), True), ((10, 10), False)],
                         ids=["rewritten_during_the_copy", "half_written", "reused_before_the_copy"])
def test_a_verdict_record_rewritten_while_a_rank_copies_it_is_not_taken(first_words, covers):
    """The ring's records are seqlocks too: the coordinator reuses a record (RING later) while a slow rank may be
    copying it. A copy that read the new verdict's words beside the old record's covered sequence (this rank's
    post) would take another step's verdict, a GO perhaps, for its own. Stood in: the first copy is torn (the
    sequence word 10 before the copy, 11 after it; or 11, odd, all along: the coordinator paused between its
    words) and says GO; or the record is whole, but was already reused for another step between the scan that found
    it and the copy (its column no longer this post's sequence). The record then completes as this post's ABORT."""
    import numpy as np

    from dspark_sidecar.server.rendezvous import ABORT, GO, NUM_REQS

    name = f"dspark-test-{uuid.uuid4().hex[:8]}"
    boards = [Board(name, 2, create=True), Board(name, 2, create=False)]
    # Rank 1 alone (nothing decides but the record below); the give-up an hour away.
    rdv = Rendezvous(boards[1], 1, DEADLINE_MS, fatal_after_s=3600.0)
    seq, col = 2, 7 + 1  # rank 1's first post, and its column in a record

    class Ring:
        def __init__(self) -> None:
            self.scans = 0
            self.words: list[int] = []

        def record(self):
            if self.scans == 1:  # torn: another step's GO with this post's covered sequence
                return np.array([first_words[0], 99, GO, 0, 0, 5, 0, 0, seq if covers else 0], dtype=np.int64)
            return np.array([12, 3, ABORT, NUM_REQS, 0b10, 5, 0, 0, seq], dtype=np.int64)

        def __getitem__(self, key):
            if not isinstance(key, tuple):  # ring[i]: the record, to copy
                assert int(key) == 0, key
                return self.record()
            if isinstance(key[0], slice):  # ring[:, col]: a scan for this rank's column
                assert key[1] == col, key
                self.scans += 1
                self.words = list(first_words) if self.scans == 1 else [12, 12]
                return np.array([seq])
            assert (int(key[0]), key[1]) == (0, 0), key  # the record's sequence word: before the copy, then after
            return self.words.pop(0) if len(self.words) > 1 else self.words[0]

    ring = Ring()
    boards[1].ring = ring
    try:
        verdict = rdv.agree(Post(3, 1, 2, 9, True))
        assert ring.scans >= 2 and not verdict.go, f"a torn record taken for this post's verdict: {verdict}"
        assert "step 3: ranks disagree on num_requests" in verdict.reason, verdict
    finally:
        rdv.close()
        boards[1].close()
        boards[0].close()


def test_a_coordinator_that_outlives_its_join_leaves_the_board_open(monkeypatch):
    """CLOSED tells the peers that no verdict comes any more, so they abort their posts at once. A coordinator
    still running after stop()'s join (wedged in a look) may yet write a GO for those posts, which the ranks that
    had not looked yet would follow into collectives that the aborted ones never join: CLOSED is set only once the
    thread has ended, and Rendezvous.close() says the board is still read."""
    import dspark_sidecar.server.rendezvous as rendezvous_mod
    from dspark_sidecar.server.rendezvous import CLOSED

    wedged, entered = threading.Event(), threading.Event()
    real = rendezvous_mod.Coordinator.poll_once

    def poll_once(self):
        entered.set()
        wedged.wait(30)  # a hang guard only
        return real(self)

    monkeypatch.setattr(rendezvous_mod.Coordinator, "poll_once", poll_once)
    board = Board(f"dspark-test-{uuid.uuid4().hex[:8]}", 2, create=True)
    rdv = Rendezvous(board, 0, DEADLINE_MS)
    try:
        wait_until(entered.is_set, 10, "the coordinator polls")
        assert rdv.close(wait_s=0.0) is False  # its join (1 s) ends with the thread still in its poll
        assert board.words[CLOSED] == 0, "CLOSED set while the coordinator can still write a verdict"
        wedged.set()
        assert rdv.close() is True and board.words[CLOSED] == 1  # the thread has ended now: closed
    finally:
        wedged.set()
        rdv._coordinator.join(10)
        if rdv._coordinator.is_alive():  # it still reads the board: only the name goes
            board.unlink()
        else:
            board.close()


@pytest.mark.parametrize("rank_63", ["refuses_its_copy", "never_posts"])
def test_a_verdict_naming_the_last_rank_of_the_largest_group_is_written(rank_63):
    """--tp takes up to layout.MAX_TP (64) ranks, and a verdict's rank mask is one bit a rank: rank 63's bit is the
    int64 word's sign bit. Stored as the Python int 2^63 it raised OverflowError in the coordinator thread, which
    ended it without a word: every step of the group then waited --rendezvous-ms + fatal_after_s and every rank
    exited, for one refused copy (or one late one) on rank 63."""
    from dspark_sidecar.layout import MAX_TP
    from dspark_sidecar.server.rendezvous import Coordinator

    world = MAX_TP
    name = f"dspark-test-{uuid.uuid4().hex[:8]}"
    boards = [Board(name, world, create=True), Board(name, world, create=False)]
    rank1 = Rendezvous(boards[1], 1, DEADLINE_MS, fatal_after_s=3600.0)  # no rank 0 Rendezvous: decided by hand
    c = Coordinator(boards[0], 1)  # not started: polled by hand; a missing copy is due after 1 ms
    for r in range(world):  # no pids posted: no process is looked at
        if r != 1 and not (r == world - 1 and rank_63 == "never_posts"):
            boards[0].slots[r][:] = (2, 7, 1, 2, 1, 9, 0, 0) if r != world - 1 else (2, 7, 1, 2, 0, 0, 0, 0)
    out: list = []
    th = threading.Thread(target=lambda: out.append(rank1.agree(Post(7, 1, 2, 9, True))), daemon=True)
    try:
        th.start()
        wait_until(lambda: boards[0].slots[1][0] == 2, 10, "rank 1 posted", interval_s=0.005)
        wait_until(c.poll_once, 10, "a verdict", interval_s=0.005)
        th.join(10)
        what = "rejected their copy" if rank_63 == "refuses_its_copy" else "did not receive it"
        assert out and not out[0].go and out[0].reason.startswith(f"step 7: rank(s) {world - 1} {what}"), out
    finally:
        th.join(10)
        _close_unless_read(th, rank1, boards)


def test_a_rank_posts_its_process_start_time_before_its_pid():
    """A peer that reads a rank's pid must read the start time that goes with it (PeerProcesses). Read as the pid
    with the board's zero start time, a rank in a pid namespace of its own, whose pid names another live process
    here, was taken for seen alive, and judged exited at the next look (that process's start time is not the
    posted one): every step aborted naming a live rank."""
    writes: list = []

    class Recorded:
        def __init__(self, row, what: str) -> None:
            self.row, self.what = row, what

        def __getitem__(self, key):
            return self.row[key]

        def __setitem__(self, key, value) -> None:
            writes.append(self.what)
            self.row[key] = value

    board = Board(f"dspark-test-{uuid.uuid4().hex[:8]}", 2, create=True)
    real = board.starts, board.pids
    board.starts, board.pids = Recorded(real[0], "start"), Recorded(real[1], "pid")
    try:
        rdv = Rendezvous(board, 1, DEADLINE_MS)  # rank 1: no coordinator thread reads them meanwhile
        assert writes == ["start", "pid"], writes
        board.starts, board.pids = real
        assert (board.pids[1], board.starts[1]) == (os.getpid(), process_start(os.getpid()))
        rdv.close()
    finally:
        board.starts, board.pids = real
        board.close()
