"""Pre-launched doorbell steps: the next step queued on the GPU behind the doorbell's GPU word, before it is rung.

Why: on the synchronized data plane the GPU used to start a step only after two hosts had each
done their part (the engine's copies and ring, then the sidecar's parse, checks, metadata copy
and graph launch), and on a real host each CUDA call at the start of a step costs several
times its tight-loop figure. Here the sidecar queues step s+1 right after answering step s,
assuming the same layout (an engine repeats its batch shape step after step):

    wait until word >= (s+1) << 32   (proto/gpu_word.py: a stream memory operation)
    metadata program                 (kernels/triton/step_meta.py: reads the engine's region, checks it)
    graph replay                     (graphs.py: the in-place graph of this layout's R)

The engine's stream writes word = (s+1) << 32 | launch_key right after its input copies, so
the GPU starts the step with neither host on the path. The host path still runs in full when
the ring arrives (parse, validate, rendezvous); the step is answered from the queued graph only
when the host and the GPU both accept it: same sequence, launch key and layout on the host, the
metadata program's flag RAN on the GPU. Otherwise the queued step was a no-op (the program
turned it into one) or ran the same step (writes are idempotent), and the step runs the
ordinary way after it, on the same stream.

A queued wait blocks the sidecar's stream until it is released, so nothing else may use the
device while one is pending: every other entry to the device (gRPC steps, bindings, the
doorbell's own misses, stopping) first calls `release`, which stores a word with SKIP_KEY
(the wait passes, the program makes the step a no-op). World size 1 only: with peers, a
release on one rank would leave the others' graphs exchanging partial sums with a no-op.
"""

from __future__ import annotations

import logging
import mmap
import time
from dataclasses import dataclass

import numpy as np
import torch

from dspark_sidecar.kernels.triton.step_meta import FLAG_RAN, step_meta
from dspark_sidecar.proto import doorbell as bell
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.proto.gpu_word import DevicePointer, GpuWordOps, RegisteredPage
from dspark_sidecar.server.graphs import StepGraphs
from dspark_sidecar.server.validate import Step

log = logging.getLogger("dspark_sidecar.server")

STREAK = 2  # queue a layout after this many steps in a row used it: a miss costs one wasted graph run
READY_TIMEOUT_S = 2.0  # a rung step whose metadata program has not run by then is run the ordinary way
# The answer to a queued step waits until its GPU has started it (see take). An engine whose host
# runs far ahead of its GPU (e.g. a target forward of many ms queued before the draft step)
# would be held back by that: a wait longer than BEHIND_S stops queueing for COOLDOWN steps,
# doubled at each repeat up to MAX_COOLDOWN, and those steps answer as soon as they are launched.
BEHIND_S = 5e-3
COOLDOWN, MAX_COOLDOWN = 256, 1 << 16


@dataclass
class _Queued:
    seq: int
    key: int
    token: object  # the validated layout's cached positions view (validate.py): same object, same layout
    graph: object
    done: object  # a torch.cuda.Event recorded after the replay: the queued work has finished


class Prelaunch:
    """One doorbell's queued step: at most one at a time, on the graphs' stream (see the module docstring)."""

    def __init__(self, ops: GpuWordOps, page: bell.Page, page_ptr: int, graphs: StepGraphs, window: int,
                 count=lambda hit: None, event=torch.cuda.Event, program=step_meta) -> None:
        """count(hit): told each time a queued step is used or released unused (metrics).
        event, program: the CUDA event class and the metadata program (tests pass CPU stand-ins)."""
        self.ops, self.page, self.graphs, self.window, self._count = ops, page, graphs, window, count
        self._event, self._program = event, program
        self._header = RegisteredPage(ops, page_ptr)
        self._word = DevicePointer(self._header.device_ptr + bell.GPU_WORD_OFFSET, torch.int64)
        # The program's flag lives in a page of our own, registered like the header: the host
        # reads it once `ready` has passed, with no device-to-host copy.
        self._flag_buf = mmap.mmap(-1, mmap.PAGESIZE)
        self._flag_host = np.frombuffer(self._flag_buf, dtype=np.int32)  # [r]: request r's FLAG_*
        self._flag_page = RegisteredPage(ops, self._flag_host.ctypes.data)
        self._flag = DevicePointer(self._flag_page.device_ptr, torch.int32)
        self._ready = event()  # recorded after the metadata program of the queued step
        self._regions: dict[int, RegisteredPage] = {}  # metadata storages registered with the GPU
        self.queued: _Queued | None = None
        self._last: tuple | None = None  # (launch key, layout token, R) of the last step served
        self._streak = 0
        self._served: tuple | None = None  # (seq, key, step) the hook saw during the current step
        self.hits = self.misses = 0
        self.cooldown = 0  # steps left before queueing again (BEHIND_S)
        self._next_cooldown = COOLDOWN

    # During a step (RankLoop's hook, under its lock) -----------------------------------------
    def take(self, seq: int, req: pb.DraftStepRequest, step: Step) -> torch.Tensor | None:
        """The queued step's hidden states [n, hidden] if it was this step and both sides accept it; else
        None after releasing the queued work (the caller runs the step the ordinary way, after it)."""
        self._served = (seq, req.launch_key, step)
        q, self.queued = self.queued, None
        if q is None:
            return None
        same = (q.seq == seq and q.key == req.launch_key and q.token is step.positions
                and q.graph is self.graphs.captured(step.inputs_embeds, step.num_reqs, step.kv.layers))
        if same and self._waited_ready() and bool((self._flag_host[: step.num_reqs] == FLAG_RAN).all()):
            self.hits += 1
            self._count(True)
            return q.graph.out
        self._release(q)
        return None

    def _waited_ready(self) -> bool:
        """Until the program has read the region (the engine may rewrite it once answered); False on timeout."""
        start = time.perf_counter()
        while not self._ready.query():
            now = time.perf_counter()
            if now > start + READY_TIMEOUT_S:
                log.warning("prelaunch: step rung but its GPU word never arrived; running it the ordinary way")
                return False
            bell.pause(0.0)
        if time.perf_counter() - start > BEHIND_S:  # the engine's GPU was far behind its host: see BEHIND_S
            self.cooldown, self._next_cooldown = self._next_cooldown, min(2 * self._next_cooldown, MAX_COOLDOWN)
            log.info("prelaunch: the GPU started a rung step %.1f ms late; not queueing for %d steps",
                     (time.perf_counter() - start) * 1e3, self.cooldown)
        return True

    # Around the answer (the doorbell thread, under the loop's lock) --------------------------
    def settle(self) -> None:
        """Before the answer goes out: release what the step left queued (never taken: refused, aborted,
        or served by a fast path). Not after: once answered, the engine's stream may already have written
        the next step's word, which this store would lower."""
        if self.queued is not None:
            self._release(self.queued)
            self.queued = None

    def after(self, seq: int, resp: pb.DraftStepResponse) -> None:
        """After the answer: queue step seq+1 if this layout has a streak."""
        self.settle()
        served, self._served = self._served, None
        if served is None or served[0] != seq or resp.HasField("error") or not served[1]:
            self._last, self._streak = None, 0
            return
        _, key, step = served
        last = self._last
        # The same layout: the same key and the very same cached views (validate.py); never `==` on tensors.
        same = last is not None and last[0] == key and last[1] is step.positions and last[2] == step.num_reqs
        self._streak = self._streak + 1 if same else 1
        self._last = (key, step.positions, step.num_reqs)
        graph = self.graphs.captured(step.inputs_embeds, step.num_reqs, step.kv.layers)
        host_side = all(t.device.type == "cpu" for t in (step.positions, step.meta.seq_lens,
                                                          step.meta.block_tables, step.meta.slot_mapping))
        if self.cooldown:
            self.cooldown -= 1
        elif self._streak >= STREAK and graph is not None and host_side:  # the program reads host memory
            self._queue(seq + 1, key, step, graph)

    def _queue(self, seq: int, key: int, step: Step, graph) -> None:
        src = tuple(self._device_view(t) for t in (step.positions, step.meta.seq_lens, step.meta.block_tables,
                                                   step.meta.slot_mapping))
        stream = self.graphs.stream
        self._flag_host[: step.num_reqs] = 0
        self.ops.wait_geq(stream.cuda_stream, self._word.address, bell.gpu_word(seq, 0))
        try:
            self._program(self._word, bell.gpu_word(seq, key), src, graph.views, self._flag,
                          num_reqs=step.num_reqs, width=step.meta.block_tables.shape[1],
                          page_size=step.kv.page_size, window=self.window, num_pages=step.kv.num_pages)
            self._ready.record(stream)
            graph.graph.replay()
            done = self._event()
            done.record(stream)
        except BaseException:
            self._pass(seq)  # the wait is queued: pass it, or the stream stays blocked behind a step nobody runs
            raise
        self.queued = _Queued(seq, key, step.positions, graph, done)

    def _device_view(self, t: torch.Tensor) -> DevicePointer:
        """The device address of a host view into a registered region (registered here on first use)."""
        storage = t.untyped_storage()
        base = storage.data_ptr()
        reg = self._regions.get(base)
        if reg is None:
            size = -(-storage.nbytes() // mmap.PAGESIZE) * mmap.PAGESIZE
            reg = self._regions[base] = RegisteredPage(self.ops, base, size)
        return DevicePointer(reg.device_ptr + (t.data_ptr() - base), t.dtype)

    # Anything else that uses the device -------------------------------------------------------
    def release(self, wait: bool = False) -> None:
        """Let a queued step pass as a no-op; wait: until it has finished (before memory it reads goes away)."""
        q, self.queued = self.queued, None
        if q is not None:
            self._release(q)
            if wait:
                q.done.synchronize()
        self._last, self._streak = None, 0

    def _release(self, q: _Queued) -> None:
        self.misses += 1
        self._count(False)
        self._pass(q.seq)

    def _pass(self, seq: int) -> None:
        """The sidecar's own store: the wait for step seq passes, and the program sees SKIP_KEY (no
        engine sends it) and makes the step a no-op. If the engine's word for seq lands after it,
        the program may instead run that step for real: the same writes the ordinary run repeats."""
        self.page.words[bell.GPU_WORD] = bell.gpu_word(seq, bell.SKIP_KEY)

    def close(self) -> None:
        if self._flag_buf.closed:
            return
        self.release(wait=True)
        for reg in self._regions.values():
            reg.close()
        self._regions.clear()
        self._flag_page.close()
        self._header.close()
        del self._flag_host
        self._flag_buf.close()
