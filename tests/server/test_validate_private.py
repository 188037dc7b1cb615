"""validate.PrivateCopy: a step's index tensors copied out of the engine's region, packed or not."""

from __future__ import annotations

import pytest
import torch

from dspark_sidecar.drafter.kv_cache import StepMetadata
from dspark_sidecar.server.validate import PrivateCopy, _byte_span, host_meta

R, W = 3, 5


def _fields(packed: bool) -> tuple[torch.Tensor, ...]:
    """positions i64 [7R], seq_lens i32 [R], block_tables i32 [R, W], slot_mapping i64 [7R]: views of one
    byte region laid out as client/dataplane.py does, or four tensors of their own."""
    shapes = [((7 * R,), torch.int64), ((R,), torch.int32), ((R, W), torch.int32), ((7 * R,), torch.int64)]
    if not packed:
        return tuple(torch.empty(s, dtype=d) for s, d in shapes)
    raw, out, off = torch.zeros(4096, dtype=torch.uint8), [], 24  # not at the region's start
    for shape, dtype in shapes:
        n = torch.Size(shape).numel() * dtype.itemsize
        out.append(raw[off : off + n].view(dtype).view(shape))
        off = -(-(off + n) // 8) * 8
    return tuple(out)


def _write(fields, base: int) -> None:
    for i, t in enumerate(fields):
        t.copy_(torch.arange(t.numel(), dtype=t.dtype).view(t.shape) + base + 1000 * i)


@pytest.mark.parametrize("packed", [True, False], ids=["one-span", "per-field"])
def test_take_copies_what_the_region_holds_then_and_nothing_later(packed):
    fields = _fields(packed)
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
