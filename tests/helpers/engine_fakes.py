"""Fakes for the engine-side shim tests: a scriptable sidecar rank on a unix socket, a thread rendezvous, thread ranks."""

from __future__ import annotations

import atexit
import collections
import contextlib
import os
import shutil
import tempfile
import threading
import time
from concurrent import futures
from multiprocessing import shared_memory
from pathlib import Path
from typing import Iterator

import grpc
import torch
from google.rpc import code_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from dspark_sidecar.drafter.config import PRESETS
from dspark_sidecar.drafter.kv_cache import StepMetadata, kv_storage_shape
from dspark_sidecar.proto import INSTANCE_METADATA, SERVICE_NAME, codec, memory
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.proto import sidecar_pb2_grpc as pb_grpc
from dspark_sidecar.proto.memory import shm_empty

HIDDEN = 16


class ThreadRendezvous:
    """The sidecar ranks' step agreement, for fake ranks that are threads of one process."""

    def __init__(self, world: int, deadline_s: float = 0.3) -> None:
        self.world, self.deadline_s = world, deadline_s
        self._cv = threading.Condition()
        self._posts: dict[int, dict[int, int]] = collections.defaultdict(dict)

    def agree(self, rank: int, step_id: int, generation: int) -> str | None:
        """None for GO, else the abort reason (the same on every rank that posted)."""
        with self._cv:
            posts = self._posts[step_id]
            posts[rank] = generation
            self._cv.notify_all()
            self._cv.wait_for(lambda: len(posts) == self.world, self.deadline_s)
            if len(posts) < self.world:
                return f"step {step_id}: ranks {sorted(set(range(self.world)) - set(posts))} missing"
            if len(set(posts.values())) > 1:
                return f"step {step_id}: generations differ"
            return None


class FakeSidecar(pb_grpc.DrafterSidecarServicer):
    """One scriptable sidecar rank: 'computes' hidden = 2 * inputs_embeds (fp32); counts every call."""

    def __init__(self, rank: int = 0, tp: int = 1, rendezvous: ThreadRendezvous | None = None,
                 max_reqs: int = 32) -> None:
        self.rank, self.tp, self.rendezvous = rank, tp, rendezvous
        self.calls: collections.Counter = collections.Counter()
        self.requests: list[pb.DraftStepRequest] = []
        self.binds: list[pb.BindKVRequest] = []
        self.serving, self.state, self.refusal = True, "SERVING", "not gfx950"
        self.max_reqs = max_reqs
        self.max_message_bytes = 1 << 26
        self.generation, self.binding_id = 0, 0
        self.step_errors: dict[int, tuple[int, str]] = {}  # step_id -> (google.rpc code, reason)
        self.step_delay_s: dict[int, float] = {}
        self.step_holds: dict[int, threading.Event] = {}  # step_id -> answered only once the test sets it
        self.bind_error: tuple[grpc.StatusCode, str] | None = None
        self.answered: list[int] = []
        self.instance = ""  # StatusReport.instance ("": an older sidecar's, nothing checked)
        self.stream_instance: str | None = None  # what a step stream's initial metadata names (None: `instance`)
        self._lock = threading.Lock()

    def GetStatus(self, request, context):
        self.calls["GetStatus"] += 1
        return pb.StatusReport(
            model=pb.ModelSummary(hidden_size=HIDDEN, compute_dtype="fp32", num_layers=5),
            limits=pb.Limits(qpr=7, launch_reqs=8, max_reqs=self.max_reqs,
                             max_message_bytes=self.max_message_bytes),
            parallel=pb.Parallel(tp_size=self.tp, tp_rank=self.rank, dist_backend="gloo", device="cpu"),
            backend="reference", fast_path_refusal=self.refusal, serving=self.serving, state=self.state,
            instance=self.instance, kv=pb.KVBindingState(bound=self.binding_id != 0, binding_id=self.binding_id,
                                 generation=self.generation))

    def BindKV(self, request, context):
        self.calls["BindKV"] += 1
        if self.bind_error is not None:
            context.abort(*self.bind_error)
        with self._lock:
            self.binds.append(request)
            self.generation += 1
            self.binding_id = 1000 * (self.rank + 1) + self.generation
            return pb.BindKVResponse(binding_id=self.binding_id, generation=self.generation, backend="reference")

    def UnbindKV(self, request, context):
        self.calls["UnbindKV"] += 1
        self.binding_id = 0
        return pb.UnbindKVResponse()

    def _step(self, req: pb.DraftStepRequest) -> pb.DraftStepResponse:
        self.calls["step"] += 1
        self.requests.append(req)
        delay = self.step_delay_s.get(req.step_id)
        if delay:
            time.sleep(delay)
        hold = self.step_holds.get(req.step_id)
        if hold is not None:
            hold.wait(300)  # a hang guard only: the test sets it

        def fail(code: int, reason: str) -> pb.DraftStepResponse:
            return pb.DraftStepResponse(step_id=req.step_id, error=pb.StepError(code=code, message=reason,
                                                                                reason=reason))

        if req.binding_id != self.binding_id or req.binding_generation != self.generation:
            return fail(code_pb2.FAILED_PRECONDITION, "STALE_BINDING")
        if req.step_id in self.step_errors:
            return fail(*self.step_errors[req.step_id])
        if self.rendezvous is not None:
            why = self.rendezvous.agree(self.rank, req.step_id, req.binding_generation)
            if why is not None:
                return fail(code_pb2.ABORTED, why)
        embeds = codec.from_tensor_ref(req.inputs_embeds, "inputs_embeds")
        return pb.DraftStepResponse(step_id=req.step_id, hidden_states=codec.to_tensor_ref(embeds.float() * 2))

    def DraftStep(self, request, context):
        return self._step(request)

    def DraftSteps(self, request_iterator, context):
        self.calls["DraftSteps"] += 1
        said = self.instance if self.stream_instance is None else self.stream_instance
        if said:
            context.send_initial_metadata(((INSTANCE_METADATA, said),))
        for req in request_iterator:
            resp = self._step(req)
            self.answered.append(req.step_id)
            yield resp

    def remote_calls(self) -> int:
        return sum(self.calls.values())


class DoorbellNeverAnswered(FakeSidecar):
    """Takes the data plane, then never answers a ring (a wedged sidecar rank)."""

    def RegisterBuffers(self, request, context):
        self.calls["RegisterBuffers"] += 1
        return pb.RegisterBuffersResponse(region_ids=[1, 2, 3])

    def AttachDoorbell(self, request, context):
        self.calls["AttachDoorbell"] += 1
        return pb.AttachDoorbellResponse()

    def UnregisterBuffers(self, request, context):
        assert list(request.region_ids) == [1, 2, 3]
        self.calls["UnregisterBuffers"] += 1
        return pb.UnregisterBuffersResponse()


def short_socket_dir() -> Path:
    """A socket folder with a short path (sun_path holds 108 bytes), under the system's temp folder rather than
    pytest's tmp_path (too long a path); removed when this process exits (a CI run left ~2,000 behind)."""
    folder = Path(tempfile.mkdtemp(prefix="dsp-"))
    _SOCKET_DIRS.append((os.getpid(), folder))
    return folder


_SOCKET_DIRS: list[tuple[int, Path]] = []


@atexit.register
def _remove_socket_dirs() -> None:
    # Only this process's own: a forked child inherits the list, and the folders are its parent's.
    for pid, folder in _SOCKET_DIRS:
        if pid == os.getpid():
            shutil.rmtree(folder, ignore_errors=True)  # a server that never stopped may still hold its socket


class FakeServer:
    """A FakeSidecar served on a unix socket with grpc.health.v1; stop() and start() again on the same path."""

    def __init__(self, sidecar: FakeSidecar, socket: Path) -> None:
        self.sidecar, self.socket = sidecar, socket
        self.health = health.HealthServicer()
        self._server: grpc.Server | None = None

    @property
    def endpoint(self) -> str:
        return f"unix:{self.socket}"

    def start(self) -> FakeServer:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        pb_grpc.add_DrafterSidecarServicer_to_server(self.sidecar, server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        self.set_health(True)
        assert server.add_insecure_port(self.endpoint) != 0
        server.start()
        self._server = server
        return self

    def set_health(self, serving: bool) -> None:
        st = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in (SERVICE_NAME, ""):
            self.health.set(name, st)

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(None).wait()
            self._server = None


class ThreadGroup:
    """A MIN all-reduce among engine 'ranks' that are threads (StepAgreement per member)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self._barrier = threading.Barrier(world, timeout=30)
        self._vals: list[torch.Tensor | None] = [None] * world
        self.calls = 0

    def member(self, rank: int) -> _Member:
        return _Member(self, rank)

    def all_min(self, rank: int, values: torch.Tensor) -> torch.Tensor:
        self._vals[rank] = values.clone()
        self._barrier.wait()
        out = torch.stack(self._vals).min(dim=0).values  # type: ignore[arg-type]
        if rank == 0:
            self.calls += 1
        self._barrier.wait()
        return out


class _Member:
    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self.rank, self.world_size = group, rank, group.world

    def all_min(self, values: torch.Tensor) -> torch.Tensor:
        return self.group.all_min(self.rank, values)


class FakeIpcEvent:
    """torch.cuda.Event where there is no GPU, for the data plane's channels: made, opened from a handle, exported
    and recorded freely; every query says its work has passed."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    @classmethod
    def from_ipc_handle(cls, device, handle):
        return cls()

    def ipc_handle(self) -> bytes:
        return b"x" * 64

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True


class FakeModel:
    """The engine's stock draft model as the shim sees it: only embed_input_ids."""

    def __init__(self, vocab: int = 64, hidden: int = HIDDEN) -> None:
        self.table = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(0))
        self.embeds = 0

    def embed_input_ids(self, ids: torch.Tensor) -> torch.Tensor:
        self.embeds += 1
        return self.table[ids]


def shm_kv_cache(num_pages: int = 8, page_size: int = 16, tp: int = 4, kv_layout: str = "planes") -> list:
    """Five tiny-preset KV layers in shared memory, allocated in kv_layout (ShmTensor each; .tensor is the layer)."""
    shape = kv_storage_shape(PRESETS["tiny"], tp, num_pages, page_size, kv_layout)
    return [shm_empty(shape, torch.float32) for _ in range(5)]


def step_inputs(r: int, page_size: int = 16, start: int = 20) -> tuple[torch.Tensor, torch.Tensor, StepMetadata]:
    """ids, positions, metadata of an R-request step; request i at P = start + i, page i."""
    ids = torch.arange(7 * r, dtype=torch.int64) % 64
    pos = torch.cat([torch.arange(start + i, start + i + 7) for i in range(r)]).to(torch.int64)
    seq = torch.tensor([start + i + 7 for i in range(r)], dtype=torch.int32)
    tables = torch.tensor([[0, 1, 2, 3]] * r, dtype=torch.int32)
    slots = pos.clone()
    return ids, pos, StepMetadata(seq, tables, slots)


class FlashAttentionMetadata034:
    """vLLM 0.34's FlashAttentionMetadata (v1/attention/backends/flash_attn.py:525), the fields the shim may read."""

    def __init__(self, num_actual_tokens: int, seq_lens: torch.Tensor, block_table: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        self.num_actual_tokens, self.max_query_len = num_actual_tokens, 7
        self.seq_lens, self.block_table, self.slot_mapping = seq_lens, block_table, slot_mapping


def vllm_draft_metadata(r: int, groups: list[list[list[str]]], page_size: int = 16, start: int = 20) -> dict:
    """step_inputs(r)'s step as vLLM 0.34 hands it to the draft forward (eager): worker/gpu/attn_utils.py
    build_attn_metadata, called from DFlashSpeculator.propose. `groups`: per KV cache group, its attention groups'
    layer names. One metadata object per attention group, every layer of it mapped to that object; KV cache group g
    has its own table, input_block_tables[g][:R] ([max_num_reqs, width] int32, group g's pages 4g..4g+3 here), and
    its own slot mapping, row g of BlockTables.slot_mappings ([groups, max_num_batched_tokens] int64, -1 past the
    step); seq_lens one view of input_buffers.seq_lens for all."""
    n = 7 * r
    _, pos, meta = step_inputs(r, page_size, start)
    seq_lens = torch.zeros(8, dtype=torch.int32)
    seq_lens[:r] = meta.seq_lens
    slot_mappings = torch.full((len(groups), 64), -1, dtype=torch.int64)
    out: dict = {}
    for g, attn_groups in enumerate(groups):
        table = torch.zeros(8, 6, dtype=torch.int32)
        table[:r, :4] = meta.block_tables + 4 * g
        pages = table[torch.arange(n) // 7, pos // page_size].to(torch.int64)
        slot_mappings[g, :n] = pages * page_size + pos % page_size
        slot_mapping = slot_mappings[:, :n][g]
        for names in attn_groups:
            md = FlashAttentionMetadata034(n, seq_lens[:r], table[:r], slot_mapping)
            out.update(dict.fromkeys(names, md))
    return out


class PreflightHook:
    """A 2-rank agreement (values as they are) that, once armed, runs `at_preflight()` inside the next step's
    pre-flight (its 5-value agreement): where this rank has prepared its link and waits for its peer."""

    world_size = 2

    def __init__(self) -> None:
        self.shim = None  # the DrafterShim it belongs to, set after both are made
        self.armed = False

    def at_preflight(self) -> None:
        raise NotImplementedError

    def all_min(self, values: torch.Tensor) -> torch.Tensor:
        if self.armed and values.numel() == 5:
            self.armed = False
            self.at_preflight()
        return values.clone()


class RecordingSharedMemory:
    """Stands for proto/memory.py's `shared_memory` module: records the segments this process creates, so
    that what is left in /dev/shm is told apart from other processes' segments (tests run side by side)."""

    def __init__(self) -> None:
        self.created: set[str] = set()

    def SharedMemory(self, *args, **kw):  # noqa: N802  (the module's name)
        seg = shared_memory.SharedMemory(*args, **kw)
        if kw.get("create"):
            self.created.add(seg.name.lstrip("/"))
        return seg

    def left(self) -> set[str]:
        """The segments recorded that are still in /dev/shm."""
        return self.created & set(os.listdir("/dev/shm"))


@contextlib.contextmanager
def recording_shm(module=memory) -> Iterator[RecordingSharedMemory]:
    """Record the shared-memory segments `module` (proto/memory.py by default) creates in this process inside the
    block (see RecordingSharedMemory).
    A diff of /dev/shm before and after also sees every other process's segments: with test runs side by
    side it failed now and then on a segment that was never this process's."""
    rec = RecordingSharedMemory()
    module.shared_memory = rec
    try:
        yield rec
    finally:
        module.shared_memory = shared_memory
