"""The rank loop: one worker thread per rank validates, agrees on, and runs draft steps strictly in order."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

import grpc
import torch

from dspark_sidecar import layout
from dspark_sidecar.drafter.config import DrafterConfig
from dspark_sidecar.drafter.model import DSparkDrafter
from dspark_sidecar.proto import codec
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.proto.memory import QuietStream
from dspark_sidecar.server.errors import SidecarError, as_sidecar_error, precondition, to_step_error
from dspark_sidecar.server.graphs import StepGraphs
from dspark_sidecar.drafter.kv_cache import StepMetadata
from dspark_sidecar.server.kv_binding import KVBinding, MemoryBindings
from dspark_sidecar.server.metrics import Metrics
from dspark_sidecar.server.rendezvous import Post, Rendezvous, digest
from dspark_sidecar.server.validate import Step, check_indices, validate_step

log = logging.getLogger("dspark_sidecar.server")
WAIT_LOG_S = 10.0  # how often a wait for released queued work says it still waits (_settle_released)
DRAIN_S = 5.0  # how long close() waits for releases held until the device is done (after_device)
STOP_STEPS_S = 10.0  # how long stop_steps() waits for the steps already accepted to be answered
# How often a release left to after_device is looked at while nothing else comes to the rank (_reap): no step, no
# section, no doorbell thread (the gRPC transport, or a lease's end that stopped it), as after a lease's end took
# a killed engine's binding.
REAP_S = 0.01
# The reasons a step is refused for the rank's own state, not for anything in it (Counters.steps_refused).
RANK_REFUSALS = frozenset({"SHUTTING_DOWN", "REFUSED"})


@contextlib.contextmanager
def held(lock, give_up: Callable[[], float] | None = None) -> Iterator[None]:
    """`lock` held for the block; with give_up, the wait for it goes in turns of give_up() seconds, each asking it
    first: it raises (the caller's client is gone) to stop waiting, the lock not taken and the block not run. A
    gRPC handler waiting for a lock that a stuck step holds (itself, or a section waiting behind it) otherwise
    held its thread for good."""
    if give_up is None:
        lock.acquire()
    elif not lock.acquire(blocking=False):  # free: taken as before, the client not asked about
        while not lock.acquire(timeout=give_up()):
            pass
    try:
        yield
    finally:
        lock.release()


@dataclass
class RankContext:
    """What the loop computes with; built once by the rank process (server/app.py)."""

    rank: int
    world: int
    cfg: DrafterConfig
    model: DSparkDrafter
    embed: torch.Tensor  # [vocab, hidden] on the rank's device, for steps that send input_ids
    memory: MemoryBindings
    metrics: Metrics
    max_reqs: int
    refusal: str | None = None  # set when --strict-refusal refuses the deployment
    fast: "FastPath | None" = None  # the FlyDSL step runner's glue (server/fast_path.py), when selected
    max_message_bytes: int = 0  # gRPC's limit (--max-message-bytes): inline answers past it are refused; 0: none


class FastPath(Protocol):
    """What the loop needs of a kernel-specific fast path that replaces the layers for whole steps."""

    max_positions: int  # positions must be below this (the kernels' RoPE table)

    def ready(self, kv: KVBinding) -> bool:
        """True when this binding can be served by the fast path (binds it on first sight)."""

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        """embeds [n, hidden], positions int64 [n], meta on the rank's device -> hidden [n, hidden]."""

    def unbound(self, retire: Callable[[Callable[[], None]], None]) -> None:
        """UnbindKV: let go of whatever it holds of the released cache, closed through retire(close)."""

    def refusal(self, kv: KVBinding | None) -> str | None:
        """Why `kv` is (or will be) served by the portable backend; None when this path serves it."""

    def pending(self, kv: KVBinding | None) -> str | None:
        """Why `kv`, which this path will serve (refusal() is None), is not served yet; None once it is."""

    def agreed(self, kv: KVBinding, fast: bool) -> None:
        """After a GO for a step this rank offered the fast path for: whether every rank did (Verdict.fast)."""


class Queued(Protocol):
    """A doorbell step's copy that may already be queued on the GPU (server/prelaunch.StepHook)."""

    def offer(self, step: Step) -> tuple[bool, bool]:
        """Before the rendezvous: (the queued copy is this step and ran, this rank would queue the next).
        Ran: every request passed the GPU's index checks, the host's own (validate.check_indices)."""

    def take(self, queued: bool, queue_next: bool) -> torch.Tensor | None:
        """After GO, with what every rank agreed: the copy's hidden states [n, hidden] if used, else None."""


class RankLoop:
    """Steps run one at a time, in arrival order, so all ranks launch in the same order.

    gRPC threads queue theirs to one worker; the doorbell thread runs its own in place (answer_now);
    one lock serializes both.
    """

    def __init__(self, ctx: RankContext, rendezvous: Rendezvous, graphs: StepGraphs | None = None) -> None:
        self.ctx, self.rendezvous, self.graphs = ctx, rendezvous, graphs
        self._queue: queue.Queue = queue.Queue()
        # One step at a time, whichever thread runs it. Re-entrant: the doorbell thread holds it from
        # a step through the queueing of the next (server/doorbell.py), and takes it again inside.
        self._lock = threading.RLock()
        # Called, under the lock, before any device work other than a doorbell step: a doorbell may
        # have the next step queued behind a wait on the GPU (server/prelaunch.py), blocking the stream.
        self._quiesce: list[Callable[[bool], None]] = []
        # Called, under the lock, while a host waits for the device: a released queued step's wait can
        # be blocked again by an engine's late word, and must be released again (Prelaunch.repass).
        # Each returns whether nothing it released still waits on the device.
        self._pokes: list[Callable[[], object]] = []
        # (event, fn): fn runs, under the lock, once the device has done the work queued before the event
        # (after_device); looked at before each step and each exclusive section.
        self._deferred: list[tuple[object, Callable[[], None]]] = []
        # The thread that sweeps _deferred while nothing else does (_reap); set and cleared under the lock.
        self._reaper: threading.Thread | None = None
        self._reap_stop = False  # close(): no reaper from here on (the teardown drops graphs and the group next)
        self._quiet = QuietStream(ctx.model.device)  # where deferred releases run (_sweep)
        # A gRPC answer that names an output region on a GPU: the engine has no event to wait on (only the
        # doorbell's output_event orders its stream after the writes), so the hidden states and the block
        # K/V must be on the device before the answer leaves (_run).
        self._device_done: Callable[[], None] | None = self._device_idle if ctx.model.device.type == "cuda" else None
        # Set by stop_steps: later steps are answered UNAVAILABLE at once. Taken with the queueing, so
        # no step can slip in behind the worker's stop marker and never be answered.
        self._gate = threading.Lock()
        self._stopping = False
        self._stop_by = 0.0  # the first stop_steps' deadline (time.monotonic): the later ones wait no longer
        # (step id, time.monotonic() at its start) of the step running now, whichever thread runs it: read by
        # the rank's beat (server/health.py watch_steps) through stuck_step. One tuple, replaced whole: read
        # without the lock, which a stuck step holds.
        self._running: tuple[int, float] | None = None
        self._worker = threading.Thread(target=self._work, name=f"dspark-rank{ctx.rank}", daemon=True)
        self._worker.start()

    def on_quiesce(self, fn: Callable[[bool], None] | None, old: Callable[[bool], None] | None = None) -> None:
        """Add `fn(wait)` to what runs before other device work (and drop `old`)."""
        with self._lock:
            if old is not None and old in self._quiesce:
                self._quiesce.remove(old)
            if fn is not None:
                self._quiesce.append(fn)

    def on_device_wait(self, fn: Callable[[], object] | None, old: Callable[[], object] | None = None) -> None:
        """Add `fn()` to what runs while a host waits for this rank's device (and drop `old`)."""
        with self._lock:
            if old is not None and old in self._pokes:
                self._pokes.remove(old)
            if fn is not None:
                self._pokes.append(fn)

    def _poke(self) -> None:
        for fn in list(self._pokes):  # a deferred release may unhook its own (Doorbell._drop_prelaunch)
            try:
                fn()
            except Exception:  # noqa: BLE001  (an event query failing: the device failed, as in _passed)
                log.exception("rank %d: the device failed while a release was waited for; exiting", self.ctx.rank)
                os._exit(3)

    def _settle_released(self) -> None:
        """Until every poke reports nothing it released still waits on the device (Prelaunch.repass).

        Without a bound, as the device wait it stands in for had. Its callers come after GO (a gRPC step, a
        capture), when every rank has released or run its copy, so only a stuck device (or peer) keeps it
        waiting; at TP > 1 a released copy finishes only with the peers'. Said every WAIT_LOG_S meanwhile."""
        start = logged = time.monotonic()
        while not all([fn() for fn in list(self._pokes)]):
            now = time.monotonic()
            if now - logged > WAIT_LOG_S:
                logged = now
                log.warning("rank %d: released queued work still waits on the device after %.0f s (a stuck device, "
                            "or at TP > 1 a peer's copy)", self.ctx.rank, now - start)
            time.sleep(20e-6)

    def _wait_for(self, events: list) -> None:
        """Until the device has passed these events: synchronize, or with pokes registered, a poll that runs them."""
        if not self._pokes:
            for e in events:
                try:
                    e.synchronize()
                except Exception:  # noqa: BLE001
                    # The device failed (a fault of an earlier, unsynchronized doorbell step surfaces here): as
                    # _passed. Raised on, the section's RPC answered INTERNAL with its binding already replaced,
                    # and the rank stayed SERVING on a broken device until a later launch failed.
                    log.exception("rank %d: the device failed while a release was waited for; exiting", self.ctx.rank)
                    os._exit(3)
            return
        while True:
            self._poke()
            if all(self._passed(e) for e in events):
                return
            time.sleep(20e-6)

    def _device_idle(self) -> None:
        """Everything queued on the device so far has run (a gRPC answer naming an output region): the
        step's streams, this thread's and the graphs', which a released queued step may hold up."""
        dev = self.ctx.model.device
        if not self._pokes:
            torch.cuda.synchronize(dev)
            return
        streams = [torch.cuda.current_stream(dev)] + ([self.graphs.stream] if self.graphs is not None else [])
        events = []
        for stream in streams:
            e = torch.cuda.Event()
            e.record(stream)
            events.append(e)
        self._wait_for(events)

    @contextlib.contextmanager
    def exclusive(self, wait: bool = True, quiesce: bool = True,
                  give_up: Callable[[], float] | None = None) -> Iterator[None]:
        """The device to oneself, between steps. wait: queued doorbell work has also finished (memory it
        reads may be unmapped inside). quiesce=False: the lock only (the doorbell queueing its next step).
        give_up: bounds the wait for the lock (held): it raises to give up, before anything here ran."""
        with held(self._lock, give_up):
            for fn in self._quiesce if quiesce else ():
                try:
                    fn(wait)
                except Exception:  # noqa: BLE001
                    # A release that failed may have left its queued step's wait blocking the device's stream,
                    # or met a failed device: nothing after it can be trusted, as after a failed launch
                    # (_guarded). Raised on, it ended the worker with its step never answered, and every
                    # gRPC step after it. One clear line, then the rank exits.
                    log.exception("rank %d: releasing queued device work failed; exiting", self.ctx.rank)
                    os._exit(3)
            self._sweep()
            yield

    def after_device(self, fn: Callable[[], None], wait: bool | None = None) -> None:
        """Run fn once the device has done every step and queued copy launched so far (on the graphs'
        stream): at once if it has, or with wait; else before a later step or exclusive section, or
        from the idle doorbell (sweep_idle), or the reaper while none of those comes (_reap). wait=None:
        wait at TP 1 only, where nothing queued waits on a peer. Called under the lock (exclusive)."""
        if self.graphs is None:
            # No graphs, so no pre-launch: eager GPU steps are asynchronous, but torch's IPC deleter
            # synchronizes before unmapping, and host shared memory is copied synchronously.
            fn()
            return
        done = torch.cuda.Event()
        done.record(self.graphs.stream)
        wait = self.ctx.world == 1 if wait is None else wait
        if wait:
            self._wait_for([done])
        self._deferred.append((done, fn))
        self._sweep()
        with self._lock:  # held already (exclusive): re-entered, so that _reap's exit and this start never cross
            if self._deferred and self._reaper is None and not self._reap_stop:
                self._reaper = threading.Thread(target=self._reap, name=f"dspark-reap{self.ctx.rank}", daemon=True)
                self._reaper.start()

    def _reap(self) -> None:
        """Sweep what after_device holds until none is left, whenever the lock is free. A step, a section and the
        idle doorbell sweep too; without them (an engine killed at TP > 1 on the gRPC transport) nothing did, and
        the gone engine's cache, released by its lease, stayed mapped until the next engine's BindKV."""
        if self.ctx.model.device.type == "cuda":  # the events are queried, and the releases run, on the rank's GPU
            torch.cuda.set_device(self.ctx.model.device)
        head, since = None, 0.0  # the oldest release waiting, and since when it has been the oldest
        logged = 0.0
        while True:
            time.sleep(REAP_S)
            if not self._lock.acquire(blocking=False):  # a step or a section runs: it sweeps itself
                continue
            try:
                if not self._reap_stop:
                    self._sweep()
                if self._reap_stop or not self._deferred:
                    self._reaper = None  # under the lock: the next deferral (after_device) starts another
                    return
                now = time.monotonic()
                if self._deferred[0] is not head:
                    head, since, logged = self._deferred[0], now, now
                elif now - logged > WAIT_LOG_S:  # as _settle_released says it: the memory stays mapped meanwhile
                    logged = now
                    log.warning("rank %d: %d releases still wait on the device after %.0f s (a stuck device, or "
                                "at TP > 1 a peer's copy not yet run): what they unmap stays mapped meanwhile",
                                self.ctx.rank, len(self._deferred), now - since)
            finally:
                self._lock.release()

    def sweep_idle(self, poke: bool = False) -> None:
        """Between steps (the doorbell's idle loop): run what after_device holds, if the lock is free.
        poke: run the device-wait pokes too (a released queued step not yet seen finished)."""
        if (self._deferred or poke) and self._lock.acquire(blocking=False):
            try:
                self._sweep(poke)
            finally:
                self._lock.release()

    def _sweep(self, poke: bool = False) -> None:
        if poke or self._deferred:
            self._poke()
        while self._deferred and self._passed(self._deferred[0][0]):
            _, fn = self._deferred.pop(0)
            try:
                # From any thread: the device current and an idle stream (QuietStream), never the
                # rank's, whose queued copy this thread, holding the lock, would wait for.
                with self._quiet():
                    fn()
            except Exception:  # noqa: BLE001  (a cleanup that fails must not fail the step or RPC that ran it)
                log.exception("rank %d: deferred release failed; its memory stays mapped", self.ctx.rank)

    def _passed(self, event) -> bool:
        try:
            return event.query()
        except Exception:  # noqa: BLE001
            # An error on the device (a fault in a step or copy): nothing queued can be trusted, as
            # after a failed launch (_guarded). One clear line, then the rank exits.
            log.exception("rank %d: the device failed before a deferred release; exiting", self.ctx.rank)
            os._exit(3)

    def drain(self, timeout_s: float | None = None) -> bool:
        """Run every release whose work is done (shutdown: close(), and again after the device sync).
        timeout_s: how long to wait for a step that holds the lock; False when it still did (none ran)."""
        if not self._lock.acquire(timeout=-1 if timeout_s is None else max(0.0, timeout_s)):
            return False
        try:
            self._sweep()
        finally:
            self._lock.release()
        return True

    def submit(self, req: pb.DraftStepRequest) -> concurrent.futures.Future:
        """A future of the DraftStepResponse; it raises SidecarError on failure (unary path)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        expires = time.monotonic_ns() + req.deadline_ms * 1_000_000 if req.deadline_ms else 0
        with self._gate:
            if self._stopping:
                self.ctx.metrics.step("refused", {})
                fut.set_exception(_shutting_down())
            else:
                self._queue.put((req, fut, time.perf_counter_ns(), expires))
        return fut

    def answer(self, req: pb.DraftStepRequest, fut: concurrent.futures.Future) -> pb.DraftStepResponse:
        """The stream path: `fut`, the step's submit(), as its response; failures become the response's StepError
        and the stream goes on. Submitted by the caller, which waits for it only while its client is there."""
        try:
            return fut.result()
        except Exception as exc:  # noqa: BLE001  (every failure is answered, none ends the stream)
            return pb.DraftStepResponse(step_id=req.step_id, error=to_step_error(as_sidecar_error(exc)))
        finally:
            # The future holds the step's exception, whose traceback holds this frame: not the future too (a
            # reference cycle, the failed step's tensors left to the cyclic collector: test_rank_cycles.py).
            del fut

    def answer_now(self, req: pb.DraftStepRequest, prelaunched: "Queued | None" = None,
                   answer_limit: int = 0, seen_ns: int = 0) -> pb.DraftStepResponse:
        """The doorbell path: run on the calling thread, in one order with the worker's steps.

        Handing the step to the worker would cost a thread wake-up (tens of us) on every step of
        the latency-critical path; the lock keeps launches serialized all the same.
        prelaunched: the doorbell's queued copy of this step, if any (server/prelaunch.py).
        answer_limit: the bytes the doorbell's answer area holds (0: no limit).
        seen_ns: the step's receipt (time.monotonic_ns), when the doorbell saw its ring; 0: now. The doorbell
        waits for this lock before it calls here (server/doorbell.py): that wait counts against deadline_ms and
        in queue_ns, as a gRPC step's wait for its turn does (submit).
        """
        now = time.monotonic_ns()
        received = min(seen_ns, now) if seen_ns else now
        expires = received + req.deadline_ms * 1_000_000 if req.deadline_ms else 0
        t_enq = time.perf_counter_ns() - (now - received)
        with self._lock:
            try:
                return self._guarded(req, t_enq, expires, prelaunched, answer_limit)
            except SidecarError as err:
                return pb.DraftStepResponse(step_id=req.step_id, error=to_step_error(err))

    def stop_steps(self, timeout_s: float = STOP_STEPS_S) -> bool:
        """Refuse every step not yet started (UNAVAILABLE, SHUTTING_DOWN; queued ones are answered so)
        and wait for the one running to finish, until timeout_s after the first call; True once none
        runs. The shutdown calls it before it ends the engines' streams: an engine reads the end of its
        stream as "the sidecar is done with my step" and then writes those K/V slots itself, so no step
        may still run when it ends."""
        with self._gate:
            if not self._stopping:
                self._stopping = True
                self._stop_by = time.monotonic() + timeout_s
                self._queue.put(None)  # behind every queued step: the worker answers them (refused), then ends
            # One bound for the whole shutdown: the teardown stops the steps (app.py), then close() does again,
            # and a step stuck on a gone peer cost it the bound twice (past the teardown's watchdog).
            deadline = min(self._stop_by, time.monotonic() + timeout_s)
        self._worker.join(timeout=max(0.0, deadline - time.monotonic()))
        # A doorbell step (answer_now) runs under the lock on its own thread, not on the worker.
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return False
        self._lock.release()
        return not self._worker.is_alive()

    def close(self) -> None:
        self._reap_stop = True  # not under the lock, which a stuck step may hold: read at the reaper's next turn
        if not self.stop_steps():
            log.warning("rank %d: a step still runs %.0f s after the shutdown began (a peer gone?); closing "
                        "without it", self.ctx.rank, STOP_STEPS_S)
        # Peers stopping too let their released copies finish; what still waits after a few seconds
        # waits on a peer that is gone, and is left to the process exit.
        deadline = time.monotonic() + DRAIN_S
        while True:
            # Bounded: a step still running (stop_steps gave up on it) holds the lock, maybe for good.
            if not self.drain(deadline - time.monotonic()):
                break
            if not self._deferred or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        if self._deferred:
            log.warning("rank %d: %d releases still wait on the device at exit", self.ctx.rank, len(self._deferred))

    # The worker -----------------------------------------------------------------------------
    def _work(self) -> None:
        if self.ctx.model.device.type == "cuda":  # the current device is per thread: kernels launch on it
            torch.cuda.set_device(self.ctx.model.device)
        while (item := self._queue.get()) is not None:
            req, fut, t_enq, expires = item
            with self.exclusive(wait=False):
                try:
                    fut.set_result(self._guarded(req, t_enq, expires, answer_limit=self.ctx.max_message_bytes,
                                                 settle=True))
                except SidecarError as err:
                    fut.set_exception(err)
            # Answered: nothing of it stays here until the next step comes. A refused step's error keeps, through
            # its traceback, the frames that held its region and cache views (validate_step's), and the
            # memory an UnregisterBuffers or a re-bind let go stayed mapped until then.
            item = req = fut = None

    def _guarded(self, req: pb.DraftStepRequest, t_enq: int, expires: int, prelaunched=None,
                 answer_limit: int = 0, settle: bool = False) -> pb.DraftStepResponse:
        """settle: a gRPC answer; one naming an output region waits for the device first (see __init__, _run)."""
        if self._deferred:
            self._sweep()
        self._running = (req.step_id, time.monotonic())
        try:
            return self._run(req, t_enq, expires, prelaunched, answer_limit, settle)
        except SidecarError:
            raise
        except Exception:  # noqa: BLE001
            # A failure inside the launch may have left a peer inside a collective: the
            # group cannot be trusted any more. One clear line, then the rank exits and the
            # launcher stops the group; engines see UNAVAILABLE and fall back.
            log.exception("rank %d: draft step %d failed inside its launch; exiting", self.ctx.rank, req.step_id)
            os._exit(3)
        finally:
            self._running = None

    def stuck_step(self, after_s: float) -> tuple[int, float] | None:
        """(step id, seconds it has run) of the step running now if it has run longer than after_s, else None.
        A step takes milliseconds and its waits on peers are bounded (the rendezvous deadline); one past
        after_s is stuck on the device or in a collective, and the rank cannot draft until it ends."""
        running = self._running
        if running is None:
            return None
        secs = time.monotonic() - running[1]
        return (running[0], secs) if secs > after_s else None

    def _run(self, req: pb.DraftStepRequest, t_enq: int, expires_ns: int = 0, prelaunched=None,
             answer_limit: int = 0, settle: bool = False) -> pb.DraftStepResponse:
        ctx = self.ctx
        t0 = time.perf_counter_ns()
        step: Step | None = None
        own_error: SidecarError | None = None
        try:
            if self._stopping:  # a doorbell step after stop_steps (the worker takes none): refused, and its
                raise _shutting_down()  # copy posted as refused, so the peers abort without waiting it out
            if ctx.refusal is not None:
                raise precondition(f"fast path refused: {ctx.refusal} (--strict-refusal)", "REFUSED")
            # A doorbell step's index checks wait for the offer below. private: the checks and the step read
            # a copy of the index tensors, not the engine's shared memory, which may change between the
            # two (validate.PrivateCopy); a pre-launched step's program reads the region on the device
            # and checks the copy it runs (kernels/triton/step_meta.py).
            step = validate_step(req, ctx.cfg, ctx.memory, ctx.max_reqs, indices=prelaunched is None,
                                 out_dtype=ctx.model.dtype, answer_limit=answer_limit, private=True)
        except SidecarError as err:
            own_error = err
        t_valid = time.perf_counter_ns()
        fast = step is not None and self._fast_ready(step)
        # A step the doorbell queued on the GPU (server/prelaunch.py): whether its copy ran, and whether
        # to queue the next; the kernel fast path replaces the graphs, so it neither takes nor queues.
        queued, queue_next = (prelaunched.offer(step) if prelaunched is not None and step is not None and not fast
                              else (False, False))
        t_check = time.perf_counter_ns()
        # A copy that ran passed the index checks on the GPU, on the bytes it read (kernels/triton/step_meta.py):
        # 30-50 us of the answer's path on an H200 host (run 189). Should a peer's copy not have run, the
        # rendezvous aborts the step (SOME_COPIES) rather than have this rank run its unchecked host copy.
        if prelaunched is not None and step is not None and not queued:
            try:
                check_indices(step)
            except SidecarError as err:
                own_error, step = err, None
        validate_ns = t_valid - t0 + time.perf_counter_ns() - t_check
        post = Post(
            step_id=req.step_id,
            generation=req.binding_generation,
            num_reqs=req.num_requests,
            # One rank has no peer to disagree with: skip the crc (~10-20 us per step).
            digest=digest(*step.host)
            if step is not None and ctx.world > 1 else 0,
            valid=step is not None,
            expires_ns=expires_ns,
            fast=fast,
            queued=queued,
            queue_next=queue_next,
        )
        verdict = self.rendezvous.agree(post)
        t1 = time.perf_counter_ns()
        if own_error is not None:
            ctx.metrics.step("refused" if own_error.reason in RANK_REFUSALS else "invalid", {})
            log.warning("rank %d: step %d refused: %s", ctx.rank, req.step_id, own_error.message)
            try:
                raise own_error
            finally:  # the traceback keeps this frame: holding the error and the step here made a cycle
                # (error -> traceback -> frame -> error) that kept the step's region views until a
                # collection, which then freed them on whatever thread and stream it ran (helper 77)
                own_error = step = None
        if not verdict.go:
            ctx.metrics.step("aborted", {})
            log.warning("rank %d: step %d aborted: %s", ctx.rank, req.step_id, verdict.reason)
            late = "deadline_ms passed" in verdict.reason
            # As above: the error's traceback keeps this frame, and a gRPC step's error lives on with its future;
            # the step's region and cache views go now, under the lock, not with the error on another thread.
            step = None
            raise SidecarError(grpc.StatusCode.DEADLINE_EXCEEDED if late else grpc.StatusCode.ABORTED, verdict.reason,
                               "deadline_ms" if late else "", "DEADLINE" if late else "ABORTED")
        assert step is not None
        if fast:  # offered here: a peer that did not keep every rank on the portable layers (GetStatus says so)
            ctx.fast.agreed(step.kv, verdict.fast)
        hidden = prelaunched.take(verdict.queued, verdict.queue_next) if prelaunched is not None else None
        early = hidden is not None
        if hidden is None and queued:
            # GO without QUEUED after this rank's copy ran (its host skipped the index checks): the coordinator
            # aborts such a step instead (SOME_COPIES), so this is a broken invariant. Checked now; a failure
            # after GO cannot be answered alone (the peers are in its collectives): it ends the rank.
            try:
                check_indices(step)
            except SidecarError as err:
                raise RuntimeError(f"step {req.step_id}: told to run the ordinary way after its own copy ran, and "
                                   f"its unchecked host copy fails the index checks: {err.message}") from None
        if hidden is None:
            hidden = self._execute(step, verdict.fast, settle)
        launches = len(layout.launch_groups(step.num_reqs))
        t_out = time.perf_counter_ns()
        out = self._output(step, hidden)
        if settle and self._device_done is not None and step.output is not None:
            # A gRPC answer in a region leaves once the device has written it (see __init__); an inline one
            # waited in .cpu(). Inside compute and output, as that .cpu() is: waited after the timings, a GPU
            # rank's answer reported only the launch, and the step's device time in no phase.
            self._device_done()
        t2 = time.perf_counter_ns()
        timings = {"queue": t0 - t_enq, "rendezvous": t1 - t0, "compute": t2 - t1, "total": t2 - t_enq}
        ctx.metrics.step("ok", timings, step.num_reqs, launches)
        word_wait, start_wait = prelaunched.waits_ns() if prelaunched is not None else (0, 0)
        return pb.DraftStepResponse(
            step_id=req.step_id, hidden_states=out,
            timings=pb.StepTimings(queue_ns=timings["queue"], rendezvous_ns=timings["rendezvous"],
                                   compute_ns=timings["compute"], total_ns=timings["total"], launches=launches,
                                   prelaunched=early, validate_ns=validate_ns, gpu_start_wait_ns=start_wait,
                                   output_ns=t2 - t_out, gpu_word_wait_ns=word_wait))

    def _fast_ready(self, step: Step) -> bool:
        """This rank could run the step on its fast path; the rendezvous turns it into one answer for all."""
        fast = self.ctx.fast
        # Positions past the fast path's RoPE table go through the portable layers (any position).
        return fast is not None and fast.ready(step.kv) and int(step.host.positions.max()) < fast.max_positions

    def _execute(self, step: Step, fast: bool = False, settle: bool = False) -> torch.Tensor:
        """The step's 5 layers + final norm in launches of <= LAUNCH_REQS; writes block K/V into the engine cache.

        fast: every rank agreed to run this step on the fast path (Verdict.fast).
        settle: a gRPC step, which first waits (poking) for released queued work: it waits on the device in
        torch (its inputs' copies, an inline answer's .cpu(), a capture), where no poke runs, and a released
        step whose wait an engine's late word blocked again would hold it for good. Only here, after GO:
        every rank has then taken this step and released its own copy, so the copies' collectives all run
        (before the rendezvous, a rank whose engine never sent the step left this one waiting for good).
        """
        if settle and self._pokes:
            self._settle_released()
        m = self.ctx.model
        dev = m.device
        if step.inputs_embeds is not None:
            embeds = step.inputs_embeds.to(dev, m.dtype)
        else:
            embeds = self.ctx.embed[step.input_ids.to(dev)]
        # The registered region itself (no dtype or device conversion made a copy): graphs read it in place.
        in_place = step.in_region and embeds is step.inputs_embeds
        if fast:
            return self.ctx.fast.forward(embeds, step.positions.to(dev), step.meta.to(dev))
        if self.graphs is not None:
            if self._pokes and self.graphs.will_capture(embeds, step.num_reqs, step.kv.layers, in_place):
                self._settle_released()  # a capture synchronizes the device, with no poke while it waits
            return self.graphs.run(embeds, step.host, step.kv.layers, in_place)
        return m.draft_step(embeds, step.positions.to(dev), step.meta.to(dev), step.kv.layers)

    def output_view(self, step: Step, like: torch.Tensor) -> torch.Tensor | None:
        """The step's output slice as a view [n, hidden] like `like` (dtype, shape); None when the step
        asked for inline bytes or the slice does not resolve (the answer's path then says why)."""
        if step.output is None:
            return None
        try:
            return self.ctx.memory.resolve(step.output, like.dtype, tuple(like.shape), "output")
        except ValueError:
            return None

    def _output(self, step: Step, hidden: torch.Tensor) -> pb.TensorRef:
        if step.output is None:
            return codec.to_tensor_ref(hidden.cpu())
        try:
            dst = self.ctx.memory.resolve(step.output, hidden.dtype, tuple(hidden.shape), "output")
        except ValueError as err:
            raise SidecarError(grpc.StatusCode.INVALID_ARGUMENT, str(err), "output", "INVALID_FIELD") from None
        if dst.data_ptr() != hidden.data_ptr():  # else already there: a pre-launched step's rows (prelaunch.py)
            dst.copy_(hidden)
        return codec.region_tensor_ref(hidden.dtype, tuple(hidden.shape), step.output.region_id,
                                       step.output.offset_bytes)


def _shutting_down() -> SidecarError:
    return SidecarError(grpc.StatusCode.UNAVAILABLE, "the sidecar rank is shutting down and takes no more steps; "
                        "the engine's own layers run them until it is back", "", "SHUTTING_DOWN")
