"""The shim's EngineConfig: values the wire cannot carry are refused by name."""

from __future__ import annotations

import re
import time
from types import SimpleNamespace

import pytest
import torch

from dspark_sidecar.client import shim as S
from dspark_sidecar.client.binding import Binding
from dspark_sidecar.client.config import BreakerConfig, EngineConfig, EngineConfigError, config_refusal
from dspark_sidecar.client.forward_context import set_forward_context
from dspark_sidecar.client.shim import DrafterShim
from helpers.engine_fakes import FakeModel, FakeServer, FakeSidecar, shm_kv_cache, short_socket_dir, step_inputs


@pytest.mark.parametrize("deadline_s", [0.0005, 0.0009999])
def test_a_step_deadline_under_one_millisecond_is_refused(deadline_s):
    """DraftStepRequest.deadline_ms carries whole milliseconds and 0 there is the sidecar's "no deadline":
    a step deadline under 1 ms (DSPARK_STEP_DEADLINE_MS=0.5) was accepted and sent as 0, so the sidecar
    ran each step with no deadline at all while the shim gave up on it after half a millisecond."""
    with pytest.raises(EngineConfigError, match="step_deadline_s: must be at least 0.001 s"):
        EngineConfig(tp_size=4, step_deadline_s=deadline_s)


@pytest.mark.parametrize("deadline_s, sent_ms", [(0.001, 1), (0.5, 500), (2.0, 2000), (1.001, 1001), (0.0015, 1)])
def test_a_one_millisecond_step_deadline_is_sent_as_one(deadline_s, sent_ms):
    """Read off the request DrafterShim._request builds: the test recomputed the shim's conversion itself, so
    a shim sending whole seconds (0 for any deadline under 1 s: no deadline at all) passed it."""
    shim = SimpleNamespace(config=EngineConfig(tp_size=4, step_deadline_s=deadline_s),
                           binder=SimpleNamespace(current=Binding(1, 1, ())))
    _, pos, meta = step_inputs(1)
    req, _ = DrafterShim._request(shim, 1, 1, pos, torch.zeros(7, 8), meta, inline=False)
    assert req.deadline_ms == sent_ms


@pytest.mark.parametrize("make, field", [
    (lambda v: EngineConfig(tp_size=4, step_deadline_s=v), "step_deadline_s"),
    (lambda v: EngineConfig(tp_size=4, bind_deadline_s=v), "bind_deadline_s"),
    (lambda v: EngineConfig(tp_size=4, late_grace_s=v), "late_grace_s"),
    (lambda v: EngineConfig(tp_size=4, connect_deadline_s=v), "connect_deadline_s"),
    (lambda v: BreakerConfig(backoff_initial_s=v), "breaker.backoff_initial_s"),
    (lambda v: BreakerConfig(backoff_max_s=v), "breaker.backoff_max_s"),
    (lambda v: BreakerConfig(probe_deadline_s=v), "breaker.probe_deadline_s"),
])
@pytest.mark.parametrize("value", ["2", None, True, float("inf"), 3601.0, 0, 0.0, -0.5])
def test_a_wait_that_is_no_number_is_named(make, field, value):
    """The waits were only range-checked: a string or None raised TypeError from `0 < v` (a traceback naming
    no field, which the vLLM plug-in's EngineConfigError handler let through), and True passed as a 1 s wait.
    The int fields beside them already refused a bool. Every wait is bounded (at most 3600 s): an infinite one
    never ends, and gRPC fails a call with an infinite timeout at once. And above 0: a gRPC call with a timeout of
    0 fails at once (DEADLINE_EXCEEDED), and a backoff of 0 stays 0 as it doubles (an open breaker probed on
    every step)."""
    with pytest.raises(EngineConfigError, match=f"^{re.escape(field)}: must be above 0"):
        make(value)


@pytest.mark.parametrize("value", [0, -1])
@pytest.mark.parametrize("field", ["tp_size", "dp_size", "pp_size", "required_tp", "max_catchup_binds", "max_reqs"])
def test_a_count_below_one_is_refused(field, value):
    """Each count is at least 1: a TP size of 0 was a deployment of no ranks (review 391's mutation pass)."""
    with pytest.raises(EngineConfigError, match=f"^{field}: must be a positive integer, got {value}"):
        EngineConfig(**({"tp_size": 4} | {field: value}))


@pytest.mark.parametrize("field", ["tp_size", "dp_size", "pp_size", "required_tp", "max_catchup_binds", "max_reqs"])
def test_a_count_given_as_true_is_refused(field):
    """bool is an int to isinstance: True passed as a count of 1 (a TP size, a request limit)."""
    kw = {"tp_size": 4, field: True}
    with pytest.raises(EngineConfigError, match=f"^{field}: must be a positive integer, got True"):
        EngineConfig(**kw)


def test_the_agreement_outwaits_a_live_peer_probing_its_sidecar():
    """A rank whose breaker is open probes its sidecar before the pre-flight (a health Check, then a GetStatus
    when it answers NOT_SERVING, each bounded by probe_deadline_s), and again in a catch-up after it: its peers
    wait at the next agreement meanwhile. The wait counted the binds, registrations and the step but not the
    probes, so with a probe_deadline_s of 30 s (BreakerConfig takes up to 3600) it stayed 65 s while a live
    peer could take two probes (120 s) and a reconnect: its peers raised AgreementTimeout into the engine."""
    cfg = EngineConfig(tp_size=4, breaker=BreakerConfig(probe_deadline_s=30.0, backoff_max_s=30.0))
    probes = 2 * 2 * cfg.breaker.probe_deadline_s
    live = probes + cfg.connect_deadline_s + cfg.bind_deadline_s
    assert cfg.agreement_timeout_s > live
    # With the defaults 71 s (86 s with the doorbell), as README and FAILURE_MODES.md say.
    assert EngineConfig(tp_size=4).agreement_timeout_s == 71.0
    short = dict(step_deadline_s=0.1, late_grace_s=0.1, connect_deadline_s=0.1, bind_deadline_s=0.1)
    assert EngineConfig(tp_size=4, **short).agreement_timeout_s == 60.0  # 60 s at least, no more
    with pytest.raises(EngineConfigError, match="^breaker: must be a BreakerConfig"):
        EngineConfig(tp_size=4, breaker={"probe_deadline_s": 30.0})  # type: ignore[arg-type]


class _SlowSidecar(FakeSidecar):
    """Answers the calls of a script, in order, each after its delay (a live sidecar, slow but within deadlines)."""

    def __init__(self) -> None:
        super().__init__(max_reqs=4)
        self.instance = "one"  # the step stream's opening is waited for (its initial metadata)
        self.script: list[tuple[str, float, dict]] = []  # (method, delay, status fields set first)

    def _slow(self, method: str) -> None:
        if self.script and self.script[0][0] == method:
            _, delay, status = self.script.pop(0)
            for k, v in status.items():
                setattr(self, k, v)
            time.sleep(delay)

    def GetStatus(self, request, context):
        self._slow("GetStatus")
        return super().GetStatus(request, context)

    def BindKV(self, request, context):
        self._slow("BindKV")
        return super().BindKV(request, context)

    def DraftSteps(self, request_iterator, context):
        self._slow("DraftSteps")
        yield from super().DraftSteps(request_iterator, context)


class _TimedPeer:
    """A peer rank's stand-in: agrees on this rank's values, once naming a higher binding generation (a catch-up),
    and notes when each agreement was reached."""

    world_size = 2

    def __init__(self) -> None:
        self.at: list[float] = []
        self.peer_generation = 0

    def all_min(self, values: torch.Tensor) -> torch.Tensor:
        self.at.append(time.monotonic())
        out = values.clone()
        if self.peer_generation and values.numel() == 5:
            out[3], self.peer_generation = -self.peer_generation, 0
        return out


def test_the_agreement_outwaits_a_live_peer_s_catch_up_and_readiness_check():
    """Measured on the shim against a live sidecar that answers each call just inside its deadline: a catch-up
    bind that times out (the link dropped), then the next readiness check's reconnect, a strict refusal judged on
    another engine's binding (bind ours, read the status again) and the step stream's opening. The formula
    counted one reconnect, the binds and two registrations at the larger of the bind and connect deadlines,
    not the status re-read, the readiness check's own bind or the stream's opening: every deadline of the path
    scaled by 1000 (connect and bind 400 s, which EngineConfig allows), the interval took 1860 s and the peers
    waited 1670 s, then gave the healthy rank up for dead (AgreementTimeout). Every wait of the path is one of
    the config's deadlines, so the interval scales with them and the scaled config must outwait it."""
    c = b = 0.4
    small = dict(connect_deadline_s=c, bind_deadline_s=b, step_deadline_s=0.01, late_grace_s=0.01,
                 max_catchup_binds=1)
    sidecar = _SlowSidecar()
    server = FakeServer(sidecar, short_socket_dir() / "rank0.sock").start()
    kv = shm_kv_cache()
    peer = _TimedPeer()
    shim = DrafterShim(EngineConfig(tp_size=4, endpoint=server.endpoint, **small,
                                    breaker=BreakerConfig(probe_deadline_s=0.01)),
                       FakeModel(), lambda: [s.tensor for s in kv], peer)
    ids, pos, meta = step_inputs(2)
    try:
        with set_forward_context(meta):
            assert shim.maybe_forward(ids, pos) is not None
            refused, serving = dict(serving=False, state="REFUSED"), dict(serving=True, state="SERVING")
            sidecar.script = [("BindKV", b * 1.3, {}),  # the catch-up's bind: past its deadline, the link dropped
                              ("GetStatus", c * 0.9, refused), ("BindKV", b * 0.9, {}), ("GetStatus", c * 0.9, serving),
                              ("DraftSteps", c * 0.9, {})]
            peer.peer_generation = shim.binder.generation + 1
            assert shim.maybe_forward(ids, pos) is None  # the catch-up
            assert shim.maybe_forward(ids, pos) is not None  # healthy: the next step forwards
        assert not sidecar.script and shim.stats.fallbacks == {S.GENERATIONS: 1}
    finally:
        shim.close()
        server.stop()
    longest = max(later - earlier for earlier, later in zip(peer.at, peer.at[1:]))
    assert longest > 4 * 0.9 * c  # the path ran: four calls just inside their deadlines
    k = 1000
    scaled = EngineConfig(tp_size=4, **{f: v * k if f != "max_catchup_binds" else v for f, v in small.items()},
                          breaker=BreakerConfig(probe_deadline_s=0.01 * k, backoff_max_s=10.0))
    assert scaled.agreement_timeout_s > k * longest, (scaled.agreement_timeout_s, k * longest)


@pytest.mark.parametrize("c, b, s", [(3600, 0.001, 0.001), (400, 400, 0.001), (0.001, 3600, 0.001), (1, 5, 2),
                                     (2, 5, 0.001), (3600, 3600, 3600)])
@pytest.mark.parametrize("transport", ["grpc", "doorbell"])
def test_the_agreement_outwaits_every_bounded_wait_between_two_agreements(c, b, s, transport):
    """The longest a live rank can take between two agreements, each wait at its bound, at the extremes the
    validation allows. A catch-up then a readiness check: two probes (Check and GetStatus each), the catch-up's
    binds and the readiness check's bind, and connect_deadline_s for each of UnregisterBuffers (the catch-up's
    drop), GetStatus, the status re-read, AttachDoorbell, RegisterBuffers, its release, the step stream's
    opening and a close()'s UnbindKV. A step: its deadline, the late grace (twice with a close() from another
    thread) and the broken link's UnregisterBuffers. With the doorbell, three page closes waiting for the engine's
    stream (the data plane's CLOSE_WAIT_S)."""
    from dspark_sidecar.client.dataplane import CLOSE_WAIT_S

    cfg = EngineConfig(tp_size=4, connect_deadline_s=c, bind_deadline_s=b, step_deadline_s=s, late_grace_s=s,
                       transport=transport, breaker=BreakerConfig(probe_deadline_s=c, backoff_initial_s=c, backoff_max_s=c))
    p, n, g = cfg.breaker.probe_deadline_s, cfg.max_catchup_binds, cfg.late_grace_s
    readiness = 2 * 2 * p + (n + 1) * b + 8 * c
    step = s + 2 * g + c
    closes = 3 * CLOSE_WAIT_S if transport == "doorbell" else 0.0
    assert cfg.agreement_timeout_s >= readiness + step + closes + 10.0  # and the slack for a loaded host


@pytest.mark.parametrize("transport", ["", "GRPC", "shm", None])
def test_a_transport_the_shim_has_not_is_named(transport):
    with pytest.raises(EngineConfigError, match="^transport: one of"):
        EngineConfig(tp_size=4, transport=transport)


@pytest.mark.parametrize("endpoint, why", [
    ("unix:/" + "d" * 120 + "/rank0.sock", "a unix socket path holds at most"),
    ("unix:/run/a,b/rank0.sock", "URI syntax"),
    ("unix://host/rank0.sock", "starts with '//'"),
])
def test_an_endpoint_no_grpc_client_can_reach_is_refused_saying_why(endpoint, why):
    """A unix: target past sun_path (or one gRPC reads as URI syntax) connected "UNKNOWN" at every step: the shim
    fell back for good with nothing naming the path. `serve` refuses such a folder; the engine's config now too."""
    with pytest.raises(EngineConfigError, match=re.escape(why)):
        EngineConfig(tp_size=4, endpoint=endpoint)


@pytest.mark.parametrize("endpoint", ["", "unix:/run/dspark-sidecar/rank0.sock", "unix:///run/x/rank1.sock",
                                      "unix:rank0.sock", "localhost:50051"])
def test_endpoints_grpc_reaches_are_kept(endpoint):
    assert EngineConfig(tp_size=4, endpoint=endpoint).endpoint == endpoint


@pytest.mark.parametrize("threshold", [0, -1, True, 2.0, float("nan"), float("inf"), "3", None])
def test_a_breaker_threshold_that_is_no_count_of_failures_is_named(threshold):
    """A whole number of failures, at least 1: 0 or -1 (meant as "never", say) opened the breaker at the first failure
    as 1 does, nan or inf never opened it (`failures >= nan` is never true), and True passed as one failure."""
    with pytest.raises(EngineConfigError, match=r"^breaker\.failure_threshold: must be >= 1"):
        BreakerConfig(failure_threshold=threshold)
    assert BreakerConfig(failure_threshold=1).failure_threshold == 1


def test_a_breaker_whose_longest_backoff_is_below_its_first_is_refused():
    with pytest.raises(EngineConfigError, match=r"^breaker\.backoff_max_s: must be >= backoff_initial_s"):
        BreakerConfig(backoff_initial_s=1.0, backoff_max_s=0.5)
    assert BreakerConfig(backoff_initial_s=0.5, backoff_max_s=0.5).backoff_max_s == 0.5


@pytest.mark.parametrize("max_reqs, ok", [(256, True), (257, False)])
def test_max_reqs_above_what_any_sidecar_serves_is_refused(max_reqs, ok):
    """Above layout.MAX_REQS_LIMIT (serve's --max-reqs range): only the positivity check was ever exercised."""
    if ok:
        assert EngineConfig(tp_size=4, max_reqs=max_reqs).max_reqs == max_reqs
    else:
        with pytest.raises(EngineConfigError, match=r"^max_reqs: must be 1\.\.256, got 257"):
            EngineConfig(tp_size=4, max_reqs=max_reqs)


@pytest.mark.parametrize("field, value, why", [
    ("tp_size", 2, "TP 2 != 4"), ("dp_size", 2, "DP > 1"), ("pp_size", 2, "PP > 1"),
    ("speculative_method", "eagle", "no DSpark draft"), ("num_speculative_tokens", 5, "7 speculative tokens required"),
    ("endpoint", "", "no sidecar endpoint configured"),
])
def test_each_deployment_refusal_alone_and_none_for_a_deployment_that_can_forward(field, value, why):
    """config_refusal: each engine-side check on its own (the others passing), and None where all pass."""
    good = dict(tp_size=4, endpoint="unix:/run/dspark-sidecar/rank0.sock")
    assert config_refusal(EngineConfig(**good)) is None
    assert config_refusal(EngineConfig(**(good | {field: value}))) == why
