"""The compute backend of a sidecar rank, chosen once at start-up: FlyDSL, Triton or the reference ops."""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

import torch

from dspark_sidecar.kernels.ops import REFERENCE_OPS, Ops
from dspark_sidecar.server.config import ServeConfig
from dspark_sidecar.server.refusal import HostFacts, fast_path_refusal

log = logging.getLogger("dspark_sidecar.server")


NOT_INTEGRATED = "FlyDSL step runner not integrated in this build (kernels compile for gfx950 only)"


class BackendUnavailable(RuntimeError):
    """An explicitly requested backend cannot run here; the message says why."""


@dataclass(frozen=True)
class BackendChoice:
    name: str
    ops: Ops
    device: torch.device
    flydsl_refusal: str | None  # why the FlyDSL path is off (None: it is on)


def resolve_device(cfg: ServeConfig, local_rank: int) -> torch.device:
    if cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise BackendUnavailable("--device cuda: no CUDA/ROCm device is visible")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def _triton_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "Triton backend needs a GPU"
    if importlib.util.find_spec("triton") is None:
        return "Triton not installed"
    if importlib.util.find_spec("dspark_sidecar.kernels.triton.ops") is None:
        return "Triton kernels not built into this package"
    return None


def choose_backend(cfg: ServeConfig, host: HostFacts, device: torch.device) -> BackendChoice:
    """auto: FlyDSL when the deployment passes every check, else Triton on a GPU, else the reference."""
    refusal = fast_path_refusal(host, None)
    # Engine facts arrive at bind time; until then only the host checks can pass or fail.
    host_refusal = refusal if refusal and not refusal.startswith("no engine bound") else None
    want = cfg.backend
    if host_refusal is None:
        # Every host check passes, but this build has no FlyDSL step runner to bind: say so
        # rather than pretend, and serve through the portable backend.
        refusal = NOT_INTEGRATED
    if want == "flydsl":
        raise BackendUnavailable(f"--backend flydsl: {host_refusal or NOT_INTEGRATED}")
    if want == "triton" or (want == "auto" and _triton_reason(device) is None):
        why = _triton_reason(device)
        if why is not None:
            raise BackendUnavailable(f"--backend triton: {why}")
        from dspark_sidecar.kernels.triton.ops import TRITON_OPS

        return BackendChoice("triton", TRITON_OPS, device, refusal)
    return BackendChoice("reference", REFERENCE_OPS, device, refusal)
