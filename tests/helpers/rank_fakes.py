"""Stand-ins for the rank loop's tests: the portable layers, counting their calls; a loop with no device work."""

from __future__ import annotations

import contextlib
import threading
from types import SimpleNamespace

import torch


class FakeModel:
    """The drafter's portable layers: every hidden state 2.0 (a fast path's stand-in answers 1.0)."""

    device, dtype = torch.device("cpu"), torch.float32

    def __init__(self) -> None:
        self.calls = 0

    def draft_step(self, embeds, positions, meta, kv):
        self.calls += 1
        return torch.full_like(embeds, 2.0)


def hold_steps(loop) -> tuple[threading.Event, threading.Event]:
    """(started, release): `loop`'s steps, from now on, set `started` and run until the test sets `release`,
    holding the rank's lock as a step stuck on the device or in a peer's collective; each answers empty."""
    from dspark_sidecar.proto import sidecar_pb2 as pb

    started, release = threading.Event(), threading.Event()

    def run(req, *args, **kwargs):
        started.set()
        assert release.wait(60)
        return pb.DraftStepResponse(step_id=req.step_id)

    loop._run = run
    return started, release


class RefusingRendezvous:
    """A rendezvous no peer agrees in: every posted copy is recorded (its expiry, its step) and refused with
    `reason`, as when a peer never received the step; only refused copies reach it in the rank's CPU tests."""

    def __init__(self, reason: str = "no peers in this test") -> None:
        self.reason, self.posts = reason, []

    def agree(self, post):
        self.posts.append(post)
        return SimpleNamespace(go=False, reason=self.reason)


class IdleLoop:
    """RankLoop for a CPU servicer's doorbells (no graphs, so no pre-launch): sections and device waits are
    immediate, and nothing is queued on a device."""

    graphs = None

    def on_quiesce(self, fn, old=None):
        pass

    @contextlib.contextmanager
    def exclusive(self, wait=True, quiesce=True, give_up=None):
        yield

    def after_device(self, fn, wait=None):
        fn()

    def sweep_idle(self, poke=False):
        pass
