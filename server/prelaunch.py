"""Pre-launched doorbell steps: the next step queued on the GPU behind the doorbell's GPU word, before it is rung.

Why: on the synchronized data plane the GPU used to start a step only after two hosts had each
done their part (the engine's copies and ring, then the sidecar's parse, checks, metadata copy
and graph launch), and on a real host each CUDA call at the start of a step costs several
times its tight-loop figure. Here the sidecar queues step s+1 right after answering step s,
assuming the same layout (an engine repeats its batch shape step after step):

    expected word := (s+1) << 32 | key (a stream memory write: what the program compares with)
    wait until word >= (s+1) << 32   (proto/gpu_word.py: a stream memory operation; on ROCm a plain >=, not
                                      cyclic: no step near the sequence's wrap is queued there, WRAP_GUARD)
    staging copy                     (step_meta.Staging: the word and the engine's region, to the device)
    metadata program                 (kernels/triton/step_meta.py: reads that copy, checks it)
    graph replay                     (graphs.py: the in-place graph of this layout's R)
    gated output copy                (step_meta.gated_copy: into the engine's output slice, requests the program ran)

The staging copy and the program are the same launches for every step of a layout, so from the
layout's second queued step on they are one captured CUDA graph: launched from Python they cost
the sidecar's host 125-165 us per step on an H200's host (BENCHMARKS.md run 145), a replay ~10.
The gated copy is captured the same way (its eager launch: 44 us of each queueing, run 189).

The engine's stream writes word = (s+1) << 32 | launch_key right after its input copies, so
the GPU starts the step with neither host on the path. The host path still runs when the ring
arrives (parse, validate, rendezvous); the step is answered from the queued graph only when the
host and the GPU both accept it: same sequence, launch key and layout on the host, the metadata
program's flag RAN on the GPU. RAN means the request passed the host's index checks there, on the
bytes the engine wrote, so the rank loop runs those only for a step not answered this way
(server/rank.py). Otherwise the queued step was a no-op (the program turned it into one) or ran the
same step (writes are idempotent), and the step runs the ordinary way after it, on the same stream;
at TP > 1, a step whose copy ran on some ranks only is aborted instead (rendezvous SOME_COPIES: those
ranks skipped the host's checks).

A queued wait blocks the sidecar's stream until it is released, so nothing else may use the
device while one is pending: every other entry to the device (gRPC steps, bindings, the
doorbell's own misses, stopping) first calls `release`, which stores a word with SKIP_KEY
(the wait passes, the program makes the step a no-op).

At TP > 1 the queued graphs exchange partial sums with each other, so three things are agreed
(server/rendezvous.py offers): every rank queues step s+1 or none does (QUEUE_NEXT, in step
s's rendezvous); every rank answers from its queued copy or none does (QUEUED, posted once this
rank's copy has started); and on the GPU, between the program and the graph, the ranks
all-reduce their flags and a gate makes every request that any rank refused a no-op on every
rank (kernels/triton/step_meta.py), so no rank writes K/V computed with a peer's no-op sums.
That exchange is captured in a small CUDA graph of its own: a queued collective may wait for an
idle engine far longer than NCCL's watchdog allows work it launched eagerly. A queued graph
enters its collectives as soon as its own engine rank rings, before the rendezvous: a peer
whose engine never rings keeps it waiting inside them until that peer releases (its next step,
binding or stop), which every rank of a lockstep engine does.
"""

from __future__ import annotations

import logging
import mmap
import time
from dataclasses import dataclass

import numpy as np
import torch

from dspark_sidecar.proto import doorbell as bell
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.proto.gpu_word import DevicePointer, GpuWordOps, RegisteredPage
from dspark_sidecar.server.config import ServeConfig
from dspark_sidecar.server.graphs import StepGraphs, gc_paused
from dspark_sidecar.server.validate import Step

log = logging.getLogger("dspark_sidecar.server")

STREAK = 2  # queue a layout after this many steps in a row used it: a miss costs one wasted graph run
READY_TIMEOUT_S = 2.0  # a rung step whose metadata program has not run by then is not answered from its copy
# The answer to a queued step waits until its GPU has started it (see take). An engine whose host
# runs far ahead of its GPU (e.g. a target forward of many ms queued before the draft step)
# would be held back by that: a wait longer than BEHIND_S stops queueing for COOLDOWN steps,
# doubled at each repeat up to MAX_COOLDOWN, and those steps answer as soon as they are launched.
# The doorbell keeps timing those steps' words between steps (watch): ON_TIME of them in a row
# within BEHIND_S of their ring end the cooldown early and reset the doubling, so an engine that
# was ahead for a while (a long prefill, say) gets pre-launched steps back a few steps after it
# synchronizes again, not hundreds of steps later (BENCHMARKS.md run 134).
# From about 1 ms ahead the ordinary launch is hidden too, at ~4 us more GPU time per step (BENCHMARKS.md
# run 127); an engine that wants its host back sooner sets serve --prelaunch-behind-ms lower.
BEHIND_S = ServeConfig.prelaunch_behind_ms / 1e3  # the serve flag's default, in seconds
COOLDOWN, MAX_COOLDOWN = 256, 1 << 16
# How long release(wait=True) waits for a released queued step to finish before the rank gives up on
# its device (the caller exits the rank): re-stored releases (repass) leave only a wedged device, or
# at TP > 1 a peer that never releases its own copy, to wait for.
RELEASE_WAIT_S = 60.0
ON_TIME = 8  # cooldown steps in a row whose word was on time: the cooldown ends (watch)
# HIP's wait is a plain >= on the word (proto/gpu_word.py), where CUDA's and the host's (_word_reached) compare
# cyclically. Near the 32-bit sequence's wrap they disagree: a wait for the first steps after it passes on an
# older step's word (its staging copy may then read the region as the engine rewrites it), and a released wait
# for a step just before it, reached by the stream only once the engine's next word (0 << 32 | key) is there,
# never passes, while repass sees it passed and stores nothing: the rank's stream blocked for good. So on HIP
# no step within WRAP_GUARD steps of the wrap is queued (nor of 2^31, the edge a signed compare would have: no
# AMD GPU here to tell which ROCm's is); the words a wait meets are from a few steps around its own. A page's
# first WRAP_GUARD steps are queued: its sequence starts at 0, so they follow no edge (_near_wrap).
WRAP_GUARD = 1 << 16


@dataclass
class _Queued:
    seq: int
    key: int
    token: object  # the validated layout's cached positions view (validate.py): same object, same layout
    graph: object
    done: object  # a torch.cuda.Event recorded after the replay: the queued work has finished
    out: object = None  # the engine's output slice [n, hidden] the replay's rows were copied into (gated), or None


class Prelaunch:
    """One doorbell's queued step: at most one at a time, on the graphs' stream (see the module docstring)."""

    def __init__(self, ops: GpuWordOps, page: bell.Page, page_ptr: int, graphs: StepGraphs, window: int,
                 count=lambda hit: None, event=torch.cuda.Event, program=None, exchange=None,
                 gate=None, capture=None, device: torch.device | str = "cpu", max_reqs: int = 256,
                 staging=None, behind_s: float = BEHIND_S, output_of=None, copy_out=None) -> None:
        """count(hit): told each time a queued step is used or released unused (metrics).
        exchange(t): TP > 1, the ranks' all-reduce MAX of int32 flags t on the current stream; None on one rank.
        device, max_reqs: where the flags are exchanged (the rank's GPU), and for up to how many requests.
        event, program, gate, capture: the CUDA event class, the metadata program, the flags' gate and
        how a function becomes a replayable graph (tests pass CPU stand-ins); program, gate and copy_out
        default to step_meta's.
        staging: where the program's sources are copied first (step_meta.Staging); on a GPU, the
        device's own, made here unless given; elsewhere none unless given (the program reads in place).
        behind_s: the cooldown's threshold (serve --prelaunch-behind-ms).
        output_of(step, out): the engine's output slice of `step` for hidden states like `out` (a view
        of its region; None: inline, or not resolvable); given, and on the graph's device, the queued
        step's rows go there on the GPU behind the replay, through copy_out(src, dst, flags, R), gated
        by the program's flags (step_meta.gated_copy), and the answer's host path copies nothing.
        program, copy_out and staging's launch also take warm=True: compile and load, queue nothing
        (`_replay_of`)."""
        # Imported here, not with the module: Triton is an optional extra (pyproject.toml), and every rank
        # imports this module (servicer, doorbell), the CPU's reference-ops ranks included, which never
        # queue a step. A module-level import ended every rank of a `serve` or `demo` without Triton.
        from dspark_sidecar.kernels.triton import step_meta as meta

        program = meta.step_meta if program is None else program
        gate = meta.step_gate if gate is None else gate
        copy_out = meta.gated_copy if copy_out is None else copy_out
        self._flag_ran = meta.FLAG_RAN
        self._hip = ops.hip  # the GPU's wait on the word is not cyclic (WRAP_GUARD)
        self.ops, self.page, self.graphs, self.window, self._count = ops, page, graphs, window, count
        self._event, self._program, self._exchange, self._gate = event, program, exchange, gate
        self._capture = capture or (_capture_graph if torch.device(device).type == "cuda" else _uncaptured)
        if staging is None and torch.device(device).type == "cuda":
            staging = meta.Staging(device)
        self._staging = staging
        self.behind_s = behind_s
        self._output_of, self._copy_out = output_of, copy_out
        self._out_ready = False  # the queued copy wrote the current step's output slice (offer's view)
        self._agreements: dict[tuple, tuple] = {}  # (R, slot input's address) -> (that view, replay of exchange + gate)
        # A layout's metadata launches and its gated copy (_replay_of): key -> (what their addresses belong
        # to, replay or None)
        self._replays: dict[tuple, tuple] = {}
        # The program's expected word, written on the stream ahead of each queued step (int64 [1]).
        self._expect = torch.zeros(1, dtype=torch.int64, device=device)
        # The program's flags in device memory: exchanged there at TP > 1, read by the gated output copy.
        self._dev_flags = torch.zeros(max_reqs, dtype=torch.int32, device=device)
        self._header = RegisteredPage(ops, page_ptr)
        self._word = DevicePointer(self._header.device_ptr + bell.GPU_WORD_OFFSET, torch.int64)
        # The program's flag lives in a page of our own, registered like the header: the host
        # reads it once `ready` has passed, with no device-to-host copy.
        self._flag_buf = mmap.mmap(-1, mmap.PAGESIZE)
        self._flag_host = np.frombuffer(self._flag_buf, dtype=np.int32)  # [r]: request r's FLAG_*
        try:
            self._flag_page = RegisteredPage(ops, self._flag_host.ctypes.data)
        except BaseException:  # refused (the doorbell goes on without us): nothing else would end the header's
            self._header.close()
            raise
        self._flag = DevicePointer(self._flag_page.device_ptr, torch.int32)
        self._ready = event()  # recorded after the metadata program of the queued step
        self._regions: dict[int, RegisteredPage] = {}  # metadata storages registered with the GPU
        self._detached = False  # detach() called: out of use, its memory freed by the finish() it returned
        self.queued: _Queued | None = None
        self._passed: _Queued | None = None  # the newest released step not yet seen finished (repass)
        self._last: tuple | None = None  # (launch key, layout token, R) of the last step served
        self._streak = 0
        self._served: tuple | None = None  # (seq, key, step, graph) offered during the current step
        self._accepted = False  # the queued step is the current one and ran (offer's local view)
        self._queue_next = False  # the verdict's QUEUE_NEXT for the current step (take)
        self.hits = self.misses = 0
        self.cooldown = 0  # steps left before queueing again (BEHIND_S)
        self._next_cooldown = COOLDOWN
        self._watched: tuple[int, float] | None = None  # (seq, ring time) of a cooldown step whose word is awaited
        self._on_time = 0  # cooldown steps in a row whose word arrived within behind_s of their ring
        self.word_wait_ns = self.start_wait_ns = 0  # the current step's waits in offer (StepTimings)

    # During a step (RankLoop's hook, under its lock) -----------------------------------------
    def hook(self, seq: int, req: pb.DraftStepRequest) -> "StepHook":
        """What the rank loop calls during doorbell step `seq` (server/rank.py)."""
        # This step's waits (offer's _waited_ready), for its StepTimings: 0 unless offer sees its queued copy.
        # Here, not in offer: a step on the kernel fast path never offers, and reported the last hit's waits.
        self.word_wait_ns = self.start_wait_ns = 0
        return StepHook(self, seq, req)

    def offer(self, seq: int, req: pb.DraftStepRequest, step: Step) -> tuple[bool, bool]:
        """Before the rendezvous: (the queued step is this one and ran, this rank would queue the next).

        The first waits until the queued copy has started on the GPU (at TP > 1: until every rank's
        has, and their flags are exchanged); nothing is released here, `take` does what was agreed.
        """
        if self._watched is not None:  # the last cooldown step's word had not arrived by this ring: no evidence
            log.debug("prelaunch: cooldown step %d: its word not seen before step %d rang", self._watched[0], seq)
            self._watched, self._on_time = None, 0
        if self.cooldown:
            self._watched = (seq, time.perf_counter())
            self.watch()  # a synchronized engine's word is here before its ring
        graph = self.graphs.captured(step.inputs_embeds, step.num_reqs, step.kv.layers)
        self._served, self._queue_next = (seq, req.launch_key, step, graph), False
        q = self.queued
        same = (q is not None and q.seq == seq and q.key == req.launch_key and q.token is step.positions
                and q.graph is graph)
        self._accepted = same and self._waited_ready(seq) and bool((self._flag_host[: step.num_reqs] == self._flag_ran).all())
        # The launch key promises the same slices (sidecar.proto), output included; checked all the same.
        self._out_ready = self._accepted and q.out is not None and _same_view(q.out, self._output_of(step, q.out))
        streak = self._streak + 1 if self._repeats(req.launch_key, step) else 1
        host_side = all(t.device.type == "cpu" for t in step.region_meta)
        # host_side: the program reads the engine's host region; cooldown: see BEHIND_S. SKIP_KEY is our own
        # release word (_pass), which the proto does not forbid an engine: a step queued under it would be rung
        # by its release, and run the old layout's step for an engine that fell back.
        nxt = (req.launch_key not in (0, bell.SKIP_KEY) and streak >= STREAK and graph is not None and host_side
               and not self.cooldown and not self._near_wrap(seq + 1))
        return self._accepted, nxt

    def _near_wrap(self, seq: int) -> bool:
        """On HIP: step seq's wait could meet words its plain >= orders unlike the host (WRAP_GUARD)."""
        if not self._hip or seq < WRAP_GUARD:
            # A page's first steps (its sequence starts at 0, its word 0) cross no edge, and every word their
            # waits meet is of step 0 or later: guarded, HIP queued nothing before each attach's 65536th step.
            return False
        r = seq % (1 << 31)  # the distance to 0 (the wrap) or to 2^31, whichever is nearer
        return r < WRAP_GUARD or r > (1 << 31) - WRAP_GUARD

    def _repeats(self, key: int, step: Step) -> bool:
        """The last step served had this layout: the same key and the very same cached views
        (validate.py); never `==` on tensors."""
        last = self._last
        return last is not None and last[0] == key and last[1] is step.positions and last[2] == step.num_reqs

    def take(self, queued: bool, queue_next: bool) -> torch.Tensor | None:
        """After GO, with the verdict's QUEUED and QUEUE_NEXT: the queued step's hidden states [n, hidden]
        if every rank answers from its copy; else None after releasing it (the caller runs the step
        the ordinary way, after it, on the same stream)."""
        self._queue_next = queue_next
        q, self.queued = self.queued, None
        if q is None:
            return None
        if queued and self._accepted:
            self.hits += 1
            self._count(True)
            return q.out if self._out_ready else q.graph.out
        self._release(q)
        return None

    def watch(self) -> None:
        """Between steps (the doorbell's poll, its thread): time a cooldown step's word once it arrives.

        Judged like a queued step's (_waited_ready): late past behind_s, the engine's GPU is still
        far behind its host. On time ON_TIME steps in a row, it no longer is: the cooldown ends.
        """
        if self._watched is None:
            return
        seq, rung_at = self._watched
        waited = time.perf_counter() - rung_at
        late = waited > self.behind_s
        if not self._word_reached(seq):
            if late:  # no need to see it land
                log.debug("prelaunch: cooldown step %d: its word not there %.2f ms after the ring", seq, waited * 1e3)
                self._watched, self._on_time = None, 0
            return
        log.debug("prelaunch: cooldown step %d: its word seen %.2f ms after the ring", seq, waited * 1e3)
        # Seen now; it landed after the last look that missed it. The doorbell looks at the ring and
        # every few tens of us between steps, but not during one (a graph capture takes tens of ms):
        # seen only after behind_s, it was late or cannot be placed, and the count starts over.
        self._watched = None
        if late:
            self._on_time = 0
            return
        self._on_time += 1
        if self._on_time >= ON_TIME and self.cooldown:
            log.info("prelaunch: the engine's GPU reached %d steps in a row within %.1f ms of their ring; "
                     "queueing again (%d cooldown steps left unused)", self._on_time, self.behind_s * 1e3,
                     self.cooldown)
            self.cooldown, self._next_cooldown, self._on_time = 0, COOLDOWN, 0

    def _word_reached(self, seq: int) -> bool:
        """This engine's stream has written the GPU word of step `seq` (or a later one): (int64)(word - seq's) >= 0."""
        return (int(self.page.words[bell.GPU_WORD]) - bell.gpu_word(seq, 0)) % (1 << 64) < 1 << 63

    def _waited_ready(self, seq: int) -> bool:
        """Until the program has read the region (the engine may rewrite it once answered); False on timeout.

        The cooldown (BEHIND_S) is judged on this engine's own word: how long after the ring its
        stream wrote it. The rest of the wait (at TP > 1 the peers' words and the flags' exchange,
        and once per flags' graph every rank's capture, ~45 ms: run 92) says nothing of this
        engine, and one rank's cooldown vetoes queueing on every rank.
        """
        start = time.perf_counter()
        own = None  # seconds until this engine's word for `seq` was seen
        while True:
            if own is None and self._word_reached(seq):  # as the stream's wait compares
                own = time.perf_counter() - start
            if self._ready.query():
                break
            if time.perf_counter() > start + READY_TIMEOUT_S:
                log.warning("prelaunch: step rung but its GPU word (or, at TP > 1, a peer's) never arrived; "
                            "not answering it from its copy")
                waited = time.perf_counter() - start
                self.word_wait_ns, self.start_wait_ns = int((waited if own is None else own) * 1e9), int(waited * 1e9)
                # This engine's own word later than behind_s (or never, so far): a cooldown, as below, whatever
                # kept the peers; else every step queued waits out this timeout. Seen late, it once started none.
                if own is None or own > self.behind_s:
                    self._start_cooldown(waited if own is None else own)
                return False
            bell.pause(0.0)
        waited = time.perf_counter() - start
        own = waited if own is None else own  # seen between two polls
        self.word_wait_ns, self.start_wait_ns = int(own * 1e9), int(waited * 1e9)
        if own > self.behind_s:  # the engine's GPU far behind its host: see BEHIND_S
            self._start_cooldown(own)
        return True

    def _start_cooldown(self, own: float) -> None:
        # A late word breaks the row (watch): on-time steps of a cooldown that ran out before ON_TIME of
        # them, counted on, ended this one after a single on-time step and reset the doubling.
        self._on_time = 0
        self.cooldown, self._next_cooldown = self._next_cooldown, min(2 * self._next_cooldown, MAX_COOLDOWN)
        log.info("prelaunch: the engine's GPU reached a rung step %.1f ms late (or not yet); not queueing for %d "
                 "steps", own * 1e3, self.cooldown)

    # Around the answer (the doorbell thread, under the loop's lock) --------------------------
    def settle(self) -> None:
        """Before the answer goes out: release what the step left queued (never taken: refused, aborted,
        or served by a fast path). Not after: once answered, the engine's stream may already have written
        the next step's word, which this store would lower."""
        # Out of `queued` first, as in release() and take(): left there by a count that raised, the step
        # was both queued and released, and repass stores nothing while a step is queued.
        q, self.queued = self.queued, None
        if q is not None:
            self._release(q)

    def after(self, seq: int, resp: pb.DraftStepResponse) -> None:
        """After the answer: queue step seq+1 if the verdict said so (every rank does the same)."""
        self.settle()
        served, self._served = self._served, None
        go, self._queue_next = self._queue_next, False
        if served is None or served[0] != seq:
            self._last, self._streak = None, 0
            return
        _, key, step, graph = served
        if resp.HasField("error") or not key:
            self._last, self._streak = None, 0
        else:
            self._streak = self._streak + 1 if self._repeats(key, step) else 1
            self._last = (key, step.positions, step.num_reqs)
        if self.cooldown:
            self.cooldown -= 1
        # Queued whatever this rank's own answer was: its peers queue too (the verdict), and a queued
        # step that turns out not to be the next one is released, its collectives paired with theirs.
        if go and graph is not None:
            self._queue(seq + 1, key, step, graph)

    def _queue(self, seq: int, key: int, step: Step, graph) -> None:
        # The region itself, not the step's private copy (validate.PrivateCopy): the program runs after the
        # engine's next write there, and checks what it reads.
        sources = [self._device_view(t) for t in step.region_meta]
        stream = self.graphs.stream
        self._flag_host[: step.num_reqs] = 0
        agree = self._agreement(graph, step.num_reqs) if self._exchange is not None else None
        metadata = self._metadata(step, graph, sources, agree is not None)  # captured before the wait is queued
        out = self._output_of(step, graph.out) if self._output_of is not None else None
        if out is not None and out.device != graph.out.device:
            # A slice in host memory (a shared-memory region, which the proto allows): the gated copy is a
            # GPU kernel that cannot reach it, and failed behind the wait. The answer's host path copies there.
            out = None
        copy = self._copy(graph.out, out, step.num_reqs) if out is not None else None  # so is this
        # Ahead of the wait, in stream order after the last program that read the previous value.
        self.ops.write(stream.cuda_stream, self._expect.data_ptr(), bell.gpu_word(seq, key))
        self.ops.wait_geq(stream.cuda_stream, self._word.address, bell.gpu_word(seq, 0))
        try:
            metadata()
            if agree is not None:
                agree()  # every rank's flags, MAX; the gate writes them to the host's page
            self._ready.record(stream)
            graph.graph.replay()
            if copy is not None:
                copy()
            done = self._event()
            done.record(stream)
        except BaseException:
            self._pass(seq)  # the wait is queued: pass it, or the stream stays blocked behind a step nobody runs
            self._track_pass(seq, key, stream)
            raise
        self.queued = _Queued(seq, key, step.positions, graph, done, out)

    def _metadata(self, step: Step, graph, sources: list, exchanged: bool):
        """The staging copy and the program for this layout, as one call (_replay_of).

        Every argument but the expected word (read from `_expect`) is an address or a shape fixed by
        the layout. An entry holds what its addresses belong to (the graph's static inputs, the
        engine's region views and, once captured, the staging buffer the capture copies into); a
        buffer grown later for another layout leaves the captured copy and its program on the old one."""
        flag = self._dev_flags if exchanged else self._flag
        kw = dict(num_reqs=step.num_reqs, width=step.meta.block_tables.shape[1], page_size=step.kv.page_size,
                  window=self.window, num_pages=step.kv.num_pages)
        key = ("metadata", tuple((ptr.address, nbytes, region) for ptr, nbytes, region in sources),
               tuple(v.data_ptr() for v in graph.views), exchanged, *kw.values())

        views = graph.views  # the closure holds these, never the graph: a rebind drops graphs with their memory

        def run_metadata(warm: bool = False) -> None:
            word, src = self._word, tuple(ptr for ptr, _, _ in sources)
            if self._staging is not None:  # copied once after the wait, then read on the device
                word, src = self._staging.stage(self._word, sources, warm=warm)
            self._program(word, self._expect, src, views, flag, mirror=self._dev_flags, warm=warm, **kw)

        def reserve() -> tuple:  # grown before the capture, which must not allocate: the buffer it bakes in
            if self._staging is None:
                return ()
            self._staging.reserve(sources)
            return (self._staging.buf,)

        hold = (graph.views, *step.region_meta)
        return self._replay_of(key, hold, run_metadata, reserve)

    def _copy(self, src: torch.Tensor, dst: torch.Tensor, R: int):
        """The gated copy of the graph's rows src into the engine's slice dst, as one call (_replay_of)."""
        key = ("copy", src.data_ptr(), dst.data_ptr(), tuple(dst.shape), dst.dtype, R)

        def run_copy(warm: bool = False) -> None:
            self._copy_out(src, dst, self._dev_flags, R, warm=warm)

        return self._replay_of(key, (src, dst), run_copy)

    def _replay_of(self, key: tuple, hold: tuple, fn, reserve=None):
        """fn itself at a key's first sight, which keeps a one-off layout from costing a capture; at the
        second, fn captured (before the wait is queued: a capture synchronizes the device, and the stream
        must not be blocked then) and from then on its replay. The entry holds `hold` (and what
        reserve(), run before the capture, returns), so no address baked into a replay is reused under
        its key while the entry lives.

        At first sight fn(warm=True) compiles its kernels and loads their code here, before the caller
        queues the wait: loaded at fn's launch behind the wait, the code waited for the wait to pass,
        i.e. for the engine's next step, and an engine whose next call needed the rank lock (a gRPC step,
        a BindKV) deadlocked with this thread (step_meta._launch, BENCHMARKS.md run 265)."""
        entry = self._replays.get(key)
        if entry is not None and entry[1] is not None:
            return entry[1]
        if entry is None:  # first sight
            if len(self._replays) >= 128:  # layouts gone (a rebind drops their graphs)
                self._replays.clear()
            fn(warm=True)
            self._replays[key] = (hold, None)
            return fn
        held = entry[0] + (reserve() if reserve is not None else ())
        self._settle()
        replay = self._capture(fn)
        self._replays[key] = (held, replay)
        return replay

    def _agreement(self, graph, R: int):
        """The replay of [all-reduce MAX of the R flags, gate] for this step graph's slot input, captured
        on first use (every rank reaches it at the same queued step: QUEUE_NEXT is agreed). An entry
        holds only that slot view, never the step graph: graphs.py drops those on a rebind, with
        their memory, and the view it holds keeps its address from being reused under the key."""
        slots = graph.views[2]
        key = (R, slots.data_ptr())
        got = self._agreements.get(key)
        if got is None:
            flags = self._dev_flags[:R]

            def agree() -> None:
                self._exchange(flags)
                self._gate(self._dev_flags, self._flag, slots, R)

            if len(self._agreements) >= 64:  # slot inputs of graphs gone (a rebind drops them)
                self._agreements.clear()
            self._settle()
            got = self._agreements[key] = (slots, self._capture(agree))
        return got[1]

    def _device_view(self, t: torch.Tensor) -> tuple[DevicePointer, int, tuple[int, int]]:
        """A host view into a registered region (registered here on first use): its device address,
        its bytes, and the registration's (device address, bytes), page-aligned and page-rounded."""
        storage = t.untyped_storage()
        base = storage.data_ptr()
        size = -(-storage.nbytes() // mmap.PAGESIZE) * mmap.PAGESIZE
        reg = self._regions.get(base)
        if reg is None:
            reg = self._regions[base] = RegisteredPage(self.ops, base, size)
        return (DevicePointer(reg.device_ptr + (t.data_ptr() - base), t.dtype), t.numel() * t.element_size(),
                (reg.device_ptr, size))

    # Anything else that uses the device -------------------------------------------------------
    def release(self, wait: bool = False) -> None:
        """Let a queued step pass as a no-op; wait: until every released step has finished (before
        memory they read goes away), re-storing the release as repass() says. RuntimeError when they
        have not after RELEASE_WAIT_S: the device (or a peer's copy) is stuck, and nothing the rank
        queues after them can be trusted to run."""
        q, self.queued = self.queued, None
        if q is not None:
            self._release(q)
        self._last, self._streak = None, 0
        if wait:
            self._wait_released()

    def _wait_released(self) -> None:
        deadline = time.monotonic() + RELEASE_WAIT_S
        while not self.repass():
            if time.monotonic() > deadline:
                raise RuntimeError(f"a released queued step (step {self._passed.seq}) has not finished "
                                   f"{RELEASE_WAIT_S:.0f} s after its release: the device, or a peer's copy, is stuck")
            bell.pause(0.0)

    def _settle(self) -> None:
        """Before a capture, which synchronizes the device with nothing to re-store a release meanwhile:
        until every released step has finished (nothing is queued here: _queue runs after settle())."""
        if self.queued is None:
            self._wait_released()  # at once when nothing was released (repass)

    @property
    def passing(self) -> bool:
        """A released step not yet seen finished (repass has work)."""
        return self._passed is not None

    def repass(self) -> bool:
        """Whether every released step has finished; if not, the release stored again where it was undone.

        The release is a host store into the word the engine's stream also writes, and the two are
        not ordered: an engine whose GPU runs behind its host can land an older step's word after the
        store (its word for step s lands after the sidecar released the queued step s+1). The wait
        then blocks again, for a word the engine may never write (it stopped, or fell back), and with
        it everything behind it on the stream. Stored again, it passes; once the newest released
        step has finished, nothing older can land in front of it. Only while nothing is queued: a
        queued step waits for the engine's word anyway, and the released ones before it with it.
        Under the rank loop's lock (RankLoop's device waits poll it, server/rank.py)."""
        q = self._passed
        if q is None:
            return True
        if q.done.query():
            self._passed = None
            return True
        if self.queued is None and not self._word_reached(q.seq):
            self._pass(q.seq)
        return False

    def _track_pass(self, seq: int, key: int, stream) -> None:
        """A wait passed before its step was queued whole (_queue failed): kept for repass like a released
        step, behind an event of its own, if the device still takes one."""
        try:
            done = self._event()
            done.record(stream)
        except Exception:  # noqa: BLE001  (the device failed: the caller's error says so; nothing to track)
            log.exception("prelaunch: no event behind the passed wait of step %d", seq)
            return
        self._passed = _Queued(seq, key, None, None, done)

    def _release(self, q: _Queued) -> None:
        # The word and its tracking first: a count that raised (the metrics callback) left the step's stream
        # waiting on a word nobody writes, and repass() with nothing to store again.
        self._pass(q.seq)
        self._passed = q  # on the one stream: finished, it has the older released steps behind it
        self.misses += 1
        self._count(False)

    def _pass(self, seq: int) -> None:
        """The sidecar's own store: the wait for step seq passes, and the program sees SKIP_KEY (no
        engine sends it) and makes the step a no-op. If the engine's word for seq lands after it,
        the program may instead run that step for real: the same writes the ordinary run repeats."""
        self.page.words[bell.GPU_WORD] = bell.gpu_word(seq, bell.SKIP_KEY)

    def forget_regions(self):
        """The engine's regions are being released (UnregisterBuffers): stop using anything that reads
        them. The queued step is released (not waited for); the layouts' captured metadata copies and
        gated output copies (their addresses are in the regions) and the registrations of the metadata
        pages are taken out of use. Returns finish(), to call once the device has done all work queued
        so far: it ends the registrations (before the pages may be unmapped) and lets the copies go.
        Nothing is queued from a step of the old regions: the next one served starts a new streak."""
        self.release()
        self._served = None
        pages, replays = list(self._regions.values()), self._replays
        self._regions, self._replays = {}, {}

        def finish() -> None:
            for reg in pages:
                reg.close()
            replays.clear()

        return finish

    def detach(self):
        """Out of use for good: the queued step released, without a host wait (a released copy at
        TP > 1 finishes only with its peers'). Returns finish(), to call once the device has done all
        work queued so far (RankLoop.after_device): it ends the page registrations, the region pages'
        and this pre-launch's own (the header, the flag page, which the copies' programs and gates
        write through), and lets the captured copies and exchanges go."""
        if self._flag_buf.closed or self._detached:
            return lambda: None
        self._detached = True
        regions = self.forget_regions()
        agreements, self._agreements = self._agreements, {}
        flag_page, header, flag_buf = self._flag_page, self._header, self._flag_buf
        self._flag_host = None  # its only view of the flag page's memory: the unmap below needs none left

        def finish() -> None:
            self._passed = None  # finished with everything else; the page may be closed next (repass reads it)
            regions()
            agreements.clear()  # graphs holding collectives go before the communicator does (app.py)
            flag_page.close()
            header.close()
            flag_buf.close()

        return finish

    def close(self) -> None:
        """Release and wait for the queued step, then free everything at once (TP 1, tests)."""
        if self._flag_buf.closed or self._detached:
            return
        self.release(wait=True)
        self.detach()()


def _same_view(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """The same memory seen the same way (a cached region view may be rebuilt as another object)."""
    return (a is not None and b is not None and a.data_ptr() == b.data_ptr() and a.shape == b.shape
            and a.dtype == b.dtype)


class StepHook:
    """One doorbell step's view of the pre-launch, for the rank loop (server/rank.py)."""

    def __init__(self, pl: Prelaunch, seq: int, req: pb.DraftStepRequest) -> None:
        self.pl, self.seq, self.req = pl, seq, req

    def offer(self, step: Step) -> tuple[bool, bool]:
        return self.pl.offer(self.seq, self.req, step)

    def take(self, queued: bool, queue_next: bool) -> torch.Tensor | None:
        return self.pl.take(queued, queue_next)

    def waits_ns(self) -> tuple[int, int]:
        """(until the engine's GPU word was seen, until the queued copy had started) during offer, ns."""
        return self.pl.word_wait_ns, self.pl.start_wait_ns


def _uncaptured(fn):
    """Off CUDA (tests' CPU stand-ins): the function itself is its replay."""
    return fn


def _capture_graph(fn):
    """fn captured in a CUDA graph, returned as its replay. Collectives in a graph replay are not
    tracked by NCCL's watchdog; launched eagerly, a queued one waiting for an idle engine would be."""
    graph = torch.cuda.CUDAGraph()
    with gc_paused(), torch.cuda.graph(graph, capture_error_mode="thread_local"):
        fn()
    return graph.replay
