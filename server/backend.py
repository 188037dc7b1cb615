"""The compute backend of a sidecar rank, chosen once at start-up: FlyDSL, Triton or the reference ops."""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

import torch

from dspark_sidecar.drafter.config import DrafterConfig
from dspark_sidecar.kernels.ops import REFERENCE_OPS, Ops
from dspark_sidecar.server.config import ServeConfig, ServeConfigError
from dspark_sidecar.server.refusal import AWAITING_BIND, HostFacts, fast_path_refusal

log = logging.getLogger("dspark_sidecar.server")


class BackendUnavailable(ServeConfigError):
    """An explicitly requested backend or device cannot run here; the message says why. A ServeConfigError:
    one line and exit 2 (cli.main), in the rank that finds it too, since only another flag or host fixes it."""


class GpusNotVisible(BackendUnavailable):
    """--device cuda, or ranks that must each have a GPU, and fewer GPUs visible than that. One line, and exit 75
    (EX_TEMPFAIL) instead of 2: the host may show them at the next start (a GPU driver still loading when the
    unit starts at boot, a GPU being reset), so systemd's unit restarts it every 5 s, the line in its journal each
    time, where a 2 (RestartPreventExitStatus=2) would leave it failed for good."""

    exit_status = 75


@dataclass(frozen=True)
class BackendChoice:
    name: str  # "flydsl", "triton" or "reference"
    ops: Ops  # the portable ops: every step of a portable backend, the steps FlyDSL refuses under "flydsl"
    device: torch.device
    flydsl_refusal: str | None  # why the FlyDSL path is off (None: selected; bind-time checks still apply)
    fallback: str | None = None  # under "flydsl": the portable backend ("triton" or "reference") of `ops`


def resolve_device(cfg: ServeConfig, local_rank: int) -> torch.device:
    if cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise GpusNotVisible("--device cuda: no CUDA/ROCm device is visible")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def check_gpu_placement(cfg: ServeConfig, visible: int | None = None) -> None:
    """GpusNotVisible for --device cuda, or --backend triton/flydsl under --device auto, with no GPU visible;
    ServeConfigError for --dist-backend nccl where --device auto puts the ranks on the CPU (no GPU visible);
    GpusNotVisible when the ranks would share GPUs under NCCL/RCCL, which refuse two ranks of one group on one
    GPU ("Duplicate GPU detected") at the first collective: after every shard has loaded, as a traceback per
    rank (run 207). An explicit --dist-backend gloo may share them."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        # Here, before any rank: in the ranks (resolve_device) it came only after each had started.
        raise GpusNotVisible("--device cuda: no CUDA/ROCm device is visible")
    if cfg.backend in ("triton", "flydsl") and cfg.device == "auto" and not torch.cuda.is_available():
        # Both flags ask for a GPU: auto put the ranks on the CPU, each refused the backend after it had started
        # (exit 2, left failed by systemd), where --device cuda on the same booting host is restarted (75).
        raise GpusNotVisible(f"--backend {cfg.backend}: no CUDA/ROCm device is visible, and it runs only on a GPU "
                             "(--device auto would put the ranks on the CPU)")
    if cfg.dist_backend == "nccl" and cfg.device == "auto" and not torch.cuda.is_available():
        # --device cpu is ServeConfig's to refuse; auto resolves to the CPU only here (resolve_device).
        raise ServeConfigError("--dist-backend nccl: no CUDA/ROCm device is visible, so --device auto runs the ranks "
                               "on the CPU, which NCCL cannot serve; use --dist-backend gloo or auto")
    if cfg.tp == 1 or cfg.device == "cpu" or cfg.dist_backend == "gloo" or cfg.shard_of:
        return
    if visible is None:
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible == 0:
        return  # --device auto runs on CPU
    if cfg.tp > visible:
        raise GpusNotVisible(f"--tp {cfg.tp}: {visible} GPU(s) visible, and NCCL/RCCL cannot run two ranks of "
                               f"one group on one GPU; make {cfg.tp} GPUs visible (CUDA_VISIBLE_DEVICES, "
                               "HIP_VISIBLE_DEVICES), lower --tp, or use --device cpu")


def _triton_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "Triton backend needs a GPU"
    if importlib.util.find_spec("triton") is None:
        return "Triton not installed"
    if importlib.util.find_spec("dspark_sidecar.kernels.triton.ops") is None:
        return "Triton kernels not built into this package"
    try:
        from dspark_sidecar.kernels.triton import ops, runtime  # noqa: F401  (ops: what the backend then imports)
    except (ImportError, AttributeError) as err:
        # find_spec sees a Triton installed, not one the kernels load with: one older than 3.4 (torch <= 2.7's CUDA
        # wheels bring 3.0-3.3) has no triton.knobs (runtime.py). Raised from here, under auto every rank of such a
        # host died at start-up (a traceback, exit 1) instead of serving on the reference ops.
        why = f"Triton cannot load the kernels here ({type(err).__name__}: {err}): they need triton>=3.4"
        log.warning("%s", why)  # under auto nothing else says why a GPU rank serves on the reference ops
        return why

    if runtime.INTERPRET:
        # Triton then runs every kernel in numpy, copying each GPU tensor to the host and back: seconds a
        # step, and a CUDA graph capture fails. Meant for CI without a GPU, never for a GPU rank.
        return "TRITON_INTERPRET is set: every Triton kernel would run in the CPU interpreter (unset it on a GPU host)"
    return None


def choose_backend(cfg: ServeConfig, host: HostFacts, device: torch.device,
                   model: DrafterConfig | None = None, dtype: torch.dtype = torch.bfloat16) -> BackendChoice:
    """auto: FlyDSL when the deployment passes every host check, over Triton on a GPU, else the reference.

    Host checks: the seed's (gfx950, FlyDSL importable, TP 4), then that `model` is the drafter
    the kernels are built for, and that this rank computes on the GPU. The engine's checks (DP, PP, method, tokens) and the KV layout
    wait for BindKV: until a binding passes them the portable ops serve.
    """
    refusal = fast_path_refusal(host, None)
    # Engine facts arrive at bind time; until then only the host checks can pass or fail.
    host_refusal = refusal if refusal and refusal != AWAITING_BIND else None
    if host_refusal is None and model is not None:
        from dspark_sidecar.server.fast_path import kernel_mismatch

        host_refusal = kernel_mismatch(model, dtype)
    if host_refusal is None and device.type != "cuda":
        # The host checks probe torch's current GPU, not this rank's device: `--device cpu` on a
        # gfx950 host passes them, and the kernels (GPU code over raw pointers) would get a CPU cache.
        host_refusal = f"FlyDSL kernels need a GPU (this rank computes on {device.type})"
    want = cfg.backend
    if want == "flydsl" and host_refusal is not None:
        raise BackendUnavailable(f"--backend flydsl: {host_refusal}")
    if want == "triton" or (want != "reference" and _triton_reason(device) is None):
        why = _triton_reason(device)
        if why is not None:
            raise BackendUnavailable(f"--backend triton: {why}")
        from dspark_sidecar.kernels.triton.ops import TRITON_OPS

        portable, ops = "triton", TRITON_OPS
    else:
        portable, ops = "reference", REFERENCE_OPS
    if host_refusal is None and want in ("auto", "flydsl"):
        return BackendChoice("flydsl", ops, device, None, fallback=portable)
    return BackendChoice(portable, ops, device, host_refusal or f"--backend {want} selected")
