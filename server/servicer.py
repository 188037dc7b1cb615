"""The DrafterSidecar gRPC servicer of one rank: thin methods on the happy path, errors via the interceptor."""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import ipaddress
import logging
import os
import platform
import secrets
import threading
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch

from dspark_sidecar import __version__, layout
from dspark_sidecar.drafter.config import ARCHITECTURE
from dspark_sidecar.proto import INSTANCE_METADATA, codec
from dspark_sidecar.proto import doorbell as page_words
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.proto import sidecar_pb2_grpc as pb_grpc
from dspark_sidecar.proto.gpu_word import GpuWordOps
from dspark_sidecar.proto.memory import MappedMemory, discard_handle
from dspark_sidecar.server.doorbell import Doorbell
from dspark_sidecar.server.errors import SidecarError, clip_message, invalid, precondition
from dspark_sidecar.server.healthcheck import one_line
from dspark_sidecar.server.kv_binding import unknown_binding
from dspark_sidecar.server.lease import LeaseKeeper
from dspark_sidecar.server.prelaunch import BEHIND_S
from dspark_sidecar.server.rank import RankContext, RankLoop, held
from dspark_sidecar.server.refusal import AWAITING_BIND, HostFacts, fast_path_refusal

log = logging.getLogger("dspark_sidecar.server")
# DraftSteps streams one rank serves at once. Each holds a gRPC handler thread while it is open; the
# rest of the pool (server/app.py) is kept for the unary calls and the health check, which would
# otherwise wait for a thread for ever. An engine rank holds one stream (two across a reconnect).
MAX_STREAMS = 8
# Unary DraftStep calls a rank holds at once, each on a handler thread until its step has run or its client left.
# A client without a deadline waits as long as a stuck step does: uncapped, such calls took every thread the
# health check, GetStatus and BindKV have (app.GRPC_THREADS = MAX_STREAMS + 8), and the rank could no longer
# say it was stuck. Past the cap a call is refused at once (RESOURCE_EXHAUSTED, TOO_MANY_STEPS).
MAX_UNARY_STEPS = 4
# How long the device may take to get past a gone engine's doorbell steps (_past_gone_engine) before the rank gives
# up on it. Steps take milliseconds; at TP > 1 a released queued copy finishes with its peers', which their engines'
# own ends release (each a lease's end on its rank).
GONE_ENGINE_DEVICE_S = 30.0
# How often a handler waiting for its step's turn, or for the rank's lock, looks whether its client is still there
# (_awaited, _until_gone): a step may wait behind one that waits out the rendezvous deadline, or is stuck for good
# (STEP_STUCK).
CLIENT_CHECK_S = 0.2


@dataclass
class Lifecycle:
    """What health and GetStatus say about this rank; changed only by server/app.py, server/health.py and BindKV."""

    state: str = "LOADING"  # LOADING -> SERVING -> DRAINING (or REFUSED with --strict-refusal, PEER_SILENT, STEP_STUCK)
    reason: str = ""  # why not SERVING, where the state alone does not say (StatusReport.state_reason)
    silent_peers: dict = field(default_factory=dict)  # {peer rank: seconds silent} (server/health.py watch_peers)
    exited_peers: dict = field(default_factory=dict)  # {peer rank: pid} whose process exited (watch_peers)
    stuck_step: tuple | None = None  # (step id, seconds) of a step running past STEP_STUCK_S (health.watch_steps)
    backend: str = "reference"
    fallback: str | None = None  # under "flydsl": the portable backend of the steps it refuses (BackendChoice.fallback)
    host: HostFacts | None = None
    flydsl_off: str | None = None  # why no FlyDSL fast path was built (BackendChoice.flydsl_refusal)
    strict: bool = False
    dist_backend: str = "gloo"
    on_change: list = field(default_factory=list)
    # Held by a publish while it sets state and reason (health.HealthPublisher), and by GetStatus while it reads
    # them: read apart, a publish in between answered serving false with state SERVING, which the shim takes
    # for a refusal for good wherever fast_path_refusal is set (any Triton host's "not gfx950").
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def serving(self) -> bool:
        return self.state == "SERVING"

    def snapshot(self) -> tuple[str, str]:
        """(state, reason) as one publish left them."""
        with self.lock:
            return self.state, self.reason


def _same_node(peer: str) -> bool:
    """Unix-socket and loopback peers only: an IPC/shm handle is only meaningful on this node."""
    if peer.startswith("unix:"):
        return True
    # gRPC percent-encodes the brackets of an IPv6 peer ("ipv6:%5B::1%5D:port"): read as is, ::1 was
    # no address and a sidecar on --tcp-host ::1 refused its own engine (PERMISSION_DENIED).
    peer = urllib.parse.unquote(peer)
    host = peer.split(":", 1)[1].rsplit(":", 1)[0].strip("[]") if ":" in peer else peer
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def give_back_unopened(peer: str, handles) -> None:
    """A request refused before any of its memory handles was opened: give back the engine's producer
    reference of each CUDA IPC handle (memory.discard_handle; else the engine's block stays allocated
    until it exits). Same-node peers only: a remote peer's reference counter names would name files
    of this node, another engine's counters among them."""
    if _same_node(peer):
        for h in handles:
            discard_handle(h)


class DrafterServicer(pb_grpc.DrafterSidecarServicer):
    def __init__(self, ctx: RankContext, loop: RankLoop, life: Lifecycle, limits: pb.Limits,
                 parallel: pb.Parallel, weight_format: str, run_dir: Path | None = None,
                 prelaunch: bool = False, prelaunch_behind_s: float = BEHIND_S) -> None:
        """run_dir: the rank's socket folder, where its doorbell wake FIFOs and its lease socket go (None: neither;
        steps are polled for, and bindings last until UnbindKV, a re-bind or the exit)."""
        self.ctx, self.loop, self.life = ctx, loop, life
        # Pre-launched doorbell steps (server/prelaunch.py): on a GPU with graphs; at TP > 1 the ranks
        # agree on queueing and on answering from the queue at each step (server/rendezvous.py).
        self.prelaunch = prelaunch and loop.graphs is not None
        self.prelaunch_behind_s = prelaunch_behind_s
        self.limits, self.parallel, self.weight_format = limits, parallel, weight_format
        self.run_dir = run_dir  # where doorbell wake FIFOs go (the socket folder); None: polling only
        self.doorbell: Doorbell | None = None
        self._attached = 0
        self._attach_lock = threading.Lock()
        self._retiring: list[Doorbell] = []  # replaced doorbells still inside a step (longer than STOP_S)
        self._doorbells_closed = False  # shutdown (close_doorbell): no doorbell attaches any more
        self._streams = threading.BoundedSemaphore(MAX_STREAMS)  # open DraftSteps streams
        self._unary_steps = threading.BoundedSemaphore(MAX_UNARY_STEPS)  # unary DraftStep calls in a handler
        self.instance = secrets.token_hex(8)  # StatusReport.instance: this start of the rank's server, no other
        self.leases = (LeaseKeeper(layout.rank_lease_socket(run_dir, ctx.rank), self.lease_lost)
                       if run_dir is not None else None)
        listeners = getattr(ctx.fast, "listeners", None)
        if listeners is not None:  # the fast path's verdict on a binding changes what health says
            listeners.append(self._publish_health)

    def refusal(self) -> str:
        """Why the FlyDSL path does not serve the current binding: the seed's checks first, then the fast path's."""
        return self._current(self._refusal_of)[1]

    def _current(self, judge):
        """(kv, judge(kv)) for a binding `kv` (or None) that was still the rank's once judged."""
        while True:
            kv = self.ctx.memory.kv
            seen = judge(kv)
            # A BindKV or UnbindKV on another thread may have replaced and closed `kv` (layers = []) while it
            # was judged: its verdict ("0 KV layers bound") is no binding's. Judged again, the current one's.
            if self.ctx.memory.kv is kv:
                return kv, seen

    def _refusal_of(self, kv) -> str:
        why = fast_path_refusal(self.life.host, kv.engine if kv else None) if self.life.host else "host not probed"
        # Unbound, the seed's checks end on AWAITING_BIND where the host passes them; a reason of this
        # host's own (no path built, or one that failed at start-up) still stands: taken for "waiting", a
        # strict rank that refuses every binding came up SERVING and its startup probe passed.
        if why is None or why == AWAITING_BIND:
            fast = self.ctx.fast
            if fast is None:
                why = self.life.flydsl_off or "FlyDSL fast path not built"
            else:
                why = fast.refusal(kv) or why
        # Clipped as an error's message is (errors.clip_message): a reason quotes its error (a compiler's
        # dump of hundreds of KB, a path's undecodable byte, which made protobuf raise in every
        # GetStatus and in BindKV's answer) and goes out in GetStatus, BindKV and strict refusals.
        # On one line, as the probe prints it (healthcheck.one_line).
        return clip_message(one_line(why or ""))

    def _status_refusal_of(self, kv) -> str:
        """GetStatus.fast_path_refusal for `kv`: _refusal_of(kv), or, where that is empty, why the fast path does not
        serve the binding's steps yet (its kernels compile in the background: FlyDSLFastPath.pending). Health,
        --strict-refusal and BindKV read refusal() alone: a compile is no refusal, and a strict rank would
        otherwise leave SERVING for every compile and the shim read it as a refused deployment."""
        # refusal() is empty only where a fast path is built (without one it says so): ctx.fast is set here.
        return self._refusal_of(kv) or self.ctx.fast.pending(kv) or ""

    def _publish_health(self) -> None:
        """Health judged again (health.HealthPublisher): after a binding changes, or the fast path's verdict on it."""
        for cb in self.life.on_change:
            cb()

    def GetStatus(self, request, context):
        c = self.ctx.cfg
        # One binding for the whole report, its layers read once and judged while it was still the rank's: a
        # BindKV or UnbindKV on another thread replaces it, then closes it (layers = []). Read apart, a report
        # gave binding A's fields with "no engine bound yet", or no binding with the next one's verdict.
        kv, (layers, why) = self._current(lambda kv: (kv.layers if kv else [], self._status_refusal_of(kv)))
        state, reason = self.life.snapshot()
        return pb.StatusReport(
            model=pb.ModelSummary(
                architecture=ARCHITECTURE, preset=c.name, num_layers=c.num_hidden_layers, hidden_size=c.hidden_size,
                num_attention_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                ffn_hidden_size=c.ffn_hidden_size, vocab_size=c.vocab_size, sliding_window=c.sliding_window,
                block_size=c.block_size, weight_format=self.weight_format,
                compute_dtype=str(self.ctx.model.dtype).replace("torch.", "")),
            limits=self.limits, parallel=self.parallel, backend=self.life.backend,
            fast_path_refusal=why, serving=state == "SERVING", state=state,
            server_version=__version__, state_reason=reason, instance=self.instance,
            lease_socket=self.leases.path if self.leases is not None else "",
            kv=pb.KVBindingState(
                bound=kv is not None, binding_id=kv.binding_id if kv else 0, generation=kv.generation if kv else 0,
                num_layers=len(layers), num_pages=kv.num_pages if kv else 0,
                page_size=kv.page_size if kv else 0,
                kv_dtype=codec.dtype_to_proto(layers[0].dtype) if layers else pb.DTYPE_UNSPECIFIED),
            counters=self.ctx.metrics.counters_pb(), latencies=self.ctx.metrics.latencies_pb())

    def BindKV(self, request, context):
        self._require_same_node(context)
        if request.lease and not self._lease_live(request.lease):
            give_back_unopened(context.peer(), [lb.memory for lb in request.layers])
            raise self._lease_lost_error(request.lease)
        # No host wait for a queued copy (wait=False; at TP > 1 it finishes only with its peers'): the old
        # cache is unmapped once the device no longer reads it, and a step graph bound to it is dropped
        # at the next step (CUDA defers destroying a graph still running). Its client gone while it waits for the
        # rank (behind a stuck step), it gives up with nothing opened: each handle goes back to the engine.
        gone = self._until_gone(context, "BindKV", "nothing was bound, the binding in place stands",
                                lambda: give_back_unopened(context.peer(), [lb.memory for lb in request.layers]))
        with self.loop.exclusive(wait=False, give_up=gone):
            kv = self.ctx.memory.bind(request, self.loop.after_device)
            # As UnbindKV: the runner holds views of the cache just replaced, and so keeps the engine's old
            # allocation alive. Left to the next step's ready(), it stayed until a step came, and the close
            # (with the IPC release's stream sync) ran on that step's path.
            if self.ctx.fast is not None:
                self.ctx.fast.unbound(self.loop.after_device)
            # The lease ended while this call mapped the cache: its loss found no binding under it to release
            # (lease_lost waits for this section, and the keeper marks a lease gone before calling it), so
            # the binding goes here, or the gone engine's cache would stay mapped.
            lost = bool(request.lease) and not self._lease_live(request.lease)
            if lost:
                self._release_binding(kv.binding_id)
            # Judged inside the section, where this call's binding is the rank's (every BindKV, UnbindKV and lease
            # release changes it in one): judged after it, the answer could carry the verdict on the binding of a
            # BindKV or release that came next ("DP > 1", "no engine bound yet") and its fallback backend.
            why = "" if lost else self.refusal()
        if lost:
            self._publish_health()  # the binding it replaced is gone too: no binding's verdict stands
            raise self._lease_lost_error(request.lease)
        self.ctx.metrics.bound()
        log.info("rank %d: KV bound (binding %d, generation %d, %d pages x %d); fast path: %s", self.ctx.rank,
                 kv.binding_id, kv.generation, kv.num_pages, kv.page_size, why or "on")
        self._publish_health()
        # The backend that serves this binding's steps (proto): a binding the FlyDSL path refuses runs on its fallback.
        backend = self.life.fallback if why and self.life.fallback else self.life.backend
        return pb.BindKVResponse(binding_id=kv.binding_id, generation=kv.generation, fast_path_refusal=why,
                                 backend=backend)

    def UnbindKV(self, request, context):
        self._require_same_node(context)
        kv = self.ctx.memory.kv
        if kv is None or kv.binding_id != request.binding_id:
            # Nothing of it to release (a second UnbindKV, an engine's late release of a binding a re-bind replaced):
            # refused before any section, whose quiesce would release the live engine's pre-launched step, at TP > 1
            # on this rank alone (a SOME_COPIES abort), as lease_lost. Still current here, unbind checks it again.
            raise unknown_binding(request.binding_id)
        gone = self._until_gone(context, "UnbindKV", f"nothing was released, binding {request.binding_id} stays "
                                "bound (until UnbindKV again, a re-bind, or its lease's end)")
        with self.loop.exclusive(wait=False, give_up=gone):  # as BindKV
            self._release_binding(request.binding_id)
        # As BindKV: health's verdict was the released binding's. Not published again, a strict rank refused
        # for that binding (an engine's DP > 1, a cache layout) stayed REFUSED with nothing bound: an engine
        # connecting later, rightly configured, read it as refused for good and never bound.
        self._publish_health()
        return pb.UnbindKVResponse()

    def _until_gone(self, context, call: str, unchanged: str, undo=lambda: None):
        """rank.held's give_up for `call` while its client waits for the rank's lock: CLIENT_CHECK_S turns (fewer
        near its deadline); once the deadline has passed DEADLINE_EXCEEDED, once the client is gone otherwise
        (a cancel, the transport) CANCELLED, after undo(). `unchanged` says what stands, for the person reading."""
        def turn() -> float:
            left = context.time_remaining()
            if left is not None and left <= 0:
                code, why = grpc.StatusCode.DEADLINE_EXCEEDED, "its deadline passed"
            elif not context.is_active():
                code, why = grpc.StatusCode.CANCELLED, "it was cancelled (its client gone, or the server stopping)"
            else:
                return CLIENT_CHECK_S if left is None else min(CLIENT_CHECK_S, left)
            undo()
            running = self.loop.stuck_step(0.0)
            holder = (f"draft step {running[0]}, running for {running[1]:.1f} s" if running is not None
                      else "another binding, buffer or doorbell change (itself waiting on the device or a step)")
            raise SidecarError(code, f"{call}: {why} while it waited for this rank, held by {holder}; {unchanged}. "
                               "A step that stays stuck (a peer rank hung in a collective, or the device stalled) "
                               "shows as STEP_STUCK in GetStatus: call again once GetStatus says SERVING, or "
                               "restart the sidecar if it does not", "", code.name)
        return turn

    def _release_binding(self, binding_id: int) -> None:
        """Unbind `binding_id` (UNKNOWN_BINDING if it is not the current one); inside loop.exclusive."""
        self.ctx.memory.unbind(binding_id, self.loop.after_device)
        if self.ctx.fast is not None:  # its runner holds views of the cache just released
            self.ctx.fast.unbound(self.loop.after_device)

    # Leases (server/lease.py) ------------------------------------------------------------------
    def _lease_live(self, token: int) -> bool:
        return self.leases is not None and self.leases.live(token)

    def _lease_lost_error(self, token: int, again: str = "bind again") -> SidecarError:
        """LEASE_LOST for `token`; `again`: the refused call, sent again (told to "bind again", an engine whose
        registration or doorbell was refused re-bound its cache and still had neither)."""
        where = (f"{self.leases.path} has" if self.leases is not None
                 else "this rank serves no lease socket (no socket folder), so it has")
        return precondition(f"lease: {token} names no open lease ({where} none by that token: its connection "
                            "closed, or it came from another sidecar start); connect to StatusReport.lease_socket "
                            f"for a new lease and {again}", "LEASE_LOST", "lease")

    def lease_lost(self, token: int) -> None:
        """A lease's connection ended (the keeper's thread): the engine that held it closed it or is gone, so
        the doorbell attached under it is stopped, as a replacing AttachDoorbell would stop it, and the binding
        and the buffer regions made under it are released, as UnbindKV and UnregisterBuffers would, and unmapped
        once the device is done with them. What was made since under another lease, or none, is left as it is."""
        # The doorbell first: it reads no more of the gone engine's steps while what they name is released.
        bell = self._stop_doorbell_of(token)
        if bell is not None:
            log.warning("rank %d: the engine that attached the doorbell closed its lease (it exited?): the doorbell "
                        "is stopped", self.ctx.rank)
        self._past_gone_engine(bell)
        kv, regions = self.ctx.memory.kv, self.ctx.memory.leases_regions(token)
        if (kv is None or kv.lease != token) and not regions:
            # Nothing under it (released first by its engine, or never bound): no section, whose quiesce would
            # release the live engine's pre-launched step, at TP > 1 on this rank alone (a SOME_COPIES abort).
            # A BindKV or RegisterBuffers still mapping under it sees the loss itself: the keeper ended the
            # lease before this call, and both look after they have recorded what they mapped.
            return
        if regions:  # else no section for them: its quiesce would run twice for one lease's end
            self._release_regions([], lease=token)
        with self.loop.exclusive(wait=False):
            kv = self.ctx.memory.kv
            if kv is None or kv.lease != token:
                return
            self._release_binding(kv.binding_id)
        log.warning("rank %d: the engine that bound KV binding %d (generation %d) closed its lease (it exited?): "
                    "the binding is released and its cache unmapped", self.ctx.rank, kv.binding_id, kv.generation)
        self._publish_health()

    def _stop_doorbell_of(self, token: int) -> Doorbell | None:
        """Stop the doorbell attached under lease `token`, if it is still the rank's, and return it (or the one
        replaced since, still ending: _doorbell_under). Under the attach lock: an AttachDoorbell under that lease
        either published its doorbell before (stopped here) or checks the lease after this (and is refused)."""
        if not self._attach_lock.acquire(timeout=GONE_ENGINE_DEVICE_S):
            # Held this long: by a release of regions waiting in it on the device (at TP 1 it waits there), which
            # never lets go if that device waits on the gone engine's event. The doorbell judged as it stands.
            held = self._doorbell_under(token)
            if held is not None:
                self._past_gone_engine(held)
            self._attach_lock.acquire()
        try:
            old = self._doorbell_under(token)
            if old is not None and old is self.doorbell:
                self.doorbell = None
                self._retire(old)
        finally:
            self._attach_lock.release()
        return old

    def _doorbell_under(self, token: int) -> Doorbell | None:
        """The doorbell attached under lease `token` that its end judges: the rank's, or one an AttachDoorbell
        replaced since (it took the attach lock before the lease's release did: the gone engine's restart) that
        is still inside its end. Missed, the release judged no doorbell: one whose end waits on a device stuck on
        the gone engine's event (at TP 1 its release waits there) was never judged, and the rank, its new
        doorbell following that one and never serving, stayed up for good. An ended one is not looked at: the
        doorbell that follows it may have queued a step of a live engine's since, which a mark would wait behind."""
        bell = self.doorbell
        if bell is not None and bell.lease == token:
            return bell
        return next((d for d in self._retiring if d.lease == token and d.is_alive()), None)

    def _past_gone_engine(self, bell: Doorbell | None) -> None:
        """The rank exits (3, for its supervisor to restart it) unless its device gets past the steps a gone
        engine's doorbell (`bell`, None: the engine had none) queued, and still answers. Each step waited on the
        engine's "inputs written" event; if the engine died before its GPU recorded that, no driver ever
        completes the wait (run 301: 45 s and on, exit or SIGKILL alike, without MPS), and everything the rank
        queues behind it waits with it, for good: its later steps, the releases of the gone engine's memory.
        Under MPS an engine that ends with GPU work in flight leaves the other clients' contexts with a sticky
        error (run 301, and NVIDIA's MPS guide), whatever they held of it: the check raises."""
        try:
            passed = bell is None or bell.device_gets_past(GONE_ENGINE_DEVICE_S)
            # With a doorbell too: one whose steps wait on no engine event (an engine whose host writes the inputs),
            # or that served none, is passed at once without a look at the device, whose context the engine's end
            # may have lost all the same (under MPS): the rank served on with it.
            passed = passed and _device_answers(self.ctx.model.device)
        except Exception:  # noqa: BLE001  (the context is lost: nothing on this device runs again)
            log.exception("rank %d: the device failed after the engine's end (under MPS an engine that ends with GPU "
                          "work in flight takes the other clients' contexts with it); exiting for a restart",
                          self.ctx.rank)
            os._exit(3)
            return  # (a test's stand-in for os._exit returns)
        if not passed:
            log.error("rank %d: the device has not got past the gone engine's last doorbell step in %.0f s: it waits "
                      "on the engine's 'inputs written' event, which no driver completes once the engine died before "
                      "its GPU recorded it, and every later step would wait behind it; exiting for a restart",
                      self.ctx.rank, GONE_ENGINE_DEVICE_S)
            os._exit(3)

    def close_leases(self, wait_s: float | None = None) -> None:
        """Shutdown: the lease socket and every lease closed (no binding is released for it: the exit unmaps);
        wait_s bounds the wait for a release already running (LeaseKeeper.close)."""
        if self.leases is not None:
            self.leases.close(wait_s)

    def RegisterBuffers(self, request, context):
        self._require_same_node(context)
        if request.lease and not self._lease_live(request.lease):
            give_back_unopened(context.peer(), [r.memory for r in request.regions])
            raise self._lease_lost_error(request.lease, "register again")
        ids = self.ctx.memory.register(request)
        if request.lease and not self._lease_live(request.lease):  # ended while they were mapped: as BindKV
            self._release_regions([], lease=request.lease)
            raise self._lease_lost_error(request.lease, "register again")
        return pb.RegisterBuffersResponse(region_ids=ids)

    def UnregisterBuffers(self, request, context):
        self._require_same_node(context)
        self.ctx.memory.check_registered(list(request.region_ids))  # NOT_FOUND before the rank's section is entered
        gone = self._until_gone(context, "UnregisterBuffers", "nothing was released, the regions stay registered "
                                "(until UnregisterBuffers again, or their lease's end)")
        self._release_regions(list(request.region_ids), request.owner, give_up=gone)
        return pb.UnregisterBuffersResponse()

    def _release_regions(self, ids: list[int], owner: int = 0, lease: int = 0, give_up=None) -> None:
        """Release the regions `ids` and those registered under `owner` or `lease` (MemoryBindings.unregister:
        NOT_FOUND, all or none, for an id not registered). give_up: bounds the waits for the attach lock and the
        rank's (rank.held), given up before anything is released."""
        if self.ctx.memory.retire_if_idle(ids, owner, lease):
            return  # nothing of theirs is registered (a registration that never arrived): no section, no quiesce
        # The doorbell stays as it is (no new one may attach meanwhile), and nothing else runs on the
        # device. What reads the regions is taken out of use at once; it is let go, and the regions
        # closed, once the device has done everything queued so far (RankLoop.after_device). At TP 1
        # that is waited for here. At TP > 1 it is not: a released pre-launched copy finishes only
        # when its peers' copies do, which start when their engines ring the next step, and those
        # engines wait for this one, which is inside this call.
        with held(self._attach_lock, give_up), self.loop.exclusive(wait=False, give_up=give_up):
            # First: NOT_FOUND (all or none) before anything is dropped.
            released = self.ctx.memory.unregister(ids, owner, lease)
            if not released:  # an owner (a lease) whose registration never arrived: nothing reads anything of it
                return
            finish = []
            for d in (self.doorbell, *self._retiring):  # a replaced one still in a step has its pre-launch too
                pl = d.prelaunch if d is not None else None  # read once: its thread may drop it meanwhile
                if pl is not None:
                    finish.append(pl.forget_regions())
            graphs = self.loop.graphs.drop_in_place() if self.loop.graphs is not None else []

            def done() -> None:
                for fn in finish:  # the page registrations end before the pages may be unmapped
                    fn()
                graphs.clear()
                for m in released:  # each goes with its last view (MappedMemory.close)
                    m.close()

            self.loop.after_device(done)
        log.info("rank %d: %d buffer regions released (%d still registered)", self.ctx.rank, len(released),
                 self.ctx.memory.region_count)

    def AttachDoorbell(self, request, context):
        self._require_same_node(context)
        try:  # refused before the page is opened: a CUDA IPC page handle goes back to its engine
            if self.life.host is not None and not self.life.host.stores_in_order:
                raise precondition(f"the shared-memory doorbell relies on stores being seen in the order written "
                                   f"(x86-64); this host is {platform.machine()}: steps go over the gRPC stream",
                                   "STORE_ORDER")
            if request.page.WhichOneof("kind") != "shm":
                raise invalid("page", "the doorbell page must be POSIX shared memory")
            device = self.ctx.model.device
            if request.input_event and device.type != "cuda":
                # The field promises a stream that waits on the event before reading a step; a CPU rank has
                # none, and reading at the ring would race an engine's GPU writes of the inputs.
                raise precondition(f"input_event: this rank computes on {device.type} and cannot wait on the "
                                   "engine's GPU event before reading a step's inputs: send input_event empty "
                                   "(an engine whose inputs are written by its host), or start the sidecar on "
                                   "the engine's GPUs (--device cuda)", "NO_DEVICE_EVENTS", "input_event")
        except SidecarError:
            give_back_unopened(context.peer(), [request.page])
            raise
        # From here the page is shared memory, which holds nothing to give back (memory.discard_handle).
        # One doorbell per rank: two attaching at once would leave one running unseen. The attach lock may be held
        # for long (a lease's release waiting on the device, an UnregisterBuffers behind a stuck step): its client
        # gone, the call gives up before the lock is taken, so before its page is opened.
        gone = self._until_gone(context, "AttachDoorbell", "nothing was attached, the doorbell in place (if any) "
                                "serves on")
        with held(self._attach_lock, gone):
            if self._doorbells_closed:
                raise SidecarError(grpc.StatusCode.UNAVAILABLE, "this rank is shutting down: no doorbell is attached "
                                   "any more; steps go over the gRPC stream until it ends", "", "SHUTTING_DOWN")
            # Under the lock, which lease_lost takes to stop the doorbell of a lease: a lease that ends after this
            # check finds the doorbell published; one that ended before is refused here (the keeper marks a lease
            # gone before its lease_lost runs), so no doorbell outlives its lease.
            if request.lease and not self._lease_live(request.lease):
                raise self._lease_lost_error(request.lease, "attach again")
            word_ops = self._gpu_word_ops if request.gpu_word else None
            # A doorbell that pre-launches hooks its release into the rank loop (on_quiesce), under the rank's lock,
            # which a stuck step holds for good: taken here first, bounded as the attach lock is, so that a call
            # whose client has gone gives up before its page is opened. The section ends before an old doorbell
            # is stopped below (its step, if one runs, needs the lock to end).
            prelaunching = word_ops is not None and self.loop.graphs is not None
            with (self.loop.exclusive(wait=False, quiesce=False, give_up=gone) if prelaunching
                  else contextlib.nullcontext()):
                page = MappedMemory(request.page, "page", torch.device("cpu"))
                self._attached += 1
                wake = str(self.run_dir / f"rank{self.ctx.rank}.wake{self._attached}") if self.run_dir else None
                mem = self.ctx.memory
                try:
                    # Its bytes are the doorbell's (none of the cache's or a region's) until its page closes.
                    mem.claim_page(page, page_words.HEADER + 2 * request.capacity_bytes)
                    bell = Doorbell(page, request.capacity_bytes, self.loop, self.ctx.model.device,
                                    request.input_event, wake, word_ops, self.ctx.cfg.sliding_window,
                                    self.prelaunch_behind_s, on_close=functools.partial(mem.release_page, page),
                                    lease=request.lease)
                except BaseException:
                    mem.release_page(page)
                    page.close()  # a refused request leaves the attached doorbell as it was
                    raise
            if self.doorbell is not None:
                self._retire(self.doorbell)
                self.doorbell = None
            # A replaced doorbell still inside a step may queue the next one behind its old page's GPU
            # word and release it only as it ends: the new one serves after that (Doorbell.run).
            bell.follow(self._retiring)
            try:
                bell.start()
            except BaseException:  # no thread ("can't start new thread"): it releases its page as a never-started one
                bell.stop()
                raise
            # Published once started: close_doorbell stops only started doorbells.
            self.doorbell = bell
        return pb.AttachDoorbellResponse(output_event=bell.output_event_handle(), wake_fifo=bell.wake_fifo,
                                         gpu_word=bell.prelaunch is not None)

    def _retire(self, old: Doorbell) -> None:
        """Stop a doorbell that is no longer the rank's (under the attach lock); one still inside a step is kept
        among the retiring until it ends, for a new doorbell to follow."""
        try:
            old.stop()
        except Exception:  # noqa: BLE001  (it is halted: a new one must start all the same)
            log.exception("rank %d: the replaced doorbell did not close cleanly", self.ctx.rank)
        self._retiring.append(old)
        self._retiring = [d for d in self._retiring if d.is_alive()]

    def close_doorbell(self, wait_s: float | None = None) -> bool:
        """Shutdown: stop the doorbell (and any it replaced that is still in a step), and attach none
        again. Under the attach lock, so a re-attach in progress is either done or refused. wait_s bounds
        the wait for that lock (None: until it is free); False, with nothing done, when it was still held:
        by a lease's release or an UnregisterBuffers that waits for the rank's lock behind a stuck step."""
        if not self._attach_lock.acquire(timeout=-1 if wait_s is None else max(0.0, wait_s)):
            return False
        try:
            self._doorbells_closed = True
            for d in (self.doorbell, *self._retiring):
                if d is not None:
                    d.stop()
        finally:
            self._attach_lock.release()
        return True

    @functools.cached_property
    def _gpu_word_ops(self) -> GpuWordOps | None:
        """The driver's stream memory operations, probed once; None where steps are not pre-launched."""
        return GpuWordOps.load(self.ctx.model.device) if self.prelaunch else None

    # Steps are same-node only too: every step writes its block K/V into the cache a same-node engine
    # bound, and may name that engine's registered regions, so a remote peer's step would write (and
    # read) another process's memory.
    def DraftStep(self, request, context):
        self._require_same_node(context, "draft steps")
        if not self._unary_steps.acquire(blocking=False):
            raise SidecarError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"step {request.step_id}: {MAX_UNARY_STEPS} unary DraftStep calls are already waiting on "
                               "this rank, the most it holds at once (their threads are the health check's and "
                               "GetStatus's): send steps on one DraftSteps stream, give each call a deadline, and look "
                               "at GetStatus for a stuck step", "", "TOO_MANY_STEPS")
        try:
            fut = self.loop.submit(request)  # may refuse (draining, a full queue): the place is given back all the same
            try:
                if not _awaited(fut, context):
                    raise SidecarError(grpc.StatusCode.CANCELLED, f"step {request.step_id}: the client is gone "
                                       "(cancelled, or its deadline passed) before the step's turn came; it runs in "
                                       "its turn all the same", "", "CANCELLED")
                return fut.result()
            finally:
                # A failed step's exception lives in the future, and its traceback holds this frame: a frame still
                # holding the future made a reference cycle, and every failed step left its request's tensors (KV
                # views, mappings) to the cyclic collector (tests/server/test_rank_cycles.py).
                del fut
        finally:
            self._unary_steps.release()

    def DraftSteps(self, request_iterator, context):
        self._require_same_node(context, "draft steps")
        if not self._streams.acquire(blocking=False):
            raise SidecarError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"{MAX_STREAMS} DraftSteps streams are open on this rank, the most it serves at once "
                               "(an engine rank needs one): close the streams no longer used, then open this one again",
                               "", "TOO_MANY_STREAMS")
        try:
            # Before any answer, and before the first request comes: the client confirms at once which server
            # instance took its stream (StatusReport.instance).
            context.send_initial_metadata(((INSTANCE_METADATA, self.instance),))
            for request in request_iterator:
                fut = self.loop.submit(request)
                if not _awaited(fut, context):  # the client is gone: this thread and the stream's place go back
                    return
                answer = self.loop.answer(request, fut)
                # Not kept while the answer goes out and the stream waits for its next step: a refused step's
                # future holds its error, whose traceback holds the views validate_step made (the binding's
                # cache, regions: mapped, under CUDA IPC allocated, past an UnbindKV or UnregisterBuffers), and
                # rank.answer's frame, whose caller is this one: a cycle once the stream ended, left to the
                # cyclic collector on whatever thread (tests/server/test_rank_abort_releases.py).
                del fut
                yield answer
        finally:  # the stream ended (half-close, cancel, transport gone): its place is free again
            self._streams.release()

    def _require_same_node(self, context, what: str = "memory registration") -> None:
        if not _same_node(context.peer()):
            raise SidecarError(grpc.StatusCode.PERMISSION_DENIED,
                               f"{what} from {context.peer()} refused: only same-node peers (unix socket or "
                               "loopback) may bind KV caches or buffers, or send the steps that write them",
                               "", "REMOTE_PEER")


def _awaited(fut, context) -> bool:
    """Wait for a step's answer while its client is there: False once the client is gone (a cancel, a passed
    deadline, the transport, the server's stop). Waited for whatever the client did, a handler held its thread
    of the rank's small pool (and a stream its place) until the step ended: behind a stuck step, for good, and
    a few such calls left GetStatus and the health check no thread. The step is not taken back: it keeps its
    place in the rank's order (at TP > 1 its peers run their copies), and its answer goes to nobody."""
    while not concurrent.futures.wait([fut], CLIENT_CHECK_S).done:
        if not context.is_active():
            return False
    return True


def _device_answers(device: torch.device) -> bool:
    """True, or what the driver raises where this process's context on `device` is lost (a sticky error): an event
    recorded on an idle stream and queried, never waited for."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            mark = torch.cuda.Event()
            mark.record(torch.cuda.Stream(device))
            mark.query()
    return True


def limits_pb(max_reqs: int, max_message_bytes: int) -> pb.Limits:
    return pb.Limits(qpr=layout.QPR, launch_reqs=layout.LAUNCH_REQS, max_reqs=max_reqs,
                     max_message_bytes=max_message_bytes)
