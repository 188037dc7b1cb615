"""A sidecar rank's grpc.health.v1 status and GetStatus state, and the beat's watches of its peers and steps."""

from __future__ import annotations

import logging
import threading
from typing import Callable

from grpc_health.v1 import health_pb2

from dspark_sidecar.proto import SERVICE_NAME
from dspark_sidecar.server.metrics import Metrics
from dspark_sidecar.server.rank import RankLoop
from dspark_sidecar.server.refusal import AWAITING_BIND
from dspark_sidecar.server.rendezvous import Board, PeerProcesses
from dspark_sidecar.server.servicer import Lifecycle

log = logging.getLogger("dspark_sidecar.server")
# A peer silent this long is stopped or wedged (a beat is due every app.BEAT_S): the rank reports
# PEER_SILENT. Long enough that a loaded host's scheduling gaps do not flap health. A peer whose
# process has exited is reported at the next beat instead (watch_peers).
PEER_SILENT_S = 3.0
# A draft step running this long is stuck (on the device, or in a collective with a wedged peer): the rank
# reports STEP_STUCK, NOT_SERVING, until it ends. Steps take milliseconds, their waits on peers are bounded
# by the rendezvous deadline (added to this bound: watch_steps), and warm-up compiles every launch shape before
# SERVING; the bound leaves room for a first launch's compile under --no-warmup. Read at each call, as PEER_SILENT_S.
STEP_STUCK_S = 15.0


class HealthPublisher:
    """Health follows the lifecycle; with --strict-refusal a refused fast path is NOT_SERVING, and a
    silent peer rank makes it NOT_SERVING until the peer is back.

    Called from the main thread (start, drain, the peers' watch) and from gRPC handler threads (a
    binding that changes the fast path): one call at a time, with a state change made under the same
    lock. Otherwise a BindKV's call that had read SERVING could set health SERVING after the drain's
    NOT_SERVING, and nothing would publish again: SERVING for the whole drain and teardown.

    Health is set only when its status changes: grpc.health.v1's servicer sends every set to every
    Watch stream, so the beat-by-beat publish of a silent peer (its reason's seconds) sent each
    subscriber a duplicate NOT_SERVING twice a second."""

    def __init__(self, life: Lifecycle, servicer, ctx, health_servicer, metrics: Metrics) -> None:
        self.life, self.servicer, self.ctx, self.health, self.metrics = life, servicer, ctx, health_servicer, metrics
        self._lock = threading.Lock()
        self._published = None  # the health status last set (None: not set by this publisher yet)

    def __call__(self, state: str | None = None) -> None:
        life = self.life
        with self._lock:
            # Worked out here and set once: set first, `state` ("SERVING" at the start) was what a
            # GetStatus on another thread read while the refusal was still being asked, on a rank
            # that then went REFUSED.
            state = life.state if state is None else state
            refused = self.servicer.refusal() if life.strict else ""
            if refused == AWAITING_BIND:
                # Every host check passed; the engine's checks wait for its BindKV: nothing is refused yet.
                # Taken for a refusal, a strict rank on the very host the fast path is for came up
                # REFUSED (NOT_SERVING), which the engine reads as refused for good before it ever binds,
                # and which keeps a native sidecar's startup probe, and so the engine, from starting.
                refused = ""
            # Read once: the beat (watch_steps, on the main thread, not under this lock) clears it when the step
            # ends, and read again below, a publish from a gRPC thread failed on the None (TypeError in BindKV).
            stuck = life.stuck_step
            if state in ("SERVING", "REFUSED", "PEER_SILENT", "STEP_STUCK"):
                # A peer out first: a step stuck in a collective is most often stuck on that peer.
                peer_out = life.silent_peers or life.exited_peers
                state = ("PEER_SILENT" if peer_out else "STEP_STUCK" if stuck else "REFUSED" if refused
                         else "SERVING")
            with life.lock:  # one change for GetStatus (Lifecycle.snapshot)
                life.reason = (peers_reason(life.exited_peers, life.silent_peers) if state == "PEER_SILENT"
                               else stuck_reason(*stuck) if state == "STEP_STUCK" else "")
                life.state = state
            self.ctx.refusal = refused or None
            serving = health_pb2.HealthCheckResponse.SERVING
            status = serving if life.serving else health_pb2.HealthCheckResponse.NOT_SERVING
            self._set(status)
            self.metrics.set_serving(life.serving)

    def draining_anyway(self) -> None:
        """DRAINING and NOT_SERVING set as they are, for a drain whose publish failed (its refusal, a peer's
        reason): health must still leave SERVING before the drain. Under the lock, as every publish."""
        with self._lock:
            with self.life.lock:
                self.life.state, self.life.reason = "DRAINING", ""
            self._set(health_pb2.HealthCheckResponse.NOT_SERVING)
            self.metrics.set_serving(False)  # dspark_serving stayed 1 for the whole drain and teardown

    def _set(self, status) -> None:
        if status != self._published:
            for name in ("", SERVICE_NAME):
                self.health.set(name, status)
            self._published = status


def watch_peers(board: Board, rank: int, life: Lifecycle, publish: Callable[[], None], peers: PeerProcesses) -> None:
    """Beat, then look at the peers: health leaves SERVING while a peer is silent (each step would
    wait out the rendezvous deadline and abort) and comes back with the peer. A peer whose process
    has exited is reported at once, not after PEER_SILENT_S, and for good (the group cannot run steps
    again; its launcher or torchrun's agent takes it down). PEER_SILENT_S is read at each call
    (tests/server/test_peer_exit.py sets it to an hour in the rank processes)."""
    board.beat(rank)
    exited = peers.exited()
    silent = {r: s for r, s in board.silent(rank, PEER_SILENT_S).items() if r not in exited}
    if exited.keys() != life.exited_peers.keys():
        log.error("rank %d: %s", rank, peers_reason(exited, {}))
    if silent.keys() != life.silent_peers.keys():
        if silent:
            log.warning("rank %d: %s", rank, peers_reason({}, silent))
        elif life.silent_peers.keys() - exited.keys():  # not when the silent peer(s) have exited instead
            log.info("rank %d: every peer rank signals again", rank)
    changed = silent.keys() != life.silent_peers.keys() or exited.keys() != life.exited_peers.keys()
    # The exited ones first: a publish on another thread (BindKV, a lease's end, a compile) may read them between the
    # two stores, and a silent peer that has exited leaves `silent` as it joins `exited`. Recorded the other way round,
    # that publish found no peer out and set SERVING. (Exits are for good: `exited` only grows.)
    life.exited_peers, life.silent_peers = exited, silent
    if changed or silent:  # while silent, publish again: the reason's seconds grow
        publish()


def watch_steps(loop: RankLoop, rank: int, life: Lifecycle, publish: Callable[[], None]) -> None:
    """From the beat: health leaves SERVING while a draft step has run past STEP_STUCK_S (engines stop
    sending steps that would queue behind it; a probe, or Kubernetes' liveness, sees why) and comes back
    when it ends. The rank beats on meanwhile: its peers' health says nothing of a step stuck here.

    A step may wait out the rendezvous deadline for a peer's copy (--rendezvous-ms, up to 60 s) and then be
    answered ABORTED: that wait is bounded, not stuck, so the bound is STEP_STUCK_S past it. Counted from the
    step's start alone, a rank waiting out a --rendezvous-ms above 15 s went STEP_STUCK ("stuck on the device
    or in a collective") for a peer's missing copy."""
    stuck, was = loop.stuck_step(STEP_STUCK_S + loop.rendezvous.deadline_ms / 1e3), life.stuck_step
    life.stuck_step = stuck
    if stuck is not None and was is None:
        log.error("rank %d: %s", rank, stuck_reason(*stuck))
    elif stuck is None and was is not None:
        log.info("rank %d: the stuck draft step %d has ended", rank, was[0])
    if stuck is not None or was is not None:  # while stuck, publish again: the reason's seconds grow
        publish()


def stuck_reason(step_id: int, secs: float) -> str:
    """GetStatus.state_reason for STEP_STUCK."""
    return (f"draft step {step_id} has run for {secs:.1f} s (steps take milliseconds): stuck on the device or in "
            "a collective; steps wait behind it until it ends")


def peers_reason(exited: dict[int, int], silent: dict[int, float]) -> str:
    """GetStatus.state_reason for PEER_SILENT: the peers whose process exited ({rank: pid}), then the
    ones alive but silent ({rank: seconds})."""
    parts = []
    if exited:
        ranks = ", ".join(str(r) for r in sorted(exited))
        pids = ", ".join(str(exited[r]) for r in sorted(exited))
        parts.append(f"peer rank(s) {ranks} exited (pid {pids}): steps abort until the sidecar group is restarted")
    if silent:
        ranks = ", ".join(str(r) for r in sorted(silent))
        parts.append(f"peer rank(s) {ranks} silent for {max(silent.values()):.1f} s: stopped or hung; "
                     "steps would abort")
    return "; ".join(parts)
