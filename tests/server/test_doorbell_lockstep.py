"""TP 2 on CPU: a doorbell step and the queueing of the next one run with nothing between them, so other
device work on one rank (a release of regions) cannot pair its peers' collectives with the wrong step."""

from __future__ import annotations

import sys
import threading
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

from helpers.ranks import run_ranks

CAP = 4096
# The release's gRPC context: a same-node engine still waiting for its answer (no deadline).
OWNER = 41  # the engine's token for its buffers
ENGINE = SimpleNamespace(peer=lambda: "unix:/engine", is_active=lambda: True, time_remaining=lambda: None)


def _rank(rank: int, world: int, release_on_rank0: bool, board_name: str) -> dict:
    """Three lockstep doorbell steps; one all-reduce per step of the step id (the right sum: 2 x id) and
    one per queued copy (100 + its step), issued in stream order; every step agrees QUEUE_NEXT. With
    release_on_rank0, rank 0's engine releases its regions (UnregisterBuffers from a gRPC thread) while
    step 1 is being answered, as a shim whose link drops mid-step does."""
    from dspark_sidecar.drafter.kv_cache import StepMetadata
    from dspark_sidecar.proto import codec
    from dspark_sidecar.proto import doorbell as bell
    from dspark_sidecar.proto import memory as mem_handles
    from dspark_sidecar.proto import sidecar_pb2 as pb
    from dspark_sidecar.server import rank as rank_mod
    from dspark_sidecar.server.doorbell import Doorbell
    from dspark_sidecar.server.kv_binding import MemoryBindings
    from dspark_sidecar.server.metrics import Metrics
    from dspark_sidecar.server.prelaunch import Prelaunch
    from dspark_sidecar.server.rank import RankContext, RankLoop
    from dspark_sidecar.server.rendezvous import Board, Rendezvous
    from dspark_sidecar.server.servicer import DrafterServicer, Lifecycle
    from dspark_sidecar.server.validate import Step, host_meta

    ctl = dist.new_group(backend="gloo")
    order: list[str] = []  # this rank's device work, in issue order

    def validate(req, cfg, mem, max_reqs, indices=True, out_dtype=None, answer_limit=0, private=False):
        pos = torch.arange(0, 7)
        meta = StepMetadata(torch.tensor([7], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32), pos.clone())
        return Step(req.step_id, 1, pos, torch.full((7, 4), float(req.step_id)), None, meta,
                    SimpleNamespace(layers=[]), None, host_meta(pos, meta))

    rank_mod.validate_step = validate
    rank_mod.check_indices = lambda step: None

    class Model:
        device, dtype = torch.device("cpu"), torch.float32

        def draft_step(self, embeds, positions, meta, kv):
            t = embeds.clone()
            order.append(f"step {int(t[0, 0])}")
            dist.all_reduce(t)
            return t

    class HostOnlyPrelaunch(Prelaunch):
        """Prelaunch's host-side bookkeeping (take, after, settle, release, forget_regions); the GPU's
        parts replaced: no copy ever runs ahead (offer), a queued copy is one asynchronous all-reduce."""

        def __init__(self, page):
            self.page, self._count = page, lambda hit: None
            self.queued = self._last = self._served = self._passed = None
            self._streak, self._accepted, self._queue_next, self._out_ready = 0, False, False, False
            self.hits = self.misses = self.cooldown = self.word_wait_ns = self.start_wait_ns = 0
            self._replays, self._regions, self._held = {}, {}, []

        def offer(self, seq, req, step):
            self._served, self._queue_next = (seq, req.launch_key, step, "graph"), False
            return False, True

        def watch(self):
            pass

        def _queue(self, seq, key, step, graph):
            t = torch.full((7, 4), 100.0 + seq)
            order.append(f"queued copy {seq}")
            work = dist.all_reduce(t, async_op=True)
            self._held.append(t)
            self.queued = SimpleNamespace(seq=seq, done=SimpleNamespace(query=work.is_completed))

        def _pass(self, seq):
            pass

        def detach(self):
            self.release()
            return lambda: None

    if rank == 0:
        board = Board(board_name, world, create=True)
    dist.barrier(group=ctl)
    if rank != 0:
        board = Board(board_name, world, create=False)
    rdv = Rendezvous(board, rank, deadline_ms=10_000)
    memory = MemoryBindings(SimpleNamespace(), world, rank, torch.float32, torch.device("cpu"))
    ctx = RankContext(rank, world, SimpleNamespace(sliding_window=64), Model(), None, memory, Metrics(rank), 8)
    loop = RankLoop(ctx, rdv, None)
    page = SimpleNamespace(storage=torch.zeros(bell.HEADER + 2 * CAP, dtype=torch.uint8), close=lambda: None)
    db = Doorbell(page, CAP, loop, torch.device("cpu"), b"")
    db.prelaunch = HostOnlyPrelaunch(db.page)
    loop.on_quiesce(db.prelaunch.release)
    svc = DrafterServicer(ctx, loop, Lifecycle(), None, None, "")
    svc.doorbell = db
    # A region the engine holds under its token (the shim's buffers): a release of none enters no section.
    seg = mem_handles.shm_empty((4096,), torch.uint8)
    svc.RegisterBuffers(pb.RegisterBuffersRequest(owner=OWNER, regions=[pb.BufferRegion(
        name="buffers", memory=mem_handles.export_handle(seg.tensor), size_bytes=4096)]), ENGINE)
    answers: dict[int, float] = {}
    publish = db._publish
    releaser: list[threading.Thread] = []

    def answered(seq, resp):
        if release_on_rank0 and rank == 0 and seq == 1:
            t = threading.Thread(target=lambda: (svc.UnregisterBuffers(
                pb.UnregisterBuffersRequest(owner=OWNER), ENGINE), order.append("release")))
            t.start()
            releaser.append(t)
            # The release must be waiting for the loop's lock before this step's answer goes out: a fixed
            # nap was not enough on a loaded 2-core host (the thread reached the lock after step 2).
            assert _blocked_in(t, "exclusive"), "the release never reached the loop's lock"
        publish(seq, resp)
        answers[seq] = float(codec.from_tensor_ref(resp.hidden_states, "h")[0, 0])

    db._publish = answered
    db.start()
    for seq in (1, 2, 3):
        if release_on_rank0 and rank == 0 and seq == 2:
            # Step 2 rings only once the release is through: on a loaded 2-core CI host the doorbell thread took the
            # loop's lock back for step 2 before the waiting release thread ran (CI of 7db9e79: order step 2 <
            # release), and the test then checked nothing. The order that matters is queued copy 2 < release.
            deadline = time.monotonic() + 20
            while "release" not in order and time.monotonic() < deadline:
                time.sleep(0.005)
            assert "release" in order, f"the release never went through: {order}"
        dist.barrier(group=ctl)
        db.page.write(db.page.req_area, pb.DraftStepRequest(step_id=seq, num_requests=1, launch_key=1)
                      .SerializeToString(), bell.REQ_LEN, bell.REQ_SEQ, seq)
        deadline = time.monotonic() + 20
        while seq not in answers and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seq in answers, f"rank {rank}: step {seq} unanswered"
    for t in releaser:
        t.join(10)
    db.stop()  # releases the copy queued after step 3, paired with the peer's
    loop.close()
    rdv.close()
    seg.close()
    dist.barrier(group=ctl)
    if rank == 0:
        board.close()
    return {"order": order, "answers": answers}


def _blocked_in(thread: threading.Thread, function: str, timeout_s: float = 10.0) -> bool:
    """Whether `thread` reaches a frame of `function` (RankLoop.exclusive: waiting for its lock) in time."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        frame = sys._current_frames().get(thread.ident)
        while frame is not None:
            if frame.f_code.co_name == function:
                time.sleep(0.01)  # from its first line to the lock's acquire
                return True
            frame = frame.f_back
        time.sleep(0.002)
    return False


def test_a_release_of_regions_on_one_rank_waits_for_the_queueing_after_the_step():
    """It used to land between a step's answer and the queueing of the next on that rank only (two
    holds of the loop's lock): that rank skipped the queued copy its peer made, and every all-reduce
    after it summed one rank's step with the other's queued copy (answers 104, 106 instead of 4, 6)."""
    for release in (False, True):
        got = run_ranks(2, _rank, release, f"dspark-t-lockstep-{int(time.time() * 1e3) % 10**9}{int(release)}",
                        timeout_s=60)
        for r, res in enumerate(got):
            assert res["answers"] == {1: 2.0, 2: 4.0, 3: 6.0}, (release, r, res)
        if release:
            order = got[0]["order"]
            assert order.index("queued copy 2") < order.index("release") < order.index("step 2"), order
