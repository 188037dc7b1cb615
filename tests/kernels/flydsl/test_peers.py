"""The TP exchange's peer-buffer protocol (kernels/flydsl/peers.py) on CPU: 4 real gloo processes, a fake HIP runtime."""

from __future__ import annotations

import pytest
import torch

from dspark_sidecar.kernels.flydsl import peers as pr
from dspark_sidecar.kernels.flydsl import shapes
from dspark_sidecar.kernels.flydsl.runner import FlyDSLUnsupported
from helpers.fake_hip import FakeHip, exchange_rank, exchange_scenarios
from helpers.ranks import run_ranks

# A collective one rank leaves unmatched (ranks that disagree on a verdict) fails the test after this long,
# not after gloo's 30 minutes. Every collective here completes in seconds.
RANK_TIMEOUT_S = 120


def test_buffer_sizes_match_the_exchange_kernel():
    ex = pytest.importorskip("dspark_sidecar.kernels.flydsl.exchange")
    assert pr.RX_SHAPE == (2 * shapes.TP * ex.MP_MAX, shapes.HIDDEN)
    assert pr.FLAGS_SHAPE == (2 * shapes.TP * ex.NBLK,)


BAD_OFFERS = [
    ("short_handle", "rank 2 sent a garbled rx IPC handle (10 bytes, expected 64 bytes)"),
    ("no_handle", "rank 2 sent no rx IPC handle"),
    ("alloc", "rank 2 could not export its exchange buffers: hipExtMallocWithFlags(hipDeviceMallocUncached) "
              "failed: out of memory"),
]


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """Every 4-rank scenario in one spawn of 4 gloo processes: [scenario][rank] -> result."""
    scenarios = [(None, -1)] + [(f, 2) for f, _ in BAD_OFFERS] + [("bogus_handle", 1), (None, -1)]
    res = run_ranks(4, exchange_scenarios, str(tmp_path_factory.mktemp("peers")), scenarios, timeout_s=RANK_TIMEOUT_S)
    return [[res[r][i] for r in range(4)] for i in range(len(scenarios))]


@pytest.mark.parametrize("scenario", [0, 5], ids=["first", "after-failures"])
def test_four_ranks_map_each_other(four_ranks, scenario):
    for out in four_ranks[scenario]:
        assert "error" not in out, out
        # Every rank's push landed in this rank's own buffers, in its slot.
        assert out["seen_rx"] == [1.0, 2.0, 3.0, 4.0]
        assert out["seen_flags"] == [100, 101, 102, 103]
        # Parity 1 was never written: zeroed at allocation (FakeHip's memory starts stale, every flag at
        # the first exchange's tag: unzeroed, a new process's first exchange read its peers as ready).
        assert out["untouched"] and out["own_is_local"] and out["epoch"] == [0]
        kinds = [k for k, _ in out["calls"]]
        # 2 own allocations, 3 peers x 2 opened; close: the 6 mappings first, then the 2 frees.
        assert kinds == ["malloc", "malloc"] + ["open"] * 6 + ["close"] * 6 + ["free"] * 2
        opened = {p for k, p in out["calls"] if k == "open"}
        assert opened == {p for k, p in out["calls"] if k == "close"}
        assert out["live_before_close"] == 8 and out["live"] == 0


@pytest.mark.parametrize("index", range(len(BAD_OFFERS)), ids=[f for f, _ in BAD_OFFERS])
def test_bad_offer_refused_identically_on_every_rank(four_ranks, index):
    reason = BAD_OFFERS[index][1]
    res = four_ranks[1 + index]
    assert [out.get("error") for out in res] == [reason] * 4
    assert all(out["live"] == 0 for out in res)  # every rank freed what it had allocated
    assert not any(k == "open" for out in res for k, _ in out["calls"])  # nobody mapped anything


def test_unopenable_handle_refused_on_every_rank_and_unmapped(four_ranks):
    # Rank 1 exports a well-formed handle naming nothing: the 3 others fail to open it, rank 1 opens
    # the rest fine. Round 2 makes every rank give up, the one that could open included.
    res = four_ranks[1 + len(BAD_OFFERS)]
    errors = {out["error"] for out in res}
    assert errors == {"rank 0 could not map rank 1's exchange buffers: hipIpcOpenMemHandle failed: invalid resource handle"}
    assert all(out["live"] == 0 for out in res)
    kinds = [k for k, _ in res[1]["calls"]]
    assert kinds.count("open") == 6 and kinds.count("close") == 6  # rank 1 had mapped its 3 peers, then unmapped


def test_group_of_two_refused_before_allocating(tmp_path):
    res = run_ranks(2, exchange_rank, str(tmp_path), None, -1, timeout_s=RANK_TIMEOUT_S)
    assert [out["error"] for out in res] == ["TP exchange needs 4 ranks, the group has 2"] * 2
    assert all(out["calls"] == [] for out in res)


def test_check_offers_names_the_bad_rank():
    good = {"protocol": pr.PROTOCOL, "host": "h", "pid": 1, "rx_bytes": pr.RX_BYTES, "flags_bytes": pr.FLAGS_BYTES,
            "rx": b"\0" * 64, "flags": b"\0" * 64}
    assert pr.check_offers([good] * 4) is None
    assert pr.check_offers([good, good, None, good]) == "rank 2 sent no exchange offer (NoneType)"
    assert "rank 3 speaks exchange protocol 0" in pr.check_offers([good] * 3 + [{**good, "protocol": 0}])
    assert "rank 1 exchange buffers are 8/" in pr.check_offers([good, {**good, "rx_bytes": 8}, good, good])
    short_flags = [good, good, {**good, "flags_bytes": 8}, good]
    assert f"rank 2 exchange buffers are {pr.RX_BYTES}/8 bytes" in pr.check_offers(short_flags)
    assert pr.check_offers([good] * 3 + [{**good, "flags": "x" * 64}]) == \
        "rank 3 sent a garbled flags IPC handle (str, expected 64 bytes)"
    assert "HIP IPC maps memory of one node only" in pr.check_offers([good] * 3 + [{**good, "host": "other"}])


def test_no_hip_runtime_is_a_clear_reason(monkeypatch):
    from dspark_sidecar.proto import driver_lib
    monkeypatch.setattr(driver_lib, "hip_runtime_candidates", lambda: ["/nonexistent/libamdhip64.so"])
    with pytest.raises(FlyDSLUnsupported, match=r"^HIP runtime \(libamdhip64\) not found; tried "
                                                r"/nonexistent/libamdhip64.so: .*\(the TP exchange's .* need ROCm\)$"):
        pr.HipRuntime(torch.device("cuda", 0))


def test_ipc_handle_struct_keeps_binary_bytes():
    # Handles are binary: NULs inside must survive the ctypes struct both ways (a c_char field
    # would cut the handle at its first NUL and every open would fail).
    raw = bytes(range(7)) + b"\0" * 9 + bytes(range(200, 248))
    assert len(raw) == pr.IPC_HANDLE_BYTES
    h = pr._IpcHandle.of(raw)
    assert h.raw() == raw
    assert bytes(memoryview(h)) == raw  # what the C side receives by value


FREE_FAILS = "hipFree failed: an illegal memory access was encountered"


@pytest.fixture(scope="module")
def four_ranks_more(tmp_path_factory):
    """More 4-rank failures in one spawn: a peer's flags that cannot be wrapped, and releases that fail."""
    scenarios = [("wrap_flags", 0), ("short_handle+free", 2), ("bogus_handle+free", 1)]
    res = run_ranks(4, exchange_scenarios, str(tmp_path_factory.mktemp("peers_more")), scenarios,
                    timeout_s=RANK_TIMEOUT_S)
    return [[res[r][i] for r in range(4)] for i in range(len(scenarios))]


def test_unwrappable_peer_flags_name_that_peer(four_ranks_more):
    # Rank 0 opens rank 1's handles and wraps its RX, then cannot wrap its flags: the reason names rank 1
    # (the rank being mapped), not the next one.
    res = four_ranks_more[0]
    want = ("rank 0 could not map rank 1's exchange buffers: torch could not view the IPC-mapped exchange "
            "buffer in place")
    assert [out.get("error") for out in res] == [want] * 4
    assert all(out["live"] == 0 for out in res)


@pytest.mark.parametrize("scenario, faulty, reason", [
    (1, 2, "rank 2 sent a garbled rx IPC handle (10 bytes, expected 64 bytes)"),
    (2, 1, "rank 0 could not map rank 1's exchange buffers: hipIpcOpenMemHandle failed: invalid resource handle"),
], ids=["round1", "round2"])
def test_failed_release_keeps_the_groups_reason(four_ranks_more, scenario, faulty, reason):
    # The faulty rank's own frees fail while it gives up: it still reports the reason every rank agreed
    # on (which says why the path is off), with the release failure added, not the release failure alone.
    res = four_ranks_more[scenario]
    for r, out in enumerate(res):
        if r == faulty:
            assert out["error"] == f"{reason} (and releasing: {FREE_FAILS}; {FREE_FAILS})"
        else:
            assert out["error"] == reason and out["live"] == 0


class OneRankOfFour:
    """torch.distributed for map_peers run as rank 0 alone: ranks 1-3 are FakeHips of this process that offer
    their buffers and map fine. Round `lost` raises as gloo does once a peer's process ended."""

    def __init__(self, folder: str, lost: int | None) -> None:
        self.peers, self.lost, self.rounds = [FakeHip(folder) for _ in range(3)], lost, 0

    def get_world_size(self, group) -> int:
        return 4

    def get_rank(self, group) -> int:
        return 0

    def all_gather_object(self, out: list, mine, group=None) -> None:
        self.rounds += 1
        if self.rounds == self.lost:
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:49330")
        out[:] = [mine] + ([pr._offer(lambda rt=rt: rt)[0] for rt in self.peers] if self.rounds == 1 else [None] * 3)


@pytest.mark.parametrize("lost", [1, 2], ids=["round1", "round2"])
def test_a_peer_lost_in_a_collective_releases_this_ranks_buffers(tmp_path, monkeypatch, lost):
    # The gloo error stops the rank's start-up (app: PeerLost), but the buffers it had allocated, and in
    # round 2 the 3 peers' it had mapped, were left behind: nothing else holds them to close.
    monkeypatch.setattr(pr, "dist", OneRankOfFour(str(tmp_path), lost))
    rt = FakeHip(str(tmp_path))
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        pr.map_peers(None, lambda: rt, torch.device("cpu"))
    kinds = [k for k, _ in rt.calls]
    assert kinds.count("open") == kinds.count("close") == (6 if lost == 2 else 0)
    assert kinds.count("free") == 2 and rt.live() == 0


def test_an_epoch_that_cannot_be_allocated_is_posted_in_round_2(tmp_path, monkeypatch):
    # Allocated after round 2, its failure (out of device memory) raised on this rank alone, its buffers
    # mapped, while its peers had agreed to serve through them.
    zeros, gpu = torch.zeros, torch.device("cuda", 7)

    def zeros_oom(*a, device=None, **k):
        if device == gpu:
            raise torch.OutOfMemoryError("HIP out of memory")
        return zeros(*a, device=device, **k)

    monkeypatch.setattr(pr, "dist", OneRankOfFour(str(tmp_path), None))
    monkeypatch.setattr(torch, "zeros", zeros_oom)
    rt = FakeHip(str(tmp_path))
    with pytest.raises(FlyDSLUnsupported, match=r"^rank 0 could not allocate its exchange epoch: OutOfMemoryError: "
                                                r"HIP out of memory$"):
        pr.map_peers(None, lambda: rt, gpu)
    assert rt.live() == 0
