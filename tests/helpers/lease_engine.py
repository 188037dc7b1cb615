"""An engine rank in its own process for the lease tests: binds a shared-memory KV cache to sidecar rank 0 through
the shim's KVBinder, under the lease its status names, prints the binding and segment names, then waits on stdin.

`python -m helpers.lease_engine <target> <num_pages> <dtype> [--no-lease] [--cuda GIB] [--buffers]` (run with tests/
on sys.path). --buffers: the data plane under the same lease too, the doorbell and the step buffers (the shared-memory
segments printed: the doorbell's page, then the buffers' where they are on the CPU).
--cuda: the cache on GPU 0 as vLLM 0.34 allocates it (every layer a view of one int8 allocation), GIB GiB more of
which stand for the rest of the engine's cache; the segment names printed are then empty. --ring-behind S (with --cuda
--buffers): the doorbell (no GPU word) rung once, its input event recorded behind S seconds of GPU work, and its
answer waited for before the line is printed: the sidecar's stream then waits on an event the GPU has not reached.
"""

from __future__ import annotations

import sys

import grpc
import torch

from dspark_sidecar.client.binding import KVBinder
from dspark_sidecar.client.dataplane import DoorbellChannel, StepBuffers
from dspark_sidecar.drafter.config import PRESETS
from dspark_sidecar.drafter.kv_cache import kv_layer_shape
from dspark_sidecar.proto import memory
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.proto import sidecar_pb2_grpc as pb_grpc
from helpers.engine_sim import PAGE


def main() -> None:
    target, pages, dtype = sys.argv[1], int(sys.argv[2]), getattr(torch, sys.argv[3])
    cfg = PRESETS["tiny"]
    shape = kv_layer_shape(cfg, 1, pages, PAGE)
    if "--cuda" in sys.argv:
        ballast = int(float(sys.argv[sys.argv.index("--cuda") + 1]) * (1 << 30))
        per = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        raw = torch.zeros(ballast + per * cfg.num_hidden_layers, dtype=torch.uint8, device="cuda:0")
        layers = [raw[ballast + i * per: ballast + (i + 1) * per].view(dtype).view(shape)
                  for i in range(cfg.num_hidden_layers)]
        torch.cuda.synchronize()
        names = []
    else:
        kv = [memory.shm_empty(shape, dtype) for _ in range(cfg.num_hidden_layers)]
        layers = [t.tensor for t in kv]
        names = [memory.export_handle(t).shm.name for t in layers]
    stub = pb_grpc.DrafterSidecarStub(grpc.insecure_channel(target))
    status = stub.GetStatus(pb.GetStatusRequest(), timeout=10)
    lease = "" if "--no-lease" in sys.argv else status.lease_socket
    binder = KVBinder(pb.EngineFacts(engine_rank=0, tp_size=1, dp_size=1, pp_size=1, speculative_method="dspark",
                                     num_speculative_tokens=7, device=str(layers[0].device),
                                     device_uuid=memory.gpu_uuid(layers[0].device)))
    b = binder.bind(stub, layers, 10.0, lease)
    if "--buffers" in sys.argv:
        dev = layers[0].device  # on a GPU: the input event, the GPU word (a pre-launching sidecar) and CUDA regions
        behind = float(sys.argv[sys.argv.index("--ring-behind") + 1]) if "--ring-behind" in sys.argv else 0.0
        bell = DoorbellChannel(stub, dev, 4096, gpu_word=dev.type == "cuda" and not behind, lease=binder.lease.held)
        bufs = StepBuffers(stub, cfg.hidden_size, 2, pages, dtype, dev, lease=binder.lease.held)
        names += [h.shm.name for h in map(memory.export_handle, (bell._page.tensor, bufs.embeds, bufs.hidden,
                                                                 bufs.meta_bytes)) if h.WhichOneof("kind") == "shm"]
    if "--buffers" in sys.argv and behind:
        _spin(behind)  # the engine's GPU still busy when the step's "inputs written" event is recorded (send)
        bell.send(pb.DraftStepRequest(step_id=1))  # answered refused (no inputs), its event wait queued all the same
        assert bell.wait(1, 30.0) is not None, "the sidecar did not answer the ring"
    print(b.binding_id, " ".join(names), flush=True)
    sys.stdin.readline()  # until the test says (or kills this process)


def _spin(seconds: float) -> None:
    """Queue `seconds` of GPU work on the current stream (torch.cuda._sleep, timed once its kernel is loaded)."""
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    torch.cuda._sleep(int(seconds * 1e3 * 10_000_000 / start.elapsed_time(end)))


if __name__ == "__main__":
    main()
