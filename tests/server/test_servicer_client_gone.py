"""A draft step's client that is gone (cancel, deadline) frees the gRPC handler thread and stream place it held.

A step waits its turn behind the one running, which can take as long as the rendezvous deadline (a peer's
missing copy) or for ever (STEP_STUCK). Its handler thread waited on the step's answer with no regard for its
caller: a unary DraftStep whose client's deadline had passed, or a DraftSteps stream the engine cancelled to
reconnect, still held a thread of the rank's small pool (and the stream its place) until the step ended. A few
such calls took every thread: GetStatus and the health check, which say STEP_STUCK, queued for ever. The step
itself still runs in its turn (its peers run theirs); only its answer, which nobody reads, is dropped.
"""

from __future__ import annotations

import concurrent.futures
import os
import tempfile
import threading
from concurrent import futures
from types import SimpleNamespace

import grpc
import pytest
import torch

from dspark_sidecar.drafter.config import load_config
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.proto import sidecar_pb2_grpc as pb_grpc
from dspark_sidecar.server import servicer as servicer_mod
from dspark_sidecar.server.errors import StatusInterceptor
from dspark_sidecar.server.metrics import Metrics
from dspark_sidecar.server.servicer import DrafterServicer, Lifecycle
from helpers.waiting import wait_until

THREADS = 2  # the rank's pool, small: two waiting handlers take all of it


class StuckLoop:
    """A RankLoop whose steps are accepted and never answered (the step before them is stuck)."""

    def __init__(self) -> None:
        self.futures: list[concurrent.futures.Future] = []

    def submit(self, req: pb.DraftStepRequest) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.futures.append(fut)
        return fut

    def answer(self, req: pb.DraftStepRequest, fut: concurrent.futures.Future) -> pb.DraftStepResponse:
        return fut.result()

    def release(self) -> None:
        for fut in self.futures:
            if not fut.done():
                fut.set_result(pb.DraftStepResponse())


@pytest.fixture
def rank(monkeypatch):
    monkeypatch.setattr(servicer_mod, "MAX_STREAMS", 1)
    cfg = load_config("tiny")
    ctx = SimpleNamespace(rank=0, fast=None, cfg=cfg, memory=SimpleNamespace(kv=None),
                          model=SimpleNamespace(dtype=torch.float32), metrics=Metrics(0))
    loop = StuckLoop()
    svc = DrafterServicer(ctx, loop, Lifecycle(state="SERVING"), pb.Limits(), pb.Parallel(), "bf16")  # type: ignore[arg-type]
    folder = tempfile.mkdtemp(prefix="gone", dir="/tmp")
    path = os.path.join(folder, "r0.sock")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=THREADS), interceptors=[StatusInterceptor()])
    pb_grpc.add_DrafterSidecarServicer_to_server(svc, server)
    server.add_insecure_port(f"unix:{path}")
    server.start()
    channel = grpc.insecure_channel(f"unix:{path}")
    try:
        yield pb_grpc.DrafterSidecarStub(channel), loop
    finally:
        channel.close()
        loop.release()  # else the handler threads wait for ever and hold the interpreter's exit
        server.stop(None).wait()
        if os.path.exists(path):
            os.unlink(path)
        os.rmdir(folder)


def test_unary_steps_whose_clients_gave_up_leave_the_threads_to_get_status(rank):
    stub, loop = rank
    for step_id in range(THREADS):
        with pytest.raises(grpc.RpcError) as err:
            stub.DraftStep(pb.DraftStepRequest(step_id=step_id), timeout=0.3)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # Every pool thread served one of those steps: before, each still waited on its step's answer.
    status = stub.GetStatus(pb.GetStatusRequest(), timeout=5.0)
    assert status.state == "SERVING"
    # The steps were taken and stay in the loop's order: they run in their turn, answered to nobody.
    assert len(loop.futures) == THREADS and not any(f.cancelled() for f in loop.futures)


def test_a_cancelled_stream_gives_its_place_and_thread_back_while_its_step_waits(rank):
    stub, loop = rank
    gone = threading.Event()

    def steps():
        yield pb.DraftStepRequest(step_id=1)
        gone.wait(10.0)

    call = stub.DraftSteps(steps())
    wait_until(lambda: len(loop.futures) == 1, 10.0, "the stream's step reached the loop", interval_s=0.02)
    call.cancel()
    gone.set()
    # The rank serves one stream (MAX_STREAMS patched): a new one is taken once the cancelled one has let go
    # of its place, which it held until its step was answered.
    wait_until(lambda: _taken(stub), 5.0, "a new stream is taken after the cancelled one let go", interval_s=0.1)
    assert not loop.futures[0].done()  # still waiting its turn: it was never dropped from the loop


def _taken(stub) -> bool:
    """Whether a stream opened now is taken rather than refused TOO_MANY_STREAMS."""
    fresh = stub.DraftSteps(iter(()))
    try:
        for _ in fresh:
            pass
        return True
    except grpc.RpcError as err:
        return err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED
