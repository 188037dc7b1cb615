"""A step's deadline_ms is posted to the rendezvous as a monotonic time that many milliseconds after its receipt.

The coordinator aborts a step past it (DEADLINE) instead of launching it, and its K/V writes, after the engine gave
up; posted too early, every step queued for a few milliseconds was aborted on a healthy sidecar, too late, a stale
step was launched. Both paths: the gRPC worker's (submit) and the doorbell's (answer_now).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.server.metrics import Metrics
from dspark_sidecar.server.rank import RankContext, RankLoop
from helpers.rank_fakes import RefusingRendezvous


@pytest.fixture
def loop():
    model = SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32)
    rdv = RefusingRendezvous()
    ctx = RankContext(0, 2, SimpleNamespace(), model, None, None, Metrics(0), 8)
    lp = RankLoop(ctx, rdv, None)  # type: ignore[arg-type]
    yield lp, rdv
    lp.close()


@pytest.mark.parametrize("path", ["grpc", "doorbell"])
@pytest.mark.parametrize("deadline_ms", [1, 2_000, 2**32 - 1])
def test_the_posted_expiry_is_deadline_ms_after_receipt(loop, path, deadline_ms):
    lp, rdv = loop
    # Refused (num_requests OUT_OF_RANGE), and its copy posted all the same: what is posted is what is looked at.
    req = pb.DraftStepRequest(step_id=1, num_requests=0, deadline_ms=deadline_ms)
    before = time.monotonic_ns()
    if path == "grpc":
        lp.submit(req).exception(timeout=10)
    else:
        lp.answer_now(req)
    after = time.monotonic_ns()
    (post,) = rdv.posts
    assert before + deadline_ms * 1_000_000 <= post.expires_ns <= after + deadline_ms * 1_000_000


def test_no_deadline_posts_none(loop):
    lp, rdv = loop
    lp.submit(pb.DraftStepRequest(step_id=1, num_requests=0)).exception(timeout=10)
    lp.answer_now(pb.DraftStepRequest(step_id=2, num_requests=0))
    assert [p.expires_ns for p in rdv.posts] == [0, 0]
