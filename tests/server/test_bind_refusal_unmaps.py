"""A refused BindKV unmaps every layer it mapped at once (MemoryBindings._discard), the refused one included."""

from __future__ import annotations

import pytest
import torch

from dspark_sidecar.drafter.config import load_config
from dspark_sidecar.drafter.kv_cache import kv_layer_shape
from dspark_sidecar.proto import codec, memory
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.server.errors import SidecarError, as_sidecar_error
from dspark_sidecar.server.kv_binding import MemoryBindings


def _maps_of(name: str) -> int:
    with open("/proc/self/maps") as maps:
        return sum(name in line for line in maps)


def _layer(i: int, t: torch.Tensor, strides=None) -> pb.KVLayerBinding:
    return pb.KVLayerBinding(layer=i, memory=memory.export_handle(t), dtype=codec.dtype_to_proto(t.dtype),
                             shape=list(t.shape), strides=list(strides or t.stride()),
                             storage_offset=t.storage_offset())


@pytest.mark.parametrize("refusal", ["strides", "overlap", "offset", "size"])
def test_the_refused_layer_s_mapping_does_not_outlive_the_refusal(refusal):
    """The refused layer's view stayed in _map_layers' frame, which the error's traceback keeps: its
    mapping went only when the error was dropped, on whatever thread and (on a GPU) stream that was,
    not in _discard's QuietStream with the others. Stood in for on CPU: while the error is held, the
    refused layer's segment was still mapped. So was a segment MappedMemory itself refused (offset_bytes or
    size_bytes past its end) after mapping it: its own frame held the mapping."""
    cfg = load_config("tiny")
    segs = [memory.shm_empty(kv_layer_shape(cfg, 1, 4, 16), torch.float32) for _ in range(cfg.num_hidden_layers)]
    mem = MemoryBindings(cfg, 1, 0, torch.float32, torch.device("cpu"))
    try:
        layers = [_layer(i, s.tensor) for i, s in enumerate(segs)]
        if refusal == "strides":  # layer 2's own elements overlap (kv_view_problem)
            layers[2] = _layer(2, segs[2].tensor, [s // 2 for s in segs[2].tensor.stride()[:-1]] + [1])
        elif refusal == "overlap":  # layer 3 on layer 2's memory
            layers[3] = _layer(3, segs[2].tensor)
        elif refusal == "offset":  # refused by MappedMemory itself, after it mapped the segment
            layers[2].memory.shm.offset_bytes = 1 << 40
        else:
            layers[2].memory.shm.size_bytes = 1 << 40
        before = [_maps_of(s.segment.name) for s in segs]
        with pytest.raises((SidecarError, memory.HandleError)) as err:
            mem.bind(pb.BindKVRequest(engine=pb.EngineFacts(engine_rank=0, tp_size=1, dp_size=1, pp_size=1),
                                      page_size=16, layers=layers))
        want = {"strides": "layers[2].strides", "overlap": "layers[3].memory"}.get(refusal, "layers[2].memory")
        assert as_sidecar_error(err.value).field == want, err.value  # a HandleError is mapped so (errors.py)
        assert err.value.__traceback__ is not None  # held, as a handler thread holds it until its call ends
        assert [_maps_of(s.segment.name) for s in segs] == before and mem.kv is None
    finally:
        for s in segs:
            s.close()
