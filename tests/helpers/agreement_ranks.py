"""Engine-rank processes for tests/client/test_shm_agreement.py (spawned: they must be importable)."""

from __future__ import annotations

import random
import socket

import torch
import torch.distributed as dist

from dspark_sidecar.client.agreement import DistAgreement, agreement_from, all_min_ints
from dspark_sidecar.client import shm_agreement
from dspark_sidecar.client.shm_agreement import AgreementTimeout, ShmAgreement, shared_page_agreement
from dspark_sidecar.proto import memory

ROUNDS = 400


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def values(seed: int, i: int, rank: int) -> list[int]:
    rnd = random.Random(seed * 1_000_003 + i * 101 + rank)
    n = 5 if i % 2 == 0 else 1  # the shim's two agreements per step
    return [rnd.randrange(-(1 << 62), 1 << 62) for _ in range(n)]


def ranks(rank: int, world: int, port: int, seed: int, errors) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        par = type("Par", (), {"world_size": world, "exchange": type("X", (), {"group": None})()})()
        shm = agreement_from(par)  # on one host: the shared-memory one
        assert isinstance(shm, ShmAgreement), type(shm)
        gloo = DistAgreement()
        for i in range(ROUNDS):
            mine = values(seed, i, rank)
            expected = [min(v) for v in zip(*(values(seed, i, r) for r in range(world)))]
            got = all_min_ints(shm, mine)
            assert got == expected, (i, got, expected)
            if i % 50 == 0:  # the gloo all-reduce agrees, interleaved with it, and leaves the caller's tensor alone
                sent = torch.tensor(mine)
                assert gloo.all_min(sent).tolist() == expected and sent.tolist() == mine
        assert shm.all_min(torch.tensor([rank, -rank])).tolist() == [0, -(world - 1)]
        shm.close()
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001  (reported to the test, which fails with it)
        errors.put(f"rank {rank}: {type(exc).__name__}: {exc}")
        raise


def stalling(rank: int, port: int, errors) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    agree, why = shared_page_agreement(timeout_s=0.5)
    assert agree is not None, why
    assert agree.all_min_ints([rank]) == [0]
    if rank == 0:
        try:
            agree.all_min_ints([1, 2])  # rank 1 never comes to this one
        except AgreementTimeout as exc:
            errors.put(str(exc))
    dist.barrier()  # rank 1 waits here until rank 0 has given up
    dist.destroy_process_group()


def _agree_over_gloo(rank: int) -> None:
    """Of two ranks left without a page: node_agreement gives gloo's, which agrees; the group then ends."""
    from dspark_sidecar.client.agreement import node_agreement

    agree = node_agreement()
    assert isinstance(agree, DistAgreement), type(agree)
    assert all_min_ints(agree, [rank, 10 - rank]) == [0, 9]
    dist.destroy_process_group()


def mapped(name: str) -> bool:
    """Whether this process still maps the shared-memory segment `name` (unlinked or not)."""
    with open("/proc/self/maps") as maps:
        return f"/dev/shm/{name}" in maps.read()


def apart(rank: int, port: int, how: str, errors, names) -> None:
    """Rank 1 cannot share rank 0's page: `how` = "missing" (another host, or another /dev/shm: the name
    opens nothing), "foreign" (a segment of that name it may not map: another user's, AttachedSegment's
    ValueError), "other" (a segment of that name that is not rank 0's) or "small" (one smaller than the
    page). Both ranks must keep gloo, and the gloo agreement must still answer; neither still maps a page
    it will not use. Rank 1 puts the page's name (from its reason) on `names`."""
    from multiprocessing import shared_memory

    opened: list[str] = []  # the segments rank 1 mapped in place of rank 0's
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        if rank == 1:
            def elsewhere(name):
                if how == "missing":
                    raise FileNotFoundError(2, "No such file or directory", f"/dev/shm/{name}")
                if how == "foreign":
                    raise ValueError(f"/dev/shm/{name} is private to another user (owner uid 1, mode 0600)")
                own = shared_memory.SharedMemory(create=True, size=8 if how == "small" else 4096)  # zeros: no token
                own.unlink()
                opened.append(own.name)
                return own
            shm_agreement.AttachedSegment = elsewhere
        page, why = shared_page_agreement()
        assert page is None, "a page was shared with a rank that cannot see it"
        want = "cannot open rank 0's page" if how in ("missing", "foreign") else "is not rank 0's page"
        assert why.startswith("rank 1: ") and want in why, why
        name = next(w for w in why.replace(":", " ").split() if w.startswith("psm_"))
        left = [n for n in [name, *opened] if mapped(n)]
        assert not left, f"rank {rank} still maps {left} after the ranks chose gloo"
        if rank == 1:
            names.put(name)
        _agree_over_gloo(rank)
    except BaseException as exc:  # noqa: BLE001  (reported to the test, which fails with it)
        errors.put(f"rank {rank}: {type(exc).__name__}: {exc}")
        raise


def deserted(rank: int, port: int, errors, names) -> None:
    """Rank 1 dies (exits) before the page's set-up: rank 0's collectives there raise, and rank 0, still alive,
    reports whether its page is still in /dev/shm (on `names`: the page's name and whether it exists)."""
    import datetime
    import os

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=20))
    if rank == 1:
        os._exit(0)  # as a killed rank: no clean-up, no goodbye to the group
    from helpers.engine_fakes import recording_shm

    with recording_shm() as rec:
        try:
            shared_page_agreement()
        except RuntimeError:  # gloo: the peer closed the connection
            (name,) = rec.created
            # Asked while the error (and with it the set-up's frame) is alive, as it is while the engine handles it.
            names.put((name, bool(rec.left()), mapped(name)))
        else:
            errors.put("rank 0: shared_page_agreement returned with its peer gone")
    os._exit(0)  # the group cannot be destroyed cleanly with its peer gone


def uncreated(rank: int, port: int, errors) -> None:
    """Rank 0 cannot create the page (/dev/shm full or missing): both ranks keep gloo, told rank 0's reason."""
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        if rank == 0:
            def full(**_kw):
                raise OSError(28, "No space left on device")
            memory.shared_memory = type("NoShm", (), {"SharedMemory": staticmethod(full)})
        shm_agreement.bell.stores_in_order = lambda machine=None: True
        page, why = shared_page_agreement()
        assert page is None and why == "rank 0: cannot create the page: [Errno 28] No space left on device", why
        _agree_over_gloo(rank)
    except BaseException as exc:  # noqa: BLE001  (reported to the test, which fails with it)
        errors.put(f"rank {rank}: {type(exc).__name__}: {exc}")
        raise


def subgroup(rank: int, port: int, errors) -> None:
    """Global ranks 1 and 2 agree through a page of their own group (group ranks 0 and 1), rank 0 outside it."""
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
        group = dist.new_group([1, 2])  # collective: every rank makes it
        if rank != 0:
            page, why = shared_page_agreement(group, timeout_s=20.0)
            assert page is not None, why
            assert DistAgreement(group).world_size == 2  # the group's ranks, not the world's (gloo's fallback)
            assert page.all_min_ints([rank, -rank]) == [1, -2]
            page.close()
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001  (reported to the test, which fails with it)
        errors.put(f"rank {rank}: {type(exc).__name__}: {exc}")
        raise


def peer_deserted(rank: int, port: int, errors, names, opened) -> None:
    """Rank 0 dies (exits) once rank 1 has mapped its page, before the set-up's last collective: rank 1's fails, and
    rank 1, still alive, reports (on `names`) the page's name and whether it still maps it while the error is alive.
    `opened`: an Event rank 1 sets once it has mapped the page, which rank 0 waits for."""
    import datetime
    import os
    from multiprocessing import shared_memory

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=20))
    if rank == 0:
        from helpers.engine_fakes import recording_shm

        def gone(*_args, **_kw):
            opened.wait(30)
            for name in rec.created:  # the name goes as its resource tracker would take it: nothing left in /dev/shm
                seg = shared_memory.SharedMemory(name)
                seg.unlink()
                seg.close()
            os._exit(0)  # as a killed rank: no clean-up, no goodbye to the group

        shm_agreement.dist.all_gather_object = gone
        with recording_shm() as rec:
            shared_page_agreement()
        os._exit(0)
    seen: list[str] = []
    attach = shm_agreement.AttachedSegment

    def attached(name):
        seg = attach(name)
        seen.append(seg.name)
        opened.set()
        return seg

    shm_agreement.AttachedSegment = attached
    try:
        shared_page_agreement()
    except RuntimeError:  # gloo: the peer closed the connection
        # Asked while the error (and with it the set-up's frame) is alive, as it is while the engine handles it.
        names.put((seen[0] if seen else "", bool(seen) and mapped(seen[0])))
    else:
        errors.put("rank 1: shared_page_agreement returned with its peer gone")
    os._exit(0)  # the group cannot be destroyed cleanly with its peer gone


def own_group(rank: int, world: int) -> tuple[int, list[int]]:
    """For tests/client/test_agreement.py (helpers.ranks.run_ranks): each global rank agrees over a gloo group of
    its own, as the TP group of one of several DP replicas. Its (world_size, MIN) must be its group's, not the
    world's: both ranks all-reduce at once, so an all-reduce over the default group pairs up and mixes them."""
    groups = [dist.new_group([r]) for r in range(world)]  # collective: every rank makes each
    agree = DistAgreement(groups[rank])
    return agree.world_size, agree.all_min(torch.tensor([rank, -rank])).tolist()
