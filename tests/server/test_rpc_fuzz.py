"""Seeded fuzzing of the RPCs of a real TP-1 CPU sidecar (the unary ones, and DraftSteps' steps).

A few hundred deterministic mutations of valid DraftStep, BindKV, UnbindKV, RegisterBuffers,
UnregisterBuffers, AttachDoorbell and GetStatus requests: wrong dtypes, bad shapes, truncated
bytes, offsets past the end, indices outside the bound cache, missing fields, bad handles. For
each, the answer must not be INTERNAL or UNKNOWN (bad input is the client's fault), must not be
OK where the input is clearly invalid, and must carry details a person can act on: rich status
details grpcio-status parses, an ErrorInfo reason, a BadRequest field the message names
(rich_status_problem). A refused step must leave the engine's KV cache untouched. Every
CHECK_EVERY calls a valid step (inline bytes, and one through registered regions) must still
answer with bit-identical hidden states, and GetStatus must say SERVING. Every problem is collected, and the test fails once with them all.
"""

from __future__ import annotations

import os
import random
import secrets
import time
from dataclasses import dataclass
from typing import Callable

import grpc
import pytest
import torch
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from dspark_sidecar import layout
from dspark_sidecar.drafter import scenario
from dspark_sidecar.drafter.kv_cache import StepMetadata
from dspark_sidecar.proto import codec, memory
from dspark_sidecar.proto import doorbell as page_words
from dspark_sidecar.proto import sidecar_pb2 as pb
from helpers.engine_sim import PAGE, EngineSim
from helpers.sidecar_proc import SidecarProcess

SEED = 0x5EED_F022
MAX_REQS = 8
CHECK_EVERY = 20
TIMEOUT_S = 10.0
SERVICE = "/dspark.sidecar.v1.DrafterSidecar/"

U32, I32, U64, I64 = 2**32 - 1, 2**31 - 1, 2**64 - 1, 2**63 - 1
CANARY_LENS = [5, 40]  # the check step: its own pages, never named by a fuzzed request
FUZZ_LENS = [3, 17, 30]  # the step every DraftStep mutation starts from: its own pages
CANARY_PAGES = sum(scenario.pages_needed(c + layout.QPR, PAGE) for c in CANARY_LENS) + 1
FUZZ_PAGES = sum(scenario.pages_needed(c + layout.QPR, PAGE) for c in FUZZ_LENS) + 1
SCRATCH_PAGES = 8  # for the valid far-position step
PAGES = CANARY_PAGES + FUZZ_PAGES + SCRATCH_PAGES
META_BYTES = 1 << 16
CLIP_REGISTERED = 4096  # the "clip" region: a 64 KiB segment registered with only 4096 usable bytes
CLIP_BASE = 8192  # where the clip segment holds a copy of the step, past its registered bytes

DTYPES = [pb.DTYPE_UNSPECIFIED, pb.DTYPE_BF16, pb.DTYPE_FP16, pb.DTYPE_FP32, pb.DTYPE_INT32, pb.DTYPE_INT64,
          pb.DTYPE_FP8_E4M3, pb.DTYPE_UINT8, 99]
STEP_FIELDS = ("positions", "inputs_embeds", "seq_lens", "block_tables", "slot_mapping")
BAD_CODES = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)


def _dname(d: int) -> str:
    return pb.DType.Name(d) if d in pb.DType.values() else str(d)


@dataclass
class Case:
    rpc: str  # method name
    label: str  # the mutation, in words
    make: Callable[[], object]  # builds the request (a message, or raw bytes) when it is sent
    invalid: bool  # clearly invalid: OK is a finding
    after_ok: Callable[[object], None] | None = None  # restores state after an accepted request


class Rig:
    def __init__(self, tmp, sc: SidecarProcess, cfg, embed) -> None:
        self.tmp, self.sc, self.cfg, self.embed = tmp, sc, cfg, embed
        self.eng = EngineSim(cfg, [sc.socket(0)], PAGES, torch.float32)
        self.eng.bind()
        self.stub, self.channel = self.eng.stubs[0], self.eng.channels[0]
        self.findings: list[str] = []
        self.notes: list[str] = []
        self.log: list[tuple[str, str, str, str]] = []
        self.held: list = []  # shm segments the sidecar may still map: closed at the end
        self._ids = iter(range(1_000_000, 10**9))
        self.dead = False

        self.canary = scenario.random_step(cfg, CANARY_LENS, PAGE, CANARY_PAGES, embed, seed=11)
        self.fuzz = _shifted(scenario.random_step(cfg, FUZZ_LENS, PAGE, FUZZ_PAGES, embed, seed=12), CANARY_PAGES)
        self.R, self.n = len(FUZZ_LENS), layout.QPR * len(FUZZ_LENS)

        # Registered regions: "meta" holds the fuzz step's tensors and an output slice; "clip" holds a copy
        # of them past the bytes it was registered with.
        self.meta = self._shm(META_BYTES)
        self.clip = self._shm(META_BYTES)
        self.offsets = self._lay_out(self.meta.tensor, 0)
        self._lay_out(self.clip.tensor, CLIP_BASE)
        regions = [pb.BufferRegion(name="meta", memory=memory.export_handle(self.meta.tensor), size_bytes=META_BYTES),
                   pb.BufferRegion(name="clip", memory=memory.export_handle(self.clip.tensor),
                                   size_bytes=CLIP_REGISTERED)]
        self.meta_id, self.clip_id = self.stub.RegisterBuffers(
            pb.RegisterBuffersRequest(regions=regions, owner=secrets.randbits(62) or 1), timeout=TIMEOUT_S).region_ids

        # The far-position step: one request at P = 100000, on scratch pages only.
        self.far = self._far_step()

        self.want_inline = self._canary_inline()
        self.want_region = self._canary_region()
        assert self.want_inline is not None and self.want_region is not None, self.findings
        self.canary_kv = self._canary_kv()

    # Set-up helpers -------------------------------------------------------------------------
    def _shm(self, nbytes: int):
        t = memory.shm_empty((nbytes,), torch.uint8)
        self.held.append(t)
        return t

    def _lay_out(self, raw: torch.Tensor, base: int) -> dict[str, int]:
        """Write the fuzz step's tensors into `raw` from `base` on, 64-byte aligned; their offsets."""
        s = self.fuzz
        tensors = {"positions": s.positions, "seq_lens": s.meta.seq_lens, "block_tables": s.meta.block_tables,
                   "slot_mapping": s.meta.slot_mapping, "inputs_embeds": s.inputs_embeds.float(),
                   "input_ids": s.input_ids, "output": torch.zeros(self.n, self.cfg.hidden_size)}
        offs, off = {}, base
        for name, t in tensors.items():
            off = -(-off // 64) * 64
            nbytes = t.numel() * t.element_size()
            raw[off:off + nbytes].view(t.dtype).copy_(t.reshape(-1))
            offs[name] = off
            off += nbytes
        assert off <= raw.numel()
        return offs

    def _far_step(self) -> scenario.StepInputs:
        P = 100_000
        L = P + layout.QPR
        width = scenario.pages_needed(L, PAGE)
        first = CANARY_PAGES + FUZZ_PAGES
        table = (first + torch.arange(width) % SCRATCH_PAGES).to(torch.int32)[None, :]
        pos = torch.arange(P, L, dtype=torch.int64)
        slots = table[0, pos // PAGE].to(torch.int64) * PAGE + pos % PAGE
        ids = torch.randint(0, self.cfg.vocab_size, (layout.QPR,), generator=torch.Generator().manual_seed(5))
        return scenario.StepInputs(ids, self.embed[ids], pos, StepMetadata(torch.tensor([L], dtype=torch.int32),
                                                                           table, slots))

    # Requests -------------------------------------------------------------------------------
    @property
    def binding(self) -> tuple[int, int]:
        return self.eng.bindings[0]

    def step_req(self, step=None) -> pb.DraftStepRequest:
        return self.eng.request(0, next(self._ids), step or self.fuzz)

    def region_req(self, region_id: int | None = None, base: int = 0) -> pb.DraftStepRequest:
        """The fuzz step with every tensor (and the output) a slice of a registered region."""
        rid = self.meta_id if region_id is None else region_id
        o, s = self.offsets, self.fuzz
        bid, gen = self.binding

        def ref(dtype, shape, name):
            return codec.region_tensor_ref(dtype, shape, rid, base + o[name])

        return pb.DraftStepRequest(
            step_id=next(self._ids), binding_id=bid, binding_generation=gen, num_requests=self.R,
            positions=ref(torch.int64, (self.n,), "positions"),
            inputs_embeds=ref(torch.float32, (self.n, self.cfg.hidden_size), "inputs_embeds"),
            seq_lens=ref(torch.int32, (self.R,), "seq_lens"),
            block_tables=ref(torch.int32, tuple(s.meta.block_tables.shape), "block_tables"),
            slot_mapping=ref(torch.int64, (self.n,), "slot_mapping"),
            output=pb.RegionSlice(region_id=rid, offset_bytes=base + o["output"]))

    def bind_req(self) -> pb.BindKVRequest:
        return self.eng.bind_request(0)

    # Calls ----------------------------------------------------------------------------------
    def call(self, rpc: str, req) -> tuple[grpc.StatusCode, str, object]:
        """(code, details, the response, or the RpcError of a failed call)."""
        try:
            if isinstance(req, bytes):
                fn = self.channel.unary_unary(SERVICE + rpc)  # raw bytes both ways
                resp = fn(req, timeout=TIMEOUT_S)
            else:
                resp = getattr(self.stub, rpc)(req, timeout=TIMEOUT_S)
            return grpc.StatusCode.OK, "", resp
        except grpc.RpcError as err:
            return err.code(), err.details() or "", err

    def run(self, case: Case) -> None:
        req = case.make()
        kv_before = self._kv() if case.rpc == "DraftStep" else None
        t = time.monotonic()
        code, details, resp = self.call(case.rpc, req)
        took = time.monotonic() - t
        self.log.append((case.rpc, case.label, code.name, details[:160]))
        where = f"{case.rpc} [{case.label}]"
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and details == "Deadline Exceeded":
            self.findings.append(f"{where}: HANG (no answer within {TIMEOUT_S:.0f} s)")
        elif code in BAD_CODES:
            self.findings.append(f"{where}: {code.name}: {details}")
        elif code == grpc.StatusCode.UNAVAILABLE:
            self.findings.append(f"{where}: UNAVAILABLE ({details}) after {took:.1f} s: server dead?")
            self._check_alive(where)
        elif code == grpc.StatusCode.OK:
            if case.invalid:
                self.findings.append(f"{where}: OK for clearly invalid input")
            if case.after_ok is not None:
                case.after_ok(resp)
        elif not details.strip():
            self.findings.append(f"{where}: {code.name} with empty details")
        if code not in (grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED) and not self.dead:
            problem = rich_status_problem(resp)
            if problem:
                self.findings.append(f"{where}: {code.name} {details[:120]!r}: {problem}")
        if kv_before is not None and code != grpc.StatusCode.OK and not _same(kv_before, self._kv()):
            pages = sorted({p for a, b in zip(kv_before, self._kv())
                            for p in torch.nonzero(_bits(a) != _bits(b))[:, 1].tolist()})
            self.findings.append(f"{where}: refused ({code.name}) but it wrote K/V (pages {pages})")

    def _check_alive(self, where: str) -> None:
        if self.sc.proc.poll() is not None or self.sc.health() != ["SERVING"]:
            self.dead = True
            self.findings.append(f"server DEAD after {where} (exit {self.sc.proc.poll()}, health "
                                 f"{self.sc.health()}):\n{self.sc.log_tail(40)}")

    # The checks between mutations -----------------------------------------------------------
    def _kv(self) -> list[torch.Tensor]:
        return [t.clone() for t in self.eng.kv_tensors(0)]

    def _canary_kv(self) -> list[torch.Tensor]:
        return [t[:, :CANARY_PAGES].clone() for t in self.eng.kv_tensors(0)]

    def _canary_inline(self) -> torch.Tensor | None:
        code, details, resp = self.call("DraftStep", self.eng.request(0, next(self._ids), self.canary))
        if code != grpc.StatusCode.OK:
            self.findings.append(f"canary step (inline) refused: {code.name}: {details}")
            return None
        return codec.from_tensor_ref(resp.hidden_states, "hidden_states").clone()

    def _canary_region(self) -> torch.Tensor | None:
        code, details, resp = self.call("DraftStep", self.region_req())
        if code != grpc.StatusCode.OK:
            self.findings.append(f"canary step (regions) refused: {code.name}: {details}")
            return None
        assert resp.hidden_states.HasField("region"), resp
        o = self.offsets["output"]
        nbytes = self.n * self.cfg.hidden_size * 4
        return self.meta.tensor[o:o + nbytes].view(torch.float32).view(self.n, -1).clone()

    def checkpoint(self, after: str) -> None:
        if self.dead:
            return
        if not _same(self.canary_kv, self._canary_kv()):
            self.findings.append(f"after {after}: the canary step's KV pages changed (no fuzzed request names them)")
        got = self._canary_inline()
        if got is not None and not torch.equal(got, self.want_inline):
            self.findings.append(f"after {after}: the canary step's hidden states differ (max |d| = "
                                 f"{(got - self.want_inline).abs().max().item():.3g})")
        got = self._canary_region()
        if got is not None and not torch.equal(got, self.want_region):
            self.findings.append(f"after {after}: the region step's hidden states differ")
        code, details, status = self.call("GetStatus", pb.GetStatusRequest())
        if code != grpc.StatusCode.OK or not status.serving or status.state != "SERVING":
            self.findings.append(f"after {after}: GetStatus {code.name} {details} "
                                 f"{status.state if status else ''}: not serving")
            self._check_alive(after)
        self.canary_kv = self._canary_kv()

    def rebind(self, _resp=None) -> None:
        """After a BindKV that was accepted: bind the engine's real cache again (a new generation)."""
        self.eng.bind()

    def close(self) -> None:
        self.eng.close()
        for t in self.held:
            try:
                t.close()
            except FileNotFoundError:
                pass


def _shifted(step: scenario.StepInputs, pages: int) -> scenario.StepInputs:
    m = step.meta
    return scenario.StepInputs(step.input_ids, step.inputs_embeds, step.positions,
                               StepMetadata(m.seq_lens, m.block_tables + pages, m.slot_mapping + pages * PAGE))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)  # fp32 cache: compared bit for bit (a NaN a valid step wrote equals itself)


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(_bits(x), _bits(y)) for x, y in zip(a, b, strict=True))


# Codes a refusal may carry (sidecar.proto): bad input, a count or index past its bounds, a stale or
# missing binding, too large, not now; NOT_FOUND only for an unregistered region id.
REFUSAL_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.FAILED_PRECONDITION,
                 grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND}
FIELD_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE}  # always about one field


def _top(field: str) -> str:
    """The request field a violation's path starts with ("layers[2].memory" -> "layers")."""
    return field.split(".", 1)[0].split("[", 1)[0]


def rich_status_problem(err: grpc.RpcError) -> str:
    """What is wrong with a refusal's rich status (sidecar.proto: google.rpc.Status with ErrorInfo, and
    BadRequest for a bad field), or '' when nothing is: a code from REFUSAL_CODES, details grpcio-status
    parses, an ErrorInfo reason in our domain, and for a bad field a violation the message names."""
    if err.code() not in REFUSAL_CODES:
        return f"code {err.code().name} is none a refusal carries"
    try:
        status = rpc_status.from_call(err)
    except ValueError as exc:  # its code or message differ from the call's
        return f"rich status does not match the call's: {exc}"
    if status is None:
        return "no rich status details (grpc-status-details-bin)"
    info, bad = error_details_pb2.ErrorInfo(), error_details_pb2.BadRequest()
    infos = [d for d in status.details if d.Unpack(info)]
    if len(infos) != 1 or info.domain != "dspark.sidecar.v1" or not info.reason:
        return f"no ErrorInfo with a reason in our domain: {[d.type_url for d in status.details]}"
    if [d for d in status.details if d.Unpack(bad)]:
        fields = [v.field for v in bad.field_violations]
        if len(fields) != 1 or _top(fields[0]) not in status.message or info.metadata["field"] != fields[0]:
            return f"BadRequest {fields} (ErrorInfo field {info.metadata['field']!r}) not named by the message"
    elif err.code() in FIELD_CODES:
        return "no BadRequest naming the field"
    return ""


# Mutations ------------------------------------------------------------------------------------

def _shape_mutations(shape: list[int]) -> dict[str, list[int]]:
    muts = {
        "[] (scalar)": [],
        "last dim dropped": shape[:-1],
        "extra dim 1": shape + [1],
        "dim0 + 1": [shape[0] + 1] + shape[1:],
        "dim0 - 1": [shape[0] - 1] + shape[1:],
        "dim0 = 0": [0] + shape[1:],
        "dim0 = -1": [-1] + shape[1:],
        "last dim = -1": shape[:-1] + [-1],
        "dim0 = 2^62": [2**62] + shape[1:],
        "dim0 = 2^63-1": [I64] + shape[1:],
        "dim0 = -2^63": [-(2**63)] + shape[1:],
        "last dim * 2": shape[:-1] + [shape[-1] * 2],
        "dims = [2^32, 2^32]": [2**32, 2**32],
        "dims negative pair [-3, -7]": [-3, -7],
    }
    out, seen = {}, {tuple(shape)}
    for k, v in muts.items():
        if tuple(v) not in seen:
            seen.add(tuple(v))
            out[k] = v
    return out


def _ref_mutations(rig: Rig, field: str, region: bool) -> list[tuple[str, Callable, bool]]:
    """(label, mutate(req), invalid) for one TensorRef field of a step."""
    base = rig.region_req() if region else rig.step_req()
    if field == "input_ids":
        _set("input_ids", rig.fuzz.input_ids)(base)
    ref0 = getattr(base, field)
    muts: list[tuple[str, Callable, bool]] = [(f"{field} missing", lambda r: r.ClearField(field), True)]

    def on_ref(fn):
        return lambda r: fn(getattr(r, field))

    for d in DTYPES:
        if d != ref0.dtype:
            # A region holds no dtype of its own: its fp32 embeddings read as fp16/bf16 are a valid request.
            ok = region and field == "inputs_embeds" and d in (pb.DTYPE_FP16, pb.DTYPE_BF16)
            muts.append((f"{field}.dtype = {_dname(d)}", on_ref(lambda x, d=d: setattr(x, "dtype", d)), not ok))
    for k, v in _shape_mutations(list(ref0.shape)).items():
        muts.append((f"{field}.shape {k} -> {v}", on_ref(lambda x, v=v: (x.ClearField("shape"), x.shape.extend(v))),
                     True))
    if not region:
        nbytes = len(ref0.data)
        item = torch.empty((), dtype=codec.dtype_from_proto(ref0.dtype)).element_size()
        for k, cut in (("truncated by 1 byte", nbytes - 1), ("truncated to half", nbytes // 2),
                       ("empty", 0), ("one byte extra", nbytes + 1), ("one element extra", nbytes + item)):
            muts.append((f"{field}.data {k} ({cut} of {nbytes} bytes)",
                         on_ref(lambda x, cut=cut: setattr(x, "data", (x.data + b"\x01" * item)[:cut])), True))
        muts.append((f"{field} payload unset (no data, no region)", on_ref(lambda x: x.ClearField("data")), True))
    regions = [("region 0", 0, 0), ("unknown region 12345", 12345, 0),
               ("meta region, offset at its end", rig.meta_id, META_BYTES),
               ("meta region, offset 2^64-1", rig.meta_id, U64),
               ("meta region, offset 2^63", rig.meta_id, 2**63),
               ("meta region, misaligned offset", rig.meta_id, rig.offsets[field if field in rig.offsets else
                                                                            "positions"] + 1),
               ("meta region, offset so the tensor overhangs the end by 8 bytes", rig.meta_id, None),
               (f"clip region past its {CLIP_REGISTERED} registered bytes (inside the segment)", rig.clip_id,
                CLIP_BASE + rig.offsets[field]),
               ]
    for k, rid, off in regions:
        if off is None:
            nbytes = codec.nbytes_of(ref0, field)
            off = -(-(META_BYTES - nbytes + 8) // 8) * 8
        muts.append((f"{field} as {k} (offset {off})",
                     on_ref(lambda x, rid=rid, off=off: x.region.CopyFrom(pb.RegionSlice(region_id=rid,
                                                                                          offset_bytes=off))), True))
    return muts


def _set(field: str, t: torch.Tensor) -> Callable:
    return lambda r: getattr(r, field).CopyFrom(codec.to_tensor_ref(t))


def _value_mutations(rig: Rig) -> list[tuple[str, Callable, bool]]:
    s, R = rig.fuzz, rig.R
    L, P, T, S = s.meta.seq_lens, s.positions, s.meta.block_tables, s.meta.slot_mapping
    W = T.shape[1]
    muts: list[tuple[str, Callable, bool]] = []

    def edit(t, fn):
        t = t.clone()
        fn(t)
        return t

    for v in (0, 6, -1, I32, -(2**31)):
        muts.append((f"seq_lens[0] = {v}", _set("seq_lens", edit(L, lambda t, v=v: t.__setitem__(0, v))), True))
    muts.append(("seq_lens[1] + 1 (disagrees with positions)", _set("seq_lens", edit(L, lambda t: t.__setitem__(1, t[1] + 1))), True))
    big = PAGES * PAGE + layout.QPR
    muts.append((f"seq_lens all {big} (past the cache)", _set("seq_lens", torch.full_like(L, big)), True))

    def consistent_far(r):  # seq_lens and positions agree, the table is too narrow and the cache too small
        L2 = torch.full_like(L, big)
        P2 = (L2.to(torch.int64)[:, None] - layout.QPR + torch.arange(layout.QPR)).reshape(-1)
        _set("seq_lens", L2)(r)
        _set("positions", P2)(r)
    muts.append((f"seq_lens = positions + 7 = {big} past the cache (tables and slots unchanged)", consistent_far, True))

    for k, v in (("positions[0] + 1", lambda t: t.__setitem__(0, t[0] + 1)),
                 ("positions[3] = -1", lambda t: t.__setitem__(3, -1)),
                 ("positions[5] = 2^63-1", lambda t: t.__setitem__(5, I64)),
                 ("positions all -7", lambda t: t.fill_(-7)),
                 ("positions of request 0 reversed", lambda t: t.__setitem__(slice(0, 7), t[:7].flip(0)))):
        muts.append((k, _set("positions", edit(P, v)), True))

    used_last = scenario.pages_needed(int(L[2]), PAGE) - 1
    for v in (PAGES, -1, I32, -(2**31)):
        muts.append((f"block_tables[0][0] = {v}", _set("block_tables", edit(T, lambda t, v=v: t.__setitem__((0, 0), v))), True))
    muts.append((f"block_tables[2][{used_last}] = {PAGES} (last used page)",
                 _set("block_tables", edit(T, lambda t: t.__setitem__((2, used_last), PAGES))), True))
    muts.append(("block_tables width 0 ([R, 0])", _set("block_tables", T[:, :0].contiguous()), True))
    muts.append(("block_tables last column dropped", _set("block_tables", T[:, :-1].contiguous()), True))
    muts.append(("block_tables 1-D (flattened)", _set("block_tables", T.reshape(-1)), True))
    muts.append(("block_tables rows swapped", _set("block_tables", T.flip(0).contiguous()), True))
    for v in (-1, PAGES, I32):  # request 0 uses 1 page: its padding is never read (vLLM pads with zeros)
        muts.append((f"block_tables[0][{W - 1}] = {v} (unused padding)",
                     _set("block_tables", edit(T, lambda t, v=v: t.__setitem__((0, W - 1), v))), False))
    for k, v in (("slot_mapping[0] = -1", -1), (f"slot_mapping[0] = {PAGES * PAGE}", PAGES * PAGE),
                 ("slot_mapping[0] + 1", int(S[0]) + 1), ("slot_mapping[0] = 2^63-1", I64),
                 ("slot_mapping[0] = -2^63", -(2**63)), ("slot_mapping[0] = 0 (a canary page)", 0)):
        muts.append((k, _set("slot_mapping", edit(S, lambda t, v=v: t.__setitem__(0, v))), True))
    muts.append(("slot_mapping all 0", _set("slot_mapping", torch.zeros_like(S)), True))

    ids = s.input_ids
    muts.append(("input_ids instead of inputs_embeds (valid)", _set("input_ids", ids), False))
    for k, v in (("input_ids[0] = -1", -1), (f"input_ids[0] = vocab {rig.cfg.vocab_size}", rig.cfg.vocab_size),
                 ("input_ids[0] = 2^63-1", I64), ("input_ids[0] = -2^63", -(2**63))):
        muts.append((k, _set("input_ids", edit(ids, lambda t, v=v: t.__setitem__(0, v))), True))
    muts.append(("input_ids as int32", _set("input_ids", ids.to(torch.int32)), True))
    muts.append(("input_ids shape [n, 1]", _set("input_ids", ids[:, None]), True))

    E = s.inputs_embeds.float()
    muts.append(("inputs_embeds all NaN", _set("inputs_embeds", torch.full_like(E, float("nan"))), False))
    muts.append(("inputs_embeds all +inf", _set("inputs_embeds", torch.full_like(E, float("inf"))), False))
    muts.append(("inputs_embeds as fp16", _set("inputs_embeds", E.half()), False))
    muts.append(("inputs_embeds as bf16", _set("inputs_embeds", E.bfloat16()), False))
    muts.append(("inputs_embeds as fp8_e4m3 (well-formed bytes)", _set("inputs_embeds", E.to(torch.float8_e4m3fn)), True))
    muts.append(("inputs_embeds as int32 (well-formed bytes)", _set("inputs_embeds", E.to(torch.int32)), True))
    muts.append(("inputs_embeds as uint8 (well-formed bytes)", _set("inputs_embeds", E.to(torch.uint8)), True))
    muts.append(("inputs_embeds [n, hidden+1]", _set("inputs_embeds", torch.zeros(rig.n, rig.cfg.hidden_size + 1)), True))
    muts.append(("inputs_embeds flat [n*hidden]", _set("inputs_embeds", E.reshape(-1)), True))
    muts.append(("inputs_embeds [n+7, hidden]", _set("inputs_embeds", torch.zeros(rig.n + 7, rig.cfg.hidden_size)), True))
    muts.append(("no input (neither inputs_embeds nor input_ids)", lambda r: r.ClearField("inputs_embeds"), True))

    for v in (0, R - 1, R + 1, MAX_REQS + 1, layout.MAX_REQS_LIMIT + 1, U32):
        muts.append((f"num_requests = {v}", lambda r, v=v: setattr(r, "num_requests", v), True))

    def rel(field, fn):
        return lambda r: setattr(r, field, fn(getattr(r, field)))
    muts += [("binding_id = 0", rel("binding_id", lambda b: 0), True),
             ("binding_id + 1", rel("binding_id", lambda b: (b + 1) % 2**64), True),
             ("binding_id = 2^64-1", rel("binding_id", lambda b: U64 if b != U64 else 1), True),
             ("binding_generation = 0", rel("binding_generation", lambda g: 0), True),
             ("binding_generation + 1", rel("binding_generation", lambda g: g + 1), True),
             ("binding_generation - 1", rel("binding_generation", lambda g: g - 1), True),
             ("binding_generation = 2^64-1", rel("binding_generation", lambda g: U64), True)]

    o = rig.offsets["output"]
    for k, rid, off in (("region 0", 0, 0), ("unknown region 12345", 12345, 0),
                        ("meta region, offset at its end", rig.meta_id, META_BYTES),
                        ("meta region, offset 2^64-1", rig.meta_id, U64),
                        ("meta region, misaligned offset", rig.meta_id, o + 2),
                        ("meta region, overhanging the end", rig.meta_id, META_BYTES - 1024),
                        (f"clip region past its {CLIP_REGISTERED} registered bytes", rig.clip_id, CLIP_BASE + o)):
        muts.append((f"output = {k} (offset {off})",
                     lambda r, rid=rid, off=off: r.output.CopyFrom(pb.RegionSlice(region_id=rid, offset_bytes=off)), True))
    muts.append(("output = a valid meta slice", lambda r: r.output.CopyFrom(
        pb.RegionSlice(region_id=rig.meta_id, offset_bytes=o)), False))
    muts += [("deadline_ms = 1", lambda r: setattr(r, "deadline_ms", 1), False),
             ("deadline_ms = 2^32-1", lambda r: setattr(r, "deadline_ms", U32), False),
             ("launch_key = 2^32-1", lambda r: setattr(r, "launch_key", U32), False),
             ("step_id = 2^64-1", lambda r: setattr(r, "step_id", U64), False)]
    return muts


def _step_cases(rig: Rig, rng: random.Random) -> list[Case]:
    cases: list[Case] = []
    invalid_inline: list[tuple[str, Callable]] = []

    def inline(label, fn, invalid):
        def make():
            r = rig.step_req()
            fn(r)
            return r
        cases.append(Case("DraftStep", label, make, invalid))
        if invalid:
            invalid_inline.append((label, fn))

    for field in STEP_FIELDS:
        for label, fn, invalid in _ref_mutations(rig, field, region=False):
            inline(label, fn, invalid)
    for label, fn, invalid in _value_mutations(rig):
        inline(label, fn, invalid)
    ids_base = rig.fuzz.input_ids
    for label, fn, invalid in _ref_mutations(rig, "input_ids", region=False):
        if "missing" in label:
            continue
        inline(f"(input_ids variant) {label}", lambda r, fn=fn: (_set("input_ids", ids_base)(r), fn(r)), invalid)
    inline("far positions: P = 100000, a 6251-page table (valid)", lambda r: None, False)
    cases[-1].make = lambda: rig.step_req(rig.far)

    for field in STEP_FIELDS:  # the same step through registered regions
        for label, fn, invalid in _ref_mutations(rig, field, region=True):
            def make(fn=fn):
                r = rig.region_req()
                fn(r)
                return r
            cases.append(Case("DraftStep", f"(regions) {label}", make, invalid))
    cases.append(Case("DraftStep", "(regions) every tensor in the clip region past its registered bytes",
                      lambda: rig.region_req(rig.clip_id, CLIP_BASE), True))
    cases.append(Case("DraftStep", "(regions) positions and slot_mapping swapped",
                      lambda: _swap(rig.region_req(), "positions", "slot_mapping"), True))

    for i in range(60):  # two invalid mutations at once
        (la, fa), (lb, fb) = rng.sample(invalid_inline, 2)

        def make(fa=fa, fb=fb):
            r = rig.step_req()
            fa(r)
            fb(r)
            return r
        cases.append(Case("DraftStep", f"{la} + {lb}", make, True))
    return cases


def _swap(req, a, b):
    x, y = pb.TensorRef(), pb.TensorRef()
    x.CopyFrom(getattr(req, a))
    y.CopyFrom(getattr(req, b))
    getattr(req, a).CopyFrom(y)
    getattr(req, b).CopyFrom(x)
    return req


def _outside_file(rig: Rig, nbytes: int) -> str:
    """A file outside /dev/shm, named relative to it ("../../tmp/..."), as a hostile shm name."""
    path = rig.tmp / f"outside-{nbytes}.bin"
    if not path.exists():
        path.write_bytes(b"\0" * nbytes)
    return os.path.relpath(path, "/dev/shm")


def _handle_mutations(rig: Rig, nbytes: int) -> list[tuple[str, Callable[[pb.MemoryHandle], None], bool]]:
    """(label, mutate(handle), invalid) for a MemoryHandle of an nbytes shm segment."""
    def shm(**kw):
        def fn(h):
            for k, v in kw.items():
                setattr(h.shm, k, v)
        return fn
    return [
        ("memory unset (no shm, no cuda_ipc)", lambda h: h.ClearField("shm"), True),
        ("shm.name ''", shm(name=""), True),
        ("shm.name does not exist", shm(name="dspark-fuzz-no-such-segment"), True),
        ("shm.name with a slash 'a/b'", shm(name="a/b"), True),
        ("shm.name with a NUL byte", shm(name="x\0y"), True),
        ("shm.name '.'", shm(name="."), True),
        ("shm.name '..'", shm(name=".."), True),
        ("shm.name 300 characters", shm(name="n" * 300), True),
        ("shm.name '../zero' (/dev/zero)", shm(name="../zero"), True),
        (f"shm.name escapes /dev/shm ('{_outside_file(rig, nbytes)}', a regular file of {nbytes} bytes)",
         shm(name=_outside_file(rig, nbytes)), True),
        (f"shm.offset_bytes {nbytes + 1} (past the segment)", shm(offset_bytes=nbytes + 1), True),
        ("shm.offset_bytes 2^64-1", shm(offset_bytes=U64), True),
        ("shm.size_bytes 1 (smaller than what is used)", shm(size_bytes=1), True),
        ("cuda_ipc handle on a CPU sidecar (garbage fields)", lambda h: h.cuda_ipc.CopyFrom(pb.CudaIpcHandle(
            device_index=7, device_uuid="GPU-fuzz", ipc_handle=b"\x01" * 64, storage_size_bytes=U64,
            storage_offset_bytes=U64, ref_counter_handle=b"/fuzz", ref_counter_offset=U64)), True),
        ("cuda_ipc handle, empty", lambda h: h.cuda_ipc.SetInParent(), True),
    ]


def _bind_cases(rig: Rig) -> list[Case]:
    cases: list[Case] = []
    layer_bytes = rig.eng.kv_tensors(0)[0].numel() * 4

    def add(label, fn, invalid):
        def make():
            r = rig.bind_req()
            fn(r)
            return r
        cases.append(Case("BindKV", label, make, invalid, after_ok=rig.rebind))

    def eng(**kw):
        return lambda r: [setattr(r.engine, k, v) for k, v in kw.items()]
    for k, v, bad in (("engine_rank", 1, True), ("engine_rank", U32, True), ("tp_size", 0, True),
                      ("tp_size", 4, True), ("tp_size", U32, True), ("dp_size", 2, False), ("pp_size", 0, False),
                      ("speculative_method", "", False), ("num_speculative_tokens", 0, False),
                      ("device", "cuda:7", False), ("device_uuid", "GPU-fuzz", False)):
        add(f"engine.{k} = {v!r}", eng(**{k: v}), bad)
    add("engine unset", lambda r: r.ClearField("engine"), True)
    for v in (0, 8, 32, U32):
        add(f"page_size = {v}", lambda r, v=v: setattr(r, "page_size", v), True)

    def layers(fn):
        def apply(r):
            ls = [pb.KVLayerBinding() for _ in r.layers]
            for a, b in zip(ls, r.layers):
                a.CopyFrom(b)
            ls = fn(ls)
            r.ClearField("layers")
            r.layers.extend(ls)
        return apply
    add("layers empty", layers(lambda ls: []), True)
    add("last layer missing", layers(lambda ls: ls[:-1]), True)
    add("layer 0 twice (6 layers)", layers(lambda ls: ls + ls[:1]), True)
    add("layers 0 and 1 swapped", layers(lambda ls: [ls[1], ls[0]] + ls[2:]), True)
    add("layer 2 listed as layer 3", layers(lambda ls: [*ls[:2], _with(ls[2], layer=3), *ls[3:]]), True)
    add("layer 4 numbered 99", layers(lambda ls: [*ls[:4], _with(ls[4], layer=99)]), True)

    def every_layer_pages(pages):
        def apply(r):
            for lb in r.layers:
                lb.shape[1] = pages
        return apply
    add("every layer 0 pages (an empty cache)", every_layer_pages(0), True)
    add("every layer one page fewer than its memory holds", every_layer_pages(PAGES - 1), False)
    add("every layer one page more than its memory holds", every_layer_pages(PAGES + 1), True)

    shape0 = list(rig.bind_req().layers[0].shape)
    strides0 = list(rig.bind_req().layers[0].strides)
    for i in (0, 4):
        def lay(fn, i=i):
            def apply(r):
                fn(r.layers[i])
            return apply
        for d in DTYPES:
            if d != pb.DTYPE_FP32:
                # fp8 e4m3 codes are a served cache dtype (vLLM's kv_cache_dtype fp8): the same
                # memory read as 1-byte codes is a smaller view of it, and valid.
                add(f"layers[{i}].dtype = {_dname(d)}", lay(lambda lb, d=d: setattr(lb, "dtype", d)),
                    d != pb.DTYPE_FP8_E4M3)
        shapes = {"4 dims": shape0[:4], "6 dims": shape0 + [1], "0 pages": [2, 0, *shape0[2:]],
                  "pages + 1": [2, shape0[1] + 1, *shape0[2:]], "pages -1": [2, -1, *shape0[2:]],
                  "pages 2^62": [2, 2**62, *shape0[2:]], "pages 2^63-1": [2, I64, *shape0[2:]],
                  "kv heads 8": [*shape0[:3], 8, shape0[4]], "head_dim 64": [*shape0[:4], 64],
                  "K only (dim0 1)": [1, *shape0[1:]], "all dims -1": [-1] * 5}
        for k, v in shapes.items():
            def fn(lb, v=v):
                lb.ClearField("shape")
                lb.shape.extend(v)
                if len(v) == len(lb.strides):  # keep the strides contiguous for the new shape
                    st, size = [], 1
                    for n in reversed(v):
                        st.append(size)
                        size *= max(n, 1)
                    lb.ClearField("strides")
                    lb.strides.extend(min(x, I64) for x in reversed(st))
            add(f"layers[{i}].shape {k} -> {v}", lay(fn), True)
        strides = {"4 strides": strides0[:4], "all 0": [0] * 5, "all 1": [1] * 5,
                   "reversed (transposed)": strides0[::-1], "negative": [-s for s in strides0],
                   "dim0 2^63-1": [I64, *strides0[1:]], "none": []}
        _, p, pg, h, d = shape0
        strides.update({"K and V on one memory (dim0 0)": [0, *strides0[1:]],
                        "head_dim every other value": [*strides0[:4], 2]})
        for k, v in strides.items():
            add(f"layers[{i}].strides {k} -> {v}",
                lay(lambda lb, v=v: (lb.ClearField("strides"), lb.strides.extend(v))), True)
        # The same memory read as K | V records [pages, heads, page_size, 2 * head_dim] (vLLM 0.34): valid.
        records = [d, h * pg * 2 * d, 2 * d, pg * 2 * d, 1]
        add(f"layers[{i}].strides records view -> {records}",
            lay(lambda lb, v=records: (lb.ClearField("strides"), lb.strides.extend(v))), False)
        for v in (-1, 1, I64, -(2**63), layer_bytes // 4):
            add(f"layers[{i}].storage_offset = {v}", lay(lambda lb, v=v: setattr(lb, "storage_offset", v)), True)
        for k, fn, bad in _handle_mutations(rig, layer_bytes):
            add(f"layers[{i}].memory: {k}", lay(lambda lb, fn=fn: fn(lb.memory)), bad)
    return cases


def _with(lb: pb.KVLayerBinding, **kw) -> pb.KVLayerBinding:
    out = pb.KVLayerBinding()
    out.CopyFrom(lb)
    for k, v in kw.items():
        setattr(out, k, v)
    return out


def _unbind_cases(rig: Rig) -> list[Case]:
    def make(fn):
        return lambda: pb.UnbindKVRequest(binding_id=fn(rig.binding[0]))
    return [Case("UnbindKV", label, make(fn), True, after_ok=rig.rebind) for label, fn in (
        ("binding_id = 0", lambda b: 0), ("binding_id + 1", lambda b: (b + 1) % 2**64),
        ("binding_id = 2^64-1", lambda b: U64 if b != U64 else 1), ("binding_id ^ 1", lambda b: b ^ 1),
        ("binding_id = 2^63", lambda b: 2**63 if b != 2**63 else 1))]


def _register_cases(rig: Rig) -> list[Case]:
    seg = rig._shm(1 << 14)
    nbytes = 1 << 14

    def region(**kw):
        return pb.BufferRegion(name="fuzz", memory=memory.export_handle(seg.tensor), size_bytes=nbytes) if not kw \
            else pb.BufferRegion(**({"name": "fuzz", "memory": memory.export_handle(seg.tensor),
                                     "size_bytes": nbytes} | kw))

    def release(resp):  # an accepted registration: let it go again
        if resp.region_ids:
            rig.stub.UnregisterBuffers(pb.UnregisterBuffersRequest(region_ids=list(resp.region_ids)),
                                       timeout=TIMEOUT_S)

    cases: list[Case] = []

    def add(label, regions_fn, invalid, owner=None):
        def make():
            return pb.RegisterBuffersRequest(regions=regions_fn(), owner=owner() if owner else 0)
        cases.append(Case("RegisterBuffers", label, make, invalid, after_ok=release))

    add("regions empty", lambda: [], False)
    add("one valid region (control)", lambda: [region()], False)
    add("size_bytes 0", lambda: [region(size_bytes=0)], False)
    add(f"size_bytes {nbytes + 1} (past the segment)", lambda: [region(size_bytes=nbytes + 1)], True)
    add("size_bytes 2^64-1", lambda: [region(size_bytes=U64)], True)
    add("name ''", lambda: [region(name="")], False)
    for k, fn, bad in _handle_mutations(rig, nbytes):
        def regions_fn(fn=fn):
            r = region()
            fn(r.memory)
            return [r]
        add(f"memory: {k}", regions_fn, bad)

    def good_then_bad():
        bad = region()
        bad.memory.shm.name = "dspark-fuzz-no-such-segment"
        return [region(), region(), bad]
    add("two valid regions then a bad one (all or none)", good_then_bad, True)

    def released_owner():  # an owner token already released registers nothing more
        tok = secrets.randbits(62) or 1
        rig.stub.UnregisterBuffers(pb.UnregisterBuffersRequest(owner=tok), timeout=TIMEOUT_S)
        return tok
    add("owner released before", lambda: [region()], True, owner=released_owner)
    return cases


def _unregister_cases(rig: Rig) -> list[Case]:
    seg = rig._shm(4096)

    def fresh() -> int:
        r = pb.BufferRegion(name="tmp", memory=memory.export_handle(seg.tensor), size_bytes=4096)
        return rig.stub.RegisterBuffers(pb.RegisterBuffersRequest(regions=[r]), timeout=TIMEOUT_S).region_ids[0]

    def twice():
        rid = fresh()
        rig.stub.UnregisterBuffers(pb.UnregisterBuffersRequest(region_ids=[rid]), timeout=TIMEOUT_S)
        return pb.UnregisterBuffersRequest(region_ids=[rid])

    def reregister(_resp):  # a registration the fuzz needs was released: not expected; fail loudly later
        pass

    return [Case("UnregisterBuffers", label, make, invalid, after_ok=reregister) for label, make, invalid in (
        ("region_ids [12345]", lambda: pb.UnregisterBuffersRequest(region_ids=[12345]), True),
        ("region_ids [0]", lambda: pb.UnregisterBuffersRequest(region_ids=[0]), True),
        ("region_ids [2^64-1]", lambda: pb.UnregisterBuffersRequest(region_ids=[U64]), True),
        ("region_ids [meta, 12345] (all or none)",
         lambda: pb.UnregisterBuffersRequest(region_ids=[rig.meta_id, 12345]), True),
        ("region_ids [12345, clip] with an owner", lambda: pb.UnregisterBuffersRequest(
            region_ids=[12345, rig.clip_id], owner=secrets.randbits(62) or 1), True),
        ("nothing (no ids, no owner)", lambda: pb.UnregisterBuffersRequest(), False),
        ("an owner that owns nothing", lambda: pb.UnregisterBuffersRequest(owner=secrets.randbits(62) or 1), False),
        ("a fresh region id twice [x, x]", lambda: pb.UnregisterBuffersRequest(region_ids=[fresh()] * 2), False),
        ("a region released before", twice, True),
    )]


def _attach_cases(rig: Rig) -> list[Case]:
    cap = page_words.MIN_CAPACITY
    size = page_words.HEADER + 2 * cap

    def req(**kw):
        page = rig._shm(size)
        return pb.AttachDoorbellRequest(**({"page": memory.export_handle(page.tensor), "capacity_bytes": cap} | kw))

    cases: list[Case] = []

    def add(label, make, invalid):
        cases.append(Case("AttachDoorbell", label, make, invalid))

    add("a valid page (control)", lambda: req(), False)
    add("gpu_word on a CPU sidecar", lambda: req(gpu_word=True), False)
    add("input_event on a CPU sidecar (it cannot wait on it)", lambda: req(input_event=b"\x07" * 64), True)
    for v in (0, 1, cap - 1, size, U64, 2**63):
        add(f"capacity_bytes = {v}", lambda v=v: req(capacity_bytes=v), True)
    add("page unset", lambda: pb.AttachDoorbellRequest(capacity_bytes=cap), True)

    def small_page():
        page = rig._shm(100)
        return pb.AttachDoorbellRequest(page=memory.export_handle(page.tensor), capacity_bytes=cap)
    add("page of 100 bytes", small_page, True)
    for k, fn, bad in _handle_mutations(rig, size):
        def make(fn=fn):
            r = req()
            fn(r.page)
            return r
        add(f"page: {k}", make, bad)
    return cases


def _status_cases(rig: Rig) -> list[Case]:
    return [Case("GetStatus", "plain", lambda: pb.GetStatusRequest(), False),
            Case("GetStatus", "unknown field 7 (varint)", lambda: b"\x38\x01", False),
            Case("GetStatus", "unknown field 1 (bytes)", lambda: b"\x0a\x03abc", False)]


@pytest.fixture(scope="module")
def rig(tmp_path_factory, tiny_cfg, tiny_ckpt, tiny_embed):
    tmp = tmp_path_factory.mktemp("rpc_fuzz")
    with SidecarProcess(tmp, tp=1, checkpoint=tiny_ckpt, extra_args=["--max-reqs", str(MAX_REQS)]) as sc:
        r = Rig(tmp, sc, tiny_cfg, tiny_embed)
        try:
            yield r
        finally:
            r.close()


def test_fuzzed_rpcs_get_actionable_statuses_and_the_rank_serves_on(rig):
    start = len(rig.findings)
    rng = random.Random(SEED)
    cases = (_step_cases(rig, rng) + _bind_cases(rig) + _unbind_cases(rig) + _register_cases(rig)
             + _unregister_cases(rig) + _attach_cases(rig) + _status_cases(rig))
    rng.shuffle(cases)
    assert len(cases) >= 300, len(cases)
    t0 = time.monotonic()
    for i, case in enumerate(cases, 1):
        rig.run(case)
        if rig.dead:
            break
        if i % CHECK_EVERY == 0:
            rig.checkpoint(f"call {i} ({case.rpc} [{case.label}])")
    if not rig.dead:
        # Unbound: steps and a second unbind are refused; bound again: the canary answers as before.
        bid = rig.binding[0]
        code, details, _ = rig.call("UnbindKV", pb.UnbindKVRequest(binding_id=bid))
        assert code == grpc.StatusCode.OK, (code, details)
        for label, make in (("UnbindKV again", lambda: pb.UnbindKVRequest(binding_id=bid)),
                            ("DraftStep", rig.step_req)):
            rig.run(Case(label.split()[0], f"{label} while unbound", make, True))
        rig.rebind()
        rig.checkpoint("the unbind / rebind sequence")
    by_rpc: dict[str, dict[str, int]] = {}
    for rpc, _, code, _ in rig.log:
        by_rpc.setdefault(rpc, {}).setdefault(code, 0)
        by_rpc[rpc][code] += 1
    print(f"\n{len(rig.log)} fuzzed calls in {time.monotonic() - t0:.1f} s: {by_rpc}")
    (rig.tmp / "fuzz-log.tsv").write_text("".join("\t".join(row) + "\n" for row in rig.log))
    found = rig.findings[start:]
    assert not found, f"{len(found)} findings:\n" + "\n".join(found)


def test_doorbell_answers_fuzzed_steps_without_internal_errors(rig):
    """The same region-step mutations over the shared-memory doorbell, plus garbled pages: each is
    answered with a StepError that is not INTERNAL/UNKNOWN, and a valid step still answers bit for bit."""
    from dspark_sidecar.client.dataplane import DoorbellChannel

    start = len(rig.findings)
    bell = DoorbellChannel(rig.stub, torch.device("cpu"), gpu_word=False)
    findings: list[str] = []
    try:
        def ring(data: bytes | None, length: int | None = None) -> pb.DraftStepResponse | None:
            bell._seq += 1
            if length is None:
                bell.page.write(bell.page.req_area, data, page_words.REQ_LEN, page_words.REQ_SEQ, bell._seq)
            else:
                bell.page.words[page_words.REQ_LEN] = length
                bell.page.words[page_words.REQ_SEQ] = bell._seq
            if bell.ringer is not None:
                bell.ringer.wake_if_asleep(bell.page)
            bell._sent_at = time.perf_counter()
            return bell.wait(0, TIMEOUT_S)

        def valid(where: str) -> None:
            resp = ring(rig.region_req().SerializeToString())
            o = rig.offsets["output"]
            got = rig.meta.tensor[o:o + rig.n * rig.cfg.hidden_size * 4].view(torch.float32).view(rig.n, -1)
            if resp is None or not resp.HasField("hidden_states") or not torch.equal(got, rig.want_region):
                findings.append(f"doorbell: valid step after {where} failed: {resp}")

        valid("attach")
        cases = [(f"(regions) {label}", fn, bad) for field in STEP_FIELDS
                 for label, fn, bad in _ref_mutations(rig, field, region=True)]
        garbled = [("garbage bytes", b"\xff" * 11, None), ("truncated request", rig.region_req().SerializeToString()[:-5], None),
                   ("empty request", b"", None), ("length word past the capacity", None, bell.capacity + 1),
                   ("length word 2^64-1", None, U64)]
        for i, (label, fn, bad) in enumerate(cases, 1):
            r = rig.region_req()
            fn(r)
            kv = rig._kv()
            resp = ring(r.SerializeToString())
            if resp is None:
                findings.append(f"doorbell [{label}]: no answer within {TIMEOUT_S:.0f} s")
                break
            if resp.HasField("error"):
                if resp.error.code in (2, 13) or not resp.error.message:
                    findings.append(f"doorbell [{label}]: code {resp.error.code}: {resp.error.message!r}")
                if not _same(kv, rig._kv()):
                    findings.append(f"doorbell [{label}]: refused but the KV cache changed")
            elif bad:
                findings.append(f"doorbell [{label}]: answered with hidden states for clearly invalid input")
            if i % CHECK_EVERY == 0:
                valid(label)
        for label, data, length in garbled:
            resp = ring(data, length)
            if resp is None:
                findings.append(f"doorbell [{label}]: no answer within {TIMEOUT_S:.0f} s")
                break
            if not resp.HasField("error") or resp.error.code in (2, 13) or not resp.error.message:
                findings.append(f"doorbell [{label}]: {resp}")
        valid("the doorbell fuzz")
    finally:
        bell.close()
    rig.checkpoint("the doorbell fuzz")
    findings += rig.findings[start:]
    assert not findings, f"{len(findings)} findings:\n" + "\n".join(findings)


def test_fuzzed_steps_on_one_stream_get_step_errors_and_the_stream_goes_on(rig):
    """DraftSteps, the RPC the unary fuzz leaves out: every clearly invalid step mutation on one stream is
    answered in order with a StepError (a refusal's code, its reason, a message naming its field), the
    stream stays open for the valid step sent last, which answers the canary's bits, and the rank serves on."""
    muts = [(label, fn) for field in STEP_FIELDS for label, fn, bad in _ref_mutations(rig, field, region=False) if bad]
    muts += [(label, fn) for label, fn, bad in _value_mutations(rig) if bad]
    reqs = []
    for _, fn in muts:
        r = rig.step_req()
        fn(r)
        reqs.append(r)
    reqs.append(rig.eng.request(0, next(rig._ids), rig.canary))
    answers = list(rig.stub.DraftSteps(iter(reqs), timeout=60))
    assert len(answers) == len(reqs), (len(answers), len(reqs))
    codes = {c.value[0] for c in REFUSAL_CODES}
    bad = []
    for (label, _), req, resp in zip(muts, reqs, answers):
        e = resp.error
        if (resp.step_id != req.step_id or not resp.HasField("error") or e.code not in codes or not e.reason
                or not e.field or _top(e.field) not in e.message):
            bad.append(f"DraftSteps [{label}]: {resp.step_id} {resp.WhichOneof('result')} {e}"[:300])
    last = answers[-1]
    assert last.HasField("hidden_states"), last
    assert torch.equal(codec.from_tensor_ref(last.hidden_states, "hidden_states"), rig.want_inline)
    start = len(rig.findings)
    rig.checkpoint(f"{len(muts)} invalid steps on one stream")
    bad += rig.findings[start:]
    assert not bad, f"{len(bad)} of {len(muts)}:\n" + "\n".join(bad)


def test_a_registration_of_more_regions_than_a_call_may_map_is_refused_before_any_is_mapped(rig):
    """RegisterBuffers maps every region of the request first: one of 70,000 regions (2 MB, well under
    --max-message-bytes) ran the rank out of descriptors or mappings (each mapping holds one of each) and
    was answered UNAVAILABLE MAP_EXHAUSTED, "nothing in the handle is wrong: try again": an engine retried it
    for ever, and while it lasted the rank had no descriptor left for its other calls. Refused by count first."""
    seg = rig._shm(4096)
    region = pb.BufferRegion(name="many", memory=memory.export_handle(seg.tensor), size_bytes=4096)
    code, details, err = rig.call("RegisterBuffers", pb.RegisterBuffersRequest(regions=[region] * 70_000))
    assert code == grpc.StatusCode.OUT_OF_RANGE, (code, details[:300])
    assert details.startswith("regions: 70000 regions"), details
    assert not rich_status_problem(err), rich_status_problem(err)
    code, details, resp = rig.call("RegisterBuffers", pb.RegisterBuffersRequest(regions=[region] * 3))
    assert code == grpc.StatusCode.OK, (code, details)
    rig.stub.UnregisterBuffers(pb.UnregisterBuffersRequest(region_ids=list(resp.region_ids)), timeout=TIMEOUT_S)
    start = len(rig.findings)
    rig.checkpoint("a registration of 70000 regions")
    assert not rig.findings[start:], "\n".join(rig.findings[start:])


@pytest.mark.parametrize("rpc", ["GetStatus", "DraftStep", "BindKV", "UnbindKV", "RegisterBuffers",
                                 "UnregisterBuffers", "AttachDoorbell"])
def test_malformed_request_bytes_are_not_internal(rig, rpc):
    """Bytes that do not parse as the request message: the client's fault (INVALID_ARGUMENT), not INTERNAL."""
    blobs = {"length past the end": b"\x0a\xff", "varint tag without a value": b"\x08",
             "11-byte varint tag": b"\xff" * 11, "truncated length-delimited field": b"\x12\x05ab"}
    start, bad = len(rig.findings), []
    for label, blob in blobs.items():
        code, details, _ = rig.call(rpc, blob)
        if code in BAD_CODES or code == grpc.StatusCode.OK or not details:
            bad.append(f"{rpc} [{label} {blob!r}]: {code.name}: {details}")
    rig.checkpoint(f"malformed {rpc} bytes")
    bad += rig.findings[start:]
    assert not bad, "\n".join(bad)


def test_a_stream_message_that_does_not_parse_ends_the_stream_with_invalid_argument(rig):
    """DraftSteps: grpc would answer INTERNAL; the stream has no step id to answer under, so it ends
    with INVALID_ARGUMENT naming the cause, and the rank serves on."""
    call = rig.channel.stream_stream(SERVICE + "DraftSteps")(iter([b"\x0a\xff"]), timeout=TIMEOUT_S)
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not parse" in err.value.details()
    start = len(rig.findings)
    rig.checkpoint("an unparseable stream message")
    assert not rig.findings[start:], "\n".join(rig.findings[start:])


def test_refusals_that_echo_a_huge_input_stay_invalid_argument(rig):
    """A refusal's message quotes the offending input (a shape, a shm name). Quoted whole, a shape of
    thousands of entries or a name of thousands of characters made a status too large for gRPC's
    trailers: the client saw RESOURCE_EXHAUSTED "received metadata size exceeds hard limit" instead."""
    r = rig.step_req()
    r.positions.ClearField("shape")
    r.positions.shape.extend([0] * 20_000)
    code, details, _ = rig.call("DraftStep", r)
    assert (code, details[:17]) == (grpc.StatusCode.INVALID_ARGUMENT, "positions: shape "), (code, details[:200])
    for name in ("n" * 50_000, "\U0001F600" * 5_000):  # ASCII, and 4 UTF-8 bytes per character
        b = rig.bind_req()
        b.layers[0].memory.shm.name = name
        code, details, _ = rig.call("BindKV", b)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details[:200])
        assert details.startswith("layers[0].memory: cannot open shared memory"), details[:200]
    start = len(rig.findings)
    rig.checkpoint("refusals quoting huge inputs")
    assert not rig.findings[start:], "\n".join(rig.findings[start:])


def test_doorbell_refusal_quoting_a_huge_shape_is_invalid_argument(rig):
    """Over the doorbell the same refusal, quoted whole, no longer fit the 4096-byte answer area and
    was replaced by RESOURCE_EXHAUSTED "register an output region": a wrong, misleading answer."""
    from dspark_sidecar.client.dataplane import DoorbellChannel

    bell = DoorbellChannel(rig.stub, torch.device("cpu"), capacity=page_words.MIN_CAPACITY, gpu_word=False)
    try:
        r = rig.region_req()
        r.positions.ClearField("shape")
        r.positions.shape.extend([0] * 1500)
        bell.send(r)
        resp = bell.wait(0, TIMEOUT_S)
    finally:
        bell.close()
    assert resp is not None and resp.HasField("error"), resp
    assert (resp.error.code, resp.error.field, resp.error.message[:17]) == (
        grpc.StatusCode.INVALID_ARGUMENT.value[0], "positions", "positions: shape "), resp.error


def test_a_health_watch_request_that_does_not_parse_is_invalid_argument(rig):
    """Health's Watch is server-streaming, a kind the interceptor did not wrap: bytes that do not
    parse were answered INTERNAL "Exception deserializing request!" by grpc itself. A well-formed
    Watch still streams the health status."""
    from grpc_health.v1 import health_pb2

    watch = rig.channel.unary_stream("/grpc.health.v1.Health/Watch")
    with pytest.raises(grpc.RpcError) as err:
        list(watch(b"\x0a\xff", timeout=TIMEOUT_S))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.value.code(), err.value.details())
    assert "does not parse" in err.value.details(), err.value.details()
    call = rig.channel.unary_stream("/grpc.health.v1.Health/Watch", request_serializer=lambda m: m.SerializeToString(),
                                    response_deserializer=health_pb2.HealthCheckResponse.FromString)(
        health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT_S)
    try:
        assert next(call).status == health_pb2.HealthCheckResponse.SERVING
    finally:
        call.cancel()
