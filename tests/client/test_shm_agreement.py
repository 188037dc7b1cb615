"""The engine ranks' shared-memory agreement, in real processes: the same answers as gloo's all-reduce,
agreement after agreement, and a clear error (not a hang) when a peer stops stepping."""

from __future__ import annotations

import pytest
import torch.multiprocessing as mp

from dspark_sidecar.client.shm_agreement import MAX_VALUES, ShmAgreement
from dspark_sidecar.proto import memory
from helpers.agreement_ranks import apart, deserted, free_port, peer_deserted, ranks, stalling, subgroup, uncreated
from helpers.full_shm import run_on_full_dev_shm

@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_gets_the_element_wise_minimum_of_all_ranks(world):
    errors = mp.get_context("spawn").SimpleQueue()
    mp.spawn(ranks, args=(world, free_port(), world, errors), nprocs=world, join=True)
    assert errors.empty()


def test_a_peer_that_stops_stepping_is_an_error_naming_it_not_a_hang():
    errors = mp.get_context("spawn").SimpleQueue()
    mp.spawn(stalling, args=(free_port(), errors), nprocs=2, join=True)
    # Both ranks have exited: an agreement that returned instead of raising left the queue empty, and get() waited for good.
    assert not errors.empty(), "rank 0's agreement with a peer that never came returned instead of timing out"
    msg = errors.get()
    assert "engine ranks [1] did not reach step agreement 2 within 0.5 s" in msg


def test_too_many_values_are_refused_before_anything_is_written():
    agree = ShmAgreement.__new__(ShmAgreement)  # the check comes first: no group needed
    agree._seq = 0
    with pytest.raises(ValueError, match=f"at most {MAX_VALUES}"):
        agree.all_min_ints(list(range(MAX_VALUES + 1)))
    assert agree._seq == 0


def test_only_ranks_on_one_x86_host_share_a_page(tmp_path, monkeypatch):
    """The page's protocol relies on stores being seen in the order written (x86-64); elsewhere the
    ranks keep gloo, told why. One rank in a group of its own: its page is trivially everyone's."""
    import platform

    import torch.distributed as dist

    from dspark_sidecar.client.shm_agreement import shared_page_agreement

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        for machine, same in (("x86_64", True), ("AMD64", True), ("aarch64", False), ("arm64", False)):
            monkeypatch.setattr(platform, "machine", lambda m=machine: m)
            page, why = shared_page_agreement()
            assert (page is not None) is same, (machine, why)
            if page is None:
                assert why == f"rank 0: {machine} may show other processes its stores out of order", why
            else:
                assert why == "" and page.all_min_ints([4, -2]) == [4, -2]
                page.close()
    finally:
        dist.destroy_process_group()


def test_a_page_rank_0_cannot_create_is_a_reason_not_an_exception(tmp_path, monkeypatch):
    """Rank 0 raising before the broadcast would leave its peers waiting in it for gloo's timeout."""
    import torch.distributed as dist

    from dspark_sidecar.client import shm_agreement

    def full(**_kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(memory.shared_memory, "SharedMemory", full)
    monkeypatch.setattr(shm_agreement.bell, "stores_in_order", lambda: True)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        page, why = shm_agreement.shared_page_agreement()
    finally:
        dist.destroy_process_group()
    assert page is None and why == "rank 0: cannot create the page: [Errno 28] No space left on device", why


@pytest.mark.parametrize("how", ["missing", "foreign", "other", "small"])
def test_ranks_that_cannot_map_rank_0_s_page_keep_gloo_and_leave_no_segment(how):
    """Not a host name but the page itself decides: ranks on two hosts that share a name, or in
    containers each with its own /dev/shm, cannot open rank 0's segment, or open another of that name (smaller
    than the page, "small": reading its token past its end raised out of the set-up)."""
    import os

    errors, names = mp.get_context("spawn").SimpleQueue(), mp.get_context("spawn").SimpleQueue()
    mp.spawn(apart, args=(free_port(), how, errors, names), nprocs=2, join=True)
    assert errors.empty(), errors.get()
    name = names.get()
    assert not os.path.exists(f"/dev/shm/{name}"), f"rank 0's page {name} was left in /dev/shm"


def test_a_peer_gone_during_the_set_up_leaves_no_page_behind():
    """A rank that dies before (or during) shared_page_agreement fails its peers' collectives there. Rank 0's
    page, unlinked only once those had passed, stayed in /dev/shm for as long as rank 0's process lived (its
    resource tracker removes it only at exit), though nothing could use it any more."""
    errors, names = mp.get_context("spawn").SimpleQueue(), mp.get_context("spawn").SimpleQueue()
    mp.spawn(deserted, args=(free_port(), errors, names), nprocs=2, join=True)
    assert errors.empty(), errors.get()
    assert not names.empty(), "rank 0 reported nothing"
    name, left, mapped = names.get()
    assert not left, f"rank 0's page {name} was left in /dev/shm after its peer was gone"
    assert not mapped, f"rank 0 still mapped its page {name} while the set-up's error was handled"


def test_a_peer_whose_rank_0_dies_during_the_set_up_unmaps_the_page():
    """Rank 0 gone after the offer fails its peers' last collective, each with rank 0's page mapped: that mapping
    must go with the error, as rank 0's own does, not stay for as long as the engine keeps the error (its frame)."""
    ctx = mp.get_context("spawn")
    errors, names, opened = ctx.SimpleQueue(), ctx.SimpleQueue(), ctx.Event()
    mp.spawn(peer_deserted, args=(free_port(), errors, names, opened), nprocs=2, join=True)
    assert errors.empty(), errors.get()
    assert not names.empty(), "rank 1 reported nothing"
    name, still_mapped = names.get()
    assert name, "rank 1 never mapped rank 0's page"
    assert not still_mapped, f"rank 1 still mapped rank 0's page {name} while the set-up's error was handled"


def test_a_peer_arriving_as_the_wait_times_out_is_agreed_with_not_an_error(monkeypatch):
    """The last poll before the deadline missed a peer that wrote its slot just after it: that peer sees every
    slot and returns the minimum, so this rank must too. It raised AgreementTimeout instead ("engine ranks []
    did not reach ..."): one rank out of a step its peers went on with. One process, both slots of a page."""
    from multiprocessing import shared_memory

    import numpy as np

    from dspark_sidecar.client import shm_agreement

    seg = shared_memory.SharedMemory(create=True, size=8 * 2 * 2 * (1 + MAX_VALUES))
    try:
        agree = ShmAgreement(seg, world_size=2, rank=0, timeout_s=0.05)
        # rank 1's slot of agreement 1, held in a list: cleared before the page is closed (a live view refuses it)
        peer = [np.ndarray((2, 2, 1 + MAX_VALUES), np.int64, buffer=seg.buf)[1][1]]

        def late(ready, deadline, active_since):
            peer[0][1:3] = [-7, 9]
            peer[0][0] = 1  # rank 1 arrives just after the last poll
            return False

        monkeypatch.setattr(shm_agreement.bell, "wait_until", late)
        monkeypatch.setattr(shm_agreement, "SPIN_S", 0.0)
        assert agree.all_min_ints([3, 4]) == [-7, 4]
        peer.clear()
        agree.close()
    finally:
        seg.unlink()


def test_a_value_past_int64_is_refused_before_the_sequence_moves():
    """A value the page cannot hold raised only once the sequence had moved: that rank then waited in the
    other bank for its peers while they waited for it in this one, and both gave up naming the other
    ("engine ranks [1] did not reach step agreement 2 ... has died"), where gloo refuses the value and
    the next agreement goes on. Two ranks of one page in one process, on threads."""
    import threading
    from multiprocessing import shared_memory

    seg = shared_memory.SharedMemory(create=True, size=8 * 2 * 2 * (1 + MAX_VALUES))
    try:
        agree = [ShmAgreement(seg, world_size=2, rank=r, timeout_s=2.0) for r in range(2)]
        with pytest.raises(ValueError, match="int64"):
            agree[0].all_min_ints([1, 1 << 63])
        out: dict = {}

        def one(r):
            try:
                out[r] = agree[r].all_min_ints([r + 5, -r])
            except Exception as exc:  # noqa: BLE001  (reported below)
                out[r] = exc

        ts = [threading.Thread(target=one, args=(r,)) for r in range(2)]
        [t.start() for t in ts]
        [t.join(timeout=10) for t in ts]
        assert out == {0: [5, -1], 1: [5, -1]}, out
        for a in agree:
            a.close()
    finally:
        seg.unlink()


def _page(world: int):
    from multiprocessing import shared_memory

    return shared_memory.SharedMemory(create=True, size=8 * (2 * world * (1 + MAX_VALUES) + 1))


def test_as_many_values_as_the_page_holds_are_agreed():
    seg = _page(1)
    try:
        agree = ShmAgreement(seg, world_size=1, rank=0, timeout_s=1.0)
        assert agree.all_min_ints(list(range(-MAX_VALUES, 0))) == list(range(-MAX_VALUES, 0))
        agree.close()
        assert seg.buf is None, "close() left the page mapped"
    finally:
        seg.unlink()


def test_a_rank_writes_its_values_before_its_sequence_number():
    """A peer that sees the sequence reads the values at once: written after it, the peer could take the
    previous agreement's values for this one's (nothing else orders them)."""
    import numpy as np

    class Recording(np.ndarray):
        stores: list = []

        def __setitem__(self, key, value):
            Recording.stores.append(key)
            super().__setitem__(key, value)

    seg = _page(1)
    try:
        agree = ShmAgreement(seg, world_size=1, rank=0, timeout_s=1.0)
        agree._slots = agree._slots.view(Recording)
        assert agree.all_min_ints([5, -3]) == [5, -3]
        assert Recording.stores == [slice(1, 3), 0], Recording.stores
        agree.close()
    finally:
        seg.unlink()


def test_a_rank_starting_the_next_agreement_leaves_the_values_a_slower_peer_still_reads():
    """Rank 0 goes on to agreement 2 as soon as rank 1 has written agreement 1, while rank 1 has not read
    agreement 1's values yet: those must still be there (the other bank), not rank 0's values of agreement 2.
    Two ranks of one page in one process, on threads; rank 1's read waits until rank 0 has written agreement 2."""
    import threading

    import numpy as np

    seg = _page(2)
    raw = np.ndarray((2, 2, 1 + MAX_VALUES), np.int64, buffer=seg.buf)  # the slots, as a third process sees them
    try:
        agree = [ShmAgreement(seg, world_size=2, rank=r, timeout_s=5.0) for r in range(2)]

        class SlowReader(np.ndarray):
            def min(self, *args, **kw):
                if self.ndim == 2:  # the values (a 1-D view is the sequence numbers)
                    for _ in range(5000):
                        if (raw[:, 0, 0] == 2).any():
                            break
                        threading.Event().wait(0.001)
                return super().min(*args, **kw)

        agree[1]._slots = agree[1]._slots.view(SlowReader)
        out: dict = {}

        def one(r, calls):
            try:
                out[r] = [agree[r].all_min_ints(v) for v in calls]
            except Exception as exc:  # noqa: BLE001  (reported below)
                out[r] = exc

        ts = [threading.Thread(target=one, args=(0, [[3, 7], [100, 100]])),
              threading.Thread(target=one, args=(1, [[4, 6], [100, 100]]))]
        [t.start() for t in ts]
        [t.join(timeout=20) for t in ts]
        assert out == {0: [[3, 6], [100, 100]], 1: [[3, 6], [100, 100]]}, out
        for a in agree:
            a.close()
    finally:
        seg.unlink()


def test_the_page_s_name_leaves_dev_shm_once_every_rank_has_mapped_it(tmp_path, monkeypatch):
    """Nothing opens it by name again: kept, it stayed in /dev/shm for as long as rank 0's process lived
    (and after it, where that process was killed along with its resource tracker)."""
    import torch.distributed as dist

    from dspark_sidecar.client import shm_agreement
    from helpers.engine_fakes import recording_shm

    monkeypatch.setattr(shm_agreement.bell, "stores_in_order", lambda: True)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        with recording_shm() as rec:
            page, why = shm_agreement.shared_page_agreement()
        assert page is not None, why
        assert len(rec.created) == 1 and not rec.left(), rec.created
        assert page.all_min_ints([2, -9]) == [2, -9]  # still mapped
        page.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("peer_gone", [False, True])
def test_a_page_whose_name_someone_else_removed_during_the_set_up_raises_nothing_of_it(tmp_path, monkeypatch, caplog,
                                                                                        peer_gone):
    """An operator cleaning /dev/shm, or systemd's RemoveIPC, may remove the page's name while the ranks set it up
    (memory.unlink_segment's case). Every rank has mapped it by then, and a mapping outlives its name: the page is
    used. Rank 0's own removal of the name raised FileNotFoundError out of the set-up instead, out of the drafter's
    first forward, while its peers went on with the page; with a peer gone as well, it hid gloo's error and left
    the page mapped. One rank in a group of its own; the name goes just before the last collective."""
    import os

    import torch.distributed as dist

    from dspark_sidecar.client import shm_agreement
    from helpers.agreement_ranks import mapped
    from helpers.engine_fakes import recording_shm

    monkeypatch.setattr(shm_agreement.bell, "stores_in_order", lambda: True)
    real = dist.all_gather_object

    def removed_then(out, obj, group=None):
        for name in rec.created:
            os.unlink(f"/dev/shm/{name}")
        if peer_gone:
            raise RuntimeError("Connection closed by peer")
        return real(out, obj, group=group)

    monkeypatch.setattr(shm_agreement.dist, "all_gather_object", removed_then)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        with recording_shm() as rec, caplog.at_level("WARNING", logger="dspark_sidecar.memory"):
            if peer_gone:
                with pytest.raises(RuntimeError, match="closed by peer"):
                    shm_agreement.shared_page_agreement()
                (name,) = rec.created
                assert not mapped(name), f"rank 0 still maps its page {name} after the set-up's error"
            else:
                page, why = shm_agreement.shared_page_agreement()
                assert page is not None, why
                assert page.all_min_ints([2, -9]) == [2, -9]  # still mapped
                page.close()
        assert "was removed by another process" in caplog.text, caplog.text
    finally:
        dist.destroy_process_group()


def test_ranks_whose_rank_0_cannot_create_the_page_all_keep_gloo():
    """Rank 0's reason travels as a page name of None: a peer that tried to open it raised (AttributeError)
    out of the set-up instead of agreeing over gloo with rank 0."""
    errors = mp.get_context("spawn").SimpleQueue()
    mp.spawn(uncreated, args=(free_port(), errors), nprocs=2, join=True)
    assert errors.empty(), errors.get()


def test_a_page_of_a_group_whose_first_rank_is_not_global_rank_0():
    """vLLM's TP group of a second DP or PP replica: its rank 0 is some other global rank, whose page name
    the broadcast carries."""
    errors = mp.get_context("spawn").SimpleQueue()
    mp.spawn(subgroup, args=(free_port(), errors), nprocs=3, join=True)
    assert errors.empty(), errors.get()


def test_a_full_dev_shm_is_a_reason_not_a_bus_error(tmp_path):
    """A tmpfs with no page left still creates a segment (ftruncate reserves nothing): rank 0's first store into
    the page then killed its process with SIGBUS, instead of the ranks keeping gloo."""
    import textwrap

    from dspark_sidecar.proto import doorbell as bell

    if not bell.stores_in_order():
        pytest.skip("the page is used on x86-64 hosts only")
    probe = tmp_path / "probe.py"
    probe.write_text(textwrap.dedent("""
        import os
        import sys

        import torch.distributed as dist
        from dspark_sidecar.client.shm_agreement import shared_page_agreement
        dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 1), rank=0, world_size=1)
        page, why = shared_page_agreement()
        print("page" if page is not None else "none", why, sorted(os.listdir("/dev/shm")), sep="|")
        dist.destroy_process_group()
    """))
    proc = run_on_full_dev_shm(probe, str(tmp_path / "store"))
    assert proc.returncode == 0, f"rc {proc.returncode} (-7 or 135: SIGBUS): {proc.stderr[-2000:]}"
    kind, why, left = proc.stdout.strip().splitlines()[-1].split("|")
    assert kind == "none" and why == "rank 0: cannot create the page: [Errno 28] No space left on device", why
    assert left == "['fill']", f"the page that could not be filled was left in /dev/shm: {left}"


def test_a_rank_gives_its_peers_up_after_its_own_timeout_from_its_arrival(monkeypatch):
    """The wait ends agreement_timeout_s after this rank wrote its slot (which follows the step's deadlines): a fixed
    or shorter wait gave a live, slow peer up for dead, a longer one left the engine waiting on a dead peer. One
    process, rank 0 of a page whose rank 1 never comes; the doorbell's wait reports the deadline it was given."""
    from dspark_sidecar.client import shm_agreement
    from dspark_sidecar.client.shm_agreement import AgreementTimeout

    waits = []

    def never(ready, deadline, active_since):
        waits.append(deadline - active_since)
        return False

    monkeypatch.setattr(shm_agreement.bell, "wait_until", never)
    seg = _page(2)
    try:
        agree = ShmAgreement(seg, world_size=2, rank=0, timeout_s=431.5)
        with pytest.raises(AgreementTimeout, match=r"engine ranks \[1\] did not reach step agreement 1 within 431.5 s"):
            agree.all_min_ints([1])
        assert waits == [pytest.approx(431.5, abs=1e-6)], waits
        agree.close()
    finally:
        seg.unlink()


def test_a_closed_page_refuses_an_agreement_instead_of_touching_the_unmapped_page(tmp_path):
    """numpy's view of the page holds no export of its buffer, so close() unmaps under it without a BufferError: a
    view kept past close() then read or wrote memory no longer mapped (SIGSEGV, or whatever the address now maps).
    In a child process: a segmentation fault there fails this test instead of ending the run."""
    import subprocess
    import sys
    import textwrap

    probe = tmp_path / "probe.py"
    probe.write_text(textwrap.dedent("""
        from multiprocessing import shared_memory
        from dspark_sidecar.client.shm_agreement import MAX_VALUES, ShmAgreement
        seg = shared_memory.SharedMemory(create=True, size=8 * (2 * (1 + MAX_VALUES) + 1))
        seg.unlink()
        agree = ShmAgreement(seg, world_size=1, rank=0, timeout_s=1.0)
        assert agree.all_min_ints([3]) == [3]
        agree.close()
        try:
            agree.all_min_ints([4])
        except Exception as exc:  # noqa: BLE001  (which error it is does not matter, only that it is one)
            print("refused", type(exc).__name__)
        else:
            print("agreed on an unmapped page")
    """))
    proc = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, timeout=120,
                          start_new_session=True)
    assert proc.returncode == 0, f"rc {proc.returncode} (-11: SIGSEGV): {proc.stderr[-2000:]}"
    assert proc.stdout.startswith("refused"), proc.stdout


def test_a_rank_that_timed_out_never_agrees_on_that_page_again():
    """After AgreementTimeout this rank's sequence is no longer its peers': it wrote agreement s, which a slow peer
    may still take, and gave it up. A caller that went on (its engine caught the error) wrote agreement s + 1 into
    the other bank, and the slow peer, arriving at s and then s + 1, took those values as the answer to its own
    s + 1 (a post-flight "every rank got a result" read from a next step's pre-flight): ranks on different branches,
    with no error anywhere. Every later call on the timed-out rank must refuse, writing nothing, so the peer's next
    agreement times out naming it. One process, both slots of a page, one rank after the other."""
    from dspark_sidecar.client.shm_agreement import AgreementTimeout

    seg = _page(2)
    try:
        late, slow = ShmAgreement(seg, 2, 0, timeout_s=0.05), ShmAgreement(seg, 2, 1, timeout_s=0.2)
        with pytest.raises(AgreementTimeout, match=r"engine ranks \[1\]"):
            late.all_min_ints([1])  # agreement 1: rank 1 is not there yet
        # the caller went on: agreement 2 on a page it can no longer share, refused with the timeout's own reason
        with pytest.raises(AgreementTimeout, match=r"engine ranks \[1\] did not reach step agreement 1 .*no agreement"):
            late.all_min_ints([1])
        assert slow.all_min_ints([7]) == [1]  # rank 1 arrives at agreement 1, which rank 0 had written
        with pytest.raises(AgreementTimeout, match=r"engine ranks \[0\] did not reach step agreement 2"):
            slow.all_min_ints([9])  # rank 0 gave agreement 2 up: nothing of it may be taken as rank 0's answer
        late.close()
        slow.close()
    finally:
        seg.unlink()


def test_a_rank_whose_wait_is_interrupted_never_agrees_on_that_page_again(monkeypatch):
    """An exception that ends the wait other than the timeout (KeyboardInterrupt, a signal handler's own) gives up
    the agreement just the same: this rank's slot says it came, so a slower peer still takes it. A caller that
    went on (its engine caught the exception) then answered that peer's post-flight with its next step's
    pre-flight, whose first value is "ready": the peer forwarded a step this rank had no answer for, and the ranks
    decided apart with no error anywhere (run for real with SIGINT in two processes, review 347). Every later
    call must refuse, writing nothing, as after a timeout. One process, both slots of a page."""
    import numpy as np

    from dspark_sidecar.client import shm_agreement
    from dspark_sidecar.client.shm_agreement import AgreementTimeout

    seg = _page(2)
    seqs = np.ndarray((2, 2, 1 + MAX_VALUES), np.int64, buffer=seg.buf)[:, 0, 0]  # each bank's rank 0 sequence
    try:
        hit, slow = ShmAgreement(seg, 2, 0, timeout_s=0.05), ShmAgreement(seg, 2, 1, timeout_s=0.2)

        def interrupted(ready, deadline, active_since):
            raise KeyboardInterrupt

        with monkeypatch.context() as m:
            m.setattr(shm_agreement.bell, "wait_until", interrupted)
            m.setattr(shm_agreement, "SPIN_S", 0.0)
            with pytest.raises(KeyboardInterrupt):
                hit.all_min_ints([1, 0, 5])  # a pre-flight: rank 1 is not there yet
        with pytest.raises(AgreementTimeout, match="interrupted"):
            hit.all_min_ints([1, 0, 5])  # the caller went on to its next step's pre-flight
        assert seqs.tolist() == [0, 1], "the rank wrote an agreement after it had given one up"
        assert slow.all_min_ints([1, 0, 7]) == [1, 0, 5]  # rank 1 takes the pre-flight rank 0 wrote
        with pytest.raises(AgreementTimeout, match=r"engine ranks \[0\] did not reach step agreement 2"):
            slow.all_min_ints([0])  # its post-flight: nothing of rank 0's next step may answer it
        seqs = None
        hit.close()
        slow.close()
    finally:
        seg.unlink()
