"""CUDA graphs of the draft step, one per request count R (two where both transports serve it), replayed on fixed inputs.

Eager launches of ~30 kernels per layer cost milliseconds of Python and launch overhead per
step; a replay costs one launch. Shapes must not depend on the step's contents, so the
attention is addressed through window-relative metadata (drafter.kv_cache.window_metadata,
fixed width), and each graph is bound to the KV cache's addresses and strides: a re-bind drops them.

A step's metadata (positions, window-relative positions, slots, lengths, block tables) is
computed in NumPy straight into a pinned staging buffer and reaches the graph's static inputs
in one asynchronous host-to-device copy. Two staging slots alternate; before a slot is
rewritten the host waits on the event recorded after its last copy, which has normally run long
before (the host never waits on the step's compute itself). The embeddings are read in place
when they sit in a registered region (the data plane: the same memory every step); otherwise
they are copied into a static buffer first.

Given two or more streams, a graph of more than 8 requests runs its launch groups side by side
on them (model.draft_step): the fork from the replay's stream and the joins are graph edges.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from dataclasses import dataclass

import numpy as np
import torch

from dspark_sidecar import layout
from dspark_sidecar.drafter.kv_cache import StepMetadata, window_metadata_into, window_width
from dspark_sidecar.drafter.model import DSparkDrafter
from dspark_sidecar.server.validate import HostMeta

log = logging.getLogger("dspark_sidecar.server")


def launch_streams(n: int, device: torch.device) -> list[torch.cuda.Stream]:
    """The n streams a step's launch groups run on side by side (model.draft_step); none for n <= 1,
    where they run in order on the caller's stream."""
    return [torch.cuda.Stream(device) for _ in range(n)] if n > 1 else []


class _Packed:
    """Byte layout of one R's metadata: int64 positions, rel positions, slots [n]; int32 lens [R], tables [R, w]."""

    def __init__(self, R: int, width: int) -> None:
        n = layout.QPR * R
        self.R, self.n, self.width = R, n, width
        self.nbytes = 3 * n * 8 + R * 4 + R * width * 4

    def views(self, buf):
        """Typed views of one buffer (torch uint8 or NumPy uint8) in this layout."""
        i64, i32 = (torch.int64, torch.int32) if isinstance(buf, torch.Tensor) else (np.int64, np.int32)
        n, R, w = self.n, self.R, self.width
        o = 24 * n
        return (buf[: 8 * n].view(i64), buf[8 * n : 16 * n].view(i64), buf[16 * n : o].view(i64),
                buf[o : o + 4 * R].view(i32), buf[o + 4 * R : o + 4 * R + 4 * R * w].view(i32).reshape(R, w))


def _kv_key(kv: list[torch.Tensor]) -> tuple:
    """What a captured graph is bound to: the cache layers' addresses, shapes, strides and dtypes (a
    bound view may have any layout's strides and be bf16 or fp8 codes, which the kernels bake in: a
    re-bind at the same address in another layout or dtype must not replay the old graphs)."""
    return tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in kv)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    embeds: torch.Tensor  # [n, hidden]: a static buffer, or the registered region the graph reads in place
    meta: torch.Tensor  # uint8 [packed.nbytes] on the device; the graph reads its typed views
    views: tuple  # positions, rel positions, slots (int64 [n]); seq lens int32 [R]; tables int32 [R, w]
    staging: list  # 2 x (pinned uint8 [nbytes], its NumPy views, event after its copy)
    out: torch.Tensor  # [n, hidden]
    flip: int = 0


class StepGraphs:
    def __init__(self, model: DSparkDrafter, page_size_of, streams: list[torch.cuda.Stream] | None = None) -> None:
        self.model = model
        self.streams = list(streams or [])  # >= 2: each graph runs its launch groups side by side (model.draft_step)
        self._page_size_of = page_size_of  # () -> the bound cache's page size
        self._graphs: dict[int, _Graph] = {}
        self._kv_key: tuple | None = None
        self.captures = 0
        # Steps run on the device's default stream, from whichever thread (doorbell or worker);
        # looking it up costs ~6 us per call, so once here.
        self._stream = torch.cuda.current_stream(model.device)

    @property
    def stream(self) -> torch.cuda.Stream:
        """The stream every replay goes to."""
        return self._stream

    def captured(self, embeds: torch.Tensor | None, R: int, kv: list[torch.Tensor]):
        """The graph a step of R requests reading `embeds` in place would replay now, if it is captured."""
        if embeds is None or self._kv_key != _kv_key(kv):
            return None
        g = self._graphs.get((R, True))
        # The view itself, not only its address: the ordinary path reads a region in place only in the
        # model's dtype (rank._execute); the same bytes named in another dtype go through the static buffer.
        return (g if g is not None and g.embeds.data_ptr() == embeds.data_ptr() and g.embeds.dtype == embeds.dtype
                and g.embeds.shape == embeds.shape else None)

    def run(self, embeds: torch.Tensor, host: HostMeta, kv: list[torch.Tensor], in_place: bool = False) -> torch.Tensor:
        """embeds [n, hidden] on the device; the step's metadata as NumPy on the host (validate.py).
        Returns the graph's output buffer [n, hidden] (valid until the next step); on the step that
        captures the graph, the warm-up's hidden states (_capture says why).

        in_place: embeds is a view of a registered region (the data plane), memory that outlives the
        graph. One graph per R is captured reading that view in place, which saves the copy into a
        static buffer (a CUDA call on the step's critical path); a step whose view is elsewhere uses
        the static-buffer graph, so there are at most two graphs per R.
        """
        key = _kv_key(kv)
        ps = self._page_size_of()
        if key != self._kv_key:  # a new binding: graphs hold the old cache's addresses
            self._graphs.clear()
            self._kv_key = key
        R = host.seq_lens.shape[0]
        g, in_place = self._find(embeds, R, in_place)
        fresh = g is None
        if fresh:
            g = self._buffers(R, window_width(ps, self.model.cfg.sliding_window), embeds if in_place else None)
        self._fill(g, embeds, host, ps)
        if fresh:
            out = self._capture(g, kv)
            self._graphs[(R, in_place)] = g
            return out  # the warm-up ran this step: a replay now would run its collectives twice
        g.graph.replay()
        return g.out

    def _find(self, embeds: torch.Tensor, R: int, in_place: bool) -> tuple["_Graph | None", bool]:
        """The graph a step of R requests on `embeds` replays, and whether it reads them in place."""
        g = self._graphs.get((R, in_place))
        if in_place and g is not None and g.embeds.data_ptr() != embeds.data_ptr():
            return self._graphs.get((R, False)), False  # another slice than the one captured on
        return g, in_place

    def will_capture(self, embeds: torch.Tensor, R: int, kv: list[torch.Tensor], in_place: bool = False) -> bool:
        """Whether run() with these arguments captures a graph (which synchronizes the device)."""
        return _kv_key(kv) != self._kv_key or self._find(embeds, R, in_place)[0] is None

    def drop_in_place(self) -> list:
        """Take the graphs that read a registered region in place out of use (the region is being
        released); returns them, for the caller to keep until the device has finished what it queued
        (a replay may still read the region). Their next step captures again: alone on this rank,
        which is safe since a capture step runs its collectives once (_capture)."""
        return [self._graphs.pop(key) for key in [key for key in self._graphs if key[1]]]

    def close(self) -> None:
        """Drop every graph once its work is done: at TP > 1 they hold NCCL work, and destroying the
        communicator while graphs that hold its collectives live hung past 15 s (runs 87-92)."""
        torch.cuda.synchronize(self.model.device)
        self._graphs.clear()
        self._kv_key = None

    def _buffers(self, R: int, width: int, embeds: torch.Tensor | None) -> _Graph:
        m, packed = self.model, _Packed(R, width)
        dev = m.device
        meta = torch.zeros(packed.nbytes, dtype=torch.uint8, device=dev)
        staging = []
        for _ in range(2):
            host = torch.zeros(packed.nbytes, dtype=torch.uint8, pin_memory=True)
            staging.append((host, packed.views(host.numpy()), torch.cuda.Event()))
        if embeds is None:
            embeds = torch.zeros(packed.n, m.cfg.hidden_size, dtype=m.dtype, device=dev)
        return _Graph(torch.cuda.CUDAGraph(), embeds, meta, packed.views(meta), staging, torch.empty(0))

    def _fill(self, g: _Graph, embeds: torch.Tensor, h: HostMeta, ps: int) -> None:
        staged, (pos, rel, slots, lens, tables), copied = g.staging[g.flip]
        g.flip ^= 1
        copied.synchronize()  # this slot's previous copy has been consumed (unrecorded: returns at once)
        pos[...] = h.positions.reshape(-1)
        slots[...] = h.slots.reshape(-1)
        window_metadata_into(h.positions, h.seq_lens, h.tables, ps, self.model.cfg.sliding_window, rel, lens, tables)
        g.meta.copy_(staged, non_blocking=True)
        copied.record(self._stream)
        if g.embeds.data_ptr() != embeds.data_ptr():
            g.embeds.copy_(embeds, non_blocking=True)

    def _step(self, g: _Graph, kv) -> torch.Tensor:
        pos, rel, slots, lens, tables = g.views
        meta = StepMetadata(lens, tables, slots)
        return self.model.draft_step(g.embeds, pos, meta, kv, attn=(rel, meta), streams=self.streams)

    def _capture(self, g: _Graph, kv) -> torch.Tensor:
        """Run the step on a side stream with its real inputs (the warm-up a capture wants), then
        capture it; returns the warm-up's hidden states [n, hidden], this step's answer.

        Why not replay after the capture, as one usually would: at TP > 1 each rank must execute
        the same collectives per step, in the same order. Ranks capture at different steps (one
        engine rank's inputs move to another region, or arrive inline: that rank's graph key is
        new while its peers replay), and a capture step that also replayed would all-reduce twice
        while its peers all-reduce once: its second round would pair with their next step, every
        answer from then on wrong. A capture executes nothing, so warm-up + capture runs each
        collective once, as a replay does; eager and replayed steps give the same bits
        (tests/kernels/triton/test_drafter.py)."""
        dev = self.model.device
        main = torch.cuda.current_stream(dev)
        side = torch.cuda.Stream(dev)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            out = self._step(g, kv)
        main.wait_stream(side)
        out.record_stream(main)  # read on the main stream (the output copy) after its side-stream allocation
        # thread_local, as Prelaunch's captures: the default ("global") mode makes another thread's
        # allocation or IPC open during the capture an error that also invalidates the capture, and
        # RPCs outside the rank lock do both (RegisterBuffers maps regions, AttachDoorbell builds its
        # Prelaunch): a second client attaching while a step captures would have cost the rank.
        with gc_paused(), torch.cuda.graph(g.graph, capture_error_mode="thread_local"):
            g.out = self._step(g, kv)
        self.captures += 1
        log.info("captured the draft-step graph for R=%d (%d graphs)", g.views[3].numel(), len(self._graphs) + 1)
        return out


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic garbage collector off for the block (a CUDA graph capture), back on after it.

    A collection can run at any Python allocation, and one inside a capture that frees a tensor
    mapped from an engine's CUDA IPC handle (a replaced cache or doorbell's step, held in a reference
    cycle) runs torch's unmap, which synchronizes the current stream: the capture's. That is
    illegal while capturing, and the error, raised in a destructor, aborted the rank (run 267).
    So the garbage is collected first, here, where a deleter's synchronization only waits for the
    step's own queued work (every caller captures with no pre-launched wait pending; torch.cuda.graph
    collects only under torch.compiler.config.force_cudagraph_gc, off by default), and what becomes
    garbage during the capture waits for the next collection after it."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
