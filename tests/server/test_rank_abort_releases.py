"""An aborted or refused gRPC step lets go of what it validated (region views, its binding's cache) once answered.

The worker kept the last step's future until the next step arrived, and the future keeps the step's
error, whose traceback keeps _run's frame (an abort's step) or validate_step's (a refusal found after
the views were made): an engine that unregistered its buffers or re-bound after such a step kept the
old memory mapped (under CUDA IPC, allocated) until some later gRPC step, then freed on the worker
outside the rank lock. The DraftSteps stream's handler kept the future too, in its frame, between steps: the
refused step's views lived on while the stream idled, and once it ended, a reference cycle (the error's traceback
holds rank.answer's frame, whose caller is the stream's) left them to the cyclic collector, on whatever thread.
"""

from __future__ import annotations

import gc
import os
import queue
import tempfile
import weakref
from concurrent import futures
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
import torch

from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.proto import sidecar_pb2_grpc as pb_grpc
from dspark_sidecar.server import rank as rank_mod
from dspark_sidecar.server.errors import SidecarError, StatusInterceptor, out_of_range
from dspark_sidecar.server.metrics import Metrics
from dspark_sidecar.server.rank import RankContext, RankLoop
from dspark_sidecar.server.servicer import DrafterServicer, Lifecycle
from helpers.rank_fakes import RefusingRendezvous
from helpers.waiting import wait_until


@pytest.fixture
def gc_off():
    """Only reference counting frees anything meanwhile: what a collection would free is what is asserted on."""
    enabled = gc.isenabled()
    gc.disable()
    yield
    if enabled:
        gc.enable()


@pytest.mark.parametrize("reason, refuse", [
    ("step 1: rank(s) 1 did not receive it within 200 ms", False),
    ("step 1: its deadline_ms passed on rank(s) 1 before every rank had it", False),
    ("step 1: rank(s) 0 rejected their copy of the step's inputs", True),
])
def test_an_aborted_or_refused_step_holds_no_view_after_its_answer(monkeypatch, gc_off, reason, refuse):
    views: list[weakref.ref] = []

    def validate(req, *args, **kwargs):  # a step whose embeddings and cache are views of the engine's memory
        embeds, cache = torch.zeros(7, 4), torch.zeros(2, 16, 4)
        views.extend((weakref.ref(embeds), weakref.ref(cache)))
        step = SimpleNamespace(host=(np.zeros(7, np.int64),), kv=SimpleNamespace(layers=[cache]),
                               inputs_embeds=embeds, num_reqs=1)
        if refuse:  # as check_indices inside validate_step: refused with the views in its frame
            raise out_of_range("slot_mapping", f"row 0 slot 99 outside the bound cache ({len(step.host)} arrays)")
        return step

    monkeypatch.setattr(rank_mod, "validate_step", validate)
    model = SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32)
    loop = RankLoop(RankContext(0, 2, SimpleNamespace(), model, None, None, Metrics(0), 8), RefusingRendezvous(reason), None)
    try:
        fut = loop.submit(pb.DraftStepRequest(step_id=1, num_requests=1))
        err = fut.exception(timeout=10)
        codes = (grpc.StatusCode.OUT_OF_RANGE,) if refuse else (grpc.StatusCode.ABORTED, grpc.StatusCode.DEADLINE_EXCEEDED)
        assert isinstance(err, SidecarError) and err.code in codes, err
        if not refuse:  # the abort's views went on the worker, under the rank lock, not later with the error
            assert [v() is None for v in views] == [True, True], "the aborted step's views live on in its error"
        del fut, err  # the engine has its answer
        req = pb.DraftStepRequest(step_id=2, num_requests=1)
        assert loop.answer(req, loop.submit(req)).HasField("error")  # the stream path
        wait_until(lambda: [v() is None for v in views] == [True] * 4, 2,
                   lambda: f"a failed step's views released after its answer: {[v() is None for v in views]}")
    finally:
        loop.close()


def test_a_step_refused_on_the_stream_holds_no_view_while_the_stream_idles_nor_after_it_ends(monkeypatch, gc_off):
    """A real gRPC server on a unix socket, the servicer's DraftSteps over a rank loop whose steps are refused with
    views in validate_step's frame (as an index check's refusal): each answer read, its views go by reference
    counting, with the stream still open (the engine may UnbindKV or UnregisterBuffers before its next step) and
    after the client half-closes it."""
    views: list[weakref.ref] = []

    def validate(req, *args, **kwargs):
        cache = torch.zeros(2, 16, 4)  # a view of the engine's cache
        views.append(weakref.ref(cache))
        step = SimpleNamespace(kv=SimpleNamespace(layers=[cache]))  # held by this frame, as validate_step's
        assert step.kv.layers[0] is cache
        raise out_of_range("slot_mapping", "row 0 slot 99 outside the bound cache's 64 slots")

    monkeypatch.setattr(rank_mod, "validate_step", validate)
    model = SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32)
    loop = RankLoop(RankContext(0, 1, SimpleNamespace(), model, None, None, Metrics(0), 8),
                    RefusingRendezvous("no peers"), None)
    ctx = SimpleNamespace(rank=0, fast=None, memory=SimpleNamespace(kv=None), model=model, metrics=Metrics(0))
    svc = DrafterServicer(ctx, loop, Lifecycle(state="SERVING"), pb.Limits(), pb.Parallel(), "bf16")  # type: ignore[arg-type]
    folder = tempfile.mkdtemp(prefix="release", dir="/tmp")
    path = os.path.join(folder, "r0.sock")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), interceptors=[StatusInterceptor()])
    pb_grpc.add_DrafterSidecarServicer_to_server(svc, server)
    server.add_insecure_port(f"unix:{path}")
    server.start()
    channel = grpc.insecure_channel(f"unix:{path}")
    requests: queue.SimpleQueue = queue.SimpleQueue()
    try:
        call = pb_grpc.DrafterSidecarStub(channel).DraftSteps(iter(requests.get, None), timeout=30)
        requests.put(pb.DraftStepRequest(step_id=1, num_requests=1))
        assert next(call).error.reason == "OUT_OF_RANGE"
        wait_until(lambda: len(views) == 1 and views[0]() is None, 2,
                   "the refused step's views released after its answer, the stream open and idle")
        requests.put(pb.DraftStepRequest(step_id=2, num_requests=1))
        requests.put(None)  # half-closed: the stream ends after this step's answer
        assert [r.error.reason for r in call] == ["OUT_OF_RANGE"]
        wait_until(lambda: len(views) == 2 and views[1]() is None, 2,
                   "the last refused step's views released once the stream ended (not left to the collector)")
    finally:
        channel.close()
        server.stop(None).wait()
        loop.close()
        if os.path.exists(path):
            os.unlink(path)
        os.rmdir(folder)
