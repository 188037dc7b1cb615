"""GetStatus (server/servicer.py) against a binding that BindKV/UnbindKV close while it is answered."""

from __future__ import annotations

import threading
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



class PublishedMidAnswer(Lifecycle):
    """A Lifecycle that, at GetStatus's first read of its state, has the rank's publisher (HealthPublisher, on
    the main thread: LOADING -> SERVING at start-up, PEER_SILENT -> SERVING when the peer is back) publish
    SERVING on another thread, given `wait_s` to land before the read goes on."""

    def __getattribute__(self, name):
        value = object.__getattribute__(self, name)
        if name == "state" and object.__getattribute__(self, "__dict__").get("publisher") is not None:
            publisher, self.publisher = self.publisher, None
            self.published = threading.Thread(target=publisher, args=("SERVING",))
            self.published.start()
            self.published.join(self.wait_s)
        return value


@pytest.mark.parametrize("before, reason", [("LOADING", ""), ("PEER_SILENT", "peer rank(s) 1 silent for 3.5 s")])
def test_a_state_published_while_status_is_answered_gives_one_state(before, reason):
    """GetStatus read the state twice (serving, then state) and the reason apart from both: a publish in
    between answered serving false with state SERVING (or PEER_SILENT with no reason). With a
    fast_path_refusal (any Triton host's "not gfx950"), the shim reads a rank not serving in a state that is
    no transient one as refused for good (client/reasons.py sidecar_refusal), and turned the sidecar off for the
    life of the engine. The answer is now the state and reason as one publish left them."""
    from grpc_health.v1 import health

    from dspark_sidecar.client.reasons import sidecar_refusal
    from dspark_sidecar.server.health import HealthPublisher

    cfg = load_config("tiny")
    ctx = SimpleNamespace(rank=0, fast=None, cfg=cfg, memory=SimpleNamespace(kv=None), refusal=None,
                          model=SimpleNamespace(dtype=torch.float32), metrics=Metrics(0))
    life = PublishedMidAnswer(state=before, reason=reason)
    svc = DrafterServicer(ctx, None, life, pb.Limits(), pb.Parallel(), "bf16")  # type: ignore[arg-type]
    life.wait_s, life.publisher = 0.5, HealthPublisher(life, svc, ctx, health.HealthServicer(), ctx.metrics)
    st = svc.GetStatus(pb.GetStatusRequest(), None)
    life.published.join(5)
    assert life.state == "SERVING" and life.reason == ""  # the publish itself went through
    assert st.fast_path_refusal and sidecar_refusal(st) is None, (st.serving, st.state, st.fast_path_refusal)
    assert (st.state, st.serving, st.state_reason) in ((before, False, reason), ("SERVING", True, "")), st


def test_the_backends_sidecar_proto_names_are_the_ones_the_sidecar_sends():
    """StatusReport.backend said e.g. "torch"; the sidecar sends "reference" for its pure-torch ops
    (BackendChoice.name), which the demo's verdict switches on."""
    import re
    from pathlib import Path

    import dspark_sidecar.proto as proto_pkg
    from dspark_sidecar.server import backend

    text = (Path(proto_pkg.__file__).parent / "sidecar.proto").read_text()
    comment = re.search(r"((?:\s*//[^\n]*\n)+)\s*string backend = 10;", text).group(1)
    source = Path(backend.__file__).read_text()
    sent = set(re.findall(r'BackendChoice\("(\w+)"', source)) | set(re.findall(r'portable, ops = "(\w+)"', source))
    assert sent == {"flydsl", "triton", "reference"}, sent
    for name in sent:
        assert f'"{name}"' in comment, (name, comment)
    assert '"torch"' not in comment


class ReplacedAfterRead:
    """MemoryBindings whose binding a BindKV or UnbindKV on another thread replaces (and closes: layers = []) right
    after the `replace_after`-th read of `kv`: the reads up to it see `first`, every later one `then`."""

    def __init__(self, first, then, replace_after: int) -> None:
        self._kv, self.then, self.reads, self.replace_after = first, then, 0, replace_after

    @property
    def kv(self):
        self.reads += 1
        seen = self._kv
        if self.reads == self.replace_after:
            self._kv = self.then
            if seen is not None:
                seen.close()
        return seen


class Compiling:
    """FlyDSLFastPath's verdicts on a host that passes the seed's checks: no refusal, and a bound binding's kernels
    still compiling (pending)."""

    def refusal(self, kv):
        return None

    def pending(self, kv):
        return None if kv is None else f"FlyDSL kernels for binding {kv.binding_id} gen {kv.generation} compiling"


def _bound(binding_id: int, generation: int):
    from dspark_sidecar.server.refusal import EngineFacts

    kv = SimpleNamespace(binding_id=binding_id, generation=generation, num_pages=4, page_size=16,
                         layers=[torch.zeros(2, 4, 16, 1, 8, dtype=torch.bfloat16)] * 2,
                         engine=EngineFacts(4, 1, 1, "dspark", 7))
    kv.close = lambda: setattr(kv, "layers", [])  # as KVBinding.close
    return kv


@pytest.mark.parametrize("first, then", [("A", None), (None, "A"), ("A", "B")])
@pytest.mark.parametrize("replace_after", [1, 2, 3])
def test_a_binding_replaced_while_status_is_answered_reports_one_binding_and_its_own_refusal(first, then,
                                                                                              replace_after):
    """GetStatus read the binding for its kv field, then again for fast_path_refusal (refusal(), and pending()
    once more): an UnbindKV landing between answered bound with binding A and "no engine bound yet", a BindKV
    answered bound false with the new binding's "kernels ... compiling", or binding A's fields with binding B's
    verdict. The report is now of one binding, one that was the rank's while it was answered."""
    from dspark_sidecar.server.refusal import AWAITING_BIND, HostFacts

    kvs = {"A": _bound(5, 3), "B": _bound(6, 4), None: None}
    cfg = load_config("tiny")
    memory = ReplacedAfterRead(kvs[first], kvs[then], replace_after)
    ctx = SimpleNamespace(rank=0, fast=Compiling(), cfg=cfg, memory=memory,
                          model=SimpleNamespace(dtype=torch.bfloat16), metrics=Metrics(0))
    life = Lifecycle(host=HostFacts(on_gfx950=True, flydsl_available=True, tp_size=4), backend="flydsl")
    svc = DrafterServicer(ctx, None, life, pb.Limits(), pb.Parallel(), "mxfp8")  # type: ignore[arg-type]
    st = svc.GetStatus(pb.GetStatusRequest(), None)
    if not st.kv.bound:
        assert (st.kv.binding_id, st.kv.num_layers, st.fast_path_refusal) == (0, 0, AWAITING_BIND), st
    else:
        kv = kvs["A"] if st.kv.binding_id == 5 else kvs["B"]
        assert (st.kv.binding_id, st.kv.generation, st.kv.num_layers, st.kv.kv_dtype) == (
            kv.binding_id, kv.generation, 2, pb.DTYPE_BF16), st
        assert st.fast_path_refusal == f"FlyDSL kernels for binding {kv.binding_id} gen {kv.generation} compiling"


class PublishedRightAfterTheRead(Lifecycle):
    """A Lifecycle that a publish (HealthPublisher, on the main thread) moves to SERVING right after GetStatus has
    read its state and reason."""

    def snapshot(self) -> tuple[str, str]:
        seen = super().snapshot()
        with self.lock:
            self.state, self.reason = "SERVING", ""
        return seen


def test_serving_is_said_of_the_state_read_not_read_again():
    """StatusReport.serving is the state read (state == "SERVING"): read again from the lifecycle, a publish in
    between answered state LOADING with serving true, which an engine takes as ready."""
    cfg = load_config("tiny")
    ctx = SimpleNamespace(rank=0, fast=None, cfg=cfg, memory=SimpleNamespace(kv=None),
                          model=SimpleNamespace(dtype=torch.float32), metrics=Metrics(0))
    life = PublishedRightAfterTheRead(state="LOADING")
    svc = DrafterServicer(ctx, None, life, pb.Limits(), pb.Parallel(), "bf16")  # type: ignore[arg-type]
    st = svc.GetStatus(pb.GetStatusRequest(), None)
    assert (st.state, st.serving, life.state) == ("LOADING", False, "SERVING")
