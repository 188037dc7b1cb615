"""The rank loop's use of a pre-launched copy (server/prelaunch.py): offered before the rendezvous, taken
only as every rank agreed, never touched for a step that is refused or aborted."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dspark_sidecar.drafter.kv_cache import StepMetadata
from dspark_sidecar.proto import codec
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.server import rank as rank_mod
from dspark_sidecar.server.errors import invalid
from dspark_sidecar.server.metrics import Metrics
from dspark_sidecar.server.rank import RankContext, RankLoop
from dspark_sidecar.server.rendezvous import Verdict
from dspark_sidecar.server.validate import Step, host_meta
from helpers.rank_fakes import FakeModel

QUEUED_OUT = torch.full((7, 4), 3.0)


class FakeRendezvous:
    def __init__(self, verdict: Verdict) -> None:
        self.verdict, self.posts = verdict, []

    def agree(self, post):
        self.posts.append(post)
        return self.verdict


class FakeHook:
    def __init__(self, offer: tuple[bool, bool], hit: bool) -> None:
        self._offer, self._hit, self.calls = offer, hit, []

    def offer(self, step):
        self.calls.append(("offer", step.num_reqs))
        return self._offer

    def take(self, queued, queue_next):
        self.calls.append(("take", queued, queue_next))
        return QUEUED_OUT if queued and self._hit else None

    def waits_ns(self):
        return 1_000, 3_000


def _step() -> Step:
    pos = torch.arange(0, 7)
    meta = StepMetadata(torch.tensor([7], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32), pos.clone())
    return Step(1, 1, pos, torch.zeros(7, 4), None, meta, SimpleNamespace(layers=[]), None, host_meta(pos, meta))


@pytest.fixture
def run(monkeypatch):
    """run(verdict, hook, valid=True, fast=None, indices_ok=True) -> (the step's response, the rendezvous,
    the model); run.checks: per call of validate_step, whether it ran the index checks itself, and
    "check_indices" each time the loop ran them after the offer."""
    loops = []

    def _run(verdict: Verdict, hook: FakeHook | None, valid: bool = True, fast=None, indices_ok: bool = True):
        def check(step):
            _run.checks.append("check_indices")
            if not indices_ok:
                raise invalid("block_tables", "block_tables[0][0] = 99 outside the bound cache's 64 pages")

        def validate(req, cfg, memory, max_reqs, indices=True, out_dtype=None, answer_limit=0, private=False):
            _run.checks.append(indices)
            if not valid:
                raise invalid("slot_mapping", "slot 99 outside the cache")
            if indices:
                check(None)
            return _step()

        _run.checks = []
        monkeypatch.setattr(rank_mod, "validate_step", validate)
        monkeypatch.setattr(rank_mod, "check_indices", check)
        model = FakeModel()
        ctx = RankContext(0, 2, SimpleNamespace(), model, None, None, Metrics(0), 8, fast=fast)
        rdv = FakeRendezvous(verdict)
        loop = RankLoop(ctx, rdv, None)
        loops.append(loop)
        # The doorbell path: errors come back in the response, as the engine reads them.
        return loop.answer_now(pb.DraftStepRequest(step_id=1, num_requests=1), hook), rdv, model

    yield _run
    for loop in loops:
        loop.close()


def _go(queued: bool = False, queue_next: bool = False, fast: bool = False) -> Verdict:
    return Verdict(True, "", 1, fast, queued, queue_next)


def test_the_offer_goes_into_the_post_and_the_verdict_into_take(run):
    hook = FakeHook(offer=(True, True), hit=True)
    resp, rdv, model = run(_go(queued=True, queue_next=True), hook)
    [post] = rdv.posts
    assert post.queued and post.queue_next and post.valid and not post.fast
    assert hook.calls == [("offer", 1), ("take", True, True)]
    assert resp.timings.prelaunched and model.calls == 0  # answered from the queued copy
    # The offer's waits (the engine's word, the copy's start) travel in the timings, inside the rendezvous.
    tm = resp.timings
    assert (tm.gpu_word_wait_ns, tm.gpu_start_wait_ns) == (1_000, 3_000)
    assert 0 < tm.validate_ns <= tm.rendezvous_ns and 0 < tm.output_ns <= tm.compute_ns
    assert torch.equal(codec.from_tensor_ref(resp.hidden_states, "hidden"), QUEUED_OUT)


def test_go_without_queued_after_this_rank_s_copy_ran_checks_the_host_copy_first(run, monkeypatch):
    """The coordinator aborts a step whose copy ran on some ranks only (SOME_COPIES), as this rank skipped
    the host's index checks. A GO without QUEUED here anyway (a broken invariant) gets them before the
    ordinary run; failing them after GO, with the peers in the step's collectives, ends the rank."""
    hook = FakeHook(offer=(True, True), hit=True)  # this rank's copy ran
    resp, rdv, model = run(_go(queued=False, queue_next=True), hook)  # a peer's did not
    assert hook.calls == [("offer", 1), ("take", False, True)]
    assert run.checks == [False, "check_indices"]
    assert not resp.timings.prelaunched and model.calls == 1 and resp.HasField("hidden_states")

    exits = []

    def _exit(code):
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(rank_mod.os, "_exit", _exit)
    with pytest.raises(SystemExit):
        run(_go(queued=False, queue_next=True), FakeHook(offer=(True, True), hit=True), indices_ok=False)
    assert exits == [3] and run.checks == [False, "check_indices"]


def test_an_invalid_or_aborted_step_never_takes_its_copy(run):
    hook = FakeHook(offer=(True, True), hit=True)
    resp, rdv, model = run(_go(queued=True, queue_next=True), hook, valid=False)
    assert resp.HasField("error") and resp.error.field == "slot_mapping"
    assert hook.calls == [] and not rdv.posts[0].valid and not rdv.posts[0].queued
    hook = FakeHook(offer=(True, True), hit=True)
    resp, _, model = run(Verdict(False, "step 1: ranks disagree on num_requests", 0), hook)
    assert resp.HasField("error") and hook.calls == [("offer", 1)] and model.calls == 0


def test_a_rank_on_the_kernel_fast_path_neither_offers_nor_queues(run):
    fast = SimpleNamespace(max_positions=100, ready=lambda kv: True, calls=0,
                           forward=lambda e, p, m: torch.full_like(e, 1.0), agreed=lambda kv, fast: None)
    hook = FakeHook(offer=(True, True), hit=True)
    resp, rdv, _ = run(_go(fast=True), hook, fast=fast)
    [post] = rdv.posts
    assert post.fast and not post.queued and not post.queue_next
    assert hook.calls == [("take", False, False)]  # releases whatever was queued
    assert not resp.timings.prelaunched


@pytest.mark.parametrize("agreed", [True, False])
def test_a_rank_that_offered_the_fast_path_learns_whether_every_rank_did(run, agreed):
    """Verdict.fast goes back to the fast path after GO (FlyDSLFastPath.agreed): outvoted by a peer that did
    not offer it, this rank's GetStatus says why its steps run the portable layers."""
    told = []
    fast = SimpleNamespace(max_positions=100, ready=lambda kv: True, forward=lambda e, p, m: torch.full_like(e, 1.0),
                           agreed=lambda kv, fast: told.append(fast))
    resp, rdv, model = run(_go(fast=agreed), None, fast=fast)
    assert rdv.posts[0].fast and told == [agreed] and not resp.HasField("error")
    assert model.calls == (0 if agreed else 1)  # the portable layers ran where a peer did not offer
    run(Verdict(False, "step 1: ranks disagree on num_requests", 0), None, fast=fast)
    assert told == [agreed]  # an aborted step says nothing of the peers' offers


def test_a_copy_that_ran_skips_the_host_index_checks(run):
    """The GPU program checked the same bytes (kernels/triton/step_meta.py): a hit is not checked again."""
    resp, rdv, model = run(_go(queued=True), FakeHook(offer=(True, False), hit=True))
    assert run.checks == [False] and resp.timings.prelaunched and rdv.posts[0].valid
    # The offer's two halves travel apart (with (True, True) everywhere else, either could stand for both).
    assert rdv.posts[0].queued and not rdv.posts[0].queue_next


@pytest.mark.parametrize("indices_ok", [True, False])
def test_a_step_without_a_copy_that_ran_gets_the_index_checks_after_the_offer(run, indices_ok):
    """Nothing queued, or the copy refused (another layout, a request the GPU found invalid): the host's
    own checks run, and a failure is the step's answer, naming the field; nothing is taken."""
    hook = FakeHook(offer=(False, True), hit=False)
    resp, rdv, model = run(_go(), hook, indices_ok=indices_ok)
    assert run.checks == [False, "check_indices"]
    assert rdv.posts[0].valid is indices_ok
    assert not rdv.posts[0].queued and rdv.posts[0].queue_next  # the offer's own halves, not one for both
    if indices_ok:
        assert not resp.HasField("error") and model.calls == 1
    else:
        assert resp.error.field == "block_tables" and model.calls == 0
        assert hook.calls == [("offer", 1)]  # refused before the rendezvous' outcome is used: no take


def test_the_fast_path_and_the_grpc_path_check_indices_as_ever(run):
    fast = SimpleNamespace(max_positions=100, ready=lambda kv: True, forward=lambda e, p, m: torch.full_like(e, 1.0),
                           agreed=lambda kv, fast: None)
    run(_go(fast=True), FakeHook(offer=(True, True), hit=True), fast=fast)
    assert run.checks == [False, "check_indices"]  # the fast path never offers: no GPU check to lean on
    run(_go(), None)
    assert run.checks == [True, "check_indices"]  # no doorbell hook: validate_step checks them itself


@pytest.mark.parametrize("where", ["validate", "index checks"])
def test_a_refused_step_leaves_no_reference_cycle_behind(run, where):
    """A refused step's error, re-raised from _run, kept _run's frame in its traceback while that frame
    held the error and the step: a cycle that kept the step's region views (GPU IPC memory on the data
    plane) until a collection freed them, on whatever thread and stream it ran. Refcounting frees it now."""
    import gc

    from dspark_sidecar.server.errors import SidecarError

    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        resp, _, _ = run(_go(), FakeHook(offer=(False, False), hit=False), valid=where != "validate", indices_ok=False)
        assert resp.HasField("error")
        gc.collect()
        cyclic = [o for o in gc.garbage if isinstance(o, SidecarError)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert cyclic == [], cyclic
