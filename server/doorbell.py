"""The sidecar end of the same-GPU data plane: a shared-memory doorbell serving DraftStepRequests without gRPC.

The engine writes a serialized DraftStepRequest (tensors as RegionSlices into registered
buffers) into the page and bumps the request sequence; this thread answers through the rank
loop, exactly as the gRPC stream would, and publishes the serialized response. On GPU the
engine's "inputs written" event is waited on by the stream before the step runs, and the
sidecar's "outputs written" event is recorded after it, so neither process syncs its host with
the GPU to order the work.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import torch

from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.proto.memory import MappedMemory
from dspark_sidecar.server.errors import invalid
from dspark_sidecar.server.rank import RankLoop

log = logging.getLogger("dspark_sidecar.server")
HEADER = 64  # bytes: 8 words, 4 used
SPIN_S = 200e-6  # spin this long after a step before backing off to short sleeps


class Doorbell(threading.Thread):
    def __init__(self, page: MappedMemory, capacity: int, loop: RankLoop, device: torch.device,
                 input_event: bytes) -> None:
        super().__init__(name="dspark-doorbell", daemon=True)
        if page.nbytes < HEADER + 2 * capacity:
            raise invalid("capacity_bytes", f"page of {page.nbytes} bytes cannot hold 2 x {capacity} + {HEADER}")
        self.page, self.capacity, self.loop, self.device = page, capacity, loop, device
        buf = page.storage.numpy()
        self.words = np.ndarray((4,), dtype=np.uint64, buffer=buf[:32])
        self.req_area = buf[HEADER : HEADER + capacity]
        self.resp_area = buf[HEADER + capacity : HEADER + 2 * capacity]
        self.input_event = self.output_event = None
        if device.type == "cuda":
            # Built here, on a gRPC handler thread whose current device may be another GPU: pin it.
            with torch.cuda.device(device):
                if input_event:
                    self.input_event = torch.cuda.Event.from_ipc_handle(device, input_event)
                self.output_event = torch.cuda.Event(interprocess=True)
                self.output_event.record(torch.cuda.current_stream(device))  # materialise it on this GPU
        self._halt = threading.Event()
        self._last = int(self.words[0])

    def output_event_handle(self) -> bytes:
        return self.output_event.ipc_handle() if self.output_event is not None else b""

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=2)
        self.page.close()

    def run(self) -> None:
        if self.device.type == "cuda":  # per-thread current device: waits and records go to this GPU
            torch.cuda.set_device(self.device)
        idle_since = time.perf_counter()
        while not self._halt.is_set():
            seq = int(self.words[0])
            if seq == self._last:
                if time.perf_counter() - idle_since > SPIN_S:
                    time.sleep(20e-6)
                continue
            try:
                self._serve(seq)
            except Exception as exc:  # noqa: BLE001  (the engine always gets an answer: it falls back)
                log.exception("doorbell: step could not be served")
                self._publish(seq, pb.DraftStepResponse(error=pb.StepError(
                    code=13, message=f"internal error: {type(exc).__name__}: {exc}", reason="INTERNAL")))
            self._last = seq
            idle_since = time.perf_counter()

    def _serve(self, seq: int) -> None:
        n = int(self.words[1])
        try:
            if n > self.capacity:
                raise invalid("request", f"{n} bytes exceed the doorbell's {self.capacity}-byte area")
            req = pb.DraftStepRequest.FromString(self.req_area[:n].tobytes())
        except Exception as exc:  # noqa: BLE001  (a garbled request is answered, never fatal)
            resp = pb.DraftStepResponse(error=pb.StepError(code=3, message=f"request: unreadable: {exc}",
                                                           field="request", reason="INVALID_FIELD"))
        else:
            if self.input_event is not None:
                torch.cuda.current_stream(self.device).wait_event(self.input_event)
            resp = self.loop.answer(req)
            if self.output_event is not None:
                self.output_event.record(torch.cuda.current_stream(self.device))
        self._publish(seq, resp)

    def _publish(self, seq: int, resp: pb.DraftStepResponse) -> None:
        data = resp.SerializeToString()
        if len(data) > self.capacity:
            data = pb.DraftStepResponse(step_id=resp.step_id, error=pb.StepError(
                code=8, message=f"response of {len(data)} bytes exceeds the doorbell area; register an output "
                                "region", reason="RESPONSE_TOO_LARGE")).SerializeToString()
        self.resp_area[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        self.words[3] = len(data)
        self.words[2] = seq  # publish last: the engine reads the length and bytes after seeing it
