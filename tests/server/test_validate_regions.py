"""validate_step on region slices: an output slice holds 7R rows; index tensors partly in a region run from a copy."""

from __future__ import annotations

import grpc
import pytest
import torch

from dspark_sidecar import layout
from dspark_sidecar.drafter import scenario
from dspark_sidecar.drafter.config import load_config
from dspark_sidecar.proto import codec, memory
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.server.errors import SidecarError
from dspark_sidecar.server.kv_binding import KVBinding, MemoryBindings
from dspark_sidecar.server.validate import validate_step

PS, PAGES, LENS = 16, 32, [5, 30]


@pytest.fixture
def rig():
    """(cfg, step, MemoryBindings bound to a PAGES x PS cache, a 64 KiB shared-memory segment, register(size))."""
    cfg = load_config("tiny")
    step = scenario.random_step(cfg, LENS, PS, PAGES, torch.randn(cfg.vocab_size, cfg.hidden_size), seed=3)
    mem = MemoryBindings(cfg, 1, 0, torch.float32, torch.device("cpu"))
    mem.kv = KVBinding(5, 1, [], PAGES, PS, None, [])
    seg = memory.shm_empty((1 << 16,), torch.uint8)

    def register(size: int) -> int:
        region = pb.BufferRegion(name="r", memory=memory.export_handle(seg.tensor), size_bytes=size)
        return mem.register(pb.RegisterBuffersRequest(regions=[region]))[0]

    try:
        yield cfg, step, mem, seg, register
    finally:
        mem.close()
        seg.close()


def _request(step, **refs) -> pb.DraftStepRequest:
    inline = dict(positions=step.positions, input_ids=step.input_ids, seq_lens=step.meta.seq_lens,
                  block_tables=step.meta.block_tables, slot_mapping=step.meta.slot_mapping)
    req = pb.DraftStepRequest(step_id=1, binding_id=5, binding_generation=1, num_requests=len(LENS),
                              **{k: codec.to_tensor_ref(v) for k, v in inline.items() if k not in refs})
    for k, ref in refs.items():
        getattr(req, k).CopyFrom(ref)
    return req


def test_an_output_slice_short_of_the_steps_rows_is_refused_before_the_step_runs(rig):
    """The answer is [7R, hidden]: a slice checked for R rows (or any fewer than 7R) passed, the step wrote
    its K/V, and only the answer's copy into the region was refused, the engine's cache left holding the
    K/V of a step it was told failed."""
    cfg, step, mem, _, register = rig
    need = layout.QPR * len(LENS) * cfg.hidden_size * 4  # fp32 hidden states
    short = register(need - 4)  # one value short
    with pytest.raises(SidecarError) as err:
        validate_step(_with_output(step, short), cfg, mem, 8, out_dtype=torch.float32)
    assert (err.value.code, err.value.field) == (grpc.StatusCode.INVALID_ARGUMENT, "output"), err.value.message
    assert validate_step(_with_output(step, register(need)), cfg, mem, 8, out_dtype=torch.float32).output is not None


def _with_output(step, region_id: int) -> pb.DraftStepRequest:
    req = _request(step)
    req.output.CopyFrom(pb.RegionSlice(region_id=region_id, offset_bytes=0))
    return req


def test_index_tensors_partly_in_a_region_are_checked_and_run_from_a_private_copy(rig):
    """A step with only slot_mapping in a region (the rest inline) has no cached layout; it still needs the
    copy: checked in place, the engine's rewrite of the slots before the step read them again sent its K/V
    writes wherever the new values said, past the checks (an index outside the cache exits the rank)."""
    cfg, step, mem, seg, register = rig
    slots = step.meta.slot_mapping
    seg.tensor[: slots.nbytes].view(torch.int64).copy_(slots)
    rid = register(slots.nbytes)
    req = _request(step, slot_mapping=codec.region_tensor_ref(torch.int64, tuple(slots.shape), rid, 0))
    checked = validate_step(req, cfg, mem, 8, private=True)
    seg.tensor[: slots.nbytes].view(torch.int64).fill_(PAGES * PS * 1000)  # the engine writes after the checks
    assert torch.equal(checked.meta.slot_mapping, slots)  # the step reads what was checked
    assert torch.equal(checked.region_meta[3], seg.tensor[: slots.nbytes].view(torch.int64))  # the region, as sources


def _all_in_one_region(step, seg, register) -> dict:
    """The step's index tensors and ids written one after another (64-byte aligned) into one registered region:
    the request's fields as region references to them."""
    refs, off = {}, 0
    for name, t in (("positions", step.positions), ("input_ids", step.input_ids), ("seq_lens", step.meta.seq_lens),
                    ("block_tables", step.meta.block_tables), ("slot_mapping", step.meta.slot_mapping)):
        seg.tensor[off : off + t.nbytes].view(t.dtype).copy_(t.reshape(-1))
        refs[name] = (t.dtype, tuple(t.shape), off)
        off += -(-t.nbytes // 64) * 64
    rid = register(off)
    return {k: codec.region_tensor_ref(d, s, rid, o) for k, (d, s, o) in refs.items()}


def test_a_cached_layout_named_again_with_another_request_count_is_refused(rig):
    """A step whose tensors all lie in regions has its checked views cached by layout. The same slices under
    another num_requests must be checked again, not served from that entry: its tensors hold the rows of the
    first count, and a step of 1 request over 2 requests' rows passed every check."""
    cfg, step, mem, seg, register = rig
    req = _request(step, **_all_in_one_region(step, seg, register))
    assert validate_step(req, cfg, mem, 8, private=True).num_reqs == len(LENS)
    assert mem.layouts  # the layout is cached: what follows is checked against the entry
    req.num_requests = 1
    with pytest.raises(SidecarError) as err:
        validate_step(req, cfg, mem, 8, private=True)
    assert (err.value.code, err.value.field) == (grpc.StatusCode.INVALID_ARGUMENT, "positions"), err.value.message


class _OnDevice(torch.Tensor):
    """A region view that says it lies in device memory (a client registering GPU memory for its metadata) and
    whose cpu() copies, as a device tensor's does: the path a GPU takes, on a host with none."""

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 0)

    def cpu(self) -> torch.Tensor:
        return torch.Tensor.clone(self).as_subclass(torch.Tensor)


def test_index_tensors_in_a_device_region_are_read_again_at_every_step(rig, monkeypatch):
    """Index tensors in a device region are checked on a host copy taken for the step (host_meta), so their layout
    is not cached: cached, the next step of the same slices reused the first step's copy, and the checks and the
    step ran the metadata the engine wrote then, not the positions (or pages, or slots) it wrote since."""
    cfg, step, mem, seg, register = rig
    resolve = mem.resolve
    monkeypatch.setattr(mem, "resolve", lambda *a: resolve(*a).as_subclass(_OnDevice))
    req = _request(step, **_all_in_one_region(step, seg, register))
    assert torch.equal(validate_step(req, cfg, mem, 8, private=True).positions, step.positions)
    seg.tensor[:8].view(torch.int64).fill_(12345)  # the engine's next step, in the same slices: request 0 moved
    with pytest.raises(SidecarError) as err:
        validate_step(req, cfg, mem, 8, private=True)
    assert (err.value.code, err.value.field) == (grpc.StatusCode.INVALID_ARGUMENT, "positions"), err.value.message
    assert "[12345, " in err.value.message, err.value.message
