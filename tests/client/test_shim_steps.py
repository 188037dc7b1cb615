"""The shim on one engine rank against a fake sidecar: the seed's refusals make no remote call; forwarding; re-binds."""

from __future__ import annotations

import sys
import threading
import time

import grpc
import pytest
import torch
from google.rpc import code_pb2

from dspark_sidecar import layout
from dspark_sidecar.client import shim as S
from dspark_sidecar.client.config import EngineConfig, EngineConfigError, config_refusal
from dspark_sidecar.client.forward_context import set_forward_context
from dspark_sidecar.client.shim import DrafterShim
from dspark_sidecar.drafter.kv_cache import StepMetadata
from dspark_sidecar.drafter.parallel import ParallelContext
from dspark_sidecar.proto import codec
from dspark_sidecar.proto import doorbell as bell
from dspark_sidecar.proto import memory
from dspark_sidecar.proto import sidecar_pb2 as pb
from helpers.engine_fakes import (
    HIDDEN, DoorbellNeverAnswered, FakeModel, FakeServer, FakeSidecar, PreflightHook, recording_shm, shm_kv_cache,
    short_socket_dir, step_inputs, vllm_draft_metadata,
)
from helpers.waiting import wait_until


@pytest.fixture
def fake():
    server = FakeServer(FakeSidecar(max_reqs=4), short_socket_dir() / "rank0.sock").start()
    yield server
    server.stop()


def make_shim(endpoint: str, kv: list | None = None, agree=None, **cfg) -> tuple[DrafterShim, FakeModel, list]:
    """Rank 0 of a TP-4 engine over a shm cache; the agreement is local (the other ranks are not simulated)
    unless `agree` (a PreflightHook: a test's stand-in for the peers) is given, which then knows the shim."""
    kv = shm_kv_cache() if kv is None else kv
    cfg.setdefault("tp_size", 4)
    cfg.setdefault("step_deadline_s", 2.0)
    # A bound on a hang, not a timing: the 1 s default's first GetStatus on a fresh channel ran out on a loaded CI
    # box (a fallback "sidecar unreachable" where the test wanted a step). No test here waits a connect out.
    cfg.setdefault("connect_deadline_s", 30.0)
    config = EngineConfig(endpoint=endpoint, **cfg)
    model = FakeModel()
    shim = DrafterShim(config, model, lambda: [s.tensor for s in kv], ParallelContext(0, 1) if agree is None else agree)
    if agree is not None:
        agree.shim = shim
    return shim, model, kv


@pytest.mark.parametrize("field, value, why", [
    ("tp_size", 2, "TP 2 != 4"), ("dp_size", 2, "DP > 1"), ("pp_size", 2, "PP > 1"),
    ("speculative_method", "eagle", "no DSpark draft"), ("num_speculative_tokens", 5, "7 speculative tokens required"),
])
def test_deployment_refusals_turn_the_process_off_without_calling(fake, field, value, why):
    shim, model, _ = make_shim(fake.endpoint, **{field: value})
    assert not shim.enabled and shim.refusal == why == config_refusal(shim.config)
    ids, pos, meta = step_inputs(2)
    with set_forward_context(meta):
        for _ in range(3):
            assert shim.maybe_forward(ids, pos) is None
    assert shim.stats.fallbacks == {f"off: {why}": 3}
    assert fake.sidecar.remote_calls() == 0 and model.embeds == 0


def test_each_per_step_refusal_is_none_without_any_remote_call(fake):
    shim, model, _ = make_shim(fake.endpoint)
    ids, pos, meta = step_inputs(2)
    cases = []
    with set_forward_context(meta):
        cases.append((S.ROWS, lambda: shim.maybe_forward(ids[:13], pos[:13])))
        cases.append((S.REQS, lambda: shim.maybe_forward(ids[:0], pos[:0])))
        big_ids, big_pos, _ = step_inputs(33)
        cases.append((S.REQS, lambda: shim.maybe_forward(big_ids, big_pos)))
        cases.append((S.POSITIONS, lambda: shim.maybe_forward(ids, pos.to(torch.int32))))
        for why, call in cases:
            before = shim.stats.fallbacks[why]
            assert call() is None
            assert shim.stats.fallbacks[why] == before + 1
    assert shim.maybe_forward(ids, pos) is None  # no forward context
    with set_forward_context(None):
        assert shim.maybe_forward(ids, pos) is None  # profiling run
    shim.is_capturing = lambda: True
    with set_forward_context(meta):
        assert shim.maybe_forward(ids, pos) is None
    assert shim.stats.fallbacks == {S.ROWS: 1, S.REQS: 2, S.POSITIONS: 1, S.NO_CONTEXT: 1,
                                    S.NO_METADATA: 1, S.CAPTURE: 1}
    assert fake.sidecar.remote_calls() == 0 and model.embeds == 0 and shim.stats.forwarded == 0


def test_forwarded_step_carries_the_step_and_returns_the_sidecar_hidden_states(fake):
    shim, model, _ = make_shim(fake.endpoint)
    ids, pos, meta = step_inputs(3)
    with set_forward_context(meta):
        out = shim.maybe_forward(ids, pos)
    assert out is not None and torch.equal(out, model.table[ids] * 2)
    (req,) = fake.sidecar.requests
    assert (req.step_id, req.num_requests, req.binding_generation) == (1, 3, 1)
    assert req.binding_id == fake.sidecar.binding_id and req.deadline_ms == 2000
    bind = fake.sidecar.binds[0]
    assert (bind.engine.tp_size, bind.engine.engine_rank, bind.page_size, len(bind.layers)) == (4, 0, 16, 5)
    assert bind.layers[0].memory.shm.name and list(bind.layers[0].shape) == [2, 8, 16, 1, 128]
    # block-table rows trimmed to the pages the longest request reaches: ceil(29 / 16) = 2
    from dspark_sidecar.proto import codec
    assert codec.from_tensor_ref(req.block_tables, "bt").shape == (3, 2)
    assert torch.equal(codec.from_tensor_ref(req.slot_mapping, "s"), meta.slot_mapping)
    # with embeddings given, the model is not asked
    with set_forward_context(meta):
        emb = torch.ones(21, 16)
        assert torch.equal(shim.maybe_forward(None, pos, emb), emb * 2)
    assert model.embeds == 1 and shim.stats.forwarded == 2
    assert fake.sidecar.calls["DraftSteps"] == 1  # one long-lived stream
    assert fake.sidecar.calls["BindKV"] == 1 and fake.sidecar.calls["GetStatus"] == 1


def test_the_sidecar_limit_becomes_the_step_limit_without_remote_calls(fake):
    shim, _, _ = make_shim(fake.endpoint)  # the fake sidecar says max_reqs = 4
    ids, pos, meta = step_inputs(5)
    with set_forward_context(meta):
        assert shim.maybe_forward(ids, pos) is None  # first step learns the limit
        calls = fake.sidecar.remote_calls()
        assert shim.maybe_forward(ids, pos) is None
    assert fake.sidecar.remote_calls() == calls and shim.stats.fallbacks[S.REQS] == 2
    ids, pos, meta = step_inputs(4)
    with set_forward_context(meta):
        assert shim.maybe_forward(ids, pos) is not None


def test_a_limit_raised_by_a_sidecar_restart_is_learned_again_by_steps_above_the_old_one(fake):
    """The agreed max_reqs is learned at a pre-flight (GetStatus read at each reconnect), but a step above it
    returns at phase 1 and never reaches one: after a restart with a larger --max-reqs, an engine whose steps
    all exceeded the old limit fell back for good (nor did it notice the restart). Now one in RELEARN_EVERY such
    steps goes on to the readiness check (which reconnects and re-binds) and the pre-flight (which agrees the
    new limit); the others still make no remote call."""
    shim, _, _ = make_shim(fake.endpoint)
    small, pos_s, meta_s = step_inputs(2)
    try:
        with set_forward_context(meta_s):
            assert shim.maybe_forward(small, pos_s) is not None  # learns max_reqs = 4
        fake.stop()
        fake.sidecar = FakeSidecar(max_reqs=8)  # restarted with a larger limit
        fake.start()
        wait_until(lambda: shim.connection.stream_ended, 5, "the step stream ended with the sidecar process")
        ids, pos, meta = step_inputs(6)
        forwarded_at = None
        with set_forward_context(meta):
            for i in range(200):
                before = fake.sidecar.remote_calls()
                if shim.maybe_forward(ids, pos) is not None:
                    forwarded_at = i + 1
                    break
                assert fake.sidecar.remote_calls() == before, f"step {i + 1} above the limit called the sidecar"
        assert forwarded_at is not None, "a limit raised by the restart was never learned"
        assert forwarded_at == S.RELEARN_EVERY and shim.stats.fallbacks == {S.REQS: S.RELEARN_EVERY - 1}
        assert fake.sidecar.calls["GetStatus"] == 1 and fake.sidecar.calls["BindKV"] == 1  # reconnected, re-bound
        with set_forward_context(meta):
            assert shim.maybe_forward(ids, pos) is not None  # the new limit holds from now on
    finally:
        shim.close()


def _counting_shim(fake, endpoint: str = "", **cfg) -> tuple[DrafterShim, list[int]]:
    """A TP-4 shim over a shm cache whose pre-flight agreements are recorded (each one's number of values)."""
    agreements: list[int] = []

    class _Counting(PreflightHook):
        def all_min(self, values):
            agreements.append(values.numel())
            return values.clone()

    return make_shim(endpoint or fake.endpoint, agree=_Counting(), **cfg)[0], agreements


def test_steps_above_a_limit_that_stays_fall_back_and_only_the_relearning_one_agrees(fake):
    """A step above the agreed limit that goes on to the pre-flight (one in RELEARN_EVERY) and finds the limit
    unchanged falls back there, unsent; the steps in between make no remote call and no agreement."""
    shim, agreements = _counting_shim(fake)
    small, pos_s, meta_s = step_inputs(2)
    ids, pos, meta = step_inputs(6)
    try:
        with set_forward_context(meta_s):
            assert shim.maybe_forward(small, pos_s) is not None  # learns max_reqs = 4 (the fake's)
        agreements.clear()
        with set_forward_context(meta):
            for _ in range(2 * S.RELEARN_EVERY):
                assert shim.maybe_forward(ids, pos) is None
        assert shim.stats.fallbacks == {S.REQS: 2 * S.RELEARN_EVERY}
        assert agreements == [5, 5] and len(fake.sidecar.requests) == 1  # two pre-flights, nothing sent
    finally:
        shim.close()


def test_steps_above_what_any_sidecar_serves_never_go_on_to_relearn_the_limit(fake):
    """The relearning step (one in RELEARN_EVERY above the agreed limit) is for a limit a restarted sidecar may have
    raised: no sidecar serves more than layout.MAX_REQS_LIMIT requests, so a step above that (or an empty one) always
    falls back at once, with no readiness check and no agreement, however many come."""
    shim, agreements = _counting_shim(fake)
    huge, pos_h, meta_h = step_inputs(layout.MAX_REQS_LIMIT + 1)
    empty = torch.zeros(0, dtype=torch.int64)
    try:
        with set_forward_context(meta_h):
            for _ in range(S.RELEARN_EVERY):
                assert shim.maybe_forward(huge, pos_h) is None
            for _ in range(S.RELEARN_EVERY):
                assert shim.maybe_forward(empty, empty) is None
        assert shim.stats.fallbacks == {S.REQS: 2 * S.RELEARN_EVERY}
        assert agreements == [] and fake.sidecar.remote_calls() == 0
    finally:
        shim.close()


def test_a_pre_flight_with_no_rank_connected_leaves_the_step_limit_as_it_was():
    """A pre-flight where no rank has read a sidecar status (every one unreachable) agrees on no limit: the
    engine's own max_reqs stays the step limit, and steps above it still fall back at phase 1, with no readiness
    check (no connect attempt) and no agreement."""
    shim, agreements = _counting_shim(None, endpoint=f"unix:{short_socket_dir() / 'nobody.sock'}", max_reqs=4)
    small, pos_s, meta_s = step_inputs(2)
    big, pos_b, meta_b = step_inputs(5)
    try:
        with set_forward_context(meta_s):
            assert shim.maybe_forward(small, pos_s) is None  # not ready: nothing listens there
        with set_forward_context(meta_b):
            for _ in range(3):
                assert shim.maybe_forward(big, pos_b) is None
        assert shim.stats.fallbacks == {S.UNREACHABLE: 1, S.REQS: 3}
        assert agreements == [5] and shim.connection.opens == 1
    finally:
        shim.close()


def test_a_catch_up_makes_at_most_max_catchup_binds_binds_in_one_step(fake):
    """A peer far ahead (its generation many binds past this rank's): one step's catch-up binds no more than
    max_catchup_binds times, the bound the agreement timeout counts a live peer's catch-up at."""
    class _PeerFarAhead(PreflightHook):
        def all_min(self, values):
            out = values.clone()
            if self.armed and values.numel() == 5 and values[3] < 0:
                out[3] = values[3] - 100  # -gen: the peer is 100 generations ahead
            return out

    agree = _PeerFarAhead()
    shim, _, _ = make_shim(fake.endpoint, agree=agree, max_catchup_binds=3)
    ids, pos, meta = step_inputs(1)
    try:
        with set_forward_context(meta):
            assert shim.maybe_forward(ids, pos) is not None
            binds = fake.sidecar.calls["BindKV"]
            agree.armed = True
            assert shim.maybe_forward(ids, pos) is None
        assert fake.sidecar.calls["BindKV"] == binds + 3 and shim.stats.fallbacks == {S.GENERATIONS: 1}
    finally:
        shim.close()


def test_reallocated_kv_cache_is_detected_and_rebound(fake):
    kv = shm_kv_cache()
    shim, _, _ = make_shim(fake.endpoint, kv=kv)
    ids, pos, meta = step_inputs(2)
    with set_forward_context(meta):
        assert shim.maybe_forward(ids, pos) is not None
        assert shim.maybe_forward(ids, pos) is not None
        assert fake.sidecar.calls["BindKV"] == 1
        old = list(kv)
        kv[:] = shm_kv_cache(num_pages=12)  # the engine re-allocates
        for s in old:
            s.close()
        assert shim.maybe_forward(ids, pos) is not None
    assert fake.sidecar.calls["BindKV"] == 2
    last = fake.sidecar.requests[-1]
    assert last.binding_generation == 2 and list(fake.sidecar.binds[-1].layers[0].shape)[1] == 12
    assert fake.sidecar.binds[-1].layers[0].memory.shm.name != fake.sidecar.binds[0].layers[0].memory.shm.name


def test_stale_binding_falls_back_then_rebinds(fake):
    shim, _, _ = make_shim(fake.endpoint)
    ids, pos, meta = step_inputs(1)
    with set_forward_context(meta):
        assert shim.maybe_forward(ids, pos) is not None
        fake.sidecar.generation += 1  # the sidecar moved on (e.g. another client re-bound it)
        assert shim.maybe_forward(ids, pos) is None
        assert shim.stats.fallbacks == {"sidecar FAILED_PRECONDITION": 1}
        assert shim.maybe_forward(ids, pos) is not None
    assert fake.sidecar.calls["BindKV"] == 2 and shim.breaker.failures == 0


@pytest.mark.parametrize("code, key, trips", [
    (code_pb2.ABORTED, "sidecar ABORTED", False),
    (code_pb2.INTERNAL, "sidecar INTERNAL", True),
    (code_pb2.UNAVAILABLE, "sidecar UNAVAILABLE", True),
    (code_pb2.RESOURCE_EXHAUSTED, "sidecar RESOURCE_EXHAUSTED", True),  # only RESPONSE_TOO_LARGE goes uncounted
])
def test_step_errors_fall_back_and_the_stream_goes_on(fake, code, key, trips):
    shim, _, _ = make_shim(fake.endpoint)
    ids, pos, meta = step_inputs(1)
    fake.sidecar.step_errors[2] = (code, "INJECTED")
    with set_forward_context(meta):
        assert shim.maybe_forward(ids, pos) is not None
        assert shim.maybe_forward(ids, pos) is None
        # ABORTED is the peers' disagreement, not this sidecar rank failing: the breaker ignores it
        assert shim.breaker.failures == (1 if trips else 0)
        assert shim.maybe_forward(ids, pos) is not None
    assert shim.stats.fallbacks == {key: 1}
    assert fake.sidecar.calls["DraftSteps"] == 1  # the failed step did not end the stream
    assert shim.breaker.failures == 0


def test_steps_whose_answer_is_too_large_fall_back_without_opening_the_breaker(fake):
    """A sidecar run with a small --max-message-bytes refuses, before it runs, every step whose inline
    hidden states would not fit (RESOURCE_EXHAUSTED, reason RESPONSE_TOO_LARGE): a fact of that step's R,
    not of the sidecar's health. Counted against the breaker, three of them in a row opened it, and
    every step after them fell back as "sidecar unavailable (breaker open)", those that fit included."""
    shim, _, _ = make_shim(fake.endpoint)
    ids, pos, meta = step_inputs(1)
    threshold = shim.config.breaker.failure_threshold
    for step_id in range(1, threshold + 2):
        fake.sidecar.step_errors[step_id] = (code_pb2.RESOURCE_EXHAUSTED, "RESPONSE_TOO_LARGE")
    with set_forward_context(meta):
        for _ in range(threshold + 1):
            assert shim.maybe_forward(ids, pos) is None
        assert shim.breaker.failures == 0
        assert shim.maybe_forward(ids, pos) is not None  # a step that fits is still forwarded
    assert shim.stats.fallbacks == {"sidecar RESOURCE_EXHAUSTED": threshold + 1}
    assert fake.sidecar.calls["DraftSteps"] == 1  # and the stream went on


def test_strict_sidecar_refusal_turns_the_process_off(fake):
    fake.sidecar.serving, fake.sidecar.state, fake.sidecar.refusal = False, "REFUSED", "not gfx950"
    shim, _, _ = make_shim(fake.endpoint)
    ids, pos, meta = step_inputs(1)
    with set_forward_context(meta):
        assert shim.maybe_forward(ids, pos) is None
        calls = fake.sidecar.remote_calls()
        assert shim.maybe_forward(ids, pos) is None
    assert not shim.enabled and shim.refusal == "sidecar refuses: not gfx950"
    assert fake.sidecar.remote_calls() == calls == 1  # one GetStatus, then nothing
    assert shim.stats.fallbacks == {"off: sidecar refuses: not gfx950": 2}


@pytest.mark.parametrize("serving, state, refusal, want", [
    (True, "SERVING", "not gfx950", None),  # a refusal the backend's fallback serves
    (False, "REFUSED", "not gfx950", "sidecar refuses: not gfx950"),
    (False, "REFUSED", "", "sidecar refuses: REFUSED"),  # strict mode says so even where the reason is gone
    *[(False, st, "not gfx950", None) for st in ("LOADING", "DRAINING", "PEER_SILENT", "STEP_STUCK")],
    (False, "LOADING", "", None),
])
def test_only_a_strict_refusal_reads_as_the_sidecar_refusing_for_good(serving, state, refusal, want):
    status = pb.StatusReport(serving=serving, state=state, fast_path_refusal=refusal)
    assert S.sidecar_refusal(status) == want


def test_a_data_plane_that_fails_to_close_does_not_raise_out_of_the_step_that_turns_the_shim_off(fake):
    """maybe_forward turns the shim off (a refusal agreed by the ranks) outside its try: closing the
    doorbell there can meet a driver error on a GPU (the page's unregistration). That must not escape
    the step: the engine gets None, the link is dropped all the same, and the error is logged once."""
    shim, _, _ = make_shim(fake.endpoint)
    ids, pos, meta = step_inputs(1)

    class _Doorbell:
        liveness = type("L", (), {"alive": True})()
        replaced = False  # the sidecar has not closed it (DoorbellTransport.replaced)

        def close(self):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with set_forward_context(meta):
        assert shim.maybe_forward(ids, pos) is not None
        shim.doorbell = _Doorbell()
        fake.sidecar.serving, fake.sidecar.state, fake.sidecar.refusal = False, "REFUSED", "not gfx950"
        shim.connection.close()  # the next step reconnects and reads the refusal
        assert shim.maybe_forward(ids, pos) is None
    assert not shim.enabled and shim.doorbell is None and not shim.connection.is_open
    assert "shim error in closing the data plane: RuntimeError" in shim._logged


class _StrictJudgesTheBinding(FakeSidecar):
    """A --strict-refusal rank whose verdict is on the bound engine's facts (a KV layout, the engine's DP):
    REFUSED while the binding of an engine that was refused and is gone (no UnbindKV) stays, judged again
    at every BindKV."""

    def __init__(self, refuse_next: bool) -> None:
        super().__init__(max_reqs=4)
        self.refuse_next = refuse_next
        self.binding_id, self.generation = 77, 1  # the gone engine's binding
        self.serving, self.state, self.refusal = False, "REFUSED", "FlyDSL refuses this KV cache's layout"

    def BindKV(self, request, context):
        resp = super().BindKV(request, context)
        if not self.refuse_next:
            self.serving, self.state, self.refusal = True, "SERVING", "not gfx950"
        return resp


@pytest.mark.parametrize("refuse_next", [False, True])
def test_a_strict_refusal_of_another_engine_s_binding_is_judged_again_on_ours(refuse_next):
    """An engine refused by a strict sidecar and gone without UnbindKV leaves the rank REFUSED, its binding
    in place. The next engine read that as its own refusal and stayed off for its whole life (until the
    sidecar restarted), its own facts never judged. It binds first and reads the verdict on its binding:
    served if that passes, off for good (one BindKV) if it does not."""
    server = FakeServer(_StrictJudgesTheBinding(refuse_next), short_socket_dir() / "rank0.sock").start()
    try:
        shim, _, _ = make_shim(server.endpoint)
        ids, pos, meta = step_inputs(1)
        with set_forward_context(meta):
            outs = [shim.maybe_forward(ids, pos) for _ in range(3)]
        assert server.sidecar.calls["BindKV"] == 1
        if refuse_next:
            assert outs == [None] * 3 and not shim.enabled
            assert shim.refusal == "sidecar refuses: FlyDSL refuses this KV cache's layout"
            assert server.sidecar.calls["step"] == 0
        else:
            assert all(o is not None for o in outs), dict(shim.stats.fallbacks)
            assert shim.enabled and shim.stats.fallbacks == {}
        shim.close()
    finally:
        server.stop()


@pytest.mark.parametrize("state", ["PEER_SILENT", "STEP_STUCK"])
def test_a_sidecar_rank_whose_peer_is_silent_is_passing_not_a_refusal(fake, state):
    # On NVIDIA fast_path_refusal is never empty ("not gfx950"): PEER_SILENT (a peer rank stopped or hung) and
    # STEP_STUCK (one of its steps running 15 s past the rendezvous deadline) must not read as strict mode, which is off for good.
    fake.sidecar.serving, fake.sidecar.state, fake.sidecar.refusal = False, state, "not gfx950"
    shim, _, _ = make_shim(fake.endpoint)
    ids, pos, meta = step_inputs(1)
    with set_forward_context(meta):
        assert shim.maybe_forward(ids, pos) is None
        fake.sidecar.serving, fake.sidecar.state = True, "SERVING"  # the peer is back, the step ended
        assert shim.maybe_forward(ids, pos) is not None
    assert shim.enabled and shim.stats.fallbacks == {"sidecar not serving": 1}


def test_connect_binds_ahead_of_the_first_step_and_a_refusal_there_is_left_to_the_agreement(fake):
    shim, _, _ = make_shim(fake.endpoint)
    assert shim.connect() is None and fake.sidecar.calls["BindKV"] == 1
    ids, pos, meta = step_inputs(2)
    with set_forward_context(meta):
        assert shim.maybe_forward(ids, pos) is not None
    assert fake.sidecar.calls["BindKV"] == 1 and fake.sidecar.calls["GetStatus"] == 1  # nothing set up twice
    fake.sidecar.serving, fake.sidecar.state, fake.sidecar.refusal = False, "REFUSED", "not gfx950"
    other, _, _ = make_shim(fake.endpoint)
    assert other.connect() == "sidecar refuses: not gfx950"
    assert other.enabled  # off only once the ranks agree, at a step's pre-flight
    with set_forward_context(meta):
        assert other.maybe_forward(ids, pos) is None
    assert not other.enabled and other.refusal == "sidecar refuses: not gfx950"


def test_bindkv_names_the_engines_gpu_uuid_on_a_gpu_and_none_on_cpu(fake, monkeypatch):
    """EngineFacts.device_uuid: the sidecar compares a named uuid with its own GPU's (an engine rank wired to
    another GPU's sidecar rank is refused at BindKV, not at its first layer handle). The shim left it empty,
    so that check never ran. On a CPU rank it stays empty (the sidecar does not compare it). The helper is
    faked: no GPU here; only the device the shim asks about is real."""
    asked = []

    def uuid(device: torch.device) -> str:
        asked.append(device)
        return "GPU-5e1f0c2a" if device.type == "cuda" else ""

    monkeypatch.setattr(memory, "gpu_uuid", uuid)
    gpu, _, _ = make_shim(fake.endpoint, device="cuda:1")  # the facts only: its KV cache is shm all the same
    cpu, _, _ = make_shim(fake.endpoint)
    try:
        assert gpu.binder.facts.device_uuid == "GPU-5e1f0c2a" and cpu.binder.facts.device_uuid == ""
        assert torch.device("cuda:1") in asked
        assert gpu.connect() is None
        assert fake.sidecar.binds[-1].engine.device_uuid == "GPU-5e1f0c2a"
        assert cpu.connect() is None
        assert fake.sidecar.binds[-1].engine.device_uuid == "" and fake.sidecar.binds[-1].engine.device == "cpu"
    finally:
        gpu.close()
        cpu.close()


def test_a_kv_cache_torch_cannot_share_is_a_named_fallback_not_a_shim_error(fake, monkeypatch, caplog):
    """torch refuses to take a CUDA IPC handle on memory from expandable segments or a cuMem allocator (a
    RuntimeError from storage._share_cuda_). It escaped bind_request: counted as "shim error in prepare" on every
    step, against the breaker, which then opened and reported the sidecar unavailable. Now: one fallback reason
    naming the cause, logged once, nothing sent, the breaker untouched, the cache not exported again; a
    re-allocated cache is tried again. (On CPU the refusal is faked; only the identity's segment lookup, which
    never runs on a GPU, still answers.)"""
    from dspark_sidecar.client import binding

    real, attempts = binding.export_handle, []

    def export(t):
        if sys._getframe(1).f_code.co_name == "bind_request" and refusing:
            attempts.append(t)
            raise RuntimeError("injected: CUDA IPC handle refused for memory from expandable segments")
        return real(t)

    refusing = True
    monkeypatch.setattr(binding, "export_handle", export)
    kv = shm_kv_cache()
    shim, _, _ = make_shim(fake.endpoint, kv=kv)
    ids, pos, meta = step_inputs(2)
    try:
        with caplog.at_level("INFO", logger="dspark_sidecar.client"), set_forward_context(meta):
            for _ in range(5):
                assert shim.maybe_forward(ids, pos) is None
            assert shim.connect() == S.KV_NOT_SHAREABLE
        assert shim.stats.fallbacks == {S.KV_NOT_SHAREABLE: 5}
        assert "expandable_segments" in S.KV_NOT_SHAREABLE
        assert shim.breaker.failures == 0 and shim.breaker.state.value == "closed"
        assert not any(k.startswith("shim error") for k in shim._logged), shim._logged
        assert len(attempts) == 1, "the same cache was exported again"
        assert fake.sidecar.calls["BindKV"] == 0
        # The same RuntimeError comes from a transient driver failure: the same cache is tried again, rarely.
        later = time.monotonic() + binding.UNSHAREABLE_RETRY_S + 1
        monkeypatch.setattr(binding.time, "monotonic", lambda: later)
        with set_forward_context(meta):
            assert shim.maybe_forward(ids, pos) is None
        assert len(attempts) == 2 and shim.stats.fallbacks == {S.KV_NOT_SHAREABLE: 6}
        monkeypatch.undo()
        monkeypatch.setattr(binding, "export_handle", export)
        warned = [r for r in caplog.records if r.levelname == "WARNING" and "expandable segments" in r.getMessage()]
        assert len(warned) == 1, [r.getMessage() for r in caplog.records]
        refusing = False
        old = list(kv)
        kv[:] = shm_kv_cache()  # the engine re-allocates (outside expandable segments, say)
        for s in old:
            s.close()
        with set_forward_context(meta):
            assert shim.maybe_forward(ids, pos) is not None
        assert fake.sidecar.calls["BindKV"] == 1
    finally:
        shim.close()


def test_engine_tp_mismatch_at_bind_is_permanent(fake):
    import grpc
    fake.sidecar.bind_error = (grpc.StatusCode.FAILED_PRECONDITION, "engine TP 4 != sidecar TP 2")
    shim, _, _ = make_shim(fake.endpoint)
    ids, pos, meta = step_inputs(1)
    with set_forward_context(meta):
        assert shim.maybe_forward(ids, pos) is None
    # without ErrorInfo the code alone is not permanent: the breaker counts it instead
    assert shim.enabled and shim.stats.fallbacks == {S.BIND_FAILED: 1}
    fake.sidecar.bind_error = (grpc.StatusCode.INVALID_ARGUMENT, "layers[0].dtype: cache is bf16")
    with set_forward_context(meta):
        shim.breaker.record_success()
        assert shim.maybe_forward(ids, pos) is None
    assert not shim.enabled and "KV cache cannot be bound" in shim.refusal


def test_a_bind_failing_for_a_passing_reason_opens_the_breaker_and_stops_the_binds(fake):
    """A BindKV refused for a passing reason (UNAVAILABLE: the sidecar rank short of file descriptors or memory,
    MAP_EXHAUSTED) is a breaker failure: after failure_threshold of them the rank sends nothing until a health
    probe passes. Uncounted, every step reconnected (GetStatus) and sent a BindKV, each up to its deadline, for as
    long as the shortage lasted."""
    fake.sidecar.bind_error = (grpc.StatusCode.UNAVAILABLE, "MAP_EXHAUSTED")
    kv = shm_kv_cache()
    shim = DrafterShim(EngineConfig(endpoint=fake.endpoint, tp_size=4), FakeModel(), lambda: [s.tensor for s in kv],
                       ParallelContext(0, 1), clock=lambda: 0.0)  # the backoff never runs out: no probe
    threshold = shim.config.breaker.failure_threshold
    ids, pos, meta = step_inputs(1)
    try:
        with set_forward_context(meta):
            for _ in range(threshold + 3):
                assert shim.maybe_forward(ids, pos) is None
        assert shim.enabled and shim.breaker.state.value == "open"
        assert shim.stats.fallbacks == {S.BIND_FAILED: threshold, S.BREAKER: 3}
        assert fake.sidecar.calls["BindKV"] == threshold and fake.sidecar.calls["GetStatus"] == threshold
    finally:
        shim.close()


def test_engine_config_validation():
    with pytest.raises(EngineConfigError, match="tp_size"):
        EngineConfig(tp_size=0)
    with pytest.raises(EngineConfigError, match="max_reqs"):
        EngineConfig(tp_size=4, max_reqs=0)
    from dspark_sidecar import layout

    assert EngineConfig(tp_size=4, max_reqs=layout.MAX_REQS_LIMIT).max_reqs == layout.MAX_REQS_LIMIT
    with pytest.raises(EngineConfigError, match=f"max_reqs: must be 1..{layout.MAX_REQS_LIMIT}"):
        EngineConfig(tp_size=4, max_reqs=layout.MAX_REQS_LIMIT + 1)
    assert config_refusal(EngineConfig(tp_size=4)) == "no sidecar endpoint configured"


def test_sidecar_restarted_between_steps_is_rebound_without_losing_a_step(fake):
    shim, _, _ = make_shim(fake.endpoint)
    ids, pos, meta = step_inputs(2)
    with set_forward_context(meta):
        assert shim.maybe_forward(ids, pos) is not None
        fake.stop()
        fake.sidecar = FakeSidecar(max_reqs=4)  # a new process: no binding, generation from 0
        fake.start()
        wait_until(lambda: shim.connection.stream_ended, 5, "the step stream ended with the sidecar process")
        assert shim.maybe_forward(ids, pos) is not None
    assert fake.sidecar.calls["GetStatus"] == 1 and fake.sidecar.calls["BindKV"] == 1
    assert shim.stats.fallbacks == {} and shim.binder.generation == 1


def test_doorbell_transport_refused_by_the_sidecar_falls_back_to_the_stream(fake):
    shim, model, _ = make_shim(fake.endpoint, transport="doorbell")  # the fake has no RegisterBuffers
    ids, pos, meta = step_inputs(2)
    with set_forward_context(meta):
        out = shim.maybe_forward(ids, pos)
    assert out is not None and torch.equal(out, model.table[ids] * 2)
    # The sidecar's message as well as its code (a refusal's says what to change).
    assert shim.doorbell is None and "data plane unavailable (UNIMPLEMENTED: " in shim._doorbell_off
    assert "Method not implemented" in shim._doorbell_off, shim._doorbell_off
    assert shim.stats.forwarded == 1 and shim.stats.via_doorbell == 0
    with pytest.raises(EngineConfigError, match="transport"):
        EngineConfig(tp_size=4, transport="carrier-pigeon")


class _BusyOnceThenAttaching(DoorbellNeverAnswered):
    """AttachDoorbell refused once for a passing reason (`code`), then attaching."""

    code = "DEADLINE_EXCEEDED"

    def AttachDoorbell(self, request, context):
        self.calls["AttachDoorbell"] += 1
        if self.calls["AttachDoorbell"] == 1:
            import grpc

            context.abort(getattr(grpc.StatusCode, self.code), "busy")
        return pb.AttachDoorbellResponse()


# DEADLINE_EXCEEDED: a sidecar rank past the engine's deadline, waiting on its peers while it releases this engine
# rank's old regions. UNAVAILABLE: a handle the sidecar could not check or map for want of descriptors or memory
# (server/errors.py HANDLE_UNCHECKED, MAP_EXHAUSTED).
@pytest.mark.parametrize("code", ["DEADLINE_EXCEEDED", "UNAVAILABLE"])
def test_a_data_plane_refused_for_a_passing_reason_is_asked_for_again(monkeypatch, code):
    """It fell back to the gRPC stream until the link next dropped, which in a healthy run is never:
    at TP > 1 one rank on the stream also turns pre-launched steps off for every rank."""
    sidecar = _BusyOnceThenAttaching(max_reqs=4)
    sidecar.code = code
    server = FakeServer(sidecar, short_socket_dir() / "rank0.sock").start()
    try:
        shim, model, _ = make_shim(server.endpoint, transport="doorbell", step_deadline_s=0.2, late_grace_s=0.2)
        ids, pos, meta = step_inputs(2)
        with set_forward_context(meta):
            out = shim.maybe_forward(ids, pos)  # over the stream meanwhile
            assert out is not None and torch.equal(out, model.table[ids] * 2)
            assert shim.doorbell is None and shim._doorbell_off is None
            assert shim.maybe_forward(ids, pos) is not None  # not asked again before DOORBELL_RETRY_S
            assert server.sidecar.calls["AttachDoorbell"] == 1
            monkeypatch.setattr(S.time, "monotonic", lambda: time.perf_counter() + S.DOORBELL_RETRY_S + 3600)
            shim.maybe_forward(ids, pos)  # asked again: attached (this fake then never answers the ring)
        assert server.sidecar.calls["AttachDoorbell"] == 2 and shim.doorbell is not None
        shim._unsettled = None  # let close() drop this test's link
        monkeypatch.undo()
        shim.close()
    finally:
        server.stop()


def test_a_restarted_sidecar_is_asked_for_its_data_plane_at_once_after_the_old_one_refused_it_for_now():
    """The wait before asking again (DOORBELL_RETRY_S) is the refusing process's: a link dropped since (here the
    sidecar restarted) ends it. Kept, the restarted sidecar's steps went over the gRPC stream for up to 5 s, and at
    TP > 1 that one rank on the stream turned pre-launched steps off for every rank meanwhile."""
    server = FakeServer(_BusyOnceThenAttaching(max_reqs=4), short_socket_dir() / "rank0.sock").start()
    try:
        shim, model, _ = make_shim(server.endpoint, transport="doorbell", step_deadline_s=0.2, late_grace_s=0.2)
        ids, pos, meta = step_inputs(2)
        with set_forward_context(meta):
            assert shim.maybe_forward(ids, pos) is not None  # refused for now: over the stream
            assert server.sidecar.calls["AttachDoorbell"] == 1 and shim.doorbell is None
            server.stop()
            server.sidecar = DoorbellNeverAnswered(max_reqs=4)  # a new process that attaches
            server.start()
            wait_until(lambda: shim.connection.stream_ended, 5, "the step stream ended with the sidecar process")
            shim.maybe_forward(ids, pos)  # the new process is asked at once (it then never answers the ring)
        assert server.sidecar.calls["AttachDoorbell"] == 1 and shim.doorbell is not None
        shim._unsettled = None  # let close() drop this test's link
        shim.close()
    finally:
        server.stop()


def test_step_buffers_are_sized_for_the_engines_max_reqs_where_the_sidecar_serves_more():
    """A StatusReport max_reqs above the engine's own (a sidecar run with a larger --max-reqs, or one naming an
    absurd count) sizes the doorbell's step buffers for EngineConfig.max_reqs at most; a larger step goes over
    the gRPC stream. Uncapped, 1 << 31 had the shim create and zero-fill about a TB of shared memory (SIGBUS).
    test_answer_fuzz's child runs under RLIMIT_AS, where the uncapped allocation fails cleanly and the steps
    go over the stream: it passed without the cap."""
    server = FakeServer(DoorbellNeverAnswered(max_reqs=16), short_socket_dir() / "rank0.sock").start()
    try:
        shim, _, _ = make_shim(server.endpoint, transport="doorbell", max_reqs=4)
        assert shim.connect() is None
        assert shim.doorbell is not None and shim.doorbell.max_reqs == 4
        assert shim.doorbell.buffers.embeds.shape[0] == shim.doorbell.buffers.hidden.shape[0] == 7 * 4
        shim.close()
    finally:
        server.stop()


def _unsettled_step(shim: DrafterShim, ids, pos) -> None:
    assert shim.maybe_forward(ids, pos) is None
    assert shim._unsettled is not None and shim.stats.fallbacks[S.DEADLINE] == 1


def test_an_unsettled_stream_step_keeps_its_link_through_a_drop_until_its_answer(fake):
    """A drop of the link (a failed catch-up bind, a disable; close() before it became final) while a step
    is past its deadline and grace: cancelling the stream would read as settled, and forwarding would
    resume while the sidecar may still write that step's K/V. The link stays until the answer comes;
    then it is dropped and opened again."""
    shim, model, _ = make_shim(fake.endpoint, step_deadline_s=0.2, late_grace_s=0.2)
    ids, pos, meta = step_inputs(2)
    with set_forward_context(meta):
        assert shim.maybe_forward(ids, pos) is not None
        fake.sidecar.step_delay_s[shim._next_step] = 1.2  # past deadline + grace
        _unsettled_step(shim, ids, pos)
        opens = shim.connection.opens
        shim._drop_link()
        assert shim.maybe_forward(ids, pos) is None and shim.stats.fallbacks[S.UNSETTLED] == 1
        assert shim.connection.is_open and shim.connection.opens == opens
        # The answer lands; the link is dropped and opened again.
        wait_until(lambda: shim.maybe_forward(ids, pos) is not None, 10,
                   lambda: f"a step forwarded after the answer: {dict(shim.stats.fallbacks)}", interval_s=0.05)
    assert shim._unsettled is None and shim.connection.opens == opens + 1
    assert not [k for k in shim.stats.fallbacks if k.startswith("shim error")], dict(shim.stats.fallbacks)


def test_an_unsettled_doorbell_step_survives_a_dropped_link_and_settles_on_its_answer(tmp_path):
    """A doorbell step unanswered past deadline and grace, then a drop of the link: the doorbell page stays mapped
    (closed, its sequence word could never be read again, and the rank would stay not ready for good),
    and the step settles once the answer's sequence lands, ordering the engine's stream after that
    step's writes (the sidecar answers at launch: its kernels may still read the input region)."""
    server = FakeServer(DoorbellNeverAnswered(max_reqs=4), short_socket_dir() / "rank0.sock").start()
    try:
        shim, _, _ = make_shim(server.endpoint, transport="doorbell", step_deadline_s=0.2, late_grace_s=0.2)
        ids, pos, meta = step_inputs(2)
        with set_forward_context(meta):
            _unsettled_step(shim, ids, pos)
            channel = shim.doorbell.bell
            shim._drop_link()
            assert shim.maybe_forward(ids, pos) is None and shim.stats.fallbacks[S.UNSETTLED] == 1
            assert shim.doorbell is not None and channel.page.words is not None
            ordered = []  # settling orders the engine's stream after the late step's writes (a GPU's event)
            channel._after_outputs = lambda: ordered.append(True)
            assert not channel.settled(0) and ordered == []
            channel.page.words[bell.RESP_SEQ] = channel._seq  # the late answer's sequence
            assert channel.settled(0) and ordered == [True]
            assert shim.maybe_forward(ids, pos) is None  # settled: a new link, and this step unanswered again
        assert shim.doorbell is not None and shim.doorbell.bell is not channel and channel.page.words is None
        assert shim.stats.fallbacks[S.DEADLINE] == 2 and server.sidecar.calls["AttachDoorbell"] == 2
        # The dropped link's regions were released on the live sidecar before new ones were registered.
        assert server.sidecar.calls["UnregisterBuffers"] == 1 and server.sidecar.calls["RegisterBuffers"] == 2
        assert not [k for k in shim.stats.fallbacks if k.startswith("shim error")], dict(shim.stats.fallbacks)
        shim._unsettled = None  # let close() drop this test's link
        shim.close()
    finally:
        server.stop()


def test_a_refused_data_plane_leaves_no_shared_memory_behind(fake):
    """A sidecar without the data plane (here: UNIMPLEMENTED) is asked again at every reconnect; each
    refused attempt releases its doorbell page and buffers at once, not at process exit."""
    shim, _, _ = make_shim(fake.endpoint, transport="doorbell")
    ids, pos, meta = step_inputs(2)
    with recording_shm() as shm, set_forward_context(meta):
        for _ in range(5):
            assert shim.maybe_forward(ids, pos) is not None  # over the stream
            shim._drop_link()  # as after a broken stream: the next step reconnects and asks again
    assert fake.sidecar.calls["GetStatus"] >= 5
    assert shm.created, "no segment recorded: the refused data planes' were not seen"
    assert shm.left() == set()
    shim.close()


def test_a_stream_that_ended_is_kept_until_the_link_drops_and_closed_then(fake):
    """An ended stream is not replaced on the same channel (a new one would reach a restarted sidecar with
    the old one's status): its send raises its StreamBroken. Its request iterator waits on a queue until it
    is told to stop: the drop closes it, else it would keep that thread (one per reconnect) for the life of
    the engine; the link opened again has a new stream."""
    from dspark_sidecar.client.connection import SidecarConnection, StreamBroken

    conn = SidecarConnection(fake.endpoint)
    conn.open(5.0)
    first = conn.stream()
    first._call.cancel()  # the stream ends from the transport's side, as when the sidecar goes away
    wait_until(lambda: not first.alive, 5, "the cancelled stream ended")
    assert conn.stream() is first and conn.stream_ended
    with pytest.raises(StreamBroken):
        first.send(pb.DraftStepRequest(step_id=1))
    closed = []
    close = first.close
    first.close = lambda: (closed.append(True), close())  # type: ignore[method-assign]
    conn.open(5.0)
    assert closed == [True]
    second = conn.stream()
    assert second is not first and second.alive
    conn.close()


class _RestartsInPreflight(PreflightHook):
    """Restarts the sidecar with a larger --max-reqs while this rank waits in the pre-flight (its peers still
    binding), and waits until this rank's step stream has seen it go."""

    def __init__(self, server: FakeServer) -> None:
        super().__init__()
        self.server = server

    def at_preflight(self) -> None:
        self.server.stop()
        self.server.sidecar = FakeSidecar(max_reqs=8)
        self.server.start()
        wait_until(lambda: self.shim.connection.stream_ended, 5, "the step stream ended with the sidecar process")


def test_a_stream_that_ends_after_the_readiness_check_is_not_replaced_on_the_stale_link(fake):
    """The step stream ends between the readiness check and the send (the sidecar restarted during the
    pre-flight). connection.stream() used to open a new stream on the same channel, to the new process,
    quietly: the restart went unseen, the status (limits, compute dtype) read from the old process was kept
    for the link's life, and a limit the restart raised was never learned, RELEARN_EVERY or not (its
    readiness check found the link open and read the same stale status). Now that step's stream is broken:
    the link drops, and the next step reconnects and reads the new process's status."""
    agree = _RestartsInPreflight(fake)
    shim, _, _ = make_shim(fake.endpoint, agree=agree)
    small, pos_s, meta_s = step_inputs(2)
    try:
        with set_forward_context(meta_s):
            assert shim.maybe_forward(small, pos_s) is not None  # learns max_reqs = 4, opens the stream
            agree.armed = True
            assert shim.maybe_forward(small, pos_s) is None
            assert shim.stats.fallbacks[S.STREAM] == 1, dict(shim.stats.fallbacks)
            assert shim.maybe_forward(small, pos_s) is not None  # reconnected, re-bound
        assert fake.sidecar.calls["GetStatus"] == 1, "the restarted sidecar's status was never read"
        assert shim.connection.status.limits.max_reqs == 8
        ids, pos, meta = step_inputs(6)
        with set_forward_context(meta):
            assert shim.maybe_forward(ids, pos) is not None  # the raised limit holds
    finally:
        shim.close()


def test_a_sidecar_restarted_between_connect_and_the_first_step_is_seen_by_its_status(fake):
    """connect() at start-up opens the link and binds; the step stream used to be opened only by the first
    step sent, so nothing watched the sidecar process in between (an engine's warm-up, or steps its peers kept
    from being sent). A restart there went unseen: the first step's new stream reached the new process, and
    the old process's status (its limits) was kept for the link's life. The stream now opens with a ready link."""
    shim, _, _ = make_shim(fake.endpoint)
    try:
        assert shim.connect() is None
        # The stream is opened at connect() but reaches the sidecar a moment later: one that had not yet when the
        # sidecar stopped went (gRPC's transparent retry) to the restarted process, so it never ended, and the
        # step ran there under the old status, unbound (FAILED_PRECONDITION: 2 of 8 runs on a loaded 2-core box).
        # Before the fix there was no stream at all until the first step: this wait then fails.
        wait_until(lambda: fake.sidecar.calls["DraftSteps"], 10,
                   "connect() opened a step stream to watch the sidecar process")
        fake.stop()
        fake.sidecar = FakeSidecar(max_reqs=8)  # restarted with a larger limit
        fake.start()
        wait_until(lambda: shim.connection.stream_ended, 10, "the step stream ended with the sidecar process")
        ids, pos, meta = step_inputs(2)
        with set_forward_context(meta):
            assert shim.maybe_forward(ids, pos) is not None, dict(shim.stats.fallbacks)
        assert fake.sidecar.calls["GetStatus"] == 1, "the restarted sidecar's status was never read"
        assert shim.connection.status.limits.max_reqs == 8
    finally:
        shim.close()


def test_a_step_stream_that_reached_another_sidecar_instance_is_dropped_before_any_step(fake):
    """The status was read from one start of the sidecar, the step stream taken by the next (a restart in between:
    gRPC carries a call that had not yet reached the old process to the new one). Its steps would have run on a
    server holding none of this link's bindings, under the old status: the readiness check drops the link instead,
    nothing sent, and the next step reads the status again."""
    fake.sidecar.instance, fake.sidecar.stream_instance = "a1", "b2"
    shim, _, _ = make_shim(fake.endpoint)
    ids, pos, meta = step_inputs(2)
    try:
        with set_forward_context(meta):
            assert shim.maybe_forward(ids, pos) is None
        assert shim.stats.fallbacks[S.STREAM] == 1 and fake.sidecar.calls["step"] == 0, dict(shim.stats.fallbacks)
        assert not shim.connection.is_open  # dropped: the next readiness check reads the status again
        fake.sidecar.stream_instance = None  # the stream and the status now name the same start
        with set_forward_context(meta):
            assert shim.maybe_forward(ids, pos) is not None, dict(shim.stats.fallbacks)
        assert fake.sidecar.calls["GetStatus"] == 2
    finally:
        shim.close()


class _RecordsPreflights(PreflightHook):
    """A 2-rank agreement whose peer agrees to everything; records each pre-flight's values."""

    def __init__(self) -> None:
        super().__init__()
        self.preflights: list[list[int]] = []

    def all_min(self, values):
        if values.numel() == 5:
            self.preflights.append(values.tolist())
        return values.clone()


def test_a_step_stream_that_ended_as_it_opened_leaves_the_rank_not_ready(fake):
    """connection.stream() hands back a stream that ended as it opened (it reached another sidecar instance, the
    sidecar refused it, or did not take it within the connect deadline) as it is. The readiness check took the link
    as ready all the same: connect() answered None (ready) on a link no step could go through, and the step's
    pre-flight told the peers this rank was ready, so at TP > 1 they sent their copies (their sidecar ranks held
    them to the rendezvous deadline, then ABORTED) and the embedding ran, while this rank's send broke at once. Now
    the rank is not ready (stream broken, a breaker failure) and its link is dropped before the pre-flight."""
    fake.sidecar.instance, fake.sidecar.stream_instance = "a1", "b2"
    agree = _RecordsPreflights()
    shim, model, _ = make_shim(fake.endpoint, agree=agree)
    ids, pos, meta = step_inputs(2)
    try:
        assert shim.connect() == S.STREAM
        assert not shim.connection.is_open and shim.breaker.failures == 1
        with set_forward_context(meta):
            assert shim.maybe_forward(ids, pos) is None
        assert agree.preflights[-1][0] == 0, "the pre-flight said ready on a rank whose step stream had ended"
        assert model.embeds == 0 and fake.sidecar.calls["step"] == 0
        assert shim.stats.fallbacks == {S.STREAM: 1}, dict(shim.stats.fallbacks)
        fake.sidecar.stream_instance = None  # the stream and the status now name the same start
        assert shim.connect() is None
        with set_forward_context(meta):
            assert shim.maybe_forward(ids, pos) is not None, dict(shim.stats.fallbacks)
        assert agree.preflights[-1][0] == 1 and shim.breaker.failures == 0
    finally:
        shim.close()


def test_a_kv_cache_of_another_layout_never_raises_out_of_maybe_forward(fake):
    """The page size is read from the cache's shape (planes [2, pages, page, heads, dim] or records
    [pages, heads, page, 2 dim]); a cache laid out otherwise once raised IndexError out of
    maybe_forward instead of answering."""
    flat = [torch.zeros(16) for _ in range(5)]
    shim = DrafterShim(EngineConfig(endpoint=fake.endpoint, tp_size=4), FakeModel(), lambda: flat, ParallelContext(0, 1))
    ids, pos, meta = step_inputs(2)
    try:
        with set_forward_context(meta):
            assert shim.maybe_forward(ids, pos) is None
        assert not shim.enabled and "shape [16]: expected planes [2, pages, page_size, heads, head_dim] or records" in shim.refusal
    finally:
        shim.close()


class _NoComputeDtype(FakeSidecar):
    """A sidecar whose GetStatus names no compute dtype the shim knows (an older one: the field unset),
    answering in `answer_dtype`."""

    answer_dtype = torch.float32

    def GetStatus(self, request, context):
        st = super().GetStatus(request, context)
        st.model.compute_dtype = ""
        return st

    def _step(self, req):
        from dspark_sidecar.proto import codec

        resp = super()._step(req)
        if resp.WhichOneof("result") == "hidden_states":
            h = codec.from_tensor_ref(resp.hidden_states, "h").to(self.answer_dtype)
            resp.hidden_states.CopyFrom(codec.to_tensor_ref(h))
        return resp


def test_without_a_known_compute_dtype_an_answer_must_have_the_engines_dtype():
    """With the sidecar's compute dtype unknown the answer check took any floating dtype: an fp32
    engine got bf16 hidden states, which its next fp32 layer (the LM head) cannot take. The stream's
    answer must then have the dtype of the engine's own embeddings."""
    server = FakeServer(_NoComputeDtype(max_reqs=4), short_socket_dir() / "rank0.sock").start()
    try:
        shim, model, _ = make_shim(server.endpoint)
        ids, pos, meta = step_inputs(2)
        with set_forward_context(meta):
            out = shim.maybe_forward(ids, pos)
            assert out is not None and out.dtype == torch.float32 and torch.equal(out, model.table[ids] * 2)
            server.sidecar.answer_dtype = torch.bfloat16
            out = shim.maybe_forward(ids, pos)
            assert out is None, f"a {out.dtype} answer was handed to a {model.table.dtype} engine"
        assert shim.stats.fallbacks == {S.BAD_ANSWER: 1}
        shim.close()
    finally:
        server.stop()


class _NoComputeDtypeWithDataPlane(_NoComputeDtype, DoorbellNeverAnswered):
    """_NoComputeDtype that would take the data plane (and never answer a ring)."""


def test_without_a_known_compute_dtype_the_doorbell_is_not_used():
    """The doorbell's buffers hold embeddings and answer in the sidecar's compute dtype; with none known they
    were sized in the KV cache's dtype (an fp8 cache: the embeddings squeezed to fp8), and the answer read
    from them was held to no dtype. Only the stream holds such a sidecar's answer to the engine's dtype."""
    server = FakeServer(_NoComputeDtypeWithDataPlane(max_reqs=4), short_socket_dir() / "rank0.sock").start()
    try:
        shim, model, _ = make_shim(server.endpoint, transport="doorbell", step_deadline_s=0.5, late_grace_s=0.2)
        ids, pos, meta = step_inputs(2)
        with set_forward_context(meta):
            out = shim.maybe_forward(ids, pos)
        assert shim.doorbell is None and "no compute dtype" in (shim._doorbell_off or ""), shim._doorbell_off
        assert server.sidecar.calls["RegisterBuffers"] == 0
        assert out is not None and out.dtype == torch.float32 and torch.equal(out, model.table[ids] * 2)
        shim.close()
    finally:
        server.stop()


def test_connect_reports_an_unexpected_error_instead_of_raising(fake):
    """connect() is maybe_forward's phase 2 alone, for an engine at start-up or the bench; it returns
    why the rank is not ready. An unexpected exception in it (here the cache's export raising OSError
    inside BindKV's request) escaped to the caller, where maybe_forward catches the same one."""
    shim, _, _ = make_shim(fake.endpoint)
    stock = shim.binder.bind
    shim.binder.bind = lambda *a, **k: (_ for _ in ()).throw(OSError("injected: export failed"))
    why = shim.connect()
    assert why == "shim error in prepare: OSError" and shim.enabled
    # Counted against the breaker, as every unexpected error of the shim's own (FAILURE_MODES.md): one that
    # repeats on every step stops costing the step a readiness check once the breaker opens.
    assert shim.breaker.failures == 1
    shim.binder.bind = stock
    shim.breaker.record_success()
    assert shim.connect() is None
    shim.close()


@pytest.mark.parametrize("field", ["backoff_initial_s", "backoff_max_s", "probe_deadline_s"])
def test_breaker_times_must_be_finite(field):
    """EngineConfig bounds its deadlines (at most 3600 s: every wait of the shim is bounded by them);
    BreakerConfig took inf. An infinite backoff never probes again, and gRPC answers a call with an
    infinite timeout DEADLINE_EXCEEDED at once, so either kept a recovered sidecar unused for good."""
    from dspark_sidecar.client.config import BreakerConfig

    kw = {field: float("inf")}
    if field == "backoff_initial_s":
        kw["backoff_max_s"] = float("inf")
    with pytest.raises(EngineConfigError, match=field):
        BreakerConfig(**kw)
    BreakerConfig(**{field: 3600.0, "backoff_max_s": 3600.0})  # the same bound as the engine's deadlines


class _PeerBoundOnceMore(PreflightHook):
    """A 2-rank agreement whose peer, once armed, names one binding generation more than this rank at
    every pre-flight (its BindKV went through once more): this rank then catches up."""

    def all_min(self, values):
        out = values.clone()
        if self.armed and values.numel() == 5 and values[3] < 0:
            out[3] = values[3] - 1  # -gen: the peer's larger generation is the MAX
        return out


def test_a_kv_cache_provider_raising_in_a_catch_up_is_not_the_sidecars_failure(fake):
    """The engine's KV cache provider reads this rank's own state; its exception is the engine's fault, not
    the sidecar's: phase 1 takes it as no KV cache, uncounted (FAILURE_MODES.md). The catch-up to a peer's
    generation called the provider directly, and its exception was counted as a shim error against the
    breaker, which opened on a sidecar that had done nothing wrong (and logged a trace as a shim bug)."""
    kv = shm_kv_cache()
    raising = {"on": False}

    def caches():
        if raising["on"]:
            raise RuntimeError("injected: the engine's cache is being re-allocated")
        return [s.tensor for s in kv]

    agree = _PeerBoundOnceMore()
    shim = DrafterShim(EngineConfig(endpoint=fake.endpoint, tp_size=4), FakeModel(), caches, agree)
    agree.shim = shim
    ids, pos, meta = step_inputs(1)
    try:
        with set_forward_context(meta):
            assert shim.maybe_forward(ids, pos) is not None
            raising["on"], agree.armed = True, True
            for _ in range(shim.config.breaker.failure_threshold):
                assert shim.maybe_forward(ids, pos) is None
        assert shim.stats.fallbacks == {S.GENERATIONS: shim.config.breaker.failure_threshold}
        assert shim.breaker.failures == 0 and shim.breaker.state.value == "closed", \
            "the engine's provider raising was counted against the sidecar"
        assert not any(k.startswith("shim error") for k in shim._logged), shim._logged
    finally:
        shim.close()


def test_a_catch_up_bind_torch_cannot_share_is_not_the_sidecars_failure(fake, monkeypatch):
    """The catch-up to a peer's generation binds too: memory torch refuses to share there (faked, as above) is
    the engine's, not a failed BindKV: before, it counted against the breaker and dropped the link."""
    from dspark_sidecar.client import binding

    real = binding.export_handle

    def export(t):
        if sys._getframe(1).f_code.co_name == "bind_request" and agree.armed:
            raise RuntimeError("injected: CUDA IPC handle refused for memory from expandable segments")
        return real(t)

    monkeypatch.setattr(binding, "export_handle", export)
    agree = _PeerBoundOnceMore()
    shim = make_shim(fake.endpoint, agree=agree)[0]
    ids, pos, meta = step_inputs(1)
    try:
        with set_forward_context(meta):
            assert shim.maybe_forward(ids, pos) is not None
            agree.armed = True
            assert shim.maybe_forward(ids, pos) is None
        assert shim.stats.fallbacks == {S.GENERATIONS: 1}
        assert shim.breaker.failures == 0 and shim.connection.is_open
        assert fake.sidecar.calls["BindKV"] == 1
    finally:
        shim.close()


def test_a_catch_up_bind_refused_for_good_turns_the_ranks_off_at_the_next_pre_flight(fake):
    """A BindKV refused for good (INVALID_ARGUMENT: the deployment, not the sidecar's health) in the catch-up to
    a peer's generation was counted against the breaker and dropped the link, as a passing failure: on a rank
    already a failure or two in (a failed bind is what leaves a rank behind), it opened the breaker, and the next
    steps fell back as "breaker open" instead of the ranks agreeing to turn off. Now the catch-up leaves it to
    the next readiness check, which binds, is refused the same way, and reports it in the pre-flight."""
    agree = _PeerBoundOnceMore()
    shim = make_shim(fake.endpoint, agree=agree)[0]
    ids, pos, meta = step_inputs(1)
    try:
        with set_forward_context(meta):
            assert shim.maybe_forward(ids, pos) is not None
            for _ in range(shim.config.breaker.failure_threshold - 1):  # e.g. steps past their deadline
                shim.breaker.record_failure(S.DEADLINE)
            failures, opens = shim.breaker.failures, shim.connection.opens
            fake.sidecar.bind_error = (grpc.StatusCode.INVALID_ARGUMENT, "layers[0].dtype: cache is bf16")
            agree.armed = True  # a peer bound once more: this rank catches up, and is refused
            assert shim.maybe_forward(ids, pos) is None
            assert shim.breaker.failures == failures and shim.breaker.state.value == "closed", \
                "a refusal for good counted against the sidecar's health"
            assert shim.connection.is_open and shim.connection.opens == opens
            assert shim.maybe_forward(ids, pos) is None
        assert not shim.enabled and "KV cache cannot be bound" in shim.refusal, shim.stats.fallbacks
        assert shim.stats.fallbacks[S.GENERATIONS] == 1 and S.BREAKER not in shim.stats.fallbacks
    finally:
        shim.close()


class _PeersAtGenerations(PreflightHook):
    """A 3-rank agreement whose peers, once armed, hold binding generations 4 and 5 at every pre-flight."""

    world_size = 3

    def all_min(self, values):
        out = values.clone()
        if self.armed and values.numel() == 5:
            out[2], out[3] = min(int(values[2]), 4), min(int(values[3]), -5)
        return out


def test_a_closed_rank_whose_unsettled_step_keeps_the_link_makes_no_catch_up_bind(fake):
    """After close() a rank makes no remote call, but a step unsettled past close()'s grace keeps its link open
    (only it tells when the sidecar is done with the step). A pre-flight whose peers name another generation
    must still not bind through that link: a BindKV after close()'s UnbindKV maps the engine's cache on the
    sidecar again, and nothing would unbind it before the sidecar exits."""
    agree = _PeersAtGenerations()
    shim = make_shim(fake.endpoint, agree=agree, step_deadline_s=0.2, late_grace_s=0.2)[0]
    answer = threading.Event()
    ids, pos, meta = step_inputs(1)
    try:
        with set_forward_context(meta):
            fake.sidecar.step_holds[1] = answer  # past deadline and grace, and past close()'s grace too
            assert shim.maybe_forward(ids, pos) is None and shim._unsettled is not None
            shim.close()
            assert shim.connection.is_open and fake.sidecar.calls["UnbindKV"] == 1  # the link kept for the step
            calls = fake.sidecar.remote_calls()
            agree.armed = True
            assert shim.maybe_forward(ids, pos) is None
        assert shim.stats.fallbacks[S.GENERATIONS] == 1  # the peers disagreed: a catch-up was called for
        assert fake.sidecar.remote_calls() == calls and fake.sidecar.calls["BindKV"] == 1
    finally:
        answer.set()


def _on_threads(fns: list, limit_s: float = 10.0) -> list:
    """Run each fn on its own thread, all released together; their results (a thread left running fails)."""
    out: list = [None] * len(fns)
    go = threading.Barrier(len(fns))

    def run(i: int) -> None:
        go.wait()
        out[i] = fns[i]()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(limit_s)
        assert not t.is_alive(), "hang"
    return out


class _ConnectsInPreflight(PreflightHook):
    """In the pre-flight (this rank has prepared its link and waits for its peer), the engine re-allocates its
    cache and another thread calls connect()."""

    def __init__(self, kv: list) -> None:
        super().__init__()
        self.kv, self.connected = kv, "not called"

    def at_preflight(self) -> None:
        old = list(self.kv)
        self.kv[:] = shm_kv_cache()
        for s in old:
            s.close()
        (self.connected,) = _on_threads([self.shim.connect])


def test_connect_on_another_thread_leaves_a_step_between_its_preflight_and_its_send_alone(fake):
    """connect() may come from any thread at any time; a step holds the link in its phases 2 and 3 but not across
    the pre-flight (close() must not wait for the peers). A connect() in that gap re-bound (or dropped and
    re-opened the link) under the step: it then sent a generation its peers had not agreed on (at TP 4 an
    ABORTED step), or, over a dropped link, raised an AssertionError counted as a shim error. Now connect() finds
    the step in flight and leaves the link as the pre-flight saw it; the step's next readiness check re-binds."""
    kv = shm_kv_cache()
    agree = _ConnectsInPreflight(kv)
    shim = make_shim(fake.endpoint, kv, agree=agree)[0]
    ids, pos, meta = step_inputs(1)
    try:
        with set_forward_context(meta):
            assert shim.maybe_forward(ids, pos) is not None
            agree.armed = True
            assert shim.maybe_forward(ids, pos) is not None
            assert fake.sidecar.calls["BindKV"] == 1 and fake.sidecar.requests[-1].binding_generation == 1
            assert agree.connected == S.STEP_IN_FLIGHT
            assert shim.maybe_forward(ids, pos) is not None  # its own readiness check re-binds the new cache
        assert fake.sidecar.calls["BindKV"] == 2 and fake.sidecar.requests[-1].binding_generation == 2
        assert shim.connect() is None  # no step in flight: connect() works as before
        assert not any(k.startswith("shim error") for k in shim._logged), shim._logged
    finally:
        shim.close()


class _JoinsInPostflight(PreflightHook):
    """Holds the next post-flight (its 1-value agreement) until `thread` has ended: a connect() started during
    the step's send then finds the step still in flight, whatever the threads' timing."""

    thread: threading.Thread | None = None

    def all_min(self, values):
        if values.numel() == 1 and self.thread is not None:
            self.thread.join(10)
        return values.clone()


def test_connect_during_a_steps_send_waits_for_the_link_then_leaves_the_step_alone(fake):
    """The step holds the link while it sends and waits for its answer (phase 3): a connect() from another thread
    then waits for it (bounded by the step deadline and late grace), and once it has it finds the step still in
    flight (its post-flight is pending) and changes nothing."""
    agree = _JoinsInPostflight()
    kv = shm_kv_cache()
    shim = DrafterShim(EngineConfig(endpoint=fake.endpoint, tp_size=4), FakeModel(), lambda: [s.tensor for s in kv],
                       agree)
    ids, pos, meta = step_inputs(1)
    got: dict = {}

    def connect() -> None:
        got["why"], got["at"] = shim.connect(), time.monotonic()

    def during_send(step_id: int) -> None:
        agree.thread = threading.Thread(target=connect, daemon=True)
        agree.thread.start()
        time.sleep(0.2)  # the step still holds the link: connect() waits
        got["sent"] = time.monotonic()

    try:
        with set_forward_context(meta):
            assert shim.maybe_forward(ids, pos) is not None
            shim.fault_hook = during_send
            assert shim.maybe_forward(ids, pos) is not None
        assert not agree.thread.is_alive(), "connect() hung"
        assert got["why"] == S.STEP_IN_FLIGHT and got["at"] >= got["sent"], got
        assert fake.sidecar.calls["BindKV"] == 1 and fake.sidecar.calls["GetStatus"] == 1
    finally:
        shim.fault_hook = None
        shim.close()


def test_two_threads_connecting_at_once_set_the_link_up_once(fake):
    # A bound on a hang, not a timing: at the 1 s default a loaded CI box's first GetStatus ran out ("sidecar
    # unreachable" for the thread that took the link first), which says nothing of two connects at once.
    shim, _, _ = make_shim(fake.endpoint, connect_deadline_s=30.0)
    try:
        assert _on_threads([shim.connect, shim.connect]) == [None, None]
        assert fake.sidecar.calls["GetStatus"] == 1 and fake.sidecar.calls["BindKV"] == 1
    finally:
        shim.close()


class _ChecksTableWidth(FakeSidecar):
    """A sidecar rank that refuses, as server/validate.py does, a step whose block-table rows are narrower than
    its sequence lengths need (INVALID_ARGUMENT naming block_tables)."""

    def _step(self, req):
        tables = codec.from_tensor_ref(req.block_tables, "block_tables")
        lens = codec.from_tensor_ref(req.seq_lens, "seq_lens")
        if tables.shape[1] * 16 < int(lens.max()):
            self.calls["step"] += 1
            self.requests.append(req)
            return pb.DraftStepResponse(step_id=req.step_id, error=pb.StepError(
                code=code_pb2.INVALID_ARGUMENT, reason="block_tables", message="block_tables: request needs more pages"))
        return super()._step(req)


def test_a_block_table_narrower_than_its_seq_lens_falls_back_unsent_and_uncounted():
    """The engine's own metadata at fault: a block-table row narrower than ceil(seq_len / page_size) pages.
    It was sent as it was; the sidecar refused it (INVALID_ARGUMENT), which drops the link and counts
    against the breaker, so every such step cost a reconnect and a breaker failure and opened the breaker
    on a sidecar that had done nothing wrong. The shim now falls back on it (attention metadata unusable)
    after the pre-flight (the page size comes from this rank's cache, which only a ready rank is sure to
    have read), without sending it."""
    server = FakeServer(_ChecksTableWidth(max_reqs=4), short_socket_dir() / "rank0.sock").start()
    shim, _, _ = make_shim(server.endpoint)
    try:
        ids, pos, meta = step_inputs(2)  # seq_lens 27, 28: two pages of 16 each
        narrow = StepMetadata(meta.seq_lens, meta.block_tables[:, :1].contiguous(), meta.slot_mapping)
        with set_forward_context(meta):
            assert shim.maybe_forward(ids, pos) is not None
        sent, status_reads = len(server.sidecar.requests), server.sidecar.calls["GetStatus"]
        with set_forward_context(narrow):
            for _ in range(shim.config.breaker.failure_threshold + 1):
                assert shim.maybe_forward(ids, pos) is None
        assert len(server.sidecar.requests) == sent, "a step the sidecar must refuse was sent"
        assert shim.stats.fallbacks == {S.BAD_METADATA: shim.config.breaker.failure_threshold + 1}
        assert shim.breaker.failures == 0 and shim.breaker.state.value == "closed"
        assert shim.connection.is_open and server.sidecar.calls["GetStatus"] == status_reads  # the link was kept
        with set_forward_context(meta):
            assert shim.maybe_forward(ids, pos) is not None
    finally:
        shim.close()
        server.stop()


def test_a_catch_up_makes_no_bind_while_the_breaker_is_open(fake):
    """An open breaker means no call to the sidecar until its backoff expires and a health probe passes
    (FAILURE_MODES.md). The catch-up to a peer's generation called BindKV all the same, once a step, on a
    link the breaker had given up on (steps that time out or answer malformed open it and keep the link)."""
    now = [1000.0]
    agree = _PeerBoundOnceMore()
    kv = shm_kv_cache()
    shim = DrafterShim(EngineConfig(endpoint=fake.endpoint, tp_size=4), FakeModel(), lambda: [s.tensor for s in kv],
                       agree, clock=lambda: now[0])
    agree.shim = shim
    ids, pos, meta = step_inputs(1)
    try:
        with set_forward_context(meta):
            assert shim.maybe_forward(ids, pos) is not None
            for _ in range(shim.config.breaker.failure_threshold):  # e.g. steps past their deadline
                shim.breaker.record_failure(S.DEADLINE)
            assert shim.breaker.state.value == "open" and shim.connection.is_open
            binds = fake.sidecar.calls["BindKV"]
            agree.armed = True  # a peer bound once more: this rank is behind
            for _ in range(3):
                assert shim.maybe_forward(ids, pos) is None
            assert fake.sidecar.calls["BindKV"] == binds, "catch-up binds sent through an open breaker"
            assert shim.stats.fallbacks == {S.GENERATIONS: 3}
            now[0] = shim.breaker.retry_at  # the backoff expires; the probe (health SERVING) passes
            assert shim.maybe_forward(ids, pos) is None
            assert fake.sidecar.calls["BindKV"] == binds + 1, "no catch-up once the breaker let calls through"
    finally:
        shim.close()


class _RefusesOnceBound(FakeSidecar):
    """A strict (--strict-refusal) sidecar rank whose fast path refuses the binding itself (found only once the
    engine's cache is bound): from the first BindKV on its status is REFUSED (NOT_SERVING), and each step is
    refused FAILED_PRECONDITION, reason REFUSED (server/rank.py)."""

    def BindKV(self, request, context):
        resp = super().BindKV(request, context)
        self.serving, self.state, self.refusal = False, "REFUSED", "FlyDSL refuses this KV cache"
        return resp

    def _step(self, req):
        if self.state == "REFUSED":
            self.calls["step"] += 1
            return pb.DraftStepResponse(step_id=req.step_id, error=pb.StepError(
                code=code_pb2.FAILED_PRECONDITION, reason="REFUSED",
                message="fast path refused: FlyDSL refuses this KV cache (--strict-refusal)"))
        return super()._step(req)


def test_a_strict_refusal_found_after_the_bind_turns_the_process_off():
    """A strict sidecar that refuses only once the cache is bound answers every step FAILED_PRECONDITION
    (REFUSED). The shim read every FAILED_PRECONDITION as a stale binding: it forgot the binding and bound
    again, on every step for good (a BindKV and a refused step each time, nothing counted against the
    breaker), and never re-read the status that says REFUSED, so the agreed turn-off never came."""
    server = FakeServer(_RefusesOnceBound(max_reqs=4), short_socket_dir() / "rank0.sock").start()
    try:
        shim, _, _ = make_shim(server.endpoint)
        ids, pos, meta = step_inputs(1)
        with set_forward_context(meta):
            for _ in range(6):
                assert shim.maybe_forward(ids, pos) is None
        assert not shim.enabled and shim.refusal == "sidecar refuses: FlyDSL refuses this KV cache", \
            (shim.refusal, dict(shim.stats.fallbacks))
        assert server.sidecar.calls["BindKV"] == 1 and server.sidecar.calls["step"] == 1
        assert shim.stats.fallbacks == {"sidecar FAILED_PRECONDITION": 1,
                                        "off: sidecar refuses: FlyDSL refuses this KV cache": 5}
        shim.close()
    finally:
        server.stop()


class _ComputesInBf16(_NoComputeDtype):
    """A sidecar computing in bf16 (its --dtype) that says so, answering in it: what serves an engine of another
    dtype whose cache is fp8 (BindKV takes an fp8 cache whatever the engine computes in)."""

    answer_dtype = torch.bfloat16

    def GetStatus(self, request, context):
        st = FakeSidecar.GetStatus(self, request, context)
        st.model.compute_dtype = "bfloat16"
        return st


def test_hidden_states_reach_the_engine_in_its_own_dtype():
    """The stream's answer is held to the sidecar's compute dtype, and was handed to the engine as it is: an
    fp32 (or fp16) engine got bf16 hidden states, which its next layer (the LM head, in the engine's dtype)
    refuses with a RuntimeError inside the engine's step. maybe_forward returns what the stock layers would:
    the engine's dtype."""
    server = FakeServer(_ComputesInBf16(max_reqs=4), short_socket_dir() / "rank0.sock").start()
    try:
        shim, model, _ = make_shim(server.endpoint)
        ids, pos, meta = step_inputs(2)
        with set_forward_context(meta):
            out = shim.maybe_forward(ids, pos)
        assert out is not None, dict(shim.stats.fallbacks)
        assert out.dtype == model.table.dtype == torch.float32, f"a {out.dtype} answer for a float32 engine"
        want = (model.table[ids].to(torch.bfloat16).float() * 2).to(torch.bfloat16).float()
        assert torch.equal(out, want)
        # And the embeddings went out in the sidecar's compute dtype: half an fp32 engine's bytes on the wire, and
        # what _fits measured against the message limit.
        assert server.sidecar.requests[-1].inputs_embeds.dtype == codec.dtype_to_proto(torch.bfloat16)
        shim.close()
    finally:
        server.stop()


def test_a_sidecar_that_comes_up_refusing_behind_an_open_breaker_turns_the_process_off(fake):
    """A strict (--strict-refusal) sidecar that refuses for good is NOT_SERVING on grpc.health.v1 for good too
    (server/health.py HealthPublisher), and its refusal is read only from GetStatus. An engine that stepped while
    the sidecar was still loading (NOT_SERVING, passing) opened its breaker; from then on only the health probe
    was sent, which never passed, so GetStatus was never read again: the ranks never agreed to turn off, every
    step still paid the pre-flight agreement, counted as "breaker open", with a probe every backoff_max_s for
    the life of the engine. A probe answered NOT_SERVING now reads the status, and a permanent refusal there
    lets the caller through to learn it; a sidecar still loading keeps the breaker open."""
    now = [1000.0]
    kv = shm_kv_cache()
    fake.sidecar.serving, fake.sidecar.state = False, "LOADING"
    fake.set_health(False)
    shim = DrafterShim(EngineConfig(endpoint=fake.endpoint, tp_size=4), FakeModel(), lambda: [s.tensor for s in kv],
                       ParallelContext(0, 1), clock=lambda: now[0])
    ids, pos, meta = step_inputs(1)
    try:
        with set_forward_context(meta):
            for _ in range(shim.config.breaker.failure_threshold):
                assert shim.maybe_forward(ids, pos) is None
            assert shim.breaker.state.value == "open"
            now[0] = shim.breaker.retry_at  # still loading: the probe fails, the breaker stays open
            assert shim.maybe_forward(ids, pos) is None
            assert shim.breaker.state.value == "open" and shim.breaker.probes_failed == 1 and shim.enabled
            # Loaded, and its fast path refused under --strict-refusal: REFUSED, health NOT_SERVING for good.
            fake.sidecar.state = "REFUSED"
            for _ in range(4):
                now[0] = shim.breaker.retry_at
                assert shim.maybe_forward(ids, pos) is None
        assert not shim.enabled and shim.refusal == "sidecar refuses: not gfx950", \
            (shim.breaker.state, dict(shim.stats.fallbacks))
        assert fake.sidecar.calls["BindKV"] == 0
    finally:
        shim.close()


class _RemotePeer(FakeSidecar):
    """A sidecar reached over a non-loopback transport (--allow-remote): it answers health and GetStatus but
    refuses every BindKV, PERMISSION_DENIED with reason REMOTE_PEER (server/servicer.py _require_same_node)."""

    def BindKV(self, request, context):
        from grpc_status import rpc_status

        from dspark_sidecar.server.errors import SidecarError, to_status
        self.calls["BindKV"] += 1
        err = SidecarError(grpc.StatusCode.PERMISSION_DENIED, f"memory registration from {context.peer()} refused: "
                           "only same-node peers (unix socket or loopback) may bind KV caches", "", "REMOTE_PEER")
        context.abort_with_status(rpc_status.to_status(to_status(err)))


def test_a_bind_refused_to_a_remote_engine_is_permanent():
    """The sidecar takes KV handles from same-node peers only: an engine that reaches it over another transport
    is refused every BindKV with PERMISSION_DENIED (REMOTE_PEER), which no retry can change. The shim read it
    as passing: a breaker failure and a dropped link on each try, and through the breaker's probes a GetStatus
    and a BindKV every backoff period for the life of the engine, never turning off. It is a refusal for good,
    agreed at the pre-flight like a TP mismatch."""
    server = FakeServer(_RemotePeer(max_reqs=4), short_socket_dir() / "rank0.sock").start()
    try:
        shim, _, _ = make_shim(server.endpoint)
        ids, pos, meta = step_inputs(1)
        with set_forward_context(meta):
            for _ in range(4):
                assert shim.maybe_forward(ids, pos) is None
        assert not shim.enabled and "PERMISSION_DENIED REMOTE_PEER" in shim.refusal, \
            (shim.refusal, dict(shim.stats.fallbacks))
        assert server.sidecar.calls["BindKV"] == 1
    finally:
        server.stop()


def test_a_request_over_the_sidecar_s_message_limit_is_not_sent_and_the_stream_goes_on(fake):
    """An inline request past the sidecar's max_message_bytes (StatusReport.limits: a small --max-message-bytes
    with wide block tables) made gRPC end the whole stream with RESOURCE_EXHAUSTED, which the shim read as a
    broken link: a reconnect and a breaker failure on every such step (helper 86). Such a step now falls back
    unsent, the breaker untouched, and a step that fits goes on over the same stream."""
    fake.sidecar.max_message_bytes = 1000
    shim, _, _ = make_shim(fake.endpoint)
    big, pos_b, meta_b = step_inputs(3)
    small, pos_s, meta_s = step_inputs(1)
    with set_forward_context(meta_b):
        for _ in range(shim.config.breaker.failure_threshold + 1):
            assert shim.maybe_forward(big, pos_b) is None
    assert shim.breaker.failures == 0 and fake.sidecar.calls["step"] == 0
    assert shim.stats.fallbacks == {S.TOO_LARGE: shim.config.breaker.failure_threshold + 1}
    with set_forward_context(meta_s):
        assert shim.maybe_forward(small, pos_s) is not None, dict(shim.stats.fallbacks)
    assert fake.sidecar.calls["step"] == 1 and fake.sidecar.calls["DraftSteps"] == 1
    assert fake.sidecar.calls["GetStatus"] == 1  # the link was kept


def test_a_request_whose_tensors_fit_but_whose_message_does_not_is_not_sent(fake):
    """The tensors' bytes decide a request's fit when they are clear of the limit by _HEADER_BYTES (no
    serialization on the step's path); within that margin the whole message is measured. A request whose
    tensors fit the sidecar's max_message_bytes and whose header then takes it over must not be sent:
    gRPC would end the stream with it."""
    from dspark_sidecar.client.metadata import read_step_metadata

    ids, pos, meta = step_inputs(1)
    embeds = FakeModel().table[ids]  # fp32, the fake sidecar's compute dtype: sent as they are
    sent, _ = read_step_metadata(meta, pos.numel(), 16)  # the table trimmed to the pages the step reaches
    payload = sum(t.numel() * t.element_size()
                  for t in (pos, embeds, sent.seq_lens, sent.block_tables, sent.slot_mapping))
    fake.sidecar.max_message_bytes = payload + 1  # the tensors fit, the message (their refs' headers) does not
    shim, _, _ = make_shim(fake.endpoint)
    with set_forward_context(meta):
        assert shim.maybe_forward(ids, pos) is None
    assert shim.stats.fallbacks == {S.TOO_LARGE: 1} and fake.sidecar.calls["step"] == 0


def test_a_fallback_reason_is_logged_once_and_counted_every_time(fake, caplog):
    """Every step of a profiling run, or of a deployment that never forwards, falls back for the same reason: the
    log says it once ("logged once"), the counters count each."""
    shim, _, _ = make_shim(fake.endpoint)
    ids, pos, _ = step_inputs(2)
    with caplog.at_level("INFO", logger="dspark_sidecar.client"):
        for _ in range(3):
            assert shim.maybe_forward(ids[:13], pos[:13]) is None
    said = [r for r in caplog.records if S.ROWS in r.getMessage()]
    assert len(said) == 1 and "logged once" in said[0].getMessage()
    assert shim.stats.fallbacks == {S.ROWS: 3}


def test_the_engines_embedding_raising_is_not_the_sidecars_failure(fake):
    """model.embed_input_ids is the engine's own object, as its KV cache provider is: its exception (an
    out-of-memory, a bad input) is the engine's fault. It was counted as a shim error against the breaker,
    so after failure_threshold such steps the breaker opened on a sidecar that had done nothing wrong: the
    steps after the embedding recovered fell back as "sidecar unavailable (breaker open)" until a health
    probe passed, and each try that failed again doubled the wait."""
    kv, model = shm_kv_cache(), FakeModel()
    shim = DrafterShim(EngineConfig(endpoint=fake.endpoint, tp_size=4), model, lambda: [s.tensor for s in kv],
                       ParallelContext(0, 1), clock=lambda: 0.0)  # frozen: an open breaker stays open
    raising = {"on": True}
    stock = model.embed_input_ids

    def embed(ids):
        if raising["on"]:
            raise torch.OutOfMemoryError("injected: the engine's embedding ran out of memory")
        return stock(ids)

    model.embed_input_ids = embed
    ids, pos, meta = step_inputs(2)
    threshold = shim.config.breaker.failure_threshold
    try:
        with set_forward_context(meta):
            for _ in range(threshold):
                assert shim.maybe_forward(ids, pos) is None
            assert shim.breaker.failures == 0 and shim.breaker.state.value == "closed", \
                "the engine's embedding raising was counted against the sidecar"
            raising["on"] = False
            assert shim.maybe_forward(ids, pos) is not None
        assert shim.stats.fallbacks == {f"{S.EMBED_FAILED}: OutOfMemoryError": threshold}, shim.stats.fallbacks
        assert fake.sidecar.calls["step"] == 1  # nothing was sent while the embedding raised
    finally:
        shim.close()


@pytest.mark.parametrize("rows", [1, 13], ids=["one-row", "one-short"])
def test_engine_embeddings_of_another_row_count_fall_back_without_a_breaker_failure(fake, rows):
    """inputs_embeds the engine passes must be the step's [7R, hidden] rows. One row was broadcast into all 7R
    by the data plane's copy (the sidecar drafted from it, every check passing); now the data plane refuses it,
    and the shim must not count that against the sidecar: the engine's input is at fault, nothing is sent."""
    shim, _, _ = make_shim(fake.endpoint)
    ids, pos, meta = step_inputs(2)
    threshold = shim.config.breaker.failure_threshold
    try:
        with set_forward_context(meta):
            for _ in range(threshold):
                assert shim.maybe_forward(ids, pos, torch.ones(rows, HIDDEN)) is None
            assert shim.breaker.failures == 0 and shim.breaker.state.value == "closed"
            assert shim.maybe_forward(ids, pos) is not None
        assert shim.stats.fallbacks == {S.BAD_EMBEDS: threshold}, shim.stats.fallbacks
        assert fake.sidecar.calls["step"] == 1
    finally:
        shim.close()


class _RefusesPositions(FakeSidecar):
    """A sidecar rank that refuses, as server/validate.py does, steps whose positions are not each request's
    seq_len - 7 .. seq_len - 1 (here: while `refuse` is set), naming the field (`field`)."""

    refuse = False
    field = "positions"

    def _step(self, req):
        if self.refuse:
            self.calls["step"] += 1
            self.requests.append(req)
            return pb.DraftStepResponse(step_id=req.step_id, error=pb.StepError(
                code=code_pb2.INVALID_ARGUMENT, field=self.field, reason="INVALID_FIELD",
                message=f"{self.field}: request 0's rows are not seq_len - 7 .. seq_len - 1"))
        return super()._step(req)


@pytest.mark.parametrize("field", ["positions", "seq_lens", "block_tables", "slot_mapping"])
def test_a_step_refused_for_its_own_metadata_falls_back_without_a_breaker_failure_or_a_reconnect(field):
    """vLLM's DSpark speculator clamps block positions at max_model_len - 1 within 7 tokens of a request's end:
    the sidecar refuses such a step naming positions. Read as the other INVALID_ARGUMENT answers (the sidecar's
    limits changed), each dropped the link and counted a breaker failure, so a few requests reaching the model's
    length opened the breaker for every request. The engine's metadata is at fault for that step only (each of
    the step's metadata fields: the speculator writes -1 slots for null blocks too)."""
    sidecar = _RefusesPositions(max_reqs=4)
    sidecar.field = field
    server = FakeServer(sidecar, short_socket_dir() / "rank0.sock").start()
    shim, _, _ = make_shim(server.endpoint)
    try:
        ids, pos, meta = step_inputs(2)
        with set_forward_context(meta):
            assert shim.maybe_forward(ids, pos) is not None
            status_reads = server.sidecar.calls["GetStatus"]
            server.sidecar.refuse = True
            for _ in range(shim.config.breaker.failure_threshold + 1):
                assert shim.maybe_forward(ids, pos) is None
            assert shim.stats.fallbacks == {"sidecar INVALID_ARGUMENT": shim.config.breaker.failure_threshold + 1}
            assert shim.breaker.failures == 0 and shim.breaker.state.value == "closed"
            assert shim.connection.is_open and server.sidecar.calls["GetStatus"] == status_reads  # the link was kept
            server.sidecar.refuse = False
            assert shim.maybe_forward(ids, pos) is not None
    finally:
        shim.close()
        server.stop()


class _PeerRefuses(PreflightHook):
    """A peer engine rank whose sidecar refuses for good: the next pre-flight carries its refusal."""

    def all_min(self, values):
        out = values.clone()
        if self.armed and values.numel() == 5:
            self.armed = False
            out[1] = -1
        return out


def test_connect_that_waited_for_the_link_while_the_ranks_turned_off_stays_off(fake):
    """connect() read `enabled` before it took the link. One from another thread that passed that check while a
    step held the link and the ranks agreed to turn off (a peer's sidecar refuses) then ran the readiness check
    on the off shim: it re-opened the link, bound the cache again after the turn-off's UnbindKV and answered
    ready, and nothing released that binding or channel before close(), since an off shim never prepares again."""
    agree = _PeerRefuses()
    shim = make_shim(fake.endpoint, agree=agree)[0]
    assert shim.connect() is None and fake.sidecar.calls["BindKV"] == 1
    hold, arrived, go = shim._hold, threading.Event(), threading.Event()
    connector: list[threading.Thread] = []

    class Gate:  # holds the connect() thread just before it takes the link, after its `enabled` check
        def __enter__(self):
            if connector and threading.current_thread() is connector[0] and not go.is_set():
                arrived.set()
                go.wait(10)
            return hold.__enter__()

        def __exit__(self, *exc):
            return hold.__exit__(*exc)

    shim._link = lambda: Gate()
    got: list = []
    connector.append(threading.Thread(target=lambda: got.append(shim.connect()), daemon=True))
    connector[0].start()
    assert arrived.wait(10)
    ids, pos, meta = step_inputs(1)
    try:
        agree.armed = True
        with set_forward_context(meta):
            assert shim.maybe_forward(ids, pos) is None
        assert not shim.enabled and fake.sidecar.calls["UnbindKV"] == 1 and not shim.connection.is_open
        calls = fake.sidecar.remote_calls()
        go.set()
        connector[0].join(10)
        assert got == ["off: a peer engine rank's sidecar refuses"]
        assert fake.sidecar.remote_calls() == calls and not shim.connection.is_open
        assert shim.binder.current is None
    finally:
        go.set()
        shim.close()


def test_a_step_whose_draft_layers_span_several_kv_cache_groups_falls_back_unsent(fake):
    """vLLM 0.34 hands the draft forward one metadata per KV cache group the draft's layers lie in, each group with its
    own table and slots (tests/client/test_metadata.py). The shim read the first layer's and sent them for every
    layer: each group's step is self-consistent, so the sidecar ran it, reading and writing the other groups' layers'
    K/V at pages of the first group's. Now it falls back, nothing sent, not counted against the breaker."""
    shim, _, _ = make_shim(fake.endpoint)
    ids, pos, _ = step_inputs(2)
    with set_forward_context(vllm_draft_metadata(2, [[["layers.0.attn"], ["layers.1.attn"]]])):
        assert shim.maybe_forward(ids, pos) is not None  # one KV cache group, two attention groups: sent
    sent = len(fake.sidecar.requests)
    with set_forward_context(vllm_draft_metadata(2, [[["layers.0.attn"]], [["layers.1.attn"]]])):
        assert shim.maybe_forward(ids, pos) is None
    assert len(fake.sidecar.requests) == sent, "sent with one KV cache group's table and slots for every layer"
    assert shim.stats.fallbacks == {S.KV_GROUPS: 1} and shim.breaker.failures == 0
