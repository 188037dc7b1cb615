"""A step tensor's or a KV layer's shape (or strides) of millions of entries is refused by count, not listed.

The tests assert what the message says (a count), not how long it took: the old code listed every
dimension, so the message checks fail on it without a wall-clock bound.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from dspark_sidecar.drafter import scenario
from dspark_sidecar.drafter.kv_cache import kv_layer_shape
from dspark_sidecar.proto import codec, memory
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.server.errors import SidecarError
from dspark_sidecar.server.kv_binding import KVBinding, MemoryBindings
from dspark_sidecar.server.validate import validate_step

PS, PAGES, LENS = 16, 64, [3, 17, 30]
DIMS = 4_000_000  # a 4 MB message; listing them took ~1.5 s (2-core box), 256 MiB ones over a minute


@pytest.fixture
def step(tiny_cfg, tiny_embed):
    mem = MemoryBindings(tiny_cfg, 1, 0, torch.float32, torch.device("cpu"))
    mem.kv = KVBinding(5, 1, [], PAGES, PS, None, [])
    s = scenario.random_step(tiny_cfg, LENS, PS, PAGES, tiny_embed, seed=0)
    req = pb.DraftStepRequest(step_id=1, binding_id=5, binding_generation=1, num_requests=len(LENS),
                              positions=codec.to_tensor_ref(s.positions),
                              inputs_embeds=codec.to_tensor_ref(s.inputs_embeds.float()),
                              seq_lens=codec.to_tensor_ref(s.meta.seq_lens),
                              block_tables=codec.to_tensor_ref(s.meta.block_tables),
                              slot_mapping=codec.to_tensor_ref(s.meta.slot_mapping))
    validate_step(req, tiny_cfg, mem, 8)  # valid as built
    return req, mem


# Each field's shape check listed the peer's every dimension (then clipped the message to 1 KiB): seconds
# of CPU and gigabytes of Python ints on the rank's step lock, which every other step waits on (at TP > 1
# the peers' rendezvous too). block_tables's two-dimension check listed them the same way.
@pytest.mark.parametrize("field,first", [("positions", 21), ("seq_lens", 3), ("block_tables", 3),
                                         ("slot_mapping", 21), ("inputs_embeds", 21)])
def test_a_shape_of_millions_of_dimensions_is_refused_at_once_counting_them(step, tiny_cfg, field, first):
    req, mem = step
    getattr(req, field).shape[:] = [first] + [1] * (DIMS - 1)
    with pytest.raises(SidecarError) as err:
        validate_step(req, tiny_cfg, mem, 8)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and err.value.field == field
    assert f"shape of {DIMS} dimensions, expected [" in err.value.message, err.value.message[:200]


def test_a_short_wrong_shape_is_still_listed(step, tiny_cfg):
    req, mem = step
    req.positions.shape[:] = [3, 7]
    with pytest.raises(SidecarError,
                       match=r"^positions: shape \[3, 7\], expected \[21\] \(7 rows for each of num_requests = 3\)$"):
        validate_step(req, tiny_cfg, mem, 8)
    req.positions.shape[:] = [21]
    req.block_tables.shape[:] = [3]
    with pytest.raises(SidecarError, match=r"^block_tables: shape \[3\], expected \[3, max_pages\] "
                                           r"\(a row per request, num_requests = 3\)$"):
        validate_step(req, tiny_cfg, mem, 8)


def _bind(cfg, layer0) -> tuple[MemoryBindings, pb.BindKVRequest, memory.ShmTensor]:
    want = kv_layer_shape(cfg, 1, 4, PS)
    shm = memory.shm_empty(want, torch.float32)
    t = shm.tensor
    layers = [pb.KVLayerBinding(layer=i, memory=memory.export_handle(t), dtype=pb.DTYPE_FP32, shape=list(want),
                                strides=list(t.stride())) for i in range(cfg.num_hidden_layers)]
    layer0(layers[0])
    mem = MemoryBindings(cfg, 1, 0, torch.float32, torch.device("cpu"))
    return mem, pb.BindKVRequest(engine=pb.EngineFacts(engine_rank=0, tp_size=1, dp_size=1, pp_size=1),
                                 page_size=PS, layers=layers), shm


# BindKV runs under the rank's step lock (servicer.BindKV): its layers' shape check listed a peer's every
# dimension as a step's did, and their strides were made a tuple before their count was looked at.
@pytest.mark.parametrize("what", ["shape", "strides"])
def test_a_kv_layer_of_millions_of_dimensions_or_strides_is_refused_at_once(tiny_cfg, what):
    def huge(lb):
        getattr(lb, what).extend([1] * DIMS)
    mem, req, shm = _bind(tiny_cfg, huge)
    with pytest.raises(SidecarError) as err:
        mem.bind(req)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and err.value.field == f"layers[0].{what}", err.value
    assert str(DIMS + 5) in err.value.message and len(err.value.message) < 200, err.value.message[:200]
    assert mem.kv is None
    shm.close()
