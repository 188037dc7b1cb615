"""A test stand-in for the engine's TP ranks in one process: shm KV shards, BindKV, steps sent from threads."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from dspark_sidecar.drafter import scenario
from dspark_sidecar.drafter.config import DrafterConfig
from dspark_sidecar.drafter.kv_cache import kv_layer_shape
from dspark_sidecar.proto import codec, memory
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.proto import sidecar_pb2_grpc as pb_grpc

PAGE = 16
RIG_PAGES = 16  # pages per layer of the server tests' shared TP-1 rig (tests/server/conftest.py)


class DraftStream:
    """One engine rank's DraftSteps stream: requests in, answers out in order, None once it has ended."""

    def __init__(self, stub) -> None:
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.answers: queue.SimpleQueue = queue.SimpleQueue()
        self.end: grpc.StatusCode | None = None
        self.call = stub.DraftSteps(iter(self.requests.get, None))
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for resp in self.call:
                self.answers.put(resp)
            self.end = grpc.StatusCode.OK
        except grpc.RpcError as e:
            self.end = e.code()  # the server stopped or went away: how it ended is the tests' to look at
        self.answers.put(None)

    def ask(self, req: pb.DraftStepRequest, timeout: float = 30.0) -> pb.DraftStepResponse | None:
        self.requests.put(req)
        return self.answers.get(timeout=timeout)

    def close(self) -> None:
        self.requests.put(None)
        self.call.cancel()


class EngineSim:
    def __init__(self, cfg: DrafterConfig, targets: list[str], num_pages: int, dtype: torch.dtype,
                 facts: dict | None = None) -> None:
        self.cfg, self.tp, self.dtype, self.num_pages = cfg, len(targets), dtype, num_pages
        self.channels = [grpc.insecure_channel(t) for t in targets]
        self.stubs = [pb_grpc.DrafterSidecarStub(c) for c in self.channels]
        self.kv = [[memory.shm_empty(kv_layer_shape(cfg, self.tp, num_pages, PAGE), dtype)
                    for _ in range(cfg.num_hidden_layers)] for _ in range(self.tp)]
        self.facts = dict(tp_size=self.tp, dp_size=1, pp_size=1, speculative_method="dspark",
                          num_speculative_tokens=7, device="cpu") | (facts or {})
        self.bindings: list[tuple[int, int]] = []
        self.pool = ThreadPoolExecutor(self.tp)

    def bind_request(self, rank: int, views: list[torch.Tensor] | None = None) -> pb.BindKVRequest:
        """Rank's BindKVRequest for its own cache, or for per-layer `views` of exported segments (any shapes,
        strides, offsets: the overlap and bounds tests)."""
        views = views if views is not None else [t.tensor for t in self.kv[rank]]
        layers = [pb.KVLayerBinding(layer=i, memory=memory.export_handle(t), dtype=codec.dtype_to_proto(self.dtype),
                                    shape=list(t.shape), strides=list(t.stride()), storage_offset=t.storage_offset())
                  for i, t in enumerate(views)]
        return pb.BindKVRequest(engine=pb.EngineFacts(engine_rank=rank, **self.facts), layers=layers, page_size=PAGE)

    def bind(self) -> list[pb.BindKVResponse]:
        resps = [self.stubs[r].BindKV(self.bind_request(r), timeout=10) for r in range(self.tp)]
        self.bindings = [(x.binding_id, x.generation) for x in resps]
        return resps

    def kv_tensors(self, rank: int) -> list[torch.Tensor]:
        return [t.tensor for t in self.kv[rank]]

    def request(self, rank: int, step_id: int, step: scenario.StepInputs, **override) -> pb.DraftStepRequest:
        bid, gen = self.bindings[rank]
        m = step.meta
        req = pb.DraftStepRequest(
            step_id=step_id, binding_id=bid, binding_generation=gen, num_requests=m.num_reqs,
            positions=codec.to_tensor_ref(step.positions), inputs_embeds=codec.to_tensor_ref(step.inputs_embeds.to(self.dtype)),
            seq_lens=codec.to_tensor_ref(m.seq_lens), block_tables=codec.to_tensor_ref(m.block_tables),
            slot_mapping=codec.to_tensor_ref(m.slot_mapping))
        for k, v in override.items():
            if isinstance(v, pb.TensorRef):
                getattr(req, k).CopyFrom(v)
            else:
                setattr(req, k, v)
        return req

    def step_all(self, step_id: int, step: scenario.StepInputs, ranks=None, timeout: float = 30.0, **override):
        """Send the step to the given ranks concurrently (unary); each result is a response or an RpcError."""
        ranks = list(range(self.tp)) if ranks is None else ranks

        def one(r):
            try:
                return self.stubs[r].DraftStep(self.request(r, step_id, step, **override), timeout=timeout)
            except grpc.RpcError as err:
                return err

        return list(self.pool.map(one, ranks))

    def close(self) -> None:
        self.pool.shutdown()
        for c in self.channels:
            c.close()
        for shards in self.kv:
            for t in shards:
                t.close()
