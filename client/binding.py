"""The engine's draft KV cache as bound to its sidecar rank: per-layer identity, BindKV, generation tracking."""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass
from typing import Sequence

import grpc
import torch

from dspark_sidecar.client.lease import EngineLease
from dspark_sidecar.drafter.kv_cache import FP8_KV, kv_planes
from dspark_sidecar.proto import codec
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.proto import memory
from dspark_sidecar.proto.rich_status import error_reason
from dspark_sidecar.proto.memory import HandleError, export_handle

log = logging.getLogger("dspark_sidecar.client")

# BindKV failures that no retry can fix: the deployment itself is wrong (engine TP != sidecar
# TP, rank wiring, cache dtype/layout the sidecar cannot serve, an engine that reaches the sidecar
# from another node: PERMISSION_DENIED, REMOTE_PEER, since KV handles name memory on the sidecar's
# node only; read as passing, it cost a GetStatus and a BindKV every breaker period, for good).
_PERMANENT_CODES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
                    grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.PERMISSION_DENIED)
_PERMANENT_REASONS = ("TP_MISMATCH", "RANK_MISMATCH", "REMOTE_PEER")
FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2") if hasattr(torch, n))


class BindError(Exception):
    """BindKV did not succeed; `permanent` says whether the deployment can never bind."""

    def __init__(self, message: str, permanent: bool) -> None:
        super().__init__(message)
        self.permanent = permanent


# How long a cache torch refused to export stays refused before it is tried again (KVBinder.bind). The
# usual cause (expandable segments, a cuMem allocator) lasts as long as the cache; torch raises the same
# RuntimeError for a transient driver failure, which would otherwise keep the sidecar off for good.
UNSHAREABLE_RETRY_S = 60.0
# The least a lease is waited for when the export left the bind less (a socket timeout of 0 would not wait at all).
_MIN_WAIT_S = 0.001


class NotShareable(BindError):
    """torch cannot export the cache's memory to another process: a legacy CUDA IPC handle cannot be taken on
    memory from expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) or a cuMem / pluggable
    allocator (vLLM's sleep mode). The engine's allocation, not the sidecar's fault: this cache is exported
    again only every UNSHAREABLE_RETRY_S, a re-allocated one at once (KVBinder.bind)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, permanent=False)


def layer_identity(t: torch.Tensor) -> tuple:
    """What must stay equal for a binding to stay valid: where the layer lives and how it is laid out.

    On CPU the shared-memory segment's name is part of it: a freed segment's address can be
    reused by a new one, and the sidecar would still be mapping the old.
    """
    segment = ""
    if t.device.type == "cpu":
        try:
            segment = export_handle(t).shm.name
        except HandleError:
            segment = "<not shared>"
    return (str(t.device), t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype, segment)


def cache_identity(layers: Sequence[torch.Tensor]) -> tuple:
    return tuple(layer_identity(t) for t in layers)


def bind_request(layers: Sequence[torch.Tensor], facts: pb.EngineFacts) -> pb.BindKVRequest:
    """BindKVRequest for per-layer caches in either of kv_cache.KV_LAYOUTS: planes [2, num_pages,
    page_size, kv_heads/tp, head_dim] or records [num_pages, kv_heads/tp, page_size, 2 * head_dim]
    (vLLM 0.34). Each is sent as the planes view of its memory (shape, strides, offset): the
    sidecar addresses both through the same strides."""
    if not layers:
        raise BindError("the engine has no draft KV cache allocated", permanent=False)
    entries: list[pb.KVLayerBinding] = []
    try:
        for i, raw in enumerate(layers):
            if raw.dtype == torch.uint8 or (raw.dtype in FP8_DTYPES and raw.dtype != FP8_KV):
                # vLLM holds an fp8 cache as uint8 codes of x / scale; its plug-in passes e4m3 at scale 1
                # as float8_e4m3fn (vllm_plugin.kv_cache_provider). Anything else cannot be read right.
                raise BindError(f"KV layer {i}: {raw.dtype} cache: the sidecar serves an fp8 cache as float8_e4m3fn "
                                "codes at k/v scale 1 only (not e5m2, fnuz or calibrated KV scales); run the draft "
                                "with kv_cache_dtype fp8 (e4m3, no KV scales), auto or bfloat16", permanent=True)
            try:
                t = kv_planes(raw)
                dtype = codec.dtype_to_proto(t.dtype)  # before the export: a refusal here leaves none to give back
            except ValueError as e:
                raise BindError(f"KV layer {i}: {e}", permanent=True) from None
            try:
                handle = export_handle(t)
            except (HandleError, ValueError) as e:
                raise BindError(f"KV layer {i}: {e}", permanent=True) from None
            except RuntimeError as e:  # torch's or the driver's refusal of this memory (see NotShareable)
                raise NotShareable(f"KV layer {i}: torch cannot share its memory with the sidecar "
                                   f"(expandable segments or cuMem memory?): {e}") from None
            entries.append(pb.KVLayerBinding(layer=i, memory=handle, dtype=dtype, shape=list(t.shape),
                                             strides=list(t.stride()), storage_offset=t.storage_offset()))
        return pb.BindKVRequest(engine=on_cache_gpu(facts, layers[0]), layers=entries,
                                page_size=int(entries[0].shape[2]))
    except BaseException:
        give_back(entries)  # exported for the layers before the one refused, and never to be sent
        raise


def give_back(entries: Sequence[pb.KVLayerBinding]) -> None:
    """Give back torch's producer reference of each layer handle exported for a BindKV that is never sent. Each
    CUDA IPC export counts the sidecar as a consumer of the block until it lets go (memory.discard_handle): the
    sidecar gives back what it is sent and does not open, but a handle that never reached it kept the engine's
    block allocated (torch's IPC limbo) after the engine freed that cache, until the engine exited."""
    for entry in entries:
        memory.discard_handle(entry.memory)


def on_cache_gpu(facts: pb.EngineFacts, layer) -> pb.EngineFacts:
    """`facts` naming the GPU the cache lives on, which the sidecar rank compares with its own at BindKV.
    The shim names its config's device when it is built; vLLM's plain "cuda" resolves to the device
    current then, which need not be the cache's: a sidecar on the cache's GPU refused such an engine."""
    if layer.device.type != "cuda":
        return facts
    uuid = memory.gpu_uuid(layer.device)
    if not uuid or uuid == facts.device_uuid:
        return facts
    named = pb.EngineFacts()
    named.CopyFrom(facts)
    named.device_uuid = uuid
    return named


@dataclass
class Binding:
    binding_id: int
    generation: int
    identity: tuple
    # The layer tensors last found with this identity (weakly: a binding must not keep a freed cache
    # alive), with what could change on one tensor object in place. See KVBinder.needs_bind.
    seen: tuple = ()


def _watch(layers: Sequence[torch.Tensor]) -> tuple:
    return tuple((weakref.ref(t), t.data_ptr(), t.shape, t.stride(), t.storage_offset(), t.dtype) for t in layers)


def _unchanged(seen: tuple, layers: Sequence[torch.Tensor]) -> bool:
    """The same tensor objects as `seen`, none moved or re-laid out. Cheaper than cache_identity
    (no device string, no shared-memory segment lookup): a tensor object that is alive and keeps its
    data pointer still holds the storage, so its device and segment cannot have changed."""
    if len(seen) != len(layers):
        return False
    for (ref, ptr, shape, stride, offset, dtype), t in zip(seen, layers):
        if (ref() is not t or t.data_ptr() != ptr or t.shape != shape or t.stride() != stride
                or t.storage_offset() != offset or t.dtype != dtype):
            return False
    return True


class KVBinder:
    """This engine rank's binding with its sidecar rank. Re-binds only when asked; never decides alone
    when (the shim calls it outside CUDA graph capture and after the ranks' agreement)."""

    def __init__(self, facts: pb.EngineFacts) -> None:
        self.facts = facts
        self.current: Binding | None = None
        # The binding the sidecar holds for this engine as far as it knows: `current`, or, once a re-bind
        # failed or the binding was invalidated, the one bound before. A refused BindKV leaves the
        # sidecar's binding in place (MemoryBindings.bind), so release() must still name it: forgotten with
        # `current`, the engine's old cache stayed mapped by the sidecar until the sidecar restarted.
        self.held: Binding | None = None
        self.binds = 0  # successful BindKV calls
        # (identity, why, when to try again) of the cache last found NotShareable: not exported again before
        # then (each try costs every layer's export, on every step the engine runs while it keeps that cache),
        # a re-allocated cache at once.
        self._unshareable: tuple[tuple, str, float] | None = None
        # Named in each BindKV: the sidecar releases the binding when this process ends (client/lease.py).
        self.lease = EngineLease()

    @property
    def generation(self) -> int:
        return self.current.generation if self.current else 0

    def needs_bind(self, layers: Sequence[torch.Tensor]) -> bool:
        """True when unbound, or when any layer moved or changed layout since the last bind.

        Asked on every step: the same tensors as last time are checked field by field in place (about
        a quarter of cache_identity's cost); other tensor objects get the full identity.
        """
        b = self.current
        if b is None:
            return True
        if _unchanged(b.seen, layers):
            return False
        if b.identity != cache_identity(layers):
            return True
        b.seen = _watch(layers)  # the same cache through new tensor objects (e.g. views rebuilt per step)
        return False

    def invalidate(self) -> None:
        """Forget the binding (the sidecar lost it, or the engine's cache contents were discarded)."""
        self.current = None

    def release(self, stub, deadline_s: float) -> None:
        """UnbindKV the binding the sidecar holds for this engine (`held`), best effort, and forget it. One the
        sidecar no longer has (it restarted, or was re-bound since) is refused UNKNOWN_BINDING. The lease stays
        for the caller to end (`lease.close()`) once it has released what else it registered under it: its end
        releases whatever a failed call left."""
        b, self.current, self.held = self.held, None, None
        if b is None or stub is None:
            return
        try:
            stub.UnbindKV(pb.UnbindKVRequest(binding_id=b.binding_id), timeout=deadline_s)
        except grpc.RpcError as e:
            log.info("UnbindKV: %s (the lease's end releases the binding where the sidecar gave it one)",
                     e.code().name)

    def bind(self, stub, layers: Sequence[torch.Tensor], deadline_s: float, lease_socket: str = "") -> Binding:
        """BindKV once, under a lease from `lease_socket` (StatusReport.lease_socket; "": none); raises BindError
        (permanent or not). The lease and BindKV share `deadline_s`: each given a whole one, a sidecar slow to hand
        out its token held the engine's step for twice it (EngineConfig.agreement_timeout_s counts one per bind)."""
        until = time.monotonic() + deadline_s
        ident = cache_identity(layers)
        if (self._unshareable is not None and self._unshareable[0] == ident
                and time.monotonic() < self._unshareable[2]):
            self.current = None
            raise NotShareable(self._unshareable[1])
        try:
            req = bind_request(layers, self.facts)
        except NotShareable as e:
            self.current, self._unshareable = None, (ident, str(e), time.monotonic() + UNSHAREABLE_RETRY_S)
            raise
        self._unshareable = None
        try:
            req.lease = self.lease.token(lease_socket, max(until - time.monotonic(), _MIN_WAIT_S))
            left = until - time.monotonic()
            if left <= 0:
                raise BindError(f"BindKV: DEADLINE_EXCEEDED the bind's {deadline_s:g} s went by before it was "
                                "sent (waiting for the sidecar's lease)", False)
        except BaseException:
            self.current = None
            give_back(req.layers)  # nothing was sent
            raise
        try:
            resp = stub.BindKV(req, timeout=left)
        except grpc.RpcError as e:
            code, reason = e.code(), error_reason(e)
            permanent = code in _PERMANENT_CODES or reason in _PERMANENT_REASONS
            self.current = None
            raise BindError(f"BindKV: {code.name} {reason} {e.details()}".strip(), permanent) from None
        if not (0 < resp.binding_id < 1 << 63 and 0 < resp.generation < 1 << 62):
            # The ids travel through the ranks' int64 agreement; a sidecar naming others is not one to trust.
            self.current = None
            raise BindError(f"BindKV: answer names binding {resp.binding_id} generation {resp.generation}, "
                            "outside what a sidecar hands out", False)
        self.current = self.held = Binding(resp.binding_id, resp.generation, ident, _watch(layers))
        self.binds += 1
        log.info("KV cache bound: binding %d generation %d (%d layers, backend %s%s)", resp.binding_id,
                 resp.generation, len(layers), resp.backend or "?",
                 f", FlyDSL off: {resp.fast_path_refusal}" if resp.fast_path_refusal else "")
        return self.current
