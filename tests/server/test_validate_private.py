"""validate.PrivateCopy: a step's index tensors copied out of the engine's region, packed or not."""

from __future__ import annotations

import pytest
import torch

from dspark_sidecar.drafter.kv_cache import StepMetadata
from dspark_sidecar.server.validate import PrivateCopy, _byte_span, host_meta

R, W = 3, 5


_SHAPES = [((7 * R,), torch.int64), ((R,), torch.int32), ((R, W), torch.int32), ((7 * R,), torch.int64)]


def _fields(packed: bool, start: int = 24, order=(0, 1, 2, 3)) -> tuple[torch.Tensor, ...]:
    """positions i64 [7R], seq_lens i32 [R], block_tables i32 [R, W], slot_mapping i64 [7R]: views of one
    byte region from byte `start`, written in `order`, each aligned to its own type (what the sidecar
    requires; client/dataplane.py aligns every field to 8), or four tensors of their own."""
    if not packed:
        return tuple(torch.empty(s, dtype=d) for s, d in _SHAPES)
    raw, out, off = torch.zeros(4096, dtype=torch.uint8), {}, start
    for i in order:
        shape, dtype = _SHAPES[i]
        off = -(-off // dtype.itemsize) * dtype.itemsize
        n = torch.Size(shape).numel() * dtype.itemsize
        out[i] = raw[off : off + n].view(dtype).view(shape)
        off += n
    return tuple(out[i] for i in range(4))


def _write(fields, base: int) -> None:
    for i, t in enumerate(fields):
        t.copy_(torch.arange(t.numel(), dtype=t.dtype).view(t.shape) + base + 1000 * i)


# "int32-first": seq_lens 4 bytes past an 8-byte boundary, positions after it at the next boundary; the
# copy's span must start at that boundary (from seq_lens it held positions at an odd offset: a RuntimeError
# inside validate_step, which exits the rank).
@pytest.mark.parametrize("packed,start,order", [(True, 24, (0, 1, 2, 3)), (False, 0, (0, 1, 2, 3)),
                                               (True, 4, (1, 0, 2, 3)), (True, 12, (2, 1, 3, 0))],
                         ids=["one-span", "per-field", "int32-first", "int32s-first-at-12"])
def test_take_copies_what_the_region_holds_then_and_nothing_later(packed, start, order):
    fields = _fields(packed, start, order)
    assert (_byte_span(fields) is not None) == packed
    pos, meta = fields[0], StepMetadata(*fields[1:])
    ids = torch.zeros(7 * R, dtype=torch.int64)
    copy = PrivateCopy(pos, ids, meta, host_meta(pos, meta))
    for base in (1, 50):
        _write(fields, base)
        ids.fill_(base)
        got_pos, got_ids, got_meta, host = copy.take()
        want = [t.clone() for t in fields]
        _write(fields, base + 7)  # the engine writes again after the copy
        ids.fill_(-1)
        own = (got_pos, got_meta.seq_lens, got_meta.block_tables, got_meta.slot_mapping)
        for f, t, w in zip(("positions", "seq_lens", "block_tables", "slot_mapping"), own, want):
            assert t.shape == w.shape and t.dtype == w.dtype and torch.equal(t, w), f
        assert (got_ids == base).all()
        assert (host.tables == want[2].numpy()).all() and (host.slots.reshape(-1) == want[3].numpy()).all()


def test_a_span_far_wider_than_the_fields_is_copied_per_field():
    raw = torch.zeros(1 << 16, dtype=torch.uint8)
    a, b = raw[:8].view(torch.int64), raw[-8:].view(torch.int64)
    assert _byte_span((a, b)) is None
    assert _byte_span((a, raw[8:16].view(torch.int64))) is not None


def test_fields_are_copied_as_one_span_up_to_twice_their_bytes_and_64_more():
    """The packed copy's bound: a span of at most 2 x the fields' bytes + 64 is one copy, one byte-aligned step past
    it is copied per field (a span that size mostly copies bytes no step reads)."""
    raw = torch.zeros(1024, dtype=torch.uint8)
    a = raw[:8].view(torch.int64)
    edge = 2 * 16 + 64  # two int64 fields: the widest span that is still one copy
    assert _byte_span((a, raw[edge - 8 : edge].view(torch.int64))) is not None
    assert _byte_span((a, raw[edge : edge + 8].view(torch.int64))) is None
