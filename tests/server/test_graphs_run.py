"""server/graphs.py's StepGraphs.run on the CPU: which graph a step captures or replays, and what it stages for it.

The CUDA parts (pinned staging, events, the capture itself) are stand-ins (CpuGraphs); run(), its lookup
and _fill are the real ones, so what is checked here is the bookkeeping a GPU rank relies on: a step that
captures answers with its warm-up and replays nothing, a new cache drops every graph, a region's graph reads
it in place while another slice goes through the static buffer, and the staging slots alternate, each
rewritten only after its last copy.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dspark_sidecar import layout
from dspark_sidecar.drafter.kv_cache import window_metadata_into, window_width
from dspark_sidecar.server.graphs import StepGraphs, _Graph, _Packed
from dspark_sidecar.server.validate import HostMeta

PAGE, WINDOW, HIDDEN = 16, 40, 8
Q = layout.QPR
STREAM = "the graphs' stream"


class Event:
    """The part of torch.cuda.Event that _fill uses; each call goes to the rig's log with its slot."""

    def __init__(self, log: list, slot: int, copied=None) -> None:
        self.log, self.slot, self.copied = log, slot, copied

    def synchronize(self) -> None:
        self.log.append(("wait", self.slot))

    def record(self, stream) -> None:
        # Recorded after the slot's copy is queued, or the wait on it would not cover that copy: the host
        # would rewrite the pinned slot while the copy may still read it.
        assert self.copied is None or self.copied(), "event recorded before the copy it stands for"
        self.log.append(("record", self.slot, stream))


class Graph:
    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


class CpuGraphs(StepGraphs):
    """StepGraphs with CPU buffers and a capture that records itself instead of capturing."""

    def __init__(self) -> None:  # no model, no device stream
        self.model = SimpleNamespace(cfg=SimpleNamespace(sliding_window=WINDOW, hidden_size=HIDDEN),
                                     dtype=torch.float32, device=torch.device("cpu"))
        self.streams, self._page_size_of = [], lambda: PAGE
        self._graphs, self._kv_key, self.captures = {}, None, 0
        self._stream = STREAM
        self.log: list = []

    def _buffers(self, R: int, width: int, embeds: torch.Tensor | None) -> _Graph:
        packed = _Packed(R, width)
        meta = torch.zeros(packed.nbytes, dtype=torch.uint8)
        staging = []
        for slot in range(2):
            host = torch.zeros(packed.nbytes, dtype=torch.uint8)
            copied = (lambda host=host: torch.equal(meta, host))  # the rig's copies are synchronous
            staging.append((host, packed.views(host.numpy()), Event(self.log, slot, copied)))
        if embeds is None:
            embeds = torch.zeros(packed.n, HIDDEN)
        return _Graph(Graph(), embeds, meta, packed.views(meta), staging, torch.empty(0))

    def _capture(self, g: _Graph, kv) -> torch.Tensor:
        self.captures += 1
        self.log.append(("capture",))
        g.out = torch.full((g.embeds.shape[0], HIDDEN), -1.0)  # the graph's buffer: only replays write it
        return g.embeds + 1  # the warm-up's hidden states, as if it had run the step


def host_meta(lens: list[int], seed: int, page: int = PAGE) -> HostMeta:
    """A valid step's host metadata: the last Q positions of each sequence, their slots in shuffled pages."""
    R, L = len(lens), np.array(lens, np.int32)
    width = int((-(-L // page)).max())
    tables = np.random.default_rng(seed).permutation(R * width).astype(np.int32).reshape(R, width)
    P = L[:, None].astype(np.int64) - Q + np.arange(Q)
    S = tables[np.arange(R)[:, None], P // page].astype(np.int64) * page + P % page
    return HostMeta(P, L, tables, S)


def cache(page: int = PAGE) -> list[torch.Tensor]:
    return [torch.zeros(2, 4, page, 1, 8) for _ in range(5)]


def staged(views) -> list[np.ndarray]:
    return [(v.numpy() if isinstance(v, torch.Tensor) else v).copy() for v in views]


def expected(h: HostMeta, page: int = PAGE) -> list[np.ndarray]:
    """What the step's metadata views must hold: positions, window-relative positions, slots, lens, tables."""
    R = h.seq_lens.shape[0]
    rel, lens = np.empty(Q * R, np.int64), np.empty(R, np.int32)
    tables = np.empty((R, window_width(page, WINDOW)), np.int32)
    window_metadata_into(h.positions, h.seq_lens, h.tables, page, WINDOW, rel, lens, tables)
    return [h.positions.reshape(-1), rel, h.slots.reshape(-1), lens, tables]


def assert_holds(views, h: HostMeta, page: int = PAGE) -> None:
    for got, want in zip(staged(views), expected(h, page), strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_step_that_captures_answers_with_its_warm_up_and_the_next_replays_on_its_own_metadata():
    graphs, kv = CpuGraphs(), cache()
    a, b = host_meta([9, 70, 33], 0), host_meta([10, 71, 50], 1)
    assert not np.array_equal(expected(a)[1], expected(b)[1])  # the two steps' rel positions differ
    n = Q * 3
    e1, e2 = torch.randn(n, HIDDEN), torch.randn(n, HIDDEN)
    out = graphs.run(e1, a, kv)
    g = graphs._graphs[(3, False)]
    # The capture step's answer is the warm-up's, and nothing replays: at TP > 1 a replay on top of the
    # warm-up would run the step's collectives twice while the peers that replay run them once.
    assert graphs.captures == 1 and g.graph.replays == 0 and torch.equal(out, e1 + 1)
    assert g.embeds is not e1 and torch.equal(g.embeds, e1)  # the static buffer holds the step's inputs
    assert_holds(g.views, a)
    assert not graphs.will_capture(e2, 3, kv)
    out = graphs.run(e2, b, kv)
    assert graphs.captures == 1 and g.graph.replays == 1 and out is g.out
    assert torch.equal(g.embeds, e2)  # each step's inputs copied in: the replay reads this step's, not the first
    assert_holds(g.views, b)
    # The staging slots alternate, each waited on (its last copy consumed) before it is rewritten, and each
    # copy's event recorded on the stream the replays go to.
    graphs.run(e1, a, kv)
    assert graphs.log == [("wait", 0), ("record", 0, STREAM), ("capture",), ("wait", 1), ("record", 1, STREAM),
                          ("wait", 0), ("record", 0, STREAM)]
    assert_holds(g.staging[1][1], b)  # slot 1 was not rewritten by the third step: its copy could still be in flight
    assert_holds(g.views, a) and g.graph.replays == 2


def test_a_new_cache_drops_every_graph_and_the_next_step_captures_again():
    """A graph bakes in the cache's addresses: replayed after a re-bind, it would write and read block K/V
    through the old cache (the engine's freed allocation)."""
    graphs, h = CpuGraphs(), host_meta([9, 70], 0)
    old, new = cache(), cache()
    e = torch.randn(Q * 2, HIDDEN)
    graphs.run(e, h, old)
    graphs.run(torch.randn(Q, HIDDEN), host_meta([12], 2), old)
    first = graphs._graphs[(2, False)]
    assert graphs.captures == 2 and len(graphs._graphs) == 2
    assert graphs.will_capture(e, 2, new)
    graphs.run(e, h, new)
    assert graphs.captures == 3 and list(graphs._graphs) == [(2, False)] and graphs._graphs[(2, False)] is not first
    assert first.graph.replays == 0
    graphs.run(e, h, new)
    assert graphs.captures == 3 and graphs._graphs[(2, False)].graph.replays == 1


def test_a_cache_of_another_page_size_gets_graphs_sized_and_filled_for_it():
    """The window-relative tables' width and every step's window metadata follow the bound cache's page size,
    read at each step: after a re-bind to pages of 4, a graph sized for pages of 16 (4 columns, not 13) would
    address the window through too few pages, and metadata computed with the old size through the wrong ones."""
    graphs, h16, h4 = CpuGraphs(), host_meta([9, 70], 0), host_meta([9, 70], 0, page=4)
    e = torch.randn(Q * 2, HIDDEN)
    graphs.run(e, h16, cache())
    assert_holds(graphs._graphs[(2, False)].views, h16)
    graphs._page_size_of, kv4 = (lambda: 4), cache(4)
    graphs.run(e, h4, kv4)
    g = graphs._graphs[(2, False)]
    assert graphs.captures == 2 and g.views[4].shape == (2, window_width(4, WINDOW)) == (2, 13)
    assert_holds(g.views, h4, page=4)
    graphs.run(e, h4, kv4)
    assert g.graph.replays == 1 and graphs.captures == 2
    assert_holds(g.views, h4, page=4)


def test_a_regions_graph_reads_it_in_place_and_another_slice_goes_through_the_static_buffer():
    graphs, kv, h = CpuGraphs(), cache(), host_meta([9, 70], 0)
    n = Q * 2
    region = torch.randn(2 * n, HIDDEN)
    here, there = region[:n], region[n:]
    graphs.run(here, h, kv, in_place=True)
    g = graphs._graphs[(2, True)]
    assert g.embeds.data_ptr() == here.data_ptr() and graphs.captured(here, 2, kv) is g  # what a pre-launch queues
    # Another slice of a region: not the captured one, so the static-buffer graph (captured now), fed by a copy.
    graphs.run(there, h, kv, in_place=True)
    static = graphs._graphs[(2, False)]
    assert graphs.captures == 2 and static is not g and torch.equal(static.embeds, there)
    assert static.embeds.data_ptr() != there.data_ptr() and graphs.captured(there, 2, kv) is None
    region[n:] += 1  # the next step's inputs, written by the engine where the last ones were
    graphs.run(there, h, kv, in_place=True)
    assert (g.graph.replays, static.graph.replays) == (0, 1) and torch.equal(static.embeds, there)
    graphs.run(here, h, kv, in_place=True)
    assert (g.graph.replays, static.graph.replays, graphs.captures) == (1, 1, 2)
    # The region is released (UnregisterBuffers): its graph goes out of use, the static one stays.
    assert graphs.drop_in_place() == [g] and list(graphs._graphs) == [(2, False)]
    assert graphs.will_capture(here, 2, kv, in_place=True) and not graphs.will_capture(there, 2, kv)


def test_close_waits_for_the_device_then_drops_every_graph(monkeypatch):
    """The teardown drops the graphs before it destroys the process group: at TP > 1 they hold its collectives,
    and destroying the communicator while such graphs lived hung past 15 s (runs 87-92). First the device's
    queued work, which may still replay one of them."""
    graphs, kv, h = CpuGraphs(), cache(), host_meta([9], 0)
    e = torch.randn(Q, HIDDEN)
    graphs.run(e, h, kv)
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append((device, dict(graphs._graphs))))
    graphs.close()
    assert len(synced) == 1 and synced[0][0] == graphs.model.device and list(synced[0][1]) == [(1, False)]
    assert graphs._graphs == {} and graphs._kv_key is None
    assert graphs.will_capture(e, 1, kv)


def test_a_capture_that_fails_keeps_no_graph_and_the_next_step_captures_again():
    """A capture can fail part-way (an illegal call inside it, an out-of-memory): the graph is then not a whole
    step, and kept under its R the next step would replay it instead of capturing, answering from whatever the
    capture left in its output buffer. Nothing is kept; the step's error goes to the caller."""
    graphs, kv, h = CpuGraphs(), cache(), host_meta([9, 70], 0)
    e = torch.randn(Q * 2, HIDDEN)
    real = CpuGraphs._capture

    def fails(self, g, kv):
        real(self, g, kv)  # the warm-up and the capture's own bookkeeping ran, then the capture failed
        raise RuntimeError("capture failed")

    graphs._capture = fails.__get__(graphs)
    with pytest.raises(RuntimeError, match="capture failed"):
        graphs.run(e, h, kv)
    assert graphs._graphs == {} and graphs.will_capture(e, 2, kv)
    del graphs._capture
    out = graphs.run(e, h, kv)
    g = graphs._graphs[(2, False)]
    assert graphs.captures == 2 and g.graph.replays == 0 and torch.equal(out, e + 1)


def test_a_step_on_the_captured_region_copies_no_inputs(monkeypatch):
    """The in-place graph reads the region where the engine wrote the step: copying the rows onto themselves
    would be a CUDA call on the step's critical path for nothing, the one the in-place graph exists to save."""
    graphs, kv, h = CpuGraphs(), cache(), host_meta([9, 70], 0)
    region = torch.randn(Q * 2, HIDDEN)
    copied_to = []
    real = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_",
                        lambda self, src, *a, **kw: copied_to.append(self.data_ptr()) or real(self, src, *a, **kw))
    graphs.run(region, h, kv, in_place=True)
    graphs.run(region, h, kv, in_place=True)
    g = graphs._graphs[(2, True)]
    assert g.graph.replays == 1 and copied_to and region.data_ptr() not in copied_to  # the metadata's copies only
    assert set(copied_to) == {g.meta.data_ptr()}


def test_launch_streams_makes_streams_only_for_two_or_more():
    """One stream runs the launch groups in order on the caller's stream: no stream of its own is made for it."""
    import unittest.mock

    from dspark_sidecar.server.graphs import launch_streams

    dev = torch.device("cuda", 0)
    with unittest.mock.patch.object(torch.cuda, "Stream", side_effect=lambda device: ("stream", device)) as made:
        assert launch_streams(0, dev) == [] and launch_streams(1, dev) == [] and made.call_count == 0
        assert launch_streams(3, dev) == [("stream", dev)] * 3


def test_a_capture_runs_the_step_once_on_a_side_stream_then_captures_it_thread_local_with_the_collector_off(
        monkeypatch):
    """StepGraphs._capture itself (CpuGraphs replaces it), on stand-ins for CUDA's streams and capture: the warm-up
    step runs on a side stream after this step's staged copies (main) and main waits for it before the answer's
    copy reads it; the capture runs in thread_local mode (another thread's RegisterBuffers must not invalidate
    it) with the collector off (run 267); the answer is the warm-up's output, the capture executing nothing."""
    import contextlib
    import gc

    log: list = []

    class Stream:
        def __init__(self, name: str) -> None:
            self.name = name

        def wait_stream(self, other: "Stream") -> None:
            log.append(("wait", self.name, other.name))

    class Out:
        def __init__(self, what: str) -> None:
            self.what = what

        def record_stream(self, s: Stream) -> None:
            log.append(("record_stream", self.what, s.name))

    current = [Stream("main")]

    @contextlib.contextmanager
    def on(stream: Stream):
        current.append(stream)
        try:
            yield
        finally:
            current.pop()

    @contextlib.contextmanager
    def graph(g, capture_error_mode="global"):
        log.append(("capture", capture_error_mode, gc.isenabled()))
        with on(Stream("capture")):
            yield
        log.append(("captured",))

    def draft_step(embeds, positions, meta, kv, attn=None, streams=()):
        what = "warm-up" if not any(e[0] == "capture" for e in log) else "graph"
        log.append(("step", current[-1].name, gc.isenabled(), what))
        return Out(what)

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: Stream("side"))
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    graphs = StepGraphs.__new__(StepGraphs)
    graphs.model = SimpleNamespace(device=torch.device("cpu"), draft_step=draft_step)
    graphs.streams, graphs._graphs, graphs.captures = [], {}, 0
    packed = _Packed(2, window_width(PAGE, WINDOW))
    g = SimpleNamespace(graph="the graph", embeds=torch.zeros(packed.n, HIDDEN), out=None,
                        views=packed.views(torch.zeros(packed.nbytes, dtype=torch.uint8)))
    assert gc.isenabled()
    out = graphs._capture(g, cache())
    assert log == [("wait", "side", "main"), ("step", "side", True, "warm-up"), ("wait", "main", "side"),
                   ("record_stream", "warm-up", "main"),
                   ("capture", "thread_local", False), ("step", "capture", False, "graph"), ("captured",)]
    assert out.what == "warm-up" and g.out.what == "graph" and graphs.captures == 1 and gc.isenabled()
