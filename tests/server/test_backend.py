"""server/backend.py: a Triton the kernels cannot load is no backend, under auto and as --backend triton."""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from dspark_sidecar.kernels.ops import REFERENCE_OPS
from dspark_sidecar.server.backend import BackendUnavailable, choose_backend
from dspark_sidecar.server.config import ServeConfig
from dspark_sidecar.server.refusal import HostFacts

GPU = torch.device("cuda", 0)  # only named: choose_backend reads its type, nothing touches a device
NO_FLYDSL = HostFacts(on_gfx950=False, flydsl_available=False, tp_size=1)


@pytest.fixture
def triton_before_3_4(monkeypatch):
    """The installed Triton as one older than 3.4 (torch <= 2.7's CUDA wheels bring 3.0-3.3): no triton.knobs,
    which kernels/triton/runtime.py reads at import. The kernels' modules are imported afresh under it."""
    triton = pytest.importorskip("triton")
    monkeypatch.delattr(triton, "knobs")
    pkg = "dspark_sidecar.kernels.triton"
    __import__(pkg)
    for name in [n for n in sys.modules if n.startswith(pkg + ".")]:
        monkeypatch.delitem(sys.modules, name)
        monkeypatch.delattr(sys.modules[pkg], name.rsplit(".", 1)[1], raising=False)


def test_auto_on_a_gpu_whose_triton_cannot_load_the_kernels_serves_on_the_reference_ops(triton_before_3_4, caplog):
    """find_spec saw Triton installed, and the import of the kernels' runtime then raised AttributeError out of
    choose_backend: under the default --backend auto every rank of a GPU host with an older Triton died at
    start-up with a traceback (the launcher's exit 1, restarted for ever), where auto promises the reference."""
    with caplog.at_level(logging.WARNING, "dspark_sidecar.server"):
        choice = choose_backend(ServeConfig(), NO_FLYDSL, GPU)
    assert (choice.name, choice.ops) == ("reference", REFERENCE_OPS)
    # The operator's only word of why a GPU rank serves on the slow ops.
    assert any("they need triton>=3.4" in r.getMessage() for r in caplog.records), caplog.records


def test_backend_triton_whose_triton_cannot_load_the_kernels_is_refused_in_one_line(triton_before_3_4):
    """BackendUnavailable (one line, exit 2) naming the flag and why, not the import's traceback."""
    with pytest.raises(BackendUnavailable, match=r"^--backend triton: Triton cannot load the kernels here "
                                                 r"\(AttributeError: .*knobs.*\): they need triton>=3\.4"):
        choose_backend(ServeConfig(backend="triton"), NO_FLYDSL, GPU)
