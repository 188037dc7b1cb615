"""The sidecar end of the same-GPU data plane: a shared-memory doorbell serving DraftStepRequests without gRPC.

The engine writes a serialized DraftStepRequest (tensors as RegionSlices into registered
buffers) into the page and bumps the request sequence; this thread runs the step itself, in
order with the rank loop's other steps (RankLoop.answer_now), and publishes the serialized
response. On GPU the engine's "inputs written" event is waited on by the stream before the step
runs, and the sidecar's "outputs written" event is recorded after it, so neither process syncs
its host with the GPU to order the work; the answer is published as soon as the step is
launched, and the engine's stream waits for the GPU work through the event. When both ends can
use the page's GPU word, the next step is queued on the GPU before it is even rung
(server/prelaunch.py), and this thread answers from it.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import torch

from dspark_sidecar.proto import doorbell as bell
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.proto.gpu_word import GpuWordError, GpuWordOps
from dspark_sidecar.proto.memory import MappedMemory
from dspark_sidecar.server.errors import clip_message, internal_message, invalid
from dspark_sidecar.server.prelaunch import BEHIND_S, Prelaunch
from dspark_sidecar.server.rank import RankLoop

log = logging.getLogger("dspark_sidecar.server")
HALT_POLL_S = 0.05  # an idle doorbell's wait for a wake; Waker.sleep caps it at bell.MISSED_WAKE_S (2 ms)
# How long stop() waits for a step in progress: the pre-launch's wait for its copy (READY_TIMEOUT_S)
# and a rendezvous fit well inside it.
STOP_S = 10.0
_KEPT: list = []  # pages whose GPU registration could not be ended: never unmapped (Doorbell._close_page)
WORD_ALIGN = 64  # the page's start: its header words (bell.WORDS) in one cache line, each an untorn 8-byte store


def _flag_exchange(world: int):
    """TP > 1: the queued steps' flags, all-reduced (MAX) over the rank's group (server/prelaunch.py)."""
    if world == 1:
        return None
    import torch.distributed as dist

    return lambda flags: dist.all_reduce(flags, op=dist.ReduceOp.MAX)


class Doorbell(threading.Thread):
    def __init__(self, page: MappedMemory, capacity: int, loop: RankLoop, device: torch.device,
                 input_event: bytes, wake_path: str | None = None, word_ops: GpuWordOps | None = None,
                 window: int = 0, behind_s: float = BEHIND_S, on_close=None, lease: int = 0) -> None:
        super().__init__(name="dspark-doorbell", daemon=True)
        self._on_close = on_close  # called once the page is closed (MemoryBindings.release_page)
        self.lease = lease  # the engine lease it was attached under (AttachDoorbellRequest.lease); 0: none
        if capacity < bell.MIN_CAPACITY:
            raise invalid("capacity_bytes", f"{capacity} is below the {bell.MIN_CAPACITY} bytes an answer may need "
                                            "(an error's message, the step's timings)")
        if page.storage.data_ptr() % WORD_ALIGN:
            # The protocol's words are single 8-byte stores that must not tear (a torn sequence number
            # could serve a step twice), and the GPU word is written by cuStreamWriteValue64.
            raise invalid("page", f"the page starts {page.storage.data_ptr() % WORD_ALIGN} bytes past a multiple of "
                                  f"{WORD_ALIGN}: send an offset_bytes that is a multiple of {WORD_ALIGN}")
        try:
            self.page = bell.Page(page.storage.numpy(), capacity)
        except ValueError as err:
            raise invalid("capacity_bytes", str(err)) from None
        if self.page.word(bell.CLOSED):
            # A doorbell stopped serving this page for good, and its engine reads the word so: a step rung
            # here is unanswered and never runs. Served again, steps would run that their engine falls back for.
            self.page.close()
            raise invalid("page", "its word [6] is set: a doorbell has stopped serving this page for good; "
                                  "attach a fresh page")
        self.memory, self.loop, self.device = page, loop, device
        self.input_event = self.output_event = None
        self._stream = None  # the doorbell thread's stream (_ring_loop): where each step waits on input_event
        if device.type == "cuda":
            # Built here, on a gRPC handler thread whose current device may be another GPU: pin it.
            with torch.cuda.device(device):
                if input_event:
                    try:
                        self.input_event = torch.cuda.Event.from_ipc_handle(device, input_event)
                    except RuntimeError as err:  # not 64 bytes, or not an event handle the driver opens
                        raise invalid("input_event", f"cannot open the engine's interprocess event on {device}: "
                                                     f"{err}") from None
                self.output_event = torch.cuda.Event(interprocess=True)
                self.output_event.record(torch.cuda.current_stream(device))  # materialise it on this GPU
        self.prelaunch: Prelaunch | None = None
        if word_ops is not None and loop.graphs is not None:  # server/prelaunch.py says when (servicer.py)
            try:
                with torch.cuda.device(device):
                    self.prelaunch = Prelaunch(word_ops, self.page, page.storage.data_ptr(), loop.graphs, window,
                                               loop.ctx.metrics.prelaunch, exchange=_flag_exchange(loop.ctx.world),
                                               device=device, max_reqs=loop.ctx.max_reqs, behind_s=behind_s,
                                               output_of=loop.output_view)
            except GpuWordError as err:
                log.warning("doorbell: steps are not pre-launched: %s", err)
            else:
                loop.on_quiesce(self.prelaunch.release)
                loop.on_device_wait(self.prelaunch.repass)
        self._halt = threading.Event()
        self._predecessors: list[Doorbell] = []  # follow()
        self._release_lock, self._released = threading.Lock(), False
        # A dropped pre-launch's finish failed: registrations may still name the page, which then stays
        # mapped when this doorbell closes it (_close_page's unmap=False), as for a stop's own drop.
        self._page_registered = False
        self._seen_ns = 0  # when the current step's ring was seen (time.monotonic_ns)
        self._last = self.page.word(bell.REQ_SEQ)
        self.waker: bell.Waker | None = None
        if wake_path is not None:
            try:
                self.waker = bell.Waker(wake_path)
            except OSError as err:  # no FIFO here (e.g. a read-only folder): poll only, and say so
                log.warning("doorbell: no wake FIFO at %s (%s); the idle doorbell keeps polling", wake_path, err)

    @property
    def wake_fifo(self) -> str:
        return self.waker.path if self.waker is not None else ""

    def output_event_handle(self) -> bytes:
        return self.output_event.ipc_handle() if self.output_event is not None else b""

    def follow(self, predecessors: list[Doorbell]) -> None:
        """Serve only once these (replaced, still inside a step) have ended; call before start()."""
        self._predecessors = list(predecessors)

    def stop(self) -> None:
        """Halt the thread; it releases the pre-launch, the FIFO and the page as it ends. A step in
        progress is never cut short: were the pre-launch dropped under it, its rank would skip the
        queueing its peers do after that step (run()), pairing collectives of different steps."""
        self._halt.set()
        if self.ident is None:  # never started
            self._release()
            return
        self.join(timeout=STOP_S)
        if self.is_alive():
            log.error("doorbell: still inside a step %.0f s after stop; it releases its page when that step ends",
                      STOP_S)

    def device_gets_past(self, within_s: float) -> bool:
        """Whether the device gets past everything this doorbell has queued on its stream within `within_s`,
        polled (a host wait on it could never end). True at once without an input event: nothing queued here
        waits on the engine. What the driver raises (a context lost to a sticky error) is raised."""
        stream = self._stream
        if self.input_event is None or stream is None:
            return True
        mark = torch.cuda.Event()
        mark.record(stream)
        # The doorbell's own poll, as long idle (every bell.SLEEP_S): nothing here is on a step's path.
        return bell.wait_until(mark.query, time.perf_counter() + within_s, active_since=float("-inf"))

    def _release(self) -> None:
        with self._release_lock:  # once: stop() before start(), then the thread's own end, must not close twice
            if self._released:
                return
            self._released = True
        try:
            if self.waker is not None:
                self.waker.close()
        finally:  # whatever the FIFO did: the queued GPU wait must be released and the page closed
            if self.prelaunch is not None:  # the page's registration ends, then the page goes: once the device is done
                self._drop_prelaunch(then=self._close_page)
            else:
                self._close_page(unmap=not self._page_registered)

    def _close_page(self, unmap: bool = True) -> None:
        """unmap=False: the page's GPU registration may outlive this (a failed unregister): kept mapped."""
        try:
            # Last, after every answer and once the device has finished this page's work: an engine
            # still waiting on a ring learns it will never be answered, and attaches again (sidecar.proto).
            self.page.words[bell.CLOSED] = 1
            if not unmap:
                _KEPT.append(self.memory)  # for the process's life: the driver may still map its pages
                return
            self.page.close()
            self.memory.close()
        finally:  # unused from here on, whether or not its mapping could go yet
            if self._on_close is not None:
                self._on_close()

    def run(self) -> None:
        try:
            for d in self._predecessors:
                while d.is_alive() and not self._halt.is_set():
                    d.join(timeout=0.05)
            self._ring_loop()
        finally:
            self._release()

    def _ring_loop(self) -> None:
        if self.device.type == "cuda":  # per-thread current device: waits and records go to this GPU
            torch.cuda.set_device(self.device)
            self._stream = torch.cuda.current_stream(self.device)  # looked up once: ~6 us per call
        bell.lower_timer_slack()
        active = time.perf_counter()
        nap = bell.nap_for(self.device.type)
        rung = lambda: self.page.word(bell.REQ_SEQ) != self._last  # noqa: E731
        while not self._halt.is_set():
            if not rung():
                if self.prelaunch is not None:  # a cooldown step's word, timed as it lands (prelaunch.py)
                    self.prelaunch.watch()
                # Memory released while the device still read it (RankLoop.after_device), and a released
                # queued step's wait that an engine's late word blocked again (Prelaunch.repass).
                self.loop.sweep_idle(poke=self.prelaunch is not None and self.prelaunch.passing)
                idle = time.perf_counter() - active
                if self.waker is not None and idle > bell.DOZE_S:  # between bursts: blocked, waking every MISSED_WAKE_S
                    self.waker.sleep(self.page, rung, HALT_POLL_S)
                else:
                    bell.pause(idle, nap)
                continue
            seq = self.page.word(bell.REQ_SEQ)
            self._seen_ns = time.monotonic_ns()  # StepTimings.seen_mono_ns (see _publish)
            # One hold of the loop's lock from the step to the queueing of the next: every rank queues
            # it (the verdict's QUEUE_NEXT) right after the step, and other device work let in between
            # (a gRPC step, a release of regions) would run before it here and after it on the peers,
            # pairing their collectives with the wrong ones. Publishing inside costs nothing.
            with self.loop.exclusive(quiesce=False):
                try:
                    resp = self._serve(seq)
                except Exception as exc:  # noqa: BLE001  (the engine always gets an answer: it falls back)
                    log.exception("doorbell: step could not be served")
                    resp = pb.DraftStepResponse(error=pb.StepError(
                        # clip_message: a lone surrogate in its words (an OS name's undecodable byte) made this
                        # answer's build raise, out of the guard below, and the thread ended, later rings unanswered
                        code=13, message=clip_message(internal_message(exc)), reason="INTERNAL"))
                    try:
                        self._publish(seq, resp)
                    except Exception:  # noqa: BLE001  (this thread must live on: the engine times out this step)
                        log.exception("doorbell: the error answer to step %d could not be published either", seq)
                if self.prelaunch is not None:  # after the answer is out: queue the next step
                    self._queue_next(seq, resp)
            self._last = seq
            active = time.perf_counter()

    def _queue_next(self, seq: int, resp: pb.DraftStepResponse) -> None:
        try:
            with self.loop.exclusive(quiesce=False):
                self.prelaunch.after(seq, resp)
        except Exception:  # noqa: BLE001  (steps still run the ordinary way: stop pre-launching, say why)
            if self.loop.ctx.world > 1:
                # Every peer queued this step (the verdict): one rank without it would pair their
                # queued collectives with its next ordinary step. Like a failed launch (rank.py).
                log.exception("doorbell: could not pre-launch the next step at TP %d; exiting", self.loop.ctx.world)
                os._exit(3)
            log.exception("doorbell: could not pre-launch the next step; steps are no longer pre-launched")
            self._drop_prelaunch()

    def _drop_prelaunch(self, then=None) -> None:
        """Unhook the pre-launch; steps then run the ordinary way. Its queued step is released, and its
        memory (and then `then()`) goes once the device has done all work queued so far: waited for at
        TP 1; at TP > 1 a released copy finishes only with its peers' (RankLoop.after_device)."""
        with self.loop.exclusive(quiesce=False):
            # Unhooked under the lock: a gRPC step or binding let in between would no longer release the
            # queued step before it used the device (helper 73).
            pl, self.prelaunch = self.prelaunch, None
            self.loop.on_quiesce(None, old=pl.release)
            finish = pl.detach()

            def done() -> None:
                self.loop.on_device_wait(None, old=pl.repass)  # its page may be closed next
                try:
                    finish()
                except BaseException:
                    # Registrations finish could not end may still name the page: it stays mapped (_KEPT),
                    # but its CLOSED word still tells the engine to attach again. Dropped while serving on
                    # (_queue_next), the page closes later (_release): told to keep it mapped then.
                    self._page_registered = True
                    if then is not None:
                        self._close_page(unmap=False)
                    raise
                if then is not None:
                    then()

            self.loop.after_device(done)

    def _serve(self, seq: int) -> pb.DraftStepResponse:
        try:
            req = pb.DraftStepRequest.FromString(self.page.read(self.page.req_area, bell.REQ_LEN))
        except Exception as exc:  # noqa: BLE001  (a garbled request is answered, never fatal)
            resp = pb.DraftStepResponse(error=pb.StepError(code=3, message=f"request: unreadable: {exc}",
                                                           field="request", reason="INVALID_FIELD"))
            # Answered, so recorded as below: the engine orders its stream after this event for this answer too,
            # and a pre-launched copy queued after the last step may run the rung step on this stream.
            if self.output_event is not None:
                self.output_event.record(self._stream)
        else:
            if self.input_event is not None:
                self._stream.wait_event(self.input_event)
            try:
                hook = self.prelaunch.hook(seq, req) if self.prelaunch is not None else None
                # From the ring seen: _ring_loop waited for the loop's lock since (deadline_ms, queue_ns).
                resp = self.loop.answer_now(req, hook, self.page.capacity, seen_ns=self._seen_ns)
            finally:
                # Every answer after the ring is read, an error one too (_ring_loop's): the engine orders its
                # stream after this event whatever the answer says, and the step may have launched work.
                if self.output_event is not None:
                    self.output_event.record(self._stream)
        self._publish(seq, resp)
        return resp

    def _publish(self, seq: int, resp: pb.DraftStepResponse) -> None:
        if self.prelaunch is not None:  # see Prelaunch.settle: before the engine can write the next word
            with self.loop.exclusive(quiesce=False):
                self.prelaunch.settle()
        resp.timings.seen_mono_ns, resp.timings.published_mono_ns = self._seen_ns, time.monotonic_ns()
        data = resp.SerializeToString()
        if len(data) > self.page.capacity:
            too_large = pb.DraftStepResponse(step_id=resp.step_id, error=pb.StepError(
                code=8, message=f"response of {len(data)} bytes exceeds the doorbell area; register an output "
                                "region", reason="RESPONSE_TOO_LARGE"))
            # A failed step's doorbell answer carries these too (sidecar.proto StepTimings).
            too_large.timings.seen_mono_ns = resp.timings.seen_mono_ns
            too_large.timings.published_mono_ns = resp.timings.published_mono_ns
            data = too_large.SerializeToString()
        self.page.write(self.page.resp_area, data, bell.RESP_LEN, bell.RESP_SEQ, seq)
