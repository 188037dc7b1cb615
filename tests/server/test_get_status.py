"""GetStatus (server/servicer.py) against a binding that BindKV/UnbindKV close while it is answered."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dspark_sidecar.drafter.config import load_config
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.server.metrics import Metrics
from dspark_sidecar.server.servicer import DrafterServicer, Lifecycle


class ClosedMidAnswer:
    """A bound KVBinding whose close() (KVBinding.close: layers = [], from a concurrent BindKV or
    UnbindKV on another handler thread) lands right after the `close_after`-th read of its layers."""

    binding_id, generation, num_pages, page_size, engine = 5, 3, 4, 16, None

    def __init__(self, n: int, close_after: int) -> None:
        self._layers = [torch.zeros(2, 4, 16, 1, 8, dtype=torch.float8_e4m3fn) for _ in range(n)]
        self.reads, self.close_after = 0, close_after

    @property
    def layers(self) -> list[torch.Tensor]:
        self.reads += 1
        seen = self._layers
        if self.reads == self.close_after:
            self._layers = []
        return seen


@pytest.mark.parametrize("close_after", [1, 2, 3])
def test_a_binding_closed_while_status_is_answered_gives_one_consistent_answer(close_after):
    """GetStatus read kv.layers up to three times: a close between the second and third read answered
    INTERNAL (IndexError on layers[0]), and one after the first reported the layers' count with no
    dtype. Read once, the answer is the binding as it was at that read."""
    cfg = load_config("tiny")
    kv = ClosedMidAnswer(cfg.num_hidden_layers, close_after)
    ctx = SimpleNamespace(rank=0, fast=None, cfg=cfg, memory=SimpleNamespace(kv=kv),
                          model=SimpleNamespace(dtype=torch.float32), metrics=Metrics(0))
    svc = DrafterServicer(ctx, None, Lifecycle(), pb.Limits(), pb.Parallel(), "bf16")  # type: ignore[arg-type]
    report = svc.GetStatus(pb.GetStatusRequest(), None)
    assert report.kv.bound and report.kv.binding_id == 5
    assert (report.kv.num_layers, report.kv.kv_dtype) == (cfg.num_hidden_layers, pb.DTYPE_FP8_E4M3)


def test_compute_dtype_is_sent_as_sidecar_proto_documents_it():
    """The .proto said e.g. "bf16"; the sidecar sends torch's dtype names ("bfloat16", "float32")."""
    import re
    from pathlib import Path

    import dspark_sidecar.proto as proto_pkg

    text = (Path(proto_pkg.__file__).parent / "sidecar.proto").read_text()
    comment = re.search(r"((?:\s*//[^\n]*\n)+)\s*string compute_dtype = 13;", text).group(1)
    cfg = load_config("tiny")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        ctx = SimpleNamespace(rank=0, fast=None, cfg=cfg, memory=SimpleNamespace(kv=None),
                              model=SimpleNamespace(dtype=dtype), metrics=Metrics(0))
        svc = DrafterServicer(ctx, None, Lifecycle(), pb.Limits(), pb.Parallel(), "bf16")  # type: ignore[arg-type]
        sent = svc.GetStatus(pb.GetStatusRequest(), None).model.compute_dtype
        assert f'"{sent}"' in comment, (sent, comment)
    assert '"bf16"' not in comment
