"""`dspark-sidecar demo`: a TP-4 sidecar and the TP-4 engine harness, N rounds of a realistic mix, one report."""

from __future__ import annotations

import functools
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import grpc

from dspark_sidecar import layout
from dspark_sidecar.client.config import BreakerConfig
from dspark_sidecar.client.harness import HarnessConfig, run_engine, worst
from dspark_sidecar.client.launcher import SidecarLauncher
from dspark_sidecar.client.reasons import BAD_ANSWER, SHIM_ERROR, sidecar_error
from dspark_sidecar.client.workload import MixConfig
from dspark_sidecar.drafter.checkpoint import ensure_synthetic_checkpoint
from dspark_sidecar.drafter.config import PRESETS
from dspark_sidecar.drafter.kv_cache import KV_DTYPE_CHOICES, KV_LAYOUTS
from dspark_sidecar.percentiles import percentile


class DemoError(RuntimeError):
    """The demo has no sidecar to talk to: its own did not start or ended with a status other than 0, or none
    answers at --use-running-sidecar's folder. The message says why (with the sidecar's log tail); the command
    prints it and exits 1."""


@dataclass(frozen=True)
class DemoConfig:
    rounds: int = 60
    tp: int = 4
    preset: str = "tiny"
    seed: int = 0  # of the synthetic checkpoint and of the request mix
    max_reqs: int = 8  # the sidecar's --max-reqs; the mix goes above it on purpose
    dtype: str = "fp32"
    socket_dir: str | None = None  # None: a fresh temporary folder
    start_sidecar: bool = True  # False: use a sidecar already serving at socket_dir
    verify: bool = True  # also run the local layers on forwarded rounds and compare
    long_contexts: bool = True  # requests whose contexts cross the 4096 window
    progress_every: int = 10
    rendezvous_ms: int = 200
    work_dir: str | None = None
    device: str = "cpu"  # or "cuda": sidecar and engine rank r on GPU r
    transport: str = "grpc"  # or "doorbell": the shared-memory data plane (client/dataplane.py)
    kv_layout: str = "planes"  # or "records": the engine's cache as vLLM 0.34 allocates it (kv_cache.KV_LAYOUTS)
    kv_dtype: str = "auto"  # or "fp8": the cache as float8 e4m3 codes (vLLM's kv_cache_dtype fp8 at scale 1)
    required_tp: int = 4  # the TP the shim forwards at (the seed's check): set it to tp to forward at TP 2

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ValueError(f"rounds: must be >= 1, got {self.rounds}")
        if not 1 <= self.max_reqs <= layout.MAX_REQS_LIMIT:
            raise ValueError(f"max_reqs: must be 1..{layout.MAX_REQS_LIMIT}, got {self.max_reqs}")
        if not 0 <= self.seed < layout.SEED_LIMIT:  # serve's range: 2^62 overflowed torch's generator, -1 no serve takes
            raise ValueError(f"seed: must be 0..{layout.SEED_LIMIT - 1}, got {self.seed}")
        if self.preset not in PRESETS:
            raise ValueError(f"preset: one of {sorted(PRESETS)}, got {self.preset!r}")
        if not self.start_sidecar and self.socket_dir is None:
            raise ValueError("socket_dir: required with start_sidecar=False")
        if self.device not in ("cpu", "cuda") or self.transport not in ("grpc", "doorbell"):
            raise ValueError(f"device cpu|cuda and transport grpc|doorbell, got {self.device!r}, {self.transport!r}")
        if self.kv_dtype not in KV_DTYPE_CHOICES:
            raise ValueError(f"kv_dtype: auto or fp8, got {self.kv_dtype!r}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout: one of {', '.join(KV_LAYOUTS)}, got {self.kv_layout!r}")


@dataclass
class DemoReport:
    rounds: int
    forwarded: int
    fallbacks: dict[str, int]  # rounds on the local layers, by the shim's reason
    warmup_fallbacks: dict[str, int]  # the profiling run and CUDA-graph capture calls before round 0
    forwarded_p50_ms: float
    forwarded_p99_ms: float
    local_p50_ms: float
    local_p99_ms: float
    compared: int  # forwarded rounds also run locally
    hidden_mismatch_rounds: int
    max_hidden_diff: float
    token_mismatch_rounds: int
    tokens_differing: int
    kv_mismatch_rounds: int
    max_kv_diff: float
    max_hidden_rel: float  # relative L2 of the largest round: what the GPU backend's roundings add
    max_kv_rel: float
    ranks_agree: bool  # every engine rank made the same decisions and drafted the same tokens
    longest_context: int
    requests: int
    binds: int
    backend: str = ""
    fast_path_refusal: str = ""
    wall_s: float = 0.0
    extra: dict = field(default_factory=dict)


def demo_mix(cfg: DemoConfig) -> MixConfig:
    """Up to max_reqs + 4 requests in flight (so some steps are too large to forward), short and
    middle prompts, and a few long ones that grow past the 4096-token window.

    Joins and stays are set so that a burst now and then goes above max_reqs and drains below it again: with
    MixConfig's own rates (a join in 35% of rounds, 8-80 rounds each) the mix filled to max_reqs + 4 and stayed
    there, so ~88% of rounds were too large to forward (review 318: 49 forwarded of 400)."""
    return MixConfig(seed=cfg.seed, max_active=cfg.max_reqs + 4, long_p=0.03 if cfg.long_contexts else 0.0,
                     first_long=cfg.long_contexts, join_p=0.2, burst_p=0.01, budget=(8, 40))


def summarise(reports: list[dict], rounds: int, wall_s: float) -> DemoReport:
    """Rank 0's view, plus whether all ranks agree."""
    r0 = reports[0]
    fallbacks: dict[str, int] = {}
    for reason, d in zip(r0["reasons"], r0["decisions"]):
        if d == "L":
            key = reason or "no sidecar"
            fallbacks[key] = fallbacks.get(key, 0) + 1
    warm = {}
    if r0["shim"] is not None:
        warm = {k: v for k, v in r0["shim"]["fallbacks"].items() if k in ("no attention metadata", "CUDA graph capture")}
    agree = len({(r["decisions"], r["digest"]) for r in reports}) == 1
    ms = 1e6

    def largest(key: str) -> float:  # over the ranks, a NaN kept (max() drops one that is not first)
        return functools.reduce(worst, (r[key] for r in reports))

    return DemoReport(
        rounds=rounds, forwarded=r0["decisions"].count("F"), fallbacks=fallbacks, warmup_fallbacks=warm,
        forwarded_p50_ms=percentile(r0["fwd_ns"], 50) / ms, forwarded_p99_ms=percentile(r0["fwd_ns"], 99) / ms,
        local_p50_ms=percentile(r0["local_ns"], 50) / ms, local_p99_ms=percentile(r0["local_ns"], 99) / ms,
        compared=r0["compared"], hidden_mismatch_rounds=max(r["hidden_mismatch"] for r in reports),
        max_hidden_diff=largest("max_hidden_diff"),
        token_mismatch_rounds=max(r["token_mismatch"] for r in reports),
        tokens_differing=max(r["tokens_differing"] for r in reports),
        kv_mismatch_rounds=max(r["kv_mismatch"] for r in reports), max_kv_diff=largest("max_kv_diff"),
        max_hidden_rel=largest("max_hidden_rel"), max_kv_rel=largest("max_kv_rel"),
        ranks_agree=agree, longest_context=r0["max_seq_len"], requests=r0["joined"], binds=r0["binds"], wall_s=wall_s)


def run_demo(cfg: DemoConfig, out: Callable[[str], None] = print) -> DemoReport:
    """Start the sidecar (unless one is given), run the harness for cfg.rounds rounds, stop it."""
    # The checkpoint first: a write that fails (a full disk) made no folder yet to leave behind.
    dspark_dir, target_dir = ensure_synthetic_checkpoint(PRESETS[cfg.preset], cfg.seed)
    ckpt = (str(dspark_dir), str(target_dir))
    work = Path(cfg.work_dir or tempfile.mkdtemp(prefix="dspark-demo-"))
    sock = Path(cfg.socket_dir) if cfg.socket_dir else Path(tempfile.mkdtemp(prefix="dsp-"))
    launcher = None
    failed = False
    try:
        # Inside the clean-up: its checks (the dtype, the TP) raised with both folders made, and both stayed.
        h = HarnessConfig(rounds=cfg.rounds, tp=cfg.tp, preset=cfg.preset, dtype=cfg.dtype, checkpoint=ckpt,
                          socket_dir=str(sock), mix=demo_mix(cfg), verify=cfg.verify, progress_every=cfg.progress_every,
                          breaker=BreakerConfig(backoff_max_s=1.0), device=cfg.device, transport=cfg.transport,
                          required_tp=cfg.required_tp, kv_layout=cfg.kv_layout, kv_dtype=cfg.kv_dtype)
        if cfg.start_sidecar:
            out(f"starting a TP-{cfg.tp} sidecar ({cfg.preset}, {cfg.dtype}, max {cfg.max_reqs} requests a step) "
                f"on {sock} ...")
            launcher = SidecarLauncher(sock, tp=cfg.tp, preset=cfg.preset, dtype=cfg.dtype, max_reqs=cfg.max_reqs,
                                       checkpoint=ckpt, extra_args=["--rendezvous-ms", str(cfg.rendezvous_ms),
                                                                    "--device", cfg.device],
                                       log_path=work / "sidecar.log")
            try:
                launcher.start()
            except (RuntimeError, TimeoutError) as err:  # exited, never SERVING (stopped), or the folder is taken
                # A taken folder is refused before anything starts: no log to name (its folder is removed below).
                log = f" (its log: {launcher.log_path})" if launcher.log_path.exists() else ""
                raise DemoError(f"the sidecar did not start{log}: {err}") from None
        try:
            status = (launcher or SidecarLauncher(sock, tp=cfg.tp)).status(0)
        except grpc.RpcError as err:
            raise DemoError(f"no sidecar status from {sock} (rank 0: {err.code().name}: {err.details()}); start one "
                            "with `dspark-sidecar serve --socket-dir ...` and wait until it is SERVING, or leave out "
                            "--use-running-sidecar"
                            if launcher is None else f"the sidecar's rank 0 did not report its status: "
                            f"{err.code().name}: {err.details()}") from None
        out(f"sidecar SERVING: backend {status.backend}"
            + (f", FlyDSL path off: {status.fast_path_refusal}" if status.fast_path_refusal else ""))
        out(f"running {cfg.rounds} rounds on a TP-{cfg.tp} engine harness ...")
        t0 = time.monotonic()
        reports = run_engine(h, work / "engine")
        report = summarise(reports, cfg.rounds, time.monotonic() - t0)
        report.backend, report.fast_path_refusal = status.backend, status.fast_path_refusal
        # Stopped here to read how it ended: one that exited mid-run (a rank crashed: the group exits 1) left
        # the later rounds on the local layers and the earlier ones compared, and the demo passed without it.
        # Stopped by this SIGTERM, a sidecar drains and exits 0 (server/launcher.launch). One that had already
        # ended failed the run whatever its status: stopped by another's SIGTERM it drained and exited 0 too, its
        # later rounds on the local layers, and the demo passed on its own stop's 0.
        early = launcher is not None and launcher.exited
        if launcher is not None and ((code := launcher.stop()) != 0 or early):
            raise DemoError(f"the sidecar exited {'mid-run ' if early else ''}with status {code} ({report.forwarded} "
                            f"of {cfg.rounds} rounds forwarded; its log: {launcher.log_path}):\n{launcher.log_tail()}")
        return report
    except Exception:
        failed = True
        raise
    finally:
        if launcher is not None:
            launcher.stop()
        # The folders made here (not given): every run left two in $TMPDIR, the sidecar's log, the ranks'
        # reports and the rendezvous file in one. That one is kept when the run ended in an error, for its log,
        # but not when it holds none (--use-running-sidecar writes no log: a folder per failed run, holding only
        # the engine's rendezvous file, named nowhere) nor after an interrupt (Ctrl-C, SIGTERM: cli.cmd_demo).
        # The socket folder holds no log.
        # (rmtree's ignore_errors: a scratch file that will not go must not turn a result into a traceback.)
        has_log = launcher is not None and launcher.log_path.exists()
        if cfg.work_dir is None and not (failed and has_log):
            shutil.rmtree(work, ignore_errors=True)
        if cfg.socket_dir is None:
            shutil.rmtree(sock, ignore_errors=True)


# Largest relative L2 (hidden states, block K/V) of a forwarded round against the local stock layers, for
# a backend that rounds differently from them (Triton, FlyDSL). bf16: a few output ulps (2^-8 relative
# each) over the whole step, the bound the kernels' parity tests use for their largest error (2^-5); the
# GPU demo measured 6.5e-3 (runs 220, 232). fp32: only the summation order differs, 2e-5 per kernel.
REL_L2_LIMIT = {"bf16": 2.0 ** -5, "fp32": 1e-4}
# An fp8 e4m3 cache: where the two paths' K rounds an ulp apart, the code can differ by one e4m3 step (1/8
# relative). The GPU demo measured 1.66e-2 (run 227); half a step over the whole block is a bug's size.
FP8_KV_REL_L2_LIMIT = 2.0 ** -4
# Fallback reasons that are the sidecar's (or the shim's) own fault, whatever the mix: an unexpected exception
# in its step (INTERNAL, UNKNOWN: client/shim._step_error's keys), an answer of the wrong shape or dtype, the
# shim's own (SHIM_ERROR). Not a peer's abort, a late step or a step over the limits, which a healthy run can see.
FAULT_REASONS = (sidecar_error(grpc.StatusCode.INTERNAL), sidecar_error(grpc.StatusCode.UNKNOWN), BAD_ANSWER)


def sidecar_faults(fallbacks: dict[str, int]) -> dict[str, int]:
    """The rounds that fell back because the sidecar or the shim failed, by reason."""
    return {k: n for k, n in fallbacks.items() if k in FAULT_REASONS or k.startswith(SHIM_ERROR)}


def verdict(r: DemoReport, dtype: str, kv_dtype: str = "auto", verify: bool = True) -> str | None:
    """Why the run's checks failed, or None. The reference backend runs the engine's own ops in its dtype,
    so its forwarded rounds must be the same bits (draft tokens included); another backend must stay
    within REL_L2_LIMIT, its draft tokens free to differ at argmax near-ties between two roundings.
    Verifying, a run that compared no round fails: it checked nothing (a sidecar that refuses every step
    would pass, the demo's very check unmade); with verify False (--no-verify) that is not a failure.
    A step the sidecar failed (FAULT_REASONS) fails the run either way."""
    if not r.ranks_agree:
        return "the engine ranks disagreed on a decision or a drafted token"
    # Before the comparison, and with --no-verify too: such a round ran on the local layers, so it was never
    # compared, and the demo passed with the sidecar raising in every step past the window, say.
    if faults := sidecar_faults(r.fallbacks):
        return (f"the sidecar failed {sum(faults.values())} steps, which ran on the local layers instead ("
                + ", ".join(f"{k!r} {n}" for k, n in sorted(faults.items(), key=lambda kv: -kv[1])) + ")")
    if not r.compared:
        if not verify:
            return None
        if r.forwarded:
            return f"{r.forwarded} rounds were forwarded but none was compared with the local layers"
        reason, n = max(r.fallbacks.items(), key=lambda kv: kv[1], default=("?", 0))
        return (f"no round was forwarded to the sidecar (all {r.rounds} ran on the local layers, most for "
                f"{reason!r} {n}), so nothing was compared: the demo checks forwarded rounds against the local "
                "layers, and a run with none checks nothing")
    if r.backend == "reference":
        if r.hidden_mismatch_rounds or r.kv_mismatch_rounds or r.token_mismatch_rounds:
            return (f"the reference backend differed from the local layers: hidden states in "
                    f"{r.hidden_mismatch_rounds}, block K/V in {r.kv_mismatch_rounds}, draft tokens in "
                    f"{r.token_mismatch_rounds} of {r.compared} rounds (they must be the same bits)")
        return None
    limit = REL_L2_LIMIT[dtype]
    kv_limit = FP8_KV_REL_L2_LIMIT if kv_dtype == "fp8" else limit
    if not (r.max_hidden_rel <= limit and r.max_kv_rel <= kv_limit):  # nan fails too
        return (f"the {r.backend or 'sidecar'} backend differed from the local layers by more than rounding: "
                f"relative L2 hidden {r.max_hidden_rel:.2e} (limit {limit:.2e}), K/V {r.max_kv_rel:.2e} "
                f"(limit {kv_limit:.2e}) for {dtype}" + (" with an fp8 cache" if kv_dtype == "fp8" else ""))
    return None


def unverified_line(r: DemoReport) -> str:
    """The last line of a --no-verify run that passed: exit 0, yet nothing was checked against the local layers."""
    return ("dspark-sidecar demo: --no-verify: nothing was compared with the local layers"
            + ("" if r.forwarded else " (and no round was forwarded)"))


def format_report(r: DemoReport) -> str:
    def ms(v: float) -> str:
        return "-" if v != v else f"{v:.2f} ms"

    lines = [
        f"rounds: {r.rounds} ({r.requests} requests joined, longest context {r.longest_context} tokens, "
        f"{r.wall_s:.1f} s)",
        f"forwarded to the sidecar: {r.forwarded}   local fallback: {r.rounds - r.forwarded}",
    ]
    for reason, n in sorted(r.fallbacks.items(), key=lambda kv: -kv[1]):
        lines.append(f"  fallback: {reason}: {n}")
    for reason, n in sorted(r.warmup_fallbacks.items()):
        lines.append(f"  before round 0 (engine warm-up): {reason}: {n}")
    lines += [
        f"step latency forwarded: p50 {ms(r.forwarded_p50_ms)}  p99 {ms(r.forwarded_p99_ms)}",
        f"step latency local:     p50 {ms(r.local_p50_ms)}  p99 {ms(r.local_p99_ms)}",
        f"sidecar vs local on {r.compared} forwarded rounds: largest hidden-state difference {r.max_hidden_diff:g} "
        f"({r.hidden_mismatch_rounds} rounds differ), draft tokens differing {r.tokens_differing} "
        f"({r.token_mismatch_rounds} rounds), block K/V largest difference {r.max_kv_diff:g}; "
        f"relative (L2): hidden {r.max_hidden_rel:.2e}, K/V {r.max_kv_rel:.2e}",
        f"engine ranks agree on every decision and token: {'yes' if r.ranks_agree else 'NO'}; KV binds: {r.binds}",
        f"sidecar backend: {r.backend or '?'}" + (f" (FlyDSL path off: {r.fast_path_refusal})" if r.fast_path_refusal else ""),
    ]
    return "\n".join(lines)
