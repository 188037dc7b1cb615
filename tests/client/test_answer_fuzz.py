"""Seeded answer fuzz of DrafterShim.maybe_forward: a fake sidecar rank that lies in its answers.

Both transports (the gRPC stream and the shared-memory doorbell) are driven through one rank of a
2-rank engine whose peer always agrees (so every agreement goes through an int64 tensor, as over
gloo). Each case arms one mutation on the fake (a step answer, GetStatus, BindKV, RegisterBuffers,
AttachDoorbell or the doorbell page's words) and checks, for every maybe_forward call:

- it returns None or a tensor equal (dtype, shape and bits) to the correct answer of that very step;
- it returns (no hang: its waits are the config's deadlines, and a step still running after HANG_S is a failure);
- no exception escapes;
- after the fault a correct step is forwarded again within a few steps (or, for a fault that stays,
  the shim turns itself off with a refusal).

Deterministic: every step has its own inputs (so a stale answer shows), random choices are seeded per
mutation name, and timing-sensitive cases are forced by sleeps on the fake's side.

Known limits, not run here (client/FAILURE_MODES.md, "A sidecar that lies"): NaN or Inf in an answer
is returned as it is (checking would cost a host sync per step); an answer that claims this step's
output region but never wrote it, or an unsolicited answer that happens to carry the next step's id,
cannot be told apart from a true one; a doorbell sequence word that jumps ahead, or a BindKV that
always names a wrong generation, leaves the rank safely on fallback for as long as it lasts.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any, Callable

import grpc
import pytest
import torch
from google.rpc import code_pb2

from dspark_sidecar.client import shim as S
from dspark_sidecar.client.config import EngineConfig
from dspark_sidecar.client.forward_context import set_forward_context
from dspark_sidecar.client.shim import DrafterShim
from dspark_sidecar.proto import codec
from dspark_sidecar.proto import doorbell as bell
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.proto.memory import AttachedSegment
from helpers.engine_fakes import (
    HIDDEN, FakeModel, FakeServer, FakeSidecar, recording_shm, shm_kv_cache, short_socket_dir, step_inputs,
)

SEED = 20240607
DEADLINE_S = 0.2
GRACE_S = 0.2
# A hang guard only: every wait of a step is bounded by the config's deadlines (step, grace, connect, bind: at most
# a few seconds here), so a step still running after this waits on something no deadline bounds.
HANG_S = 30.0
R = 2
N = 7 * R
RECOVER_STEPS, RECOVER_S = 8, 2.5
U64 = (1 << 64) - 1


# ------------------------------------------------------------------------------------------------
# The engine side
# ------------------------------------------------------------------------------------------------

class EchoPeer:
    """A 2-rank agreement whose peer holds the same values; they travel as an int64 tensor, as over gloo."""

    world_size = 2

    def all_min(self, values: torch.Tensor) -> torch.Tensor:
        return values.clone()


def inputs(k: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Step k's ids (distinct per step, so a stale answer never equals the right one), positions, metadata."""
    _, pos, meta = step_inputs(R)
    ids = (torch.arange(N, dtype=torch.int64) * 5 + 11 * k + 1) % 64
    return ids, pos, meta


@dataclasses.dataclass
class Call:
    out: Any = None
    exc: BaseException | None = None
    secs: float = 0.0
    hung: bool = False


def call(shim: DrafterShim, k: int) -> Call:
    """maybe_forward for step k on a worker thread, so a hang is reported instead of stopping the run."""
    ids, pos, meta = inputs(k)
    res = Call()

    def run() -> None:
        try:
            with set_forward_context(meta):
                res.out = shim.maybe_forward(ids, pos)
        except BaseException as e:  # noqa: BLE001
            res.exc = e

    t0 = time.monotonic()
    th = threading.Thread(target=run, daemon=True, name=f"fuzz-step-{k}")
    th.start()
    th.join(HANG_S)
    res.secs = time.monotonic() - t0
    res.hung = th.is_alive()
    return res


def expected(model: FakeModel, k: int) -> torch.Tensor:
    ids, _, _ = inputs(k)
    return model.table[ids] * 2


def check(res: Call, model: FakeModel, k: int, what: str) -> None:
    assert not res.hung, f"{what}: maybe_forward still running after {res.secs:.2f} s (hang)"
    assert res.exc is None, f"{what}: exception escaped maybe_forward: {type(res.exc).__name__}: {res.exc}"
    if res.out is not None:
        want = expected(model, k)
        out = res.out
        assert isinstance(out, torch.Tensor), f"{what}: returned {type(out).__name__}"
        assert out.dtype == want.dtype and tuple(out.shape) == tuple(want.shape), (
            f"{what}: returned {out.dtype} {list(out.shape)}, the step's answer is {want.dtype} {list(want.shape)}")
        if not torch.equal(out, want):
            stale = [j for j in range(max(0, k - 4), k + 4) if j != k and torch.equal(out, expected(model, j))]
            detail = (f"equal to step {stale}'s answer (stale)" if stale else
                      f"nan={int(torch.isnan(out).sum())} max|diff|={float((out - want).abs().nan_to_num(0).max()):.3g}")
            raise AssertionError(f"{what}: returned a wrong tensor for this step: {detail}")


# ------------------------------------------------------------------------------------------------
# The fake sidecar rank (gRPC stream, and a doorbell that really answers)
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class StepMut:
    """A lie in the answer to the next step the fake receives."""

    values: Callable[[torch.Tensor], torch.Tensor] | None = None  # the correct hidden -> what is sent / written
    ref: Callable[[pb.TensorRef, random.Random], pb.TensorRef] | None = None  # the answer's TensorRef -> sent
    resp: Callable[[pb.DraftStepRequest, pb.DraftStepResponse, torch.Tensor], list] | None = None  # -> [(delay, resp)]
    compute: bool = True  # doorbell: write the output region at all
    page: Callable[[Any, bytes, int, random.Random], None] | None = None  # doorbell: custom publish(page, bytes, seq)
    # The lie is one the shim must not act on (a later sequence's words): the step forwards its own answer, or at
    # worst misses its deadline, and is never read as broken or malformed.
    ignored: bool = False


class FuzzSidecar(FakeSidecar):
    def __init__(self, dataplane: bool, **kw) -> None:
        super().__init__(**kw)
        self.dataplane = dataplane
        self.rng = random.Random(SEED)
        self.step_mut: StepMut | None = None
        self.status_mut: Callable[[pb.StatusReport], None] | None = None
        self.status_once = True
        self.bind_mut: Callable[[pb.BindKVResponse], None] | None = None
        self.bind_once = True
        self.register_mut: Callable[[list, dict], list] | None = None
        self.attach_mut: Callable[[pb.AttachDoorbellResponse], None] | None = None
        self.applied: set[str] = set()  # the setup mutations that reached an answer (test_setup_answer_mutation)
        self.last_hidden: torch.Tensor | None = None  # the previous step's (correct) answer: stale material
        self.regions: dict[int, tuple[AttachedSegment, torch.Tensor]] = {}
        self._next_region = 101
        self._bells: list[threading.Event] = []
        self.thread_errors: list[str] = []
        self.busy = threading.Event()
        # Step ids in the order their requests arrived (either transport). Not `busy`: the gRPC fake clears that
        # only when gRPC resumes its generator after the previous answer's yield, so a step sent right after an
        # answer can find it still set from that answer's step.
        self.received: list[int] = []

    # --- control RPCs -----------------------------------------------------------------------------
    def GetStatus(self, request, context):
        st = super().GetStatus(request, context)
        if self.status_mut is not None:
            self.status_mut(st)
            self.applied.add("status")
            if self.status_once:
                self.status_mut = None
        return st

    def BindKV(self, request, context):
        resp = super().BindKV(request, context)
        if self.bind_mut is not None:
            self.bind_mut(resp)
            self.applied.add("bind")
            if self.bind_once:
                self.bind_mut = None
        return resp

    def RegisterBuffers(self, request, context):
        self.calls["RegisterBuffers"] += 1
        if not self.dataplane:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "no data plane")
        ids = []
        for r in request.regions:
            seg = AttachedSegment(r.memory.shm.name)
            storage = torch.frombuffer(seg.buf, dtype=torch.uint8)[: r.size_bytes or seg.size]
            rid, self._next_region = self._next_region, self._next_region + 1
            self.regions[rid] = (seg, storage)
            ids.append(rid)
        if self.register_mut is not None:
            ids, self.register_mut = self.register_mut(ids, self.regions), None
            self.applied.add("register")
        return pb.RegisterBuffersResponse(region_ids=ids)

    def UnregisterBuffers(self, request, context):
        self.calls["UnregisterBuffers"] += 1
        for rid in request.region_ids:
            self.regions.pop(rid, None)
        return pb.UnregisterBuffersResponse()

    def AttachDoorbell(self, request, context):
        self.calls["AttachDoorbell"] += 1
        if not self.dataplane:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "no data plane")
        seg = AttachedSegment(request.page.shm.name)
        page = bell.Page(torch.frombuffer(seg.buf, dtype=torch.uint8).numpy(), int(request.capacity_bytes))
        for ev in self._bells:
            ev.set()  # a re-attach replaces the page
        stop = threading.Event()
        self._bells.append(stop)
        threading.Thread(target=self._ring_loop, args=(seg, page, stop), daemon=True, name="fuzz-bell").start()
        resp = pb.AttachDoorbellResponse()
        if self.attach_mut is not None:
            self.attach_mut(resp)
            self.attach_mut = None
            self.applied.add("attach")
        return resp

    def stop_bells(self) -> None:
        for ev in self._bells:
            ev.set()

    # --- steps --------------------------------------------------------------------------------------
    def _hidden_of(self, req: pb.DraftStepRequest, embeds: torch.Tensor) -> torch.Tensor:
        return embeds.float() * 2

    def DraftSteps(self, request_iterator, context):
        self.calls["DraftSteps"] += 1
        for req in request_iterator:
            mut, self.step_mut = self.step_mut, None
            self.received.append(req.step_id)
            self.busy.set()
            items = self._grpc_answer(req, mut)
            for delay, resp in items:
                if delay:
                    time.sleep(delay)
                self.answered.append(resp.step_id)
                yield resp
            self.busy.clear()

    def _grpc_answer(self, req: pb.DraftStepRequest, mut: StepMut | None) -> list:
        prev = self.last_hidden
        resp = self._step(req)
        correct = None
        if resp.WhichOneof("result") == "hidden_states":
            correct = codec.from_tensor_ref(resp.hidden_states, "h").clone()
            self.last_hidden = correct
        if mut is None:
            return [(0.0, resp)]
        if correct is not None and mut.values is not None:
            resp.hidden_states.CopyFrom(codec.to_tensor_ref(mut.values(correct.clone())))
        if correct is not None and mut.ref is not None:
            resp.hidden_states.CopyFrom(mut.ref(_copy(resp.hidden_states), self.rng))
        if mut.resp is not None:
            return mut.resp(req, resp, prev)
        return [(0.0, resp)]

    # doorbell -----------------------------------------------------------------------------------------
    def _region(self, rid: int) -> torch.Tensor | None:
        got = self.regions.get(rid)
        return None if got is None else got[1]

    def _bell_compute(self, req: pb.DraftStepRequest, mut: StepMut | None) -> pb.DraftStepResponse:
        self.calls["step"] += 1
        self.requests.append(req)

        def fail(code: int, reason: str) -> pb.DraftStepResponse:
            return pb.DraftStepResponse(step_id=req.step_id, error=pb.StepError(code=code, message=reason, reason=reason))

        if req.binding_id != self.binding_id or req.binding_generation != self.generation:
            return fail(code_pb2.FAILED_PRECONDITION, "STALE_BINDING")
        if req.step_id in self.step_errors:
            return fail(*self.step_errors[req.step_id])
        src, out = self._region(req.inputs_embeds.region.region_id), self._region(req.output.region_id)
        if src is None or out is None:
            return fail(code_pb2.INVALID_ARGUMENT, "UNKNOWN_REGION")
        dtype = codec.dtype_from_proto(req.inputs_embeds.dtype)
        shape = tuple(req.inputs_embeds.shape)
        off = req.inputs_embeds.region.offset_bytes
        nbytes = math.prod(shape) * dtype.itemsize
        embeds = src[off: off + nbytes].view(dtype).view(shape)
        hidden = self._hidden_of(req, embeds)
        self.last_hidden = hidden.clone()
        if mut is not None and mut.values is not None:
            hidden = mut.values(hidden)
        hidden = hidden.contiguous()
        if mut is None or mut.compute:
            o = req.output.offset_bytes
            raw = hidden.reshape(-1).view(torch.uint8)
            out[o: o + raw.numel()].copy_(raw)
        return pb.DraftStepResponse(step_id=req.step_id, hidden_states=codec.region_tensor_ref(
            hidden.dtype, tuple(hidden.shape), req.output.region_id, req.output.offset_bytes))

    def _ring_loop(self, seg, page, stop: threading.Event) -> None:
        last = page.word(bell.REQ_SEQ)
        while not stop.is_set():
            try:
                seq = page.word(bell.REQ_SEQ)
            except TypeError:  # page closed under us
                return
            if seq == last:
                time.sleep(0.0005)
                continue
            last = seq
            try:
                req = pb.DraftStepRequest.FromString(page.read(page.req_area, bell.REQ_LEN))
                mut, self.step_mut = self.step_mut, None
                self.received.append(req.step_id)
                self.busy.set()
                prev = self.last_hidden
                resp = self._bell_compute(req, mut)
                if mut is None:
                    items = [(0.0, resp)]
                else:
                    if mut.ref is not None and resp.WhichOneof("result") == "hidden_states":
                        resp.hidden_states.CopyFrom(mut.ref(_copy(resp.hidden_states), self.rng))
                    items = mut.resp(req, resp, prev) if mut.resp is not None else [(0.0, resp)]
                for delay, r in items:
                    if delay:
                        time.sleep(delay)
                    if stop.is_set():
                        return
                    data = r.SerializeToString()
                    if mut is not None and mut.page is not None:
                        mut.page(page, data, seq, self.rng)
                    else:
                        page.write(page.resp_area, data, bell.RESP_LEN, bell.RESP_SEQ, seq)
                self.busy.clear()
            except Exception as e:  # noqa: BLE001
                self.thread_errors.append(f"{type(e).__name__}: {e}")
        del seg


def _copy(ref: pb.TensorRef) -> pb.TensorRef:
    out = pb.TensorRef()
    out.CopyFrom(ref)
    return out


# ------------------------------------------------------------------------------------------------
# Mutations
# ------------------------------------------------------------------------------------------------

def _ref_set(**kw):
    def f(ref: pb.TensorRef, rng: random.Random) -> pb.TensorRef:
        for k, v in kw.items():
            if k == "shape":
                del ref.shape[:]
                ref.shape.extend(v)
            else:
                setattr(ref, k, v)
        return ref
    return f


def _data(fn):
    def f(ref: pb.TensorRef, rng: random.Random) -> pb.TensorRef:
        if ref.WhichOneof("payload") == "data":
            ref.data = fn(ref.data, rng)
        return ref
    return f


def _no_payload(ref: pb.TensorRef, rng: random.Random) -> pb.TensorRef:
    ref.ClearField("data")
    ref.ClearField("region")
    return ref


def _as_region(ref: pb.TensorRef, rng: random.Random) -> pb.TensorRef:
    ref.region.CopyFrom(pb.RegionSlice(region_id=rng.randrange(1, 1 << 40), offset_bytes=0))
    return ref


def _with_id(delta: int | None = None, absolute: int | None = None, then_correct: bool = False, stale: bool = False):
    def f(req, resp, prev):
        bad = pb.DraftStepResponse()
        bad.CopyFrom(resp)
        bad.step_id = absolute if absolute is not None else max(0, req.step_id + delta)
        if stale and prev is not None and bad.WhichOneof("result") == "hidden_states" \
                and bad.hidden_states.WhichOneof("payload") == "data":
            bad.hidden_states.CopyFrom(codec.to_tensor_ref(prev))
        return [(0.0, bad)] + ([(0.0, resp)] if then_correct else [])
    return f


def _empty_result(req, resp, prev):
    return [(0.0, pb.DraftStepResponse(step_id=req.step_id))]


def _empty_message(req, resp, prev):
    return [(0.0, pb.DraftStepResponse())]


def _twice(gap: float):
    def f(req, resp, prev):
        return [(0.0, resp), (gap, resp)]
    return f


def _late(delay: float):
    def f(req, resp, prev):
        return [(delay, resp)]
    return f


def _error(code: int, with_id: int | None = None):
    def f(req, resp, prev):
        return [(0.0, pb.DraftStepResponse(step_id=req.step_id if with_id is None else req.step_id + with_id,
                                           error=pb.StepError(code=code, message=f"fuzz code {code}",
                                                              reason="FUZZ")))]
    return f


def _page_len(fn):
    def f(page, data, seq, rng):
        page.resp_area[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).numpy()
        page.words[bell.RESP_LEN] = fn(len(data), page.capacity)
        page.words[bell.RESP_SEQ] = seq
    return f


def _page_garbage(page, data, seq, rng):
    junk = bytes(rng.randrange(256) for _ in range(64))
    page.write(page.resp_area, junk, bell.RESP_LEN, bell.RESP_SEQ, seq)


def _page_seq(fn, then_correct_after: float | None = None):
    def f(page, data, seq, rng):
        page.resp_area[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).numpy()
        page.words[bell.RESP_LEN] = len(data)
        page.words[bell.RESP_SEQ] = fn(seq) & U64
        if then_correct_after is not None:
            time.sleep(then_correct_after)
            page.words[bell.RESP_SEQ] = seq
    return f


def _page_future_then_right(page, data, seq, rng):
    """Garbage published under the next sequence, then this step's answer under its own: only the latter is it."""
    junk = bytes(rng.randrange(256) for _ in range(64))
    page.write(page.resp_area, junk, bell.RESP_LEN, bell.RESP_SEQ, (seq + 1) & U64)
    time.sleep(0.02)
    page.write(page.resp_area, data, bell.RESP_LEN, bell.RESP_SEQ, seq)


def _page_seq_first(page, data, seq, rng):
    """The sequence word before the bytes (a torn publish): the engine may read the previous answer."""
    page.words[bell.RESP_SEQ] = seq
    time.sleep(0.05)
    page.write(page.resp_area, data, bell.RESP_LEN, bell.RESP_SEQ, seq)


BOTH, GRPC, BELL = ("grpc", "doorbell"), ("grpc",), ("doorbell",)

STEP_MUTATIONS: dict[str, tuple[tuple, StepMut]] = {
    # hidden_states: shape
    "shape_rows_plus_7": (BOTH, StepMut(values=lambda h: torch.cat([h, h[:7]]))),
    "shape_cols_minus_1": (BOTH, StepMut(values=lambda h: h[:, :-1])),
    "shape_transposed": (BOTH, StepMut(values=lambda h: h.t().contiguous())),
    "shape_flat": (BOTH, StepMut(values=lambda h: h.reshape(-1))),
    "shape_3d": (BOTH, StepMut(values=lambda h: h[None])),
    "shape_zero_rows": (BOTH, StepMut(values=lambda h: h[:0])),
    "shape_scalar": (BOTH, StepMut(values=lambda h: h[0, 0].clone())),
    "shape_negative": (BOTH, StepMut(ref=_ref_set(shape=[-N, -HIDDEN]))),
    "shape_huge": (BOTH, StepMut(ref=_ref_set(shape=[1 << 40, HIDDEN]))),
    "shape_overflow": (BOTH, StepMut(ref=_ref_set(shape=[(1 << 63) - 1, (1 << 63) - 1]))),
    # hidden_states: dtype
    "dtype_int32": (BOTH, StepMut(values=lambda h: h.to(torch.int32))),
    "dtype_uint8_bytes": (BOTH, StepMut(values=lambda h: h.reshape(-1).view(torch.uint8)[: N * HIDDEN].reshape(N, HIDDEN))),
    "dtype_bf16_values": (BOTH, StepMut(values=lambda h: h.to(torch.bfloat16))),
    "dtype_fp16_values": (BOTH, StepMut(values=lambda h: h.to(torch.float16))),
    "dtype_fp8_values": (BOTH, StepMut(values=lambda h: h.to(torch.float8_e4m3fn))),
    "dtype_bf16_reinterpreted_bytes": (BOTH, StepMut(values=lambda h: h.view(torch.bfloat16)[:, :HIDDEN].contiguous())),
    "dtype_unset": (BOTH, StepMut(ref=_ref_set(dtype=0))),
    "dtype_unknown_77": (BOTH, StepMut(ref=_ref_set(dtype=77))),
    # hidden_states: bytes
    "bytes_short_by_1": (GRPC, StepMut(ref=_data(lambda d, rng: d[:-1]))),
    "bytes_long_by_4": (GRPC, StepMut(ref=_data(lambda d, rng: d + b"\0\0\0\0"))),
    "bytes_empty": (GRPC, StepMut(ref=_data(lambda d, rng: b""))),
    "payload_none": (BOTH, StepMut(ref=_no_payload)),
    "payload_region_on_stream": (GRPC, StepMut(ref=_as_region)),
    # hidden_states: values
    # whole answer
    "empty_result_right_id": (BOTH, StepMut(resp=_empty_result)),
    "empty_message": (BOTH, StepMut(resp=_empty_message)),
    "id_earlier": (BOTH, StepMut(resp=_with_id(-1))),
    "id_earlier_stale_then_right": (GRPC, StepMut(resp=_with_id(-1, then_correct=True, stale=True))),
    "id_later": (BOTH, StepMut(resp=_with_id(+1))),
    "id_max_u64": (BOTH, StepMut(resp=_with_id(absolute=U64))),
    "id_zero": (BOTH, StepMut(resp=_with_id(absolute=0))),
    "duplicated_answer": (GRPC, StepMut(resp=_twice(0.05))),
    "late_within_grace": (BOTH, StepMut(resp=_late(DEADLINE_S + 0.08))),
    "late_after_grace": (BOTH, StepMut(resp=_late(DEADLINE_S + GRACE_S + 0.3))),
    # StepError codes
    "error_code_0_OK": (BOTH, StepMut(resp=_error(0))),
    "error_code_1_CANCELLED": (BOTH, StepMut(resp=_error(1))),
    "error_code_2_UNKNOWN": (BOTH, StepMut(resp=_error(2))),
    "error_code_3_INVALID_ARGUMENT": (BOTH, StepMut(resp=_error(3))),
    "error_code_4_DEADLINE_EXCEEDED": (BOTH, StepMut(resp=_error(4))),
    "error_code_9_FAILED_PRECONDITION": (BOTH, StepMut(resp=_error(9))),
    "error_code_10_ABORTED": (BOTH, StepMut(resp=_error(10))),
    "error_code_11_OUT_OF_RANGE": (BOTH, StepMut(resp=_error(11))),
    "error_code_14_UNAVAILABLE": (BOTH, StepMut(resp=_error(14))),
    "error_code_16_UNAUTHENTICATED": (BOTH, StepMut(resp=_error(16))),
    "error_code_17_unknown": (BOTH, StepMut(resp=_error(17))),
    "error_code_minus_1": (BOTH, StepMut(resp=_error(-1))),
    "error_code_int32_max": (BOTH, StepMut(resp=_error((1 << 31) - 1))),
    "error_for_next_step_id": (BOTH, StepMut(resp=_error(13, with_id=+1))),
    # doorbell: the answer does not match the step / the region was not written
    "bell_stale_region_id_earlier": (BELL, StepMut(compute=False, resp=_with_id(-1))),
    "bell_inline_payload_region_untouched": (BELL, StepMut(compute=False, ref=lambda ref, rng: codec.to_tensor_ref(
        torch.zeros(N, HIDDEN)))),
    "bell_region_id_elsewhere": (BELL, StepMut(compute=False, ref=lambda ref, rng: _ref_region(ref, 987654, 0))),
    "bell_region_offset_elsewhere": (BELL, StepMut(compute=False, ref=lambda ref, rng: _ref_region(
        ref, ref.region.region_id, 4096))),
    # doorbell page words
    "bell_len_u64_max": (BELL, StepMut(page=_page_len(lambda n, cap: U64))),
    "bell_len_capacity_plus_1": (BELL, StepMut(page=_page_len(lambda n, cap: cap + 1))),
    "bell_len_zero": (BELL, StepMut(page=_page_len(lambda n, cap: 0))),
    "bell_len_one": (BELL, StepMut(page=_page_len(lambda n, cap: 1))),
    "bell_len_truncated_3": (BELL, StepMut(page=_page_len(lambda n, cap: max(0, n - 3)))),
    "bell_len_capacity": (BELL, StepMut(page=_page_len(lambda n, cap: cap))),
    "bell_garbage_bytes": (BELL, StepMut(page=_page_garbage)),
    "bell_seq_before_bytes": (BELL, StepMut(page=_page_seq_first)),
    "bell_seq_future_then_right": (BELL, StepMut(page=_page_seq(lambda s: s + 1, then_correct_after=0.05), ignored=True)),
    "bell_seq_future_garbage_then_right": (BELL, StepMut(page=_page_future_then_right, ignored=True)),
    "bell_seq_old_then_right_late": (BELL, StepMut(page=_page_seq(lambda s: s - 1,
                                                                 then_correct_after=DEADLINE_S + GRACE_S + 0.3))),
}


def _ref_region(ref: pb.TensorRef, rid: int, off: int) -> pb.TensorRef:
    ref.region.CopyFrom(pb.RegionSlice(region_id=rid, offset_bytes=off))
    return ref


@dataclasses.dataclass
class SetupMut:
    """A lie at connect time (GetStatus, BindKV, RegisterBuffers, AttachDoorbell); armed before the first step."""

    status: Callable[[pb.StatusReport], None] | None = None
    bind: Callable[[pb.BindKVResponse], None] | None = None
    register: Callable[[list, dict], list] | None = None
    attach: Callable[[pb.AttachDoorbellResponse], None] | None = None
    persistent: bool = False
    ok_reasons: tuple = ()  # a fallback reason that is the right steady answer (e.g. the limit learned)


def _st(**kw):
    def f(st: pb.StatusReport) -> None:
        for path, v in kw.items():
            obj, *rest = path.split("__")
            target = getattr(st, obj)
            setattr(target, rest[0], v) if rest else setattr(st, obj, v)
    return f


def _bind(binding_id=None, generation=None):
    def f(resp: pb.BindKVResponse) -> None:
        if binding_id is not None:
            resp.binding_id = binding_id
        if generation is not None:
            resp.generation = generation
    return f


def _fifo(tmp: str) -> str:
    path = os.path.join(tmp, "unread.fifo")
    if not os.path.exists(path):
        os.mkfifo(path)
    return path


SETUP_MUTATIONS: dict[str, tuple[tuple, SetupMut]] = {
    "status_max_reqs_0": (BOTH, SetupMut(status=_st(limits__max_reqs=0), persistent=True)),
    "status_max_reqs_1": (BOTH, SetupMut(status=_st(limits__max_reqs=1), persistent=True, ok_reasons=(S.REQS,))),
    "status_max_reqs_257": (BOTH, SetupMut(status=_st(limits__max_reqs=257), persistent=True)),
    "status_max_reqs_2p31": (GRPC, SetupMut(status=_st(limits__max_reqs=1 << 31), persistent=True)),
    "status_max_reqs_u32_max": (GRPC, SetupMut(status=_st(limits__max_reqs=(1 << 32) - 1), persistent=True)),
    "status_max_reqs_0_once": (BOTH, SetupMut(status=_st(limits__max_reqs=0))),
    "status_hidden_size_mismatch_32": (BOTH, SetupMut(status=_st(model__hidden_size=32), persistent=True)),
    "status_hidden_size_0": (BOTH, SetupMut(status=_st(model__hidden_size=0), persistent=True)),
    "status_qpr_launch_reqs_0": (BOTH, SetupMut(status=_st(limits__qpr=0, limits__launch_reqs=0), persistent=True)),
    "status_compute_dtype_garbage": (BOTH, SetupMut(status=_st(model__compute_dtype="int7"), persistent=True)),
    "status_not_serving_loading_once": (BOTH, SetupMut(status=_st(serving=False, state="LOADING"))),
    "status_not_serving_odd_state_once": (BOTH, SetupMut(status=_st(serving=False, state="WEIRD", fast_path_refusal=""))),
    "status_refused_for_good": (BOTH, SetupMut(status=_st(serving=False, state="REFUSED"), persistent=True)),
    "status_serving_but_state_refused": (BOTH, SetupMut(status=_st(state="REFUSED"), persistent=True)),
    "bind_id_0_gen_0": (BOTH, SetupMut(bind=_bind(0, 0))),
    "bind_gen_0": (BOTH, SetupMut(bind=_bind(generation=0))),
    "bind_id_u64_max": (BOTH, SetupMut(bind=_bind(binding_id=U64))),
    "bind_gen_2p62": (BOTH, SetupMut(bind=_bind(generation=1 << 62))),
    "bind_gen_2p63": (BOTH, SetupMut(bind=_bind(generation=1 << 63))),
    "bind_gen_u64_max": (BOTH, SetupMut(bind=_bind(generation=U64))),
    "register_no_ids": (BELL, SetupMut(register=lambda ids, regs: [])),
    "register_two_ids": (BELL, SetupMut(register=lambda ids, regs: ids[:2])),
    "register_four_ids": (BELL, SetupMut(register=lambda ids, regs: ids + [999])),
    "register_unknown_ids": (BELL, SetupMut(register=lambda ids, regs: [7, 8, 9])),
    "register_one_id_thrice": (BELL, SetupMut(register=lambda ids, regs: [ids[0]] * 3)),
    "attach_wake_fifo_regular_file": (BELL, SetupMut(attach=lambda r: setattr(r, "wake_fifo", "/etc/hostname"))),
    "attach_wake_fifo_missing": (BELL, SetupMut(attach=lambda r: setattr(r, "wake_fifo", "/nonexistent/fifo"))),
    # os.open raises ValueError (not OSError) for a NUL byte: it escaped the channel after the attach, and the
    # page and its registration were left to the process's exit
    "attach_wake_fifo_nul": (BELL, SetupMut(attach=lambda r: setattr(r, "wake_fifo", "/tmp/fifo\x00x"))),
    "attach_gpu_word_and_event_on_cpu": (BELL, SetupMut(attach=lambda r: (setattr(r, "gpu_word", True),
                                                                          setattr(r, "output_event", b"\x01" * 64)))),
}


# ------------------------------------------------------------------------------------------------
# The driver
# ------------------------------------------------------------------------------------------------

@pytest.fixture
def rig(request):
    made = []

    def make(transport: str) -> tuple[FuzzSidecar, DrafterShim, FakeModel]:
        fake = FuzzSidecar(dataplane=transport == "doorbell", max_reqs=4)
        server = FakeServer(fake, short_socket_dir() / "rank0.sock").start()
        kv = shm_kv_cache()
        model = FakeModel()
        cfg = EngineConfig(tp_size=4, endpoint=server.endpoint, transport=transport, step_deadline_s=DEADLINE_S,
                           late_grace_s=GRACE_S, connect_deadline_s=1.0, bind_deadline_s=1.0)
        shim = DrafterShim(cfg, model, lambda: [s.tensor for s in kv], EchoPeer())
        made.append((server, shim, kv))
        return fake, shim, model

    yield make
    for server, shim, kv in made:
        shim._unsettled = None
        try:
            shim.close()  # never raises (client/shim.py): after any mutated answer, an error here is a finding
        finally:
            server.sidecar.stop_bells()
            server.stop()
            for s in kv:
                s.close()


def recover(shim: DrafterShim, model: FakeModel, k: int, what: str, ok_reasons: tuple = (),
            refusal_ok: bool = True) -> int:
    """Steps k, k+1, ...: each checked; returns the step that forwarded again (fails when none does)."""
    t0 = time.monotonic()
    tried = 0
    while tried < RECOVER_STEPS or time.monotonic() - t0 < RECOVER_S:
        res = call(shim, k)
        check(res, model, k, f"{what}: recovery step {k}")
        if res.out is not None:
            return k
        if refusal_ok and not shim.enabled and shim.refusal:
            return k
        if ok_reasons and shim.stats.fallbacks and any(shim.stats.fallbacks[r] >= 3 for r in ok_reasons):
            return k
        k += 1
        tried += 1
        time.sleep(0.06)
    raise AssertionError(f"{what}: never forwarded again ({tried} steps, {time.monotonic() - t0:.1f} s); "
                         f"enabled={shim.enabled} refusal={shim.refusal!r} fallbacks={dict(shim.stats.fallbacks)}")


def no_shim_error(shim: DrafterShim, what: str) -> None:
    """A lying sidecar is the sidecar's fault: its answer falls back under a reason of its own (malformed
    answer, stream broken), never as an error of the shim's (a trace logged, as for a bug here)."""
    errs = {k: v for k, v in shim.stats.fallbacks.items() if k.startswith("shim error")}
    assert not errs, f"{what}: the sidecar's lie read as a shim error: {errs}"


def _cases(table):
    return [pytest.param(t, name, id=f"{t}-{name}") for name, (ts, _) in table.items() for t in ts]


@pytest.mark.parametrize("transport, name", _cases(STEP_MUTATIONS))
def test_step_answer_mutation(rig, transport, name):
    fake, shim, model = rig(transport)
    what = f"[{transport}] {name}"
    res = call(shim, 1)
    check(res, model, 1, f"{what}: warm-up")
    assert res.out is not None, f"{what}: the warm-up step did not forward: {dict(shim.stats.fallbacks)}"
    assert (shim.doorbell is not None) == (transport == "doorbell")
    mut = fake.step_mut = STEP_MUTATIONS[name][1]
    before = dict(shim.stats.fallbacks)
    check(call(shim, 2), model, 2, f"{what}: the mutated step")
    assert fake.step_mut is None, f"{what}: the mutation was never applied"
    grew = {k for k, v in shim.stats.fallbacks.items() if v > before.get(k, 0)}
    if mut.ignored:
        assert not grew & {S.STREAM, S.BAD_ANSWER}, f"{what}: the shim took the lie for its answer: {sorted(grew)}"
    if S.BAD_ANSWER in grew:  # counted against the sidecar: a few such steps open its breaker
        assert shim.breaker.failures >= 1, f"{what}: a malformed answer not counted against the breaker"
    recover(shim, model, 3, what, refusal_ok=False)
    no_shim_error(shim, what)
    assert not fake.thread_errors, fake.thread_errors


@pytest.mark.parametrize("transport, name", _cases(SETUP_MUTATIONS))
def test_setup_answer_mutation(rig, transport, name, tmp_path):
    fake, shim, model = rig(transport)
    mut = SETUP_MUTATIONS[name][1]
    what = f"[{transport}] {name}"
    fake.status_mut, fake.status_once = mut.status, not mut.persistent
    fake.bind_mut, fake.bind_once = mut.bind, not mut.persistent
    fake.register_mut, fake.attach_mut = mut.register, mut.attach
    with recording_shm() as shm:
        check(call(shim, 1), model, 1, f"{what}: first step")
    if (mut.register is not None or mut.attach is not None) and shim.doorbell is None:  # refused data plane: nothing of it may stay
        left = shm.left()
        assert not left, f"{what}: the refused data plane left {len(left)} shared-memory segments: {sorted(left)}"
    armed = {k for k in ("status", "bind", "register", "attach") if getattr(mut, k) is not None}
    assert armed <= fake.applied, f"{what}: the mutation was never applied ({sorted(armed - fake.applied)})"
    # Only a lie that stays may turn the shim off for good: with refusal_ok=True for every case, a shim that
    # read a one-off LOADING status as a refusal (off for the process) passed as "recovered".
    recover(shim, model, 2, what, ok_reasons=mut.ok_reasons, refusal_ok=mut.persistent)
    no_shim_error(shim, what)
    assert not fake.thread_errors, fake.thread_errors


def test_an_answer_for_a_later_step_does_not_settle_a_step_still_running(rig):
    """Answers come one per request, in order, so StepStream.settled(k) reads `last_answered >= k`. One
    answer labelled with a later id (k+3) must not make a later timed-out step read as settled while the
    sidecar is still inside it (it may still write that step's K/V)."""
    fake, shim, model = rig("grpc")
    check(call(shim, 1), model, 1, "warm-up")
    fake.step_mut = StepMut(resp=_with_id(+3))
    check(call(shim, 2), model, 2, "id+3")  # unanswered: deadline, grace; then settled by the stray id?
    k = recover(shim, model, 3, "id+3")
    fake.step_mut = StepMut(resp=_late(DEADLINE_S + GRACE_S + 1.0))  # a real stall, past deadline and grace
    check(call(shim, k + 1), model, k + 1, "stalled step")
    assert fake.busy.is_set(), "the fake should still be inside the stalled step"
    deadlines = shim.stats.fallbacks[S.DEADLINE]
    check(call(shim, k + 2), model, k + 2, "step after the stall")
    assert shim.stats.fallbacks[S.UNSETTLED] >= 1 and shim.stats.fallbacks[S.DEADLINE] == deadlines, (
        "a new step was sent while the sidecar was still running the unsettled one "
        f"(settled() trusted last_answered={shim.connection._stream.last_answered}); fallbacks={dict(shim.stats.fallbacks)}")


def test_a_doorbell_step_stalled_past_its_grace_keeps_the_next_one_back(rig):
    """The doorbell's settled(k) is the page's answer to k (or the sidecar closing the page, or its process
    ending), as the stream's is its answer. A step the sidecar is still inside after its deadline and grace may
    still write its K/V and read its input rows: the next step is not rung over them until it answers."""
    fake, shim, model = rig("doorbell")
    first = call(shim, 1)
    check(first, model, 1, "warm-up")
    assert first.out is not None and shim.doorbell is not None, dict(shim.stats.fallbacks)
    fake.step_mut = StepMut(resp=_late(DEADLINE_S + GRACE_S + 1.0))  # a real stall, past deadline and grace
    check(call(shim, 2), model, 2, "stalled step")
    assert fake.busy.is_set(), "the fake should still be inside the stalled step"
    deadlines, rung = shim.stats.fallbacks[S.DEADLINE], fake.calls["step"]
    check(call(shim, 3), model, 3, "step after the stall")
    assert shim.stats.fallbacks[S.UNSETTLED] >= 1 and fake.calls["step"] == rung, (
        f"a step was rung while the sidecar was still inside the unsettled one; fallbacks={dict(shim.stats.fallbacks)}")
    assert shim.stats.fallbacks[S.DEADLINE] == deadlines
    recover(shim, model, 4, "after the stall", refusal_ok=False)


_HUGE_DOORBELL = textwrap.dedent("""
    import resource, sys, time, threading
    resource.setrlimit(resource.RLIMIT_AS, (10 << 30, resource.RLIM_INFINITY))  # a guard: the shim would fill /dev/shm
    sys.path.insert(0, {tests!r})
    import importlib.util
    spec = importlib.util.spec_from_file_location("answer_fuzz", {path!r})
    mod = importlib.util.module_from_spec(spec); sys.modules["answer_fuzz"] = mod; spec.loader.exec_module(mod)
    FuzzSidecar, EchoPeer, call, check, _st = mod.FuzzSidecar, mod.EchoPeer, mod.call, mod.check, mod._st
    DEADLINE_S, GRACE_S = mod.DEADLINE_S, mod.GRACE_S
    from helpers.engine_fakes import FakeModel, FakeServer, shm_kv_cache, short_socket_dir
    from dspark_sidecar.client.config import EngineConfig
    from dspark_sidecar.client.shim import DrafterShim
    fake = FuzzSidecar(dataplane=True, max_reqs=4)
    fake.status_mut, fake.status_once = _st(**{kw}), False
    server = FakeServer(fake, short_socket_dir() / "rank0.sock").start()
    kv = shm_kv_cache(); model = FakeModel()
    cfg = EngineConfig(tp_size=4, endpoint=server.endpoint, transport="doorbell", step_deadline_s=DEADLINE_S,
                       late_grace_s=GRACE_S, bind_deadline_s=1.0)
    shim = DrafterShim(cfg, model, lambda: [s.tensor for s in kv], EchoPeer())
    outs = []
    for k in range(1, 7):
        res = call(shim, k)
        check(res, model, k, "step %d" % k)
        outs.append(res.out is not None)
        time.sleep(0.06)
    print("FORWARDED", outs, dict(shim.stats.fallbacks))
    sys.stdout.flush()
    import os; os._exit(0 if any(outs[1:]) or not shim.enabled else 3)
""")


@pytest.mark.parametrize("kw", [{"limits__max_reqs": 1 << 31}, {"model__hidden_size": (1 << 32) - 1}],
                         ids=["max_reqs_2p31", "hidden_size_u32_max"])
def test_doorbell_sized_from_absurd_status_limits(kw):
    """The data plane's buffers are sized from GetStatus. Run in a child under RLIMIT_AS: unguarded, the
    shim would create a sparse shm segment of about a TB and zero-fill it (SIGBUS or OOM)."""
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([tests, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", _HUGE_DOORBELL.format(tests=tests, kw=kw, path=os.path.abspath(__file__))], env=env,
                          capture_output=True, text=True, timeout=60)
    tail = (proc.stdout + proc.stderr)[-1500:]
    assert proc.returncode == 0, f"child exit {proc.returncode}: {tail}"


def test_a_good_answer_for_one_shape_is_refused_for_another():
    """check_answer keeps the good answer per (rows, width): an answer that was good for a step of one
    shape, sent for a step of another, is refused as the field checks refuse it (a stale or mis-keyed
    good answer would let it through)."""
    import types

    import torch

    from dspark_sidecar.client.doorbell_transport import DoorbellTransport
    from dspark_sidecar.proto import codec
    from dspark_sidecar.proto import sidecar_pb2 as pb

    t = object.__new__(DoorbellTransport)
    t.buffers = types.SimpleNamespace(hidden_id=5, dtype=torch.bfloat16)
    t._answer_ref = {}

    def answer(rows: int, width: int) -> pb.DraftStepResponse:
        return pb.DraftStepResponse(step_id=1, hidden_states=codec.region_tensor_ref(torch.bfloat16, (rows, width), 5, 0))

    for rows in (7, 14, 7):  # each shape seen, then asked again with the other's answer
        t.check_answer(answer(rows, 16), 1, rows, 16)
        other = 21 - rows
        with pytest.raises(ValueError, match="expected"):
            t.check_answer(answer(rows, 16), 1, other, 16)
        with pytest.raises(ValueError, match="expected"):
            t.check_answer(answer(rows, 16), 1, rows, 32)


@pytest.mark.parametrize("transport", BOTH)
def test_a_forwarded_answer_is_the_engines_to_keep(rig, transport, monkeypatch):
    """maybe_forward's tensor is memory of the engine's own. An fp32 engine on CPU gets the answer with no dtype
    or device conversion, which would copy it. Without the shim's own copy it would be, over the stream, a
    tensor over the message's immutable bytes (codec.from_tensor_ref without writable=True) and, over the
    doorbell, a view of the output region that the next step's answer overwrites. Kept across a step, it
    must still be its own step's answer. Nothing pinned either copy: test_shim_steps.py wrote into a result
    ("not aliasing the message bytes") and checked nothing, and every other check reads a result at once."""
    over_bytes: list[torch.Tensor] = []
    real = torch.frombuffer
    monkeypatch.setattr(torch, "frombuffer", lambda *a, **k: over_bytes.append(real(*a, **k)) or over_bytes[-1])
    fake, shim, model = rig(transport)
    first = call(shim, 1)
    check(first, model, 1, f"[{transport}] step 1")
    assert first.out is not None, dict(shim.stats.fallbacks)
    assert (shim.doorbell is not None) == (transport == "doorbell")
    if transport == "grpc":  # (the doorbell's regions are shared memory, which frombuffer maps too)
        lo, hi = first.out.data_ptr(), first.out.data_ptr() + first.out.nbytes
        shared = [t for t in over_bytes if t.numel() and t.data_ptr() < hi and lo < t.data_ptr() + t.nbytes]
        assert not shared, "the answer is a tensor over the message's bytes, not memory of its own"
    k = recover(shim, model, 2, f"[{transport}] after step 1", refusal_ok=False)  # a later step answered
    assert torch.equal(first.out, expected(model, 1)), f"step 1's answer changed under the engine at step {k}"
    first.out.fill_(-1.0)  # the engine's to write: nothing the shim reads or answers changes
    recover(shim, model, k + 1, f"[{transport}] after the engine wrote step 1's answer", refusal_ok=False)
