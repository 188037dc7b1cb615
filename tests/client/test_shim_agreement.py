"""Four engine ranks (threads) with four fake sidecar ranks: every step ends with the same decision on every rank."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from dspark_sidecar.client import shim as S
from dspark_sidecar.client.breaker import BreakerState
from dspark_sidecar.client.config import BreakerConfig, EngineConfig
from dspark_sidecar.client.forward_context import set_forward_context
from dspark_sidecar.client.shim import DrafterShim
from helpers.engine_fakes import (
    FakeModel, FakeServer, FakeSidecar, ThreadGroup, ThreadRendezvous, shm_kv_cache, short_socket_dir, step_inputs,
)
from helpers.waiting import wait_until

TP = 4


class Engine:
    """Four shims, one per engine rank, each talking to its own fake sidecar rank."""

    def __init__(self, step_deadline_s: float = 2.0, late_grace_s: float = 1.0) -> None:
        folder = short_socket_dir()
        self.rendezvous = ThreadRendezvous(TP, deadline_s=0.3)
        self.servers = [FakeServer(FakeSidecar(r, TP, self.rendezvous), folder / f"rank{r}.sock").start()
                        for r in range(TP)]
        self.group = ThreadGroup(TP)
        self.model = FakeModel()
        self.kv = [shm_kv_cache() for _ in range(TP)]
        breaker = BreakerConfig(failure_threshold=1, backoff_initial_s=0.02, backoff_max_s=0.1, probe_deadline_s=0.5)
        self.shims = [
            DrafterShim(EngineConfig(tp_size=TP, endpoint=self.servers[r].endpoint, step_deadline_s=step_deadline_s,
                                     late_grace_s=late_grace_s, breaker=breaker),
                        self.model, (lambda r=r: [s.tensor for s in self.kv[r]]), self.group.member(r))
            for r in range(TP)
        ]
        self.pool = ThreadPoolExecutor(TP)

    def step(self, r: int = 2) -> list[torch.Tensor | None]:
        ids, pos, meta = step_inputs(r)

        def one(rank: int):
            with set_forward_context(meta):
                return self.shims[rank].maybe_forward(ids, pos)

        outs = list(self.pool.map(one, range(TP)))
        assert len({o is None for o in outs}) == 1, "engine ranks ended the step with different decisions"
        if outs[0] is not None:
            assert all(torch.equal(o, outs[0]) for o in outs)
        return outs

    def close(self) -> None:
        self.pool.shutdown()
        for s in self.shims:
            s.close()
        for s in self.servers:
            s.stop()


@pytest.fixture
def engine():
    e = Engine()
    yield e
    e.close()


def reasons(engine: Engine) -> list[dict]:
    return [dict(s.stats.fallbacks) for s in engine.shims]


def test_all_ranks_forward_with_two_agreements_per_step(engine):
    for _ in range(3):
        assert engine.step()[0] is not None
    assert engine.group.calls == 6
    assert [s.sidecar.calls["DraftSteps"] for s in engine.servers] == [1] * TP


def test_one_ranks_stream_broken_makes_every_rank_fall_back_for_that_step(engine):
    assert engine.step()[0] is not None
    engine.shims[2].fault_hook = lambda step_id: engine.shims[2].connection.stream().close()
    assert engine.step()[0] is None  # the peers' sidecar ranks abort at their rendezvous deadline (reasons below)
    engine.shims[2].fault_hook = None
    got = reasons(engine)
    assert got[2] == {S.STREAM: 1}
    assert all(got[r] == {"sidecar ABORTED": 1} for r in (0, 1, 3))
    assert engine.step()[0] is not None  # rank 2 reconnected; its binding is still current
    assert engine.servers[2].sidecar.calls["BindKV"] == 1


def test_one_sidecar_rank_down_then_back(engine):
    assert engine.step()[0] is not None
    engine.servers[3].stop()
    for _ in range(5):
        assert engine.step()[0] is None
    assert engine.shims[3].breaker.state is BreakerState.OPEN
    # Rank 3 learns at once (a refused connect, then its open breaker), and its peers fall back at the
    # pre-flight: no step waits out its deadline on the rank that is gone.
    got = reasons(engine)
    assert set(got[3]) <= {S.UNREACHABLE, S.STREAM, S.BREAKER} and got[3].get(S.BREAKER, 0) >= 3, got[3]
    assert engine.shims[0].stats.fallbacks[S.PEER_NOT_READY] >= 3
    assert not any(S.DEADLINE in g for g in got), got
    # Restart rank 3 as a fresh process would: no binding, generation counting from 0 again,
    # while ranks 0-2 re-bound once more meanwhile (generation 2): rank 3 must catch up.
    engine.servers[3].sidecar = FakeSidecar(3, TP, engine.rendezvous)
    engine.servers[3].start()
    for r in range(3):
        engine.shims[r].binder.invalidate()
    wait_until(lambda: engine.step()[0] is not None, 10, lambda: f"a step forwarded: {reasons(engine)}",
               interval_s=0.02)
    gens = [s.binder.generation for s in engine.shims]
    assert len(set(gens)) == 1 and gens[0] >= 2
    assert engine.servers[3].sidecar.calls["BindKV"] >= 2  # caught up from 1


def test_generation_catch_up(engine):
    engine.servers[1].sidecar.generation = 5  # rank 1's sidecar has seen more binds
    assert engine.step()[0] is None
    assert engine.shims[0].stats.fallbacks == {S.GENERATIONS: 1}
    assert engine.step()[0] is not None
    assert [s.binder.generation for s in engine.shims] == [6] * TP


def test_a_raised_limit_is_learned_again_by_every_rank_at_the_same_step(engine):
    """One in RELEARN_EVERY steps above the agreed max_reqs goes on to the pre-flight: counted alike on every
    rank, so all ranks go on (and agree) at the same step, and none waits in an agreement its peers skip."""
    assert engine.step()[0] is not None  # learns the fakes' 32
    for srv, shim in zip(engine.servers, engine.shims):
        srv.sidecar.max_reqs = 40  # as after a restart with --max-reqs 40: read again at the next reconnect
        shim.connection.close()
    calls = engine.group.calls
    for i in range(1, S.RELEARN_EVERY):
        assert engine.step(36)[0] is None
    assert engine.group.calls == calls  # no agreement on the steps in between
    assert engine.step(36)[0] is not None
    assert [s._max_reqs for s in engine.shims] == [40] * TP
    assert reasons(engine) == [{S.REQS: S.RELEARN_EVERY - 1}] * TP


def test_whole_sidecar_down_and_back_through_health(engine):
    assert engine.step()[0] is not None
    for s in engine.servers:
        s.stop()
    # A rank learns its sidecar went away when its stream's reader thread sees the stream end. Until then it is
    # ready, and falls back with its peers as PEER_NOT_READY: on a loaded 2-core CI box one rank's reader came
    # after the first step (CI of 407807a). Wait for every rank's, as the single-rank tests do.
    wait_until(lambda: all(s.connection.stream_ended for s in engine.shims), 10,
               lambda: f"every rank's stream ended: {[s.connection.stream_ended for s in engine.shims]}")
    for _ in range(10):
        assert engine.step()[0] is None
    assert all(s.breaker.state is BreakerState.OPEN for s in engine.shims)
    # Each rank learns at once (a refused connect, then its open breaker): no step waits out its deadline.
    got = reasons(engine)
    assert all(set(g) <= {S.UNREACHABLE, S.STREAM, S.BREAKER} and g.get(S.BREAKER, 0) >= 8 for g in got), got
    for s in engine.servers:  # restarted, still loading
        s.sidecar = FakeSidecar(s.sidecar.rank, TP, engine.rendezvous)
        s.start()
        s.set_health(False)
    for _ in range(5):
        assert engine.step()[0] is None
        time.sleep(0.03)
    assert sum(s.sidecar.calls["step"] for s in engine.servers) == 0
    assert sum(s.breaker.probes_failed for s in engine.shims) >= TP
    for s in engine.servers:
        s.set_health(True)
    wait_until(lambda: engine.step()[0] is not None, 10, lambda: f"a step forwarded: {reasons(engine)}",
               interval_s=0.02)
    assert all(s.breaker.state is BreakerState.CLOSED for s in engine.shims)
    assert [s.sidecar.calls["BindKV"] for s in engine.servers] == [1] * TP  # re-bound the new sidecar


def test_late_answer_within_grace_settles_and_a_later_one_pauses_forwarding():
    engine = Engine(step_deadline_s=0.5, late_grace_s=0.5)
    try:
        assert engine.step()[0] is not None
        engine.servers[0].sidecar.step_delay_s[2] = 0.7  # after the deadline, inside the grace
        assert engine.step()[0] is None
        assert engine.shims[0].stats.fallbacks == {S.DEADLINE: 1}
        assert engine.shims[0]._unsettled is None
        # The breaker opened on the timeout: wait until it closes.
        wait_until(lambda: engine.step()[0] is not None, 10, lambda: f"a step forwarded: {reasons(engine)}",
                   interval_s=0.05)
        engine.servers[0].sidecar.step_delay_s[engine.shims[0]._next_step] = 1.5  # past deadline + grace
        assert engine.step()[0] is None
        assert engine.shims[0]._unsettled is not None
        outs = engine.step()
        assert outs[0] is None and engine.shims[0].stats.fallbacks[S.UNSETTLED] == 1
        time.sleep(0.6)  # the late answer arrives: settled
        wait_until(lambda: engine.step()[0] is not None, 10, lambda: f"a step forwarded: {reasons(engine)}",
                   interval_s=0.05)
        assert engine.shims[0]._unsettled is None
    finally:
        engine.close()


def test_an_exception_on_one_rank_between_the_agreements_cannot_hang_its_peers(engine):
    assert engine.step()[0] is not None

    def boom(step_id):
        raise RuntimeError("injected")

    engine.shims[1].fault_hook = boom
    calls = engine.group.calls
    assert engine.step()[0] is None
    # Rank 1 still took part in the step's second agreement: both completed. A rank that skipped it left its
    # peers there until the fake group's barrier broke (30 s, a hang guard), one agreement short.
    assert engine.group.calls == calls + 2
    assert engine.shims[1].stats.fallbacks == {"shim error in step: RuntimeError": 1}
    engine.shims[1].fault_hook = None
    engine.shims[2].binder.bind = lambda *a, **k: (_ for _ in ()).throw(OSError("injected"))
    engine.shims[2].binder.invalidate()
    assert engine.step()[0] is None
    assert engine.shims[2].stats.fallbacks["shim error in prepare: OSError"] == 1
    assert engine.shims[0].stats.fallbacks[S.PEER_NOT_READY] == 1


def test_an_exception_in_one_ranks_kv_cache_provider_is_a_rank_not_ready_not_a_raise(engine):
    """The engine's KV cache provider is this rank's own state (vLLM's layer attributes), not the
    step's replicated inputs: it raised out of maybe_forward before any agreement, so the engine
    step failed on that rank while its peers waited for it in the pre-flight. It is a rank without
    a KV cache now: not ready in the pre-flight, so every rank falls back for that step."""
    assert engine.step()[0] is not None
    kv = engine.kv[2]
    calls = []

    def broken() -> list:
        calls.append(True)
        raise RuntimeError("injected: the engine's cache attribute is being replaced")

    engine.shims[2]._kv_caches = broken
    agreements = engine.group.calls
    outs = engine.step()  # raised RuntimeError from rank 2 before
    assert outs[0] is None and calls
    assert engine.group.calls == agreements + 1  # every rank met at the pre-flight, and all stopped there
    assert engine.shims[2].stats.fallbacks == {S.NO_KV: 1}
    assert all(engine.shims[r].stats.fallbacks == {S.PEER_NOT_READY: 1} for r in (0, 1, 3))
    engine.shims[2]._kv_caches = lambda: [s.tensor for s in kv]
    assert engine.step()[0] is not None  # the provider is back: forwarding resumes, no re-bind needed
    assert engine.servers[2].sidecar.calls["BindKV"] == 1


@pytest.mark.parametrize("deadline_s, connect_s", [(2.0, 1.0), (120.0, 1.0), (600.0, 1.0), (2.0, 30.0)])
def test_a_rank_waits_for_its_peers_longer_than_a_live_peer_can_take(monkeypatch, deadline_s, connect_s):
    """The shared page's agreement gave peers a fixed 60 s. A step may take step_deadline_s plus
    late_grace_s between the two agreements (DSPARK_STEP_DEADLINE_MS allows up to an hour), so with
    a 120 s deadline the peers of a rank still waiting for its answer raised AgreementTimeout into the
    engine. The wait now follows the config's deadlines. The data plane's two registrations each wait up to
    connect_deadline_s (DoorbellTransport), which were counted at bind_deadline_s: a connect deadline above
    the bind deadline made the wait shorter than a live peer's reconnect."""
    from dspark_sidecar.client import agreement

    asked = []
    monkeypatch.setattr(agreement, "node_agreement", lambda group, timeout_s=60.0: asked.append(timeout_s) or "page")
    cfg = EngineConfig(tp_size=TP, endpoint="unix:/nonexistent/rank0.sock", step_deadline_s=deadline_s,
                       connect_deadline_s=connect_s)
    par = type("Par", (), {"world_size": TP, "rank": 0, "exchange": type("X", (), {"group": None})()})()
    shim = DrafterShim(cfg, model=None, kv_caches=lambda: [], par=par)
    assert shim._agree == "page" and asked == [cfg.agreement_timeout_s]
    # A reconnect, the catch-up binds, the buffers' and the doorbell's registrations, a step and its grace.
    longest_live = (3 * cfg.connect_deadline_s + cfg.max_catchup_binds * cfg.bind_deadline_s
                    + cfg.step_deadline_s + cfg.late_grace_s)
    assert cfg.agreement_timeout_s > longest_live and cfg.agreement_timeout_s >= 60.0


def test_one_rank_closed_from_another_thread_mid_step_makes_every_rank_fall_back():
    """An engine rank's shim closed on another thread (a shutdown hook) while its step waits for the answer:
    that rank's step is woken and every rank ends it with None; from then on the closed rank is not ready
    at each pre-flight (it still takes part: its peers wait there), so every rank falls back, none hangs,
    and the closed rank calls its sidecar no more.

    The order tells the wake from a wait for the answer: the closed rank's sidecar holds its answer until
    the step has ended on every rank, and the step deadline and grace are ten minutes, so a step that waited
    for the answer (or its deadline) would still run at the hang guard. Released after, the answer settles
    the woken step, and close() sees it settle and drops the link."""
    engine = Engine(step_deadline_s=600.0, late_grace_s=600.0)
    release = threading.Event()
    try:
        assert engine.step()[0] is not None
        shim2, side2 = engine.shims[2], engine.servers[2].sidecar
        side2.step_holds[shim2._next_step] = release  # the answer comes only once the step has ended
        closer: list[threading.Thread] = []

        def close_soon(_step_id: int) -> None:
            t = threading.Thread(target=lambda: (time.sleep(0.1), shim2.close()), daemon=True)
            t.start()
            closer.append(t)

        shim2.fault_hook = close_soon
        outs: list = []
        stepper = threading.Thread(target=lambda: outs.append(engine.step()), daemon=True)
        stepper.start()
        stepper.join(30)  # a hang guard only
        assert outs, "the closed rank's step waited for its answer (held until the step ends)"
        assert outs[0][0] is None
        release.set()
        closer[0].join(30)  # close() lets the woken step settle: its answer comes first
        assert not closer[0].is_alive(), "close() did not return"
        # close() itself saw the step settle and dropped the link: not a later maybe_forward (_settle_off)
        assert shim2._unsettled is None and not shim2.connection.is_open, "close() did not wait for the step"
        calls = side2.remote_calls()
        for _ in range(3):
            assert engine.step()[0] is None
        got = reasons(engine)
        assert got[2] == {S.CLOSED: 4}, got[2]
        assert all(got[r].get(S.PEER_NOT_READY) == 3 for r in (0, 1, 3)), got
        assert side2.remote_calls() == calls and not shim2.connection.is_open
    finally:
        release.set()
        engine.close()


def test_a_rank_closed_during_the_preflight_still_embeds_its_step_as_its_peers_do():
    """The engine's embedding is a collective (vLLM's VocabParallelEmbedding all-reduces over the TP ranks), and
    the shim runs it once every rank is past the pre-flight. A rank closed from another thread while it waited
    in the pre-flight skipped it (phase 3 found the shim closed first) while its peers ran theirs: their
    all-reduce was then matched by the closed rank's next one (its stock layers' embedding, or a layer's), so
    the ranks' collectives fell out of step for the process's life. Every rank past the pre-flight embeds."""
    engine = Engine()
    try:
        calls = [0] * TP

        class Embedding:  # each rank's own count of the collective
            def __init__(self, rank: int) -> None:
                self.rank = rank

            def embed_input_ids(self, ids: torch.Tensor) -> torch.Tensor:
                calls[self.rank] += 1
                return engine.model.embed_input_ids(ids)

        for r, shim in enumerate(engine.shims):
            shim._model = Embedding(r)
        assert engine.step()[0] is not None and calls == [1] * TP
        shim2 = engine.shims[2]
        member = shim2._agree

        class CloseInPreflight:  # rank 2's shim closed by another thread while it waits for its peers
            world_size = member.world_size

            def all_min(self, values: torch.Tensor) -> torch.Tensor:
                if values.numel() == 5:
                    closer = threading.Thread(target=shim2.close)
                    closer.start()
                    closer.join(10)
                return member.all_min(values)

        shim2._agree = CloseInPreflight()
        assert engine.step()[0] is None
        assert reasons(engine)[2] == {S.CLOSED: 1}
        assert calls == [2] * TP, f"embedding collectives per rank: {calls}"
    finally:
        engine.close()


def test_one_rank_rejecting_an_answer_its_peers_got_makes_every_rank_fall_back(engine):
    """The post-flight agreement on its own. Every other test's lone failing rank kept its sidecar rank out of
    the fake sidecars' rendezvous, so the peers' sidecars aborted too and every rank already had None: the
    post-flight's verdict was never read (ignoring it passed them all). Here every sidecar rank runs the step
    and answers; only rank 2 rejects its answer (a compute dtype its status did not name), so its peers hold
    valid hidden states and must still return None."""
    assert engine.step()[0] is not None
    step_id = engine.shims[2]._next_step
    engine.shims[2].connection.status.model.compute_dtype = "bf16"  # the fake answers fp32: malformed to rank 2
    assert engine.step()[0] is None
    assert all(step_id in s.sidecar.answered for s in engine.servers)
    got = reasons(engine)
    assert got[2] == {S.BAD_ANSWER: 1}, got[2]
    assert all(got[r] == {S.PEER_FAILED: 1} for r in (0, 1, 3)), got
