"""A step's metadata rewritten in shared memory between its checks and its use cannot kill a rank.

On the data plane a step's positions, seq_lens, block_tables and slot_mapping (and input_ids) are
slices of a region the engine registered: shared memory the engine can write at any time. A rank
used to check them there (validate.py) and then run the step reading the same bytes again; an
engine that rewrote them in between (a bug, early reuse of its buffer, or on purpose) had the step
index out of range inside its launch, and an exception there exits the rank with code 3 (rank.py
`_guarded`): the whole TP group went down. A rank now checks and runs one private copy of them,
taken before the checks: a rewrite after the copy changes nothing the step reads, one before it is
refused with the field named, and the rank serves on.

These run an in-process CPU RankLoop (a GPU rank's graphs: tests/server/test_dataplane_gpu.py) (the tiny drafter, a real MemoryBindings over shm regions); the
rewrite is injected through a seam, right after validate_step returns.
"""

from __future__ import annotations

import concurrent.futures
from types import SimpleNamespace

import pytest
import torch

from dspark_sidecar.drafter import scenario
from dspark_sidecar.drafter.checkpoint import CheckpointReader
from dspark_sidecar.drafter.model import DSparkDrafter
from dspark_sidecar.drafter.parallel import ParallelContext
from dspark_sidecar.kernels.ops import REFERENCE_OPS
from dspark_sidecar.proto import codec
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.server import rank as rank_mod
from dspark_sidecar.server.kv_binding import MemoryBindings
from dspark_sidecar.server.metrics import Metrics
from dspark_sidecar.server.rank import RankContext, RankLoop
from dspark_sidecar.server.rendezvous import Verdict
from dspark_sidecar.server.validate import validate_step
from dspark_sidecar.client.dataplane import StepBuffers
from helpers.engine_sim import PAGE, EngineSim

LENS = [5, 40, 100]
PAGES = sum(scenario.pages_needed(c + 7, PAGE) for c in LENS) + 2
BIG = 1 << 40  # far past any cache, vocabulary or table


class _Exited(BaseException):
    """The rank's os._exit, made catchable: the test process must outlive the rank it runs."""


class _OneRank:
    """A world of one: GO for a valid post."""

    def agree(self, post):
        return Verdict(post.valid, "" if post.valid else f"step {post.step_id}: invalid here", 0)


class _Stub:
    """StepBuffers' RPCs, straight into this process's MemoryBindings."""

    def __init__(self, mem: MemoryBindings) -> None:
        self.mem = mem

    def RegisterBuffers(self, req, timeout=None):  # noqa: N802  (the gRPC method's name)
        return pb.RegisterBuffersResponse(region_ids=self.mem.register(req))

    def UnregisterBuffers(self, req, timeout=None):  # noqa: N802
        for m in self.mem.unregister(list(req.region_ids), req.owner):
            m.close()
        return pb.UnregisterBuffersResponse()


@pytest.fixture
def rig(tiny_cfg, tiny_ckpt, tiny_embed, monkeypatch):
    exits: list[int] = []

    def _exit(code):
        exits.append(code)
        raise _Exited(code)

    monkeypatch.setattr(rank_mod.os, "_exit", _exit)
    cpu = torch.device("cpu")
    model = DSparkDrafter(tiny_cfg, ParallelContext(0, 1), REFERENCE_OPS, torch.float32, cpu).load(
        CheckpointReader(tiny_ckpt[0], torch.float32))
    mem = MemoryBindings(tiny_cfg, 1, 0, torch.float32, cpu)
    eng = EngineSim(tiny_cfg, ["localhost:1"], PAGES, torch.float32)  # its cache and BindKV requests; no RPCs
    kv = mem.bind(eng.bind_request(0))
    bufs = StepBuffers(_Stub(mem), tiny_cfg.hidden_size, 4, 16, torch.float32, cpu)
    loop = RankLoop(RankContext(0, 1, tiny_cfg, model, tiny_embed, mem, Metrics(0), 4), _OneRank())
    step = scenario.random_step(tiny_cfg, LENS, PAGE, PAGES, tiny_embed, seed=7)
    try:
        yield SimpleNamespace(loop=loop, kv=kv, bufs=bufs, eng=eng, step=step, exits=exits)
    finally:
        loop.close()
        bufs.close()
        mem.kv = None
        kv.close()
        eng.close()


def _request(rig, step_id: int, ids: bool = False) -> pb.DraftStepRequest:
    """The step in the registered regions; ids: input_ids (a region slice) instead of inputs_embeds."""
    bid, gen = rig.kv.binding_id, rig.kv.generation
    req = pb.DraftStepRequest(step_id=step_id, binding_id=bid, binding_generation=gen, num_requests=len(LENS))
    rig.bufs.fill(req, rig.step.inputs_embeds, rig.step.positions, rig.step.meta)
    if ids:
        n = 7 * len(LENS)
        rig.bufs.embeds.view(-1)[: 2 * n].view(torch.int64)[:] = torch.arange(n) % 97
        req.input_ids.CopyFrom(codec.region_tensor_ref(torch.int64, (n,), rig.bufs.embeds_id, 0))
    return req


def _region_views(rig, req: pb.DraftStepRequest) -> dict[str, torch.Tensor]:
    """The step's index tensors where `req` names them: views of the shared memory the engine writes."""
    raw = rig.bufs.meta_bytes
    out = {}
    for field in ("positions", "seq_lens", "block_tables", "slot_mapping"):
        ref = getattr(req, field)
        dtype = codec.dtype_from_proto(ref.dtype, field)
        nbytes = torch.Size(ref.shape).numel() * dtype.itemsize
        out[field] = raw[ref.region.offset_bytes : ref.region.offset_bytes + nbytes].view(dtype)
    out["input_ids"] = rig.bufs.embeds.view(-1)[: 2 * 7 * len(LENS)].view(torch.int64)
    return out


def _bad(field: str) -> int:
    """A value far out of range for `field` (int32 fields: one that fits)."""
    return 1 << 30 if field in ("seq_lens", "block_tables") else BIG


def _rewrite_after_validation(rig, monkeypatch, field: str) -> list[bool]:
    """validate_step, then `field` rewritten out of range in the region: the engine's write landing
    between the checks and the step. Returns a switch: [True] while armed; each rewrite disarms it."""
    real = rank_mod.validate_step
    armed = [True]

    def validate(*args, **kwargs):
        step = real(*args, **kwargs)
        if armed[0]:
            _region_views(rig, args[0])[field].fill_(_bad(field))
            armed[0] = False
        return step

    monkeypatch.setattr(rank_mod, "validate_step", validate)
    return armed


def _answer(rig, req: pb.DraftStepRequest, grpc_path: bool) -> pb.DraftStepResponse | None:
    """The rank's answer, or None where the rank exited instead (rig.exits says with which code)."""
    if not grpc_path:
        try:
            return rig.loop.answer_now(req)  # the doorbell's path: in place, on this thread
        except _Exited:
            return None
    fut = rig.loop.submit(req)  # gRPC's: the worker thread, which the exit ends with the step unanswered
    try:
        return fut.result(timeout=10)
    except concurrent.futures.TimeoutError:
        assert rig.exits, "no answer and no exit"
        return None


@pytest.mark.parametrize("grpc_path", [False, True], ids=["doorbell", "grpc"])
@pytest.mark.parametrize("field", ["slot_mapping", "block_tables", "seq_lens", "input_ids"])
def test_metadata_rewritten_after_the_checks_runs_the_checked_step_and_the_rank_serves_on(rig, monkeypatch,
                                                                                         field, grpc_path):
    ids = field == "input_ids"
    want = rig.loop.answer_now(_request(rig, 1, ids))  # the clean step: its answer and the K/V it wrote
    assert want.HasField("hidden_states"), want
    want_hidden = rig.bufs.hidden[: 7 * len(LENS)].clone()
    kv_before = [t.clone() for t in rig.eng.kv_tensors(0)]
    rig.bufs.hidden.zero_()
    armed = _rewrite_after_validation(rig, monkeypatch, field)
    got = _answer(rig, _request(rig, 2, ids), grpc_path)
    assert armed == [False]  # the region was rewritten after the checks
    assert rig.exits == [], f"the rank exited (code {rig.exits}) on {field} rewritten after its checks"
    assert got.HasField("hidden_states"), got  # the checked copy ran: the same step, the same bits
    assert torch.equal(rig.bufs.hidden[: 7 * len(LENS)], want_hidden)
    assert all(torch.equal(a, b) for a, b in zip(kv_before, rig.eng.kv_tensors(0)))  # same K/V, same slots
    again = _answer(rig, _request(rig, 3, ids), grpc_path)  # the rank serves on
    assert again.HasField("hidden_states"), again


# seq_lens past the rows' positions: the positions are named, as disagreeing with them.
@pytest.mark.parametrize("field,named", [("slot_mapping", "slot_mapping"), ("block_tables", "block_tables"),
                                         ("seq_lens", "positions"), ("input_ids", "input_ids")])
def test_metadata_rewritten_before_the_checks_is_refused_naming_the_field(rig, field, named):
    ids = field == "input_ids"
    req = _request(rig, 1, ids)
    _region_views(rig, req)[field].fill_(_bad(field))
    got = rig.loop.answer_now(req)
    assert rig.exits == []
    assert got.HasField("error") and got.error.field == named, got
    again = rig.loop.answer_now(_request(rig, 2, ids))  # the engine's next step, written properly
    assert again.HasField("hidden_states"), again


def test_the_step_runs_a_copy_and_keeps_the_region_as_its_sources(rig):
    """What the host checks and runs is the copy; a pre-launched program, which runs after the engine's next
    write, reads the region (Step.sources, server/prelaunch.py). The engine's write after the checks shows
    in the sources only."""
    req = _request(rig, 1)
    ctx = rig.loop.ctx
    step = validate_step(req, ctx.cfg, ctx.memory, ctx.max_reqs, private=True)
    fields = ("positions", "seq_lens", "block_tables", "slot_mapping")
    own = (step.positions, step.meta.seq_lens, step.meta.block_tables, step.meta.slot_mapping)
    ran = [t.clone() for t in own]
    views = _region_views(rig, req)
    for f in fields:
        views[f].fill_(_bad(f))
    for f, src, t, was in zip(fields, step.region_meta, own, ran):
        assert (src == _bad(f)).all(), f"{f}: the sources are not the region"
        assert torch.equal(t, was), f"{f}: the step's tensor changed with the region"
    _request(rig, 1)  # the engine writes the step again
    again = validate_step(req, ctx.cfg, ctx.memory, ctx.max_reqs, private=True)
    assert again.positions is step.positions  # one copy per layout: a pre-launched step's token (prelaunch.py)
    inline = validate_step(req, ctx.cfg, ctx.memory, ctx.max_reqs)
    assert inline.sources is None and inline.region_meta[0] is inline.positions


def _request_packed_from(rig, step_id: int, start: int) -> pb.DraftStepRequest:
    """The step with its metadata in the region from byte `start`, seq_lens first, each field aligned to its
    own type only (what the sidecar requires; the project's client aligns every field to 8)."""
    req = _request(rig, step_id)
    raw, off, m = rig.bufs.meta_bytes, start, rig.step.meta
    for field, t in (("seq_lens", m.seq_lens), ("positions", rig.step.positions),
                     ("block_tables", m.block_tables), ("slot_mapping", m.slot_mapping)):
        off = -(-off // t.dtype.itemsize) * t.dtype.itemsize
        raw[off : off + t.nbytes].view(t.dtype).view(t.shape).copy_(t)
        getattr(req, field).CopyFrom(codec.region_tensor_ref(t.dtype, tuple(t.shape), rig.bufs.meta_id, off))
        off += t.nbytes
    return req


def test_metadata_packed_from_an_int32_field_off_an_8_byte_boundary_is_served(rig):
    """seq_lens at byte 4, positions at 16: the private copy's one span must keep positions 8-aligned (it
    started at seq_lens: a RuntimeError inside validate_step, and the rank exited)."""
    want = rig.loop.answer_now(_request_packed_from(rig, 1, 0))
    assert want.HasField("hidden_states"), want
    want_hidden = rig.bufs.hidden[: 7 * len(LENS)].clone()
    got = _answer(rig, _request_packed_from(rig, 2, 4), grpc_path=False)
    assert rig.exits == [], f"the rank exited (code {rig.exits}) on a valid layout"
    assert got.HasField("hidden_states"), got
    assert torch.equal(rig.bufs.hidden[: 7 * len(LENS)], want_hidden)


def test_regions_released_while_a_step_is_checked_leave_no_cached_view_of_them(rig, monkeypatch):
    """UnregisterBuffers runs on a gRPC thread while the rank checks a step on its own. One that lands
    after the step's views are resolved and before they are cached used to leave cache entries viewing the
    released regions (MemoryBindings._views, validate's layouts): a later step naming those region ids was
    served from them instead of refused. Entries built before a release are no longer cached after it."""
    from dspark_sidecar.server import validate as validate_mod

    mem, ctx = rig.loop.ctx.memory, rig.loop.ctx
    real = validate_mod._tensors
    released = []

    def racing(*args):
        out = real(*args)  # every view of the step resolved (and, before the fix, cached)
        released.extend(mem.unregister([], owner=rig.bufs.owner))
        return out

    monkeypatch.setattr(validate_mod, "_tensors", racing)
    req = _request(rig, 1)
    validate_step(req, ctx.cfg, mem, ctx.max_reqs, private=True)  # the step in flight still runs
    assert released and not mem.layouts
    assert not [k for k in mem._views if k[0] in (rig.bufs.embeds_id, rig.bufs.hidden_id, rig.bufs.meta_id)]
    monkeypatch.setattr(validate_mod, "_tensors", real)
    got = rig.loop.answer_now(_request(rig, 2))  # the same slices, in regions released since
    assert got.HasField("error") and "is not registered" in got.error.message, got
    rig.bufs._ids = []  # released above: the rig's close has nothing left to unregister
    for m in released:
        m.close()
