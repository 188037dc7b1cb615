"""BindKV refuses drafter layers whose caches share memory; layers that only share a segment bind.

Each layer's view was checked on its own (kv_view_problem: no two of ITS elements share memory), but
nothing compared the layers with each other: five layers naming the same segment at the same offset
were bound, and every step then wrote layer 1's K/V over layer 0's (and so on): drafts computed from
the wrong keys, with no error anywhere. A half-overlapping layer did the same to part of the cache.
Layers packed side by side in one segment, or interleaved page by page (one allocation [pages,
layers, 2, page_size, heads, head_dim]), share no element and must still bind.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from dspark_sidecar.drafter import scenario
from dspark_sidecar.drafter.kv_cache import kv_layer_shape
from dspark_sidecar.proto import memory
from dspark_sidecar.proto import sidecar_pb2 as pb
from helpers.engine_sim import PAGE, RIG_PAGES

PAGES = RIG_PAGES
TIMEOUT_S = 30.0


def _serves(eng, cfg, embed, step_id: int) -> None:
    """The engine's own cache bound again, a valid step answers."""
    eng.bind()
    step = scenario.random_step(cfg, [5, 30], PAGE, PAGES, embed, seed=3)
    resp = eng.stubs[0].DraftStep(eng.request(0, step_id, step), timeout=TIMEOUT_S)
    assert resp.HasField("hidden_states"), resp


def _refused(eng, req, field: str) -> str:
    with pytest.raises(grpc.RpcError) as err:
        eng.stubs[0].BindKV(req, timeout=TIMEOUT_S)
    details = err.value.details()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.value.code(), details)
    assert details.startswith(f"{field}: "), details
    assert "overlap" in details, details
    return details


def _segment(held, cfg, layers: int) -> torch.Tensor:
    shape = kv_layer_shape(cfg, 1, PAGES, PAGE)
    seg = memory.shm_empty((layers, *shape), torch.float32)
    held.append(seg)
    return seg.tensor


def test_every_layer_on_the_same_memory_is_refused(rig):
    eng, cfg, embed, held = rig
    one = eng.kv_tensors(0)[0]
    before = eng.stubs[0].GetStatus(pb.GetStatusRequest(), timeout=TIMEOUT_S).kv
    details = _refused(eng, eng.bind_request(0, [one] * cfg.num_hidden_layers), "layers[1].memory")
    assert "layers[0]" in details, details
    after = eng.stubs[0].GetStatus(pb.GetStatusRequest(), timeout=TIMEOUT_S).kv
    assert (after.binding_id, after.generation) == (before.binding_id, before.generation)  # the binding stands
    _serves(eng, cfg, embed, 1)


def test_a_layer_half_over_another_is_refused(rig):
    eng, cfg, embed, held = rig
    seg = _segment(held, cfg, 2).reshape(-1)
    n = seg.numel() // 2
    views = [seg[:n].view(kv_layer_shape(cfg, 1, PAGES, PAGE))] + [
        seg[n // 2: n // 2 + n].view(kv_layer_shape(cfg, 1, PAGES, PAGE))] + eng.kv_tensors(0)[2:]
    _refused(eng, eng.bind_request(0, views), "layers[1].memory")
    _serves(eng, cfg, embed, 2)


def test_one_shared_element_is_refused(rig):
    """Layer 3 starts on layer 2's last value: the ranges meet in one element."""
    eng, cfg, embed, held = rig
    seg = _segment(held, cfg, 2).reshape(-1)
    n = seg.numel() // 2
    shape = kv_layer_shape(cfg, 1, PAGES, PAGE)
    views = eng.kv_tensors(0)[:2] + [seg[:n].view(shape), seg[n - 1: 2 * n - 1].view(shape)] + eng.kv_tensors(0)[4:]
    _refused(eng, eng.bind_request(0, views), "layers[3].memory")
    _serves(eng, cfg, embed, 3)


def test_a_layer_over_another_in_a_different_layout_is_refused(rig):
    """Layer 1 reads layer 0's memory as K | V records: other strides, the same bytes."""
    eng, cfg, embed, held = rig
    base = eng.kv_tensors(0)[0]
    _, p, pg, h, d = base.shape
    records = base.reshape(-1).as_strided(base.shape, (d, h * pg * 2 * d, 2 * d, pg * 2 * d, 1))
    _refused(eng, eng.bind_request(0, [base, records] + eng.kv_tensors(0)[2:]), "layers[1].memory")
    _serves(eng, cfg, embed, 4)


def test_layers_sharing_a_segment_but_no_element_bind(rig):
    """Side by side in one segment, and interleaved page by page ([pages, layers, 2, page, heads, d])."""
    eng, cfg, embed, held = rig
    L = cfg.num_hidden_layers
    side = _segment(held, cfg, L)
    resp = eng.stubs[0].BindKV(eng.bind_request(0, [side[i] for i in range(L)]), timeout=TIMEOUT_S)
    assert resp.binding_id
    two, p, pg, h, d = kv_layer_shape(cfg, 1, PAGES, PAGE)
    seg = memory.shm_empty((p, L, two, pg, h, d), torch.float32)
    held.append(seg)
    views = [seg.tensor[:, i].transpose(0, 1) for i in range(L)]
    assert all(v.shape == (two, p, pg, h, d) for v in views)
    resp = eng.stubs[0].BindKV(eng.bind_request(0, views), timeout=TIMEOUT_S)
    assert resp.binding_id
    # Steps run against the interleaved binding, and write each layer's K/V into its own elements only.
    eng.bindings = [(resp.binding_id, resp.generation)]
    step = scenario.random_step(cfg, [5, 30], PAGE, PAGES, embed, seed=3)
    assert eng.stubs[0].DraftStep(eng.request(0, 5, step), timeout=TIMEOUT_S).HasField("hidden_states")
    _serves(eng, cfg, embed, 6)


def test_the_overlap_check_agrees_with_the_elements():
    """_Span.overlaps against the byte sets themselves, over small dense layouts at many offsets."""
    import itertools
    import random

    from dspark_sidecar.server.kv_binding import _Span

    rng = random.Random(7)
    buf = torch.zeros(4096, dtype=torch.uint8)

    class M:  # MappedMemory.place for views of `buf`
        @staticmethod
        def place(t):
            return ("shm", 0, 0), t.data_ptr() - buf.data_ptr()

    def view(dtype, shape, order, offset):
        item = torch.empty((), dtype=dtype).element_size()
        strides, size = [0] * len(shape), 1
        for k in order:  # order: dimensions from the innermost out (head_dim, the last, first)
            strides[k], size = size, size * shape[k]
        return buf[: (len(buf) // item) * item].view(dtype).as_strided(shape, strides, offset)

    def byte_set(t):
        item = t.element_size()
        base = t.data_ptr() - buf.data_ptr()
        return {base + item * sum(i * s for i, s in zip(idx, t.stride())) + b
                for idx in itertools.product(*(range(n) for n in t.shape)) for b in range(item)}

    checked = hits = 0
    for _ in range(400):
        shape = (2, rng.randint(1, 3), rng.randint(1, 3), rng.randint(1, 2), rng.randint(1, 4))
        orders = [[4, *p] for p in itertools.permutations(range(4))]
        dt = rng.choice([torch.float32, torch.bfloat16])
        a = view(dt, shape, rng.choice(orders), rng.randint(0, 64))
        same = rng.random() < 0.7
        if same:  # the common case: one layout, two offsets
            b = a.as_strided(a.shape, a.stride(), rng.randint(0, 64))
        else:
            b = view(dt, shape, rng.choice(orders), rng.randint(0, 64))
        got = _Span.of(M, a).overlaps(_Span.of(M, b))
        want = bool(byte_set(a) & byte_set(b))
        if same:
            assert got == want, (shape, a.stride(), a.storage_offset(), b.storage_offset())
        else:
            assert got or not want, (shape, a.stride(), b.stride())  # may refuse more, never less
        checked += 1
        hits += want
    assert 50 < hits < checked - 50, hits


def test_a_one_element_dimension_s_stride_does_not_make_a_layout_different():
    """A dimension of one element (the KV heads at TP 4, one page) is never stepped along, and torch leaves
    its stride free: two layers interleaved page by page in one allocation, equal in every other stride,
    share no byte and are compared exactly. Taken as different layouts, they were compared by byte range,
    which interleaved layers share, and a valid binding was refused."""
    from dspark_sidecar.server.kv_binding import _Span

    pages, layers, page, d = 3, 2, 2, 4
    alloc = torch.zeros(pages, layers, 2, page, 1, d)  # [pages, layers, K/V, page_size, heads, head_dim]

    class M:  # MappedMemory.place for views of `alloc`
        @staticmethod
        def place(t):
            return ("shm", 0, 0), t.data_ptr() - alloc.data_ptr()

    a, b = (alloc[:, i].transpose(0, 1) for i in range(layers))  # [2, pages, page_size, 1, head_dim] each
    b = b.as_strided(b.shape, (*b.stride()[:3], 12345, 1), b.storage_offset())  # its heads stride, never used
    assert a.stride()[:3] == b.stride()[:3] and a.stride()[3] != b.stride()[3]
    a.fill_(1)
    assert not b.any()  # the layers share no element
    assert not _Span.of(M, a).overlaps(_Span.of(M, b)) and not _Span.of(M, b).overlaps(_Span.of(M, a))
    restrided = a.as_strided(b.shape, b.stride(), a.storage_offset())  # a's elements, b's free stride
    assert _Span.of(M, a).overlaps(_Span.of(M, restrided))
