"""The answer's copy out of the output region: into a tensor made while the step runs, through the driver's copy."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dspark_sidecar.client import dataplane
from dspark_sidecar.client.dataplane import DoorbellChannel
from dspark_sidecar.client.doorbell_transport import DoorbellTransport
from dspark_sidecar.proto import sidecar_pb2 as pb

ROWS, WIDTH = 14, 32


class _Bell:
    """The doorbell's side of a step: rings, and copies rows as DoorbellChannel.copy_rows does (recorded)."""

    def __init__(self, raw: bool) -> None:
        self.copies_raw, self.copies, self.events = raw, [], []

    def order_inputs(self) -> None:
        self.events.append("order")

    def send_bytes(self, data: bytes, key: int) -> None:
        self.events.append("ring")

    def copy_rows(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.copies.append((dst.data_ptr(), src.data_ptr()))
        dst.copy_(src)


def _transport(raw: bool) -> tuple[DoorbellTransport, torch.Tensor]:
    region = torch.zeros(4 * ROWS, WIDTH, dtype=torch.bfloat16)  # the output region, rows of every step size
    t = DoorbellTransport.__new__(DoorbellTransport)
    t.liveness = SimpleNamespace(alive=True)
    t.bell = _Bell(raw)
    t.buffers = SimpleNamespace(stage=lambda *a: SimpleNamespace(hidden=region[:ROWS], fields=b"", launch_key=1))
    t._view = t._out = None
    return t, region


def _step(t: DoorbellTransport, region: torch.Tensor, value: float) -> torch.Tensor:
    t.send(pb.DraftStepRequest(step_id=1), None, None, None)
    region[:ROWS] = value  # the sidecar's kernels write the answer's rows
    return t.hidden()


def test_each_answer_is_copied_into_a_tensor_of_the_engine_s_own_made_before_the_answer():
    t, region = _transport(raw=True)
    first = _step(t, region, 1.0)
    assert t.bell.events == ["order", "ring"]
    assert t.bell.copies == [(first.data_ptr(), region.data_ptr())], "one driver copy, out of the region"
    assert first.shape == (ROWS, WIDTH) and first.dtype == torch.bfloat16 and bool((first == 1.0).all())
    second = _step(t, region, 2.0)
    # The next step rewrote the region: the engine still holds the first answer as it was, in its own memory.
    assert bool((first == 1.0).all()) and bool((second == 2.0).all())
    assert second.data_ptr() not in (first.data_ptr(), region.data_ptr())


def test_the_tensor_is_made_after_the_ring_so_the_step_s_host_path_before_it_does_not_pay_for_it(monkeypatch):
    t, region = _transport(raw=True)
    made = []
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: made.append(list(t.bell.events)) or real_empty(*a, **k))
    _step(t, region, 1.0)
    assert made == [["order", "ring"]]


def test_without_the_driver_s_copy_the_answer_is_cloned():
    t, region = _transport(raw=False)
    first = _step(t, region, 3.0)
    assert t.bell.copies == [] and t._out is None
    assert bool((first == 3.0).all()) and first.data_ptr() != region.data_ptr()


def test_an_allocation_that_fails_after_the_ring_leaves_the_step_to_its_wait_and_a_clone(monkeypatch):
    """Rung, the step is on the sidecar: raising out of send would leave it unwaited and unsettled."""
    t, region = _transport(raw=True)

    def oom(*a, **k):
        raise RuntimeError("CUDA out of memory (test)")

    monkeypatch.setattr(torch, "empty", oom)
    t.send(pb.DraftStepRequest(step_id=1), None, None, None)
    monkeypatch.undo()
    region[:ROWS] = 5.0
    out = t.hidden()
    assert t.bell.copies == [] and bool((out == 5.0).all()) and out.data_ptr() != region.data_ptr()


def test_a_step_whose_answer_was_never_copied_out_leaves_no_tensor_to_the_next(monkeypatch):
    """A step given up on (its deadline passed: hidden() never ran) keeps the tensor send() made for its answer.
    The next step's own allocation failing, its answer must be cloned, never copied into that tensor: it has the
    last step's shape (copy_rows refuses it, a good answer read as BAD_ANSWER) and the engine never had it."""
    t, region = _transport(raw=True)
    rows = iter([ROWS, ROWS // 2])
    t.buffers = SimpleNamespace(stage=lambda *a: SimpleNamespace(hidden=region[:next(rows)], fields=b"", launch_key=1))
    t.send(pb.DraftStepRequest(step_id=1), None, None, None)  # never answered in time: no hidden()

    def oom(*a, **k):
        raise RuntimeError("CUDA out of memory (test)")

    monkeypatch.setattr(torch, "empty", oom)
    t.send(pb.DraftStepRequest(step_id=2), None, None, None)
    monkeypatch.undo()
    region[: ROWS // 2] = 6.0
    out = t.hidden()
    assert out.shape == (ROWS // 2, WIDTH) and bool((out == 6.0).all())
    assert t.bell.copies == [] and out.data_ptr() != region.data_ptr()


class _Ops:
    def __init__(self) -> None:
        self.calls = []

    def copy(self, stream: int, dst: int, src: int, nbytes: int) -> None:
        self.calls.append((stream, dst, src, nbytes))


def _channel(ops) -> DoorbellChannel:
    ch = DoorbellChannel.__new__(DoorbellChannel)
    ch._ops, ch.device = ops, torch.device("cpu")
    return ch


def test_copy_rows_queues_the_driver_s_copy_on_the_current_stream(monkeypatch):
    monkeypatch.setattr(dataplane, "_raw_stream", lambda device: 0x5)
    ops = _Ops()
    ch = _channel(ops)
    src, dst = torch.ones(ROWS, WIDTH, dtype=torch.bfloat16), torch.empty(ROWS, WIDTH, dtype=torch.bfloat16)
    assert ch.copies_raw
    ch.copy_rows(dst, src)
    assert ops.calls == [(0x5, dst.data_ptr(), src.data_ptr(), ROWS * WIDTH * 2)]


@pytest.mark.parametrize("dst", [torch.empty(ROWS, WIDTH + 1, dtype=torch.bfloat16),
                                 torch.empty(ROWS, WIDTH, dtype=torch.float16),
                                 torch.empty(WIDTH, ROWS, dtype=torch.bfloat16).t()],
                         ids=["shape", "dtype", "strided"])
def test_copy_rows_refuses_what_a_byte_copy_would_get_wrong(monkeypatch, dst):
    monkeypatch.setattr(dataplane, "_raw_stream", lambda device: 0x5)
    ops = _Ops()
    with pytest.raises(ValueError, match="copy_rows"):
        _channel(ops).copy_rows(dst, torch.ones(ROWS, WIDTH, dtype=torch.bfloat16))
    assert ops.calls == []


def test_copy_rows_without_the_driver_is_torch_s_copy():
    ch = _channel(None)
    src, dst = torch.full((ROWS, WIDTH), 7.0), torch.zeros(ROWS, WIDTH)
    assert not ch.copies_raw
    ch.copy_rows(dst, src)
    assert torch.equal(dst, src)
