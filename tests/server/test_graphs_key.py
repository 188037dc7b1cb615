"""server/graphs.py's graph key, on CPU: what a captured draft-step graph is bound to."""

from __future__ import annotations

import pytest
import torch

from dspark_sidecar.drafter.kv_cache import kv_planes
from dspark_sidecar.server.graphs import _kv_key


def test_a_rebind_that_only_changes_the_strides_drops_the_graphs():
    # A captured graph bakes in each layer's strides (the Triton kernels take them as arguments).
    # A re-bind may map a cache at the address the last one had (an engine restarted on another
    # vLLM: planes before, records now) with the same 5-D view shape: the key must differ, or the
    # old graph would replay, writing and reading K/V through the old layout's strides.
    memory = torch.zeros(4 * 1 * 16 * 256)
    planes = memory.view(2, 4, 16, 1, 128)
    records = kv_planes(memory.view(4, 1, 16, 256))
    assert planes.data_ptr() == records.data_ptr() and planes.shape == records.shape
    assert planes.stride() != records.stride()
    assert _kv_key([planes] * 5) != _kv_key([records] * 5)
    assert _kv_key([planes] * 5) == _kv_key([memory.view(2, 4, 16, 1, 128)] * 5)  # the same view: kept


def test_a_rebind_that_only_changes_the_number_of_pages_drops_the_graphs():
    # The records layout's view strides (d, heads*page*2d, 2d, page*2d, 1) do not depend on the number of
    # pages: a re-bind of a larger (or smaller) cache at the same address in that layout differs from the last
    # one by its shape alone. A graph captured for the old one checks its slots' pages against the old count.
    memory = torch.zeros(8 * 1 * 16 * 256)
    small = kv_planes(memory[: 4 * 16 * 256].view(4, 1, 16, 256))
    large = kv_planes(memory.view(8, 1, 16, 256))
    assert small.data_ptr() == large.data_ptr() and small.stride() == large.stride() and small.dtype == large.dtype
    assert small.shape != large.shape
    assert _kv_key([small] * 5) != _kv_key([large] * 5)


def test_a_rebind_that_only_changes_the_dtype_drops_the_graphs():
    # The same bytes bound as fp8 e4m3 codes (vLLM's kv_cache_dtype fp8) after bf16, or back: the
    # kernels' loads and stores are compiled for the cache's dtype.
    memory = torch.zeros(2 * 4 * 16 * 128, dtype=torch.uint8)
    bf16 = memory.view(torch.bfloat16)[: 2 * 4 * 16 * 64].view(2, 4, 16, 1, 64)
    fp8 = memory.view(torch.float8_e4m3fn)[: 2 * 4 * 16 * 64].view(2, 4, 16, 1, 64)
    assert bf16.data_ptr() == fp8.data_ptr() and bf16.shape == fp8.shape and bf16.stride() == fp8.stride()
    assert _kv_key([bf16] * 5) != _kv_key([fp8] * 5)


def test_the_in_place_graph_a_prelaunch_would_replay_reads_its_inputs_in_its_own_dtype():
    # StepGraphs.captured: the graph a doorbell step would have queued (server/prelaunch.py). The ordinary
    # path reads a region in place only when it is already the model's dtype (rank._execute: `embeds is
    # step.inputs_embeds`); a step whose inputs sit at the captured view's address in another dtype is
    # converted into the static buffer. The pre-launch must not queue (and then answer from) the in-place
    # graph for it: that graph reads the region's bytes as the dtype it was captured with.
    from types import SimpleNamespace

    from dspark_sidecar.server.graphs import StepGraphs

    region = torch.zeros(4 * 7 * 64, dtype=torch.uint8)
    bf16 = region.view(torch.bfloat16)[: 7 * 64].view(7, 64)
    fp32 = region.view(torch.float32)[: 7 * 64].view(7, 64)
    assert bf16.data_ptr() == fp32.data_ptr()
    kv = [torch.zeros(2, 4, 16, 1, 8)] * 5
    graphs = StepGraphs.__new__(StepGraphs)  # no CUDA here: only what captured() reads
    g = SimpleNamespace(embeds=bf16)
    graphs._graphs, graphs._kv_key = {(1, True): g}, _kv_key(kv)
    assert graphs.captured(bf16, 1, kv) is g
    assert graphs.captured(fp32, 1, kv) is None


def test_the_collector_is_off_inside_a_capture_and_back_after_it():
    """gc_paused: no cyclic collection inside a capture (one that freed an IPC-mapped tensor there aborted
    the rank, run 267), the collector's state restored after it, an exception included."""
    import gc
    import weakref

    from dspark_sidecar.server.graphs import gc_paused

    class Cycle:  # garbage only a collection frees, made before the capture
        def __init__(self):
            self.me = self

    freed = []
    c = Cycle()
    weakref.finalize(c, freed.append, True)
    del c
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled() and freed == [True]  # collected before the capture, at a safe point
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="capture failed"), gc_paused():
        raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # off before: left off
    finally:
        gc.enable()


def test_the_in_place_graph_is_offered_only_for_its_own_view_and_cache():
    """StepGraphs.captured's other guards (the dtype test above reaches none of them): a step whose inputs
    sit elsewhere, or at the same address in another shape, or whose cache was re-bound, gets no in-place
    graph to queue: it would read the captured slice, or K/V through the old cache's addresses."""
    from types import SimpleNamespace

    from dspark_sidecar.server.graphs import StepGraphs

    region = torch.zeros(14, 64)
    view = region[:7]
    kv = [torch.zeros(2, 4, 16, 1, 8)] * 5
    graphs = StepGraphs.__new__(StepGraphs)
    g = SimpleNamespace(embeds=view)
    graphs._graphs, graphs._kv_key = {(1, True): g}, _kv_key(kv)
    assert graphs.captured(region[:7], 1, kv) is g  # the same view, rebuilt as another object
    assert graphs.captured(region[7:], 1, kv) is None  # another slice
    assert graphs.captured(region[:6], 1, kv) is None  # the same address, fewer rows
    assert graphs.captured(view, 1, [torch.zeros(2, 4, 16, 1, 8)] * 5) is None  # another cache
    assert graphs.captured(view, 2, kv) is None and graphs.captured(None, 1, kv) is None
