"""An aborted or refused gRPC step lets go of what it validated (region views, its binding's cache) once answered.

The worker kept the last step's future until the next step arrived, and the future keeps the step's
error, whose traceback keeps _run's frame (an abort's step) or validate_step's (a refusal found after
the views were made): an engine that unregistered its buffers or re-bound after such a step kept the
old memory mapped (under CUDA IPC, allocated) until some later gRPC step, then freed on the worker
outside the rank lock.
"""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
import torch

from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.server import rank as rank_mod
from dspark_sidecar.server.errors import SidecarError, out_of_range
from dspark_sidecar.server.metrics import Metrics
from dspark_sidecar.server.rank import RankContext, RankLoop
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
