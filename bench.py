"""`dspark-sidecar bench`: one draft step against the HBM floor and the stock layers, all measured in one run.

Modes, each at TP-rank-shard shapes (rank 0 of `shard_of`; partial sums are not exchanged, as
on one GPU there is no peer):
  a  reference layers in-process, eager          b  the same, CUDA-graphed (static-shape attention)
  c  the GPU backend in-process, CUDA-graphed     d  the sidecar from the engine over the data plane
     (c: launch groups side by side on --launch-streams streams, as the bench's sidecar runs them)
  e  the sidecar over the gRPC stream with inline tensors
  f  mode d, PIPELINE steps back to back with no host sync between them (ms per step): as an
     engine runs when the draft step's output stays on the GPU; the sidecar's host work then
     overlaps the previous step's GPU work, where (d) exposes it in full
  g  mode d queued behind --lead-ms of the engine's own GPU work (as a target forward is queued
     before the draft step): the engine's host runs ahead of its GPU, as a real engine's does, so
     neither host is on the GPU's path; GPU time from the end of that work to the hidden states
     on the engine's stream, against (c)'s GPU time
  h  mode d from the engine's shim (DrafterShim.maybe_forward over the same data plane): issue 8's
     "full sidecar path from the shim", with the shim's per-step checks, agreements and the copy of
     the hidden states out of the output region that d leaves out
  i  mode h queued behind --lead-ms of the engine's own GPU work, as g is d: whether the shim's host
     time stays off the GPU's path when the engine's host runs ahead
In d, f, g, h and i the engine's embeddings already sit in the registered input region
(StepBuffers.input_view: an engine writes its embedding lookup there), as c's graph reads the
engine's tensor in place; --engine-copy has fill() copy them there on every step instead.
The floor is the bytes a step must read (the shard's layer weights once per launch group of up to
8 requests, as spec section 5 counts them; each request's window of K/V) over a device-to-device
copy bandwidth measured in the same run.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from google.protobuf import text_format

from dspark_sidecar import layout
from dspark_sidecar.bench_defaults import P99_MIN_SAMPLES, REPEATS
from dspark_sidecar.bench_phases import AFTER, ShimPhases
from dspark_sidecar.client.launcher import sidecar_env
from dspark_sidecar.drafter import scenario
from dspark_sidecar.drafter.checkpoint import EMBED_KEY, SyntheticSource
from dspark_sidecar.drafter.config import DrafterConfig, load_config
from dspark_sidecar.drafter.kv_cache import KV_DTYPE_CHOICES, KV_LAYOUTS, kv_cache_dtype, kv_planes, kv_storage_shape
from dspark_sidecar.drafter.model import DSparkDrafter
from dspark_sidecar.drafter.parallel import ParallelContext
from dspark_sidecar.kernels import reference
from dspark_sidecar.kernels.ops import REFERENCE_OPS
from dspark_sidecar.kernels.timing import gpu_times
from dspark_sidecar.kernels.weights import prepare_layer_weights
from dspark_sidecar.percentiles import percentile
from dspark_sidecar.proto import codec, memory
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.proto import sidecar_pb2_grpc as pb_grpc
from dspark_sidecar.server.config import BACKENDS, MAX_LAUNCH_STREAMS

MODES = ("a", "b", "c", "d", "e", "f", "g", "h", "i")
NAMES = {"a": "reference eager", "b": "reference graphed", "c": "GPU backend graphed",
         "d": "sidecar data plane", "e": "sidecar gRPC inline", "f": "data plane pipelined",
         "g": "data plane, engine ahead", "h": "sidecar via the shim", "i": "via the shim, engine ahead"}
REMOTE_MODES = frozenset("defghi")  # the modes that need the sidecar (and, but for e, its data plane)
PIPELINE = 10  # mode f: steps per timed batch, the engine's host never waiting for the GPU between them
# The longest --contexts: a step's seq_lens (context + QPR) are int32 (kv_cache.StepMetadata). Above it the cache's
# element count overflowed int64 (a context of 10^20: a RuntimeError from shm_empty's view, not the one-line refusal).
CONTEXT_LIMIT = 2**31 - 1 - layout.QPR
GRAPHABLE_REFERENCE = dataclasses.replace(REFERENCE_OPS, name="reference-static",
                                          paged_window_attention=reference.paged_window_attention_static)


class BenchConfigError(ValueError):
    """A bench option out of its range, named by its flag."""


class BenchFailed(RuntimeError):
    """A run that could not finish (its sidecar did not start, an engine rank failed): one line naming the part
    that failed and the log or folder kept for it; the command exits 1."""


@dataclass(frozen=True)
class BenchConfig:
    preset: str = "minimax-m3.1"
    shard_of: int = 4
    reqs: tuple[int, ...] = (1, 8, 32)
    contexts: tuple[int, ...] = (512, 4096)
    modes: tuple[str, ...] = MODES
    dtype: str = "bf16"
    weights: str = "bf16"  # or mxfp8: layer weights kept quantized in every mode (and the sidecar)
    repeats: int = REPEATS  # from P99_MIN_SAMPLES up a row's p99 is one (with fewer it is the maximum)
    page_size: int = 16
    out_dir: Path = Path("bench-out")
    sidecar_backend: str = "auto"
    prelaunch: bool = True  # the sidecar may queue doorbell steps behind the GPU word (server/prelaunch.py)
    engine_copy: bool = False  # d, f-i: the engine's embeddings copied into the input region each step
    launch_streams: int = 0  # c and the sidecar: launch groups side by side on N streams (ServeConfig's; 0 = its default)
    lead_ms: float = 8.0  # g: the engine's GPU work queued before each step (server/prelaunch.py BEHIND_S: 5 ms)
    shim_inputs: str = "host"  # h/i: positions and metadata on the host, or on the GPU as vLLM's forward context has them
    kv_layout: str = "planes"  # the engine's cache allocation (kv_cache.KV_LAYOUTS): records is vLLM 0.34's
    kv_dtype: str = "auto"  # the cache's element type: auto (the compute dtype) or fp8 (e4m3 codes, kv_cache.FP8_KV)
    shim_phases: bool = False  # h: the shim's host time before the ring and after the answer, in phases (bench_phases.py)
    seed: int = 0
    notes: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise BenchConfigError(f"--modes: {bad or 'none given'}; choose from {''.join(MODES)} (e.g. 'acd' or 'a,c,d')")
        if self.weights not in ("bf16", "mxfp8"):
            raise BenchConfigError(f"--weights: bf16 or mxfp8, got {self.weights!r}")
        if self.kv_dtype not in KV_DTYPE_CHOICES:
            raise BenchConfigError(f"--kv-dtype: auto or fp8, got {self.kv_dtype!r}")
        if self.kv_layout not in KV_LAYOUTS:
            raise BenchConfigError(f"--kv-layout: one of {', '.join(KV_LAYOUTS)}, got {self.kv_layout!r}")
        if self.shim_inputs not in ("host", "device"):
            raise BenchConfigError(f"--shim-inputs: host or device, got {self.shim_inputs!r}")
        if not 0 < self.lead_ms <= 1000:
            raise BenchConfigError(f"--lead-ms: above 0 and at most 1000, got {self.lead_ms}")
        if not 0 <= self.launch_streams <= MAX_LAUNCH_STREAMS:
            raise BenchConfigError(f"--launch-streams: 0..{MAX_LAUNCH_STREAMS}, got {self.launch_streams}")
        if not self.reqs or not all(1 <= r <= layout.MAX_REQS_LIMIT for r in self.reqs):
            raise BenchConfigError(f"--reqs: request counts in 1..{layout.MAX_REQS_LIMIT}, got {list(self.reqs)}")
        if not self.contexts or not all(1 <= c <= CONTEXT_LIMIT for c in self.contexts):
            raise BenchConfigError(f"--contexts: context lengths in 1..{CONTEXT_LIMIT}, got {list(self.contexts)}")
        for flag, values in (("--modes", self.modes), ("--reqs", self.reqs), ("--contexts", self.contexts)):
            twice = sorted({v for v in values if values.count(v) > 1})
            if twice:  # a case run twice: two rows for it in the table and the JSON, the plot's line through both
                raise BenchConfigError(f"{flag}: {', '.join(map(str, twice))} given more than once")
        if self.shard_of < 1:
            raise BenchConfigError(f"--shard-of: a TP size of at least 1, got {self.shard_of}")
        if self.repeats < 1:
            raise BenchConfigError(f"--repeats: at least 1, got {self.repeats}")
        if self.sidecar_backend not in BACKENDS:
            raise BenchConfigError(f"--sidecar-backend: one of {BACKENDS}, got {self.sidecar_backend!r}")
        if self.shim_phases and "h" not in self.modes:  # it splits h's time: without h it was ignored
            raise BenchConfigError(f"--shim-phases: splits mode h's time, and --modes {''.join(self.modes)} has no h")


class Case:
    """One (R, context) step on the shared KV cache: inputs on the device, metadata on both sides."""

    def __init__(self, cfg: DrafterConfig, R: int, ctx: int, page: int, pages: int, embed: torch.Tensor,
                 device: torch.device, seed: int) -> None:
        self.R, self.ctx = R, ctx
        self.host = scenario.random_step(cfg, [ctx] * R, page, pages, embed, seed=seed)
        self.embeds = self.host.inputs_embeds.to(device)
        self.positions = self.host.positions.to(device)
        self.meta = self.host.meta.to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _settle_steps() -> int:
    """Untimed (d) steps before its timed ones, enough for the sidecar's pre-launch to settle after the
    mode before: a layout's streak, and after (g)'s steps far behind their ring (a cooldown), the
    on-time steps that end it (server/prelaunch.py). A steady state is what an engine sees."""
    from dspark_sidecar.server import prelaunch  # imports Triton's kernels: GPU runs only

    return prelaunch.STREAK + prelaunch.ON_TIME + 2


def _pipelined_batches(repeats: int) -> int:
    """Mode f's timed batches of PIPELINE steps for --repeats (at least 3 batch means to take the median of)."""
    return max(3, repeats // PIPELINE)


def timeit(fn, device: torch.device, repeats: int, warmup: int = 3) -> list[float]:
    """Wall-clock ms per call, the device synchronized around each call, warm-up calls included: an
    engine that syncs after every step (mode d) must do so while warming up too, or its host runs
    ahead of its GPU and the sidecar sees a different engine (run 139: at R=32 its pre-launch
    cooldown then outlasted the warm-up)."""
    for _ in range(warmup):
        fn()
        _sync(device)
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        _sync(device)
        out.append((time.perf_counter() - t) * 1e3)
    return out


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written. On a GPU in GPU time
    (gpu_times, as the microbench's): the floor is GPU time, and a wall-clock copy with a sync around
    it carries the host's launch and sync (about 6% of a 1 GiB copy on an H200), which lowered the
    bandwidth and raised the floor until the thirty-first session. On CPU, wall-clock."""
    if device.type != "cuda":
        nbytes = 64 << 20
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy = lambda: dst.copy_(src)  # noqa: E731
    if device.type == "cuda":
        copy()  # warm-up, untimed
        ms = statistics.median(gpu_times(copy, device, 10))
    else:
        ms = statistics.median(timeit(copy, device, 10))
    return 2 * nbytes / (ms / 1e3)


@functools.cache
def _spin_cycles_per_ms(device: torch.device) -> float:
    """torch.cuda._sleep's cycles per ms of GPU time on this device (it spins on the SM clock)."""
    timed = gpu_times(lambda: torch.cuda._sleep(2_000_000), device, 5)
    return 2_000_000 / statistics.median(timed)


def floor_bytes(model: DSparkDrafter, cfg: DrafterConfig, R: int, ctx: int, kv_itemsize: int | None = None) -> int:
    """The shard's layer weights and final norm read once per launch group, plus each request's K/V window per layer.

    The step runs in launches of at most layout.LAUNCH_REQS requests (architecture.md), each
    streaming every weight: spec section 5's "weights read once per launch group" (R = 32: 4x).
    Weights kept as MXFP8 count their bytes as stored: 1 per weight plus 1 per 32 for the scales;
    K/V count kv_itemsize bytes a value (default: the compute dtype's; 1 for an fp8 cache).
    """
    w = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n.startswith(("layers.", "final_norm")))
    for layer in model.layers:
        for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
            if not isinstance(lin.weight, torch.Tensor):  # MxFp8Weight, NormFolded: not registered parameters
                w += lin.weight.nbytes
    keys = min(ctx + layout.QPR, cfg.sliding_window + layout.QPR - 1)
    kv_local = cfg.num_key_value_heads // model.par.world_size
    kv = R * keys * 2 * kv_local * cfg.head_dim * (kv_itemsize or model.dtype.itemsize)
    return w * len(layout.launch_groups(R)) + kv * cfg.num_hidden_layers


def graphed(fn, device: torch.device):
    """Capture fn once into a CUDA graph; returns the replay callable."""
    s = torch.cuda.Stream(device)
    s.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


class SidecarUnderTest:
    """A one-process sidecar computing the same shard (--tp 1 --shard-of N --random-weights)."""

    def __init__(self, bc: BenchConfig, device: torch.device, work: Path, tp: int = 1) -> None:
        self.work, self.sock = work, work / "sock"
        # A shard of TP 1 is the whole drafter, plain --tp 1: serve refuses --shard-of 1 (exit 2), which failed
        # every sidecar mode of a `bench --shard-of 1`.
        shard = ["--shard-of", str(bc.shard_of)] if tp == 1 and bc.shard_of > 1 else []
        argv = [sys.executable, "-m", "dspark_sidecar", "serve", "--tp", str(tp), *shard,
                "--random-weights", "--preset", bc.preset, "--dtype", bc.dtype, "--weights", bc.weights,
                "--socket-dir", str(self.sock),
                "--device", device.type, "--backend", bc.sidecar_backend, "--max-reqs", str(max(bc.reqs)),
                "--seed", str(bc.seed), "--drain-s", "0", *([] if bc.prelaunch else ["--no-prelaunch"]),
                "--launch-streams", str(bc.launch_streams),
                "--exit-with-pid", str(os.getpid())]  # a bench killed with SIGKILL leaves no sidecar behind
        env = sidecar_env()  # its flags are argv's alone
        self.log = open(work / "sidecar.log", "wb")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        from dspark_sidecar.server.healthcheck import check

        deadline = time.monotonic() + 600
        try:
            while check(self.target, 1.0) != "SERVING":
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()  # still starting after the deadline: not left behind
                    raise BenchFailed(f"the bench's sidecar did not start; see {work / 'sidecar.log'}")
                time.sleep(0.5)
        except BaseException as err:
            if not isinstance(err, BenchFailed):
                # Stopped while it starts (SIGTERM: cli's _sigterm_unwinds; Ctrl-C): Bench has no handle on this
                # sidecar yet to close, which served until --exit-with-pid noticed, its folder left in the temp dir.
                self.close()
                self.discard()
            raise

    @property
    def target(self) -> str:
        return f"unix:{self.sock}/rank0.sock"

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()

    def discard(self) -> None:
        """Remove the work folder (the sidecar's log and socket folder) once the sidecar stopped cleanly;
        a failed one's stays for its log, which the bench's error names. Each run left one in the temp dir."""
        if self.proc.returncode == 0:
            shutil.rmtree(self.work)


class Bench:
    """The state one bench run shares across cases: weights, the KV cache, the sidecar connection."""

    def __init__(self, bc: BenchConfig, device: torch.device) -> None:
        self.bc, self.device = bc, device
        self.cfg = cfg = load_config(bc.preset)
        self.dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[bc.dtype]
        source = SyntheticSource(cfg, self.dtype, device, bc.seed)
        self.model = DSparkDrafter(cfg, ParallelContext(0, bc.shard_of), REFERENCE_OPS, self.dtype, device).load(source)
        # As the sidecar holds them (server/app.py): its GPU backend is the Triton one.
        prepare_layer_weights(self.model, bc.weights, cfg.quant_block, fold=device.type == "cuda")
        self.embed = source.read(EMBED_KEY, (cfg.vocab_size, cfg.hidden_size))
        self.pages = max(bc.reqs) * scenario.pages_needed(max(bc.contexts) + layout.QPR, bc.page_size)
        shape = kv_storage_shape(cfg, bc.shard_of, self.pages, bc.page_size, bc.kv_layout)
        gen = torch.Generator(device).manual_seed(bc.seed)
        self._shm = []
        kv_dtype = kv_cache_dtype(bc.kv_dtype, self.dtype)
        try:
            if device.type == "cuda":
                raw = [torch.randn(shape, generator=gen, device=device).to(kv_dtype)
                       for _ in range(cfg.num_hidden_layers)]
            else:  # the sidecar maps the engine's cache: on CPU it must live in shared memory
                for _ in range(cfg.num_hidden_layers):
                    self._shm.append(memory.shm_empty(shape, kv_dtype))
                raw = [t.tensor for t in self._shm]
                for t in raw:
                    t.copy_(torch.randn(shape, generator=gen))
        except BaseException as err:
            # The layers made so far go now: they stayed in /dev/shm (GBs at a large --contexts) until exit.
            for t in self._shm:
                t.close()
            if not isinstance(err, (OSError, torch.OutOfMemoryError)):
                raise
            # A cache that does not fit (/dev/shm's ENOSPC, the GPU's OOM) is the flags' size: one line, not a traceback.
            nbytes = math.prod(shape) * kv_dtype.itemsize
            raise BenchConfigError(
                f"--reqs/--contexts: the KV cache for {max(bc.reqs)} requests of {max(bc.contexts)} tokens "
                f"({cfg.num_hidden_layers} x {nbytes / 2**30:.2f} GiB) could not be allocated: {err}") from None
        self.kv_raw = raw  # as the engine holds it (the shim's view of the cache)
        self.kv = [kv_planes(t) for t in raw]  # [2, pages, page_size, heads, head_dim] views, any layout
        self.gpu_ops = None
        self.streams: list = []  # c: the launch groups side by side, as the bench's sidecar runs them
        if device.type == "cuda":
            from dspark_sidecar.kernels.triton.ops import TRITON_OPS
            from dspark_sidecar.server.config import ServeConfig
            from dspark_sidecar.server.graphs import launch_streams

            self.gpu_ops = TRITON_OPS
            self.streams = launch_streams(ServeConfig(tp=1, launch_streams=bc.launch_streams).step_streams, device)
        self.step_id = 0
        self._inputs: torch.Tensor | None = None  # d/f: the embeddings fill() is given (measure sets it)
        # Per remote step: queue, rendezvous, launch, total (ns), and whether it was pre-launched.
        # ... then, of those phases: validate, the engine's GPU word seen, the queued copy started, output.
        self.sidecar_ns: list[tuple[int, int, int, int, bool, int, int, int, int]] = []
        # Per data-plane step: fill + ring, ring -> answer; then that ring -> answer in four parts (_ring_path).
        self.engine_ns: list[tuple[int, ...]] = []
        self.gpu_ms: list[float] = []  # b/c: GPU time per replay (gpu_times), beside the wall-clock figure
        self.mode_misses: int | None = None  # d/f/g: queued steps the sidecar released unused during the mode
        self.side = self.channel = self.bufs = self.bell = self.shim = None
        self.shim_ns: list[tuple[int, int]] = []  # h, i: the shim's own time before the ring, after the answer
        self.phases = None  # --shim-phases: bench_phases.ShimPhases on the shim, made for each mode h (measure)
        self.no_sidecar: str | None = None  # why d-i cannot run: the sidecar or its data plane was not set up
        if REMOTE_MODES & set(bc.modes):
            try:
                self._connect()
            except Exception as exc:  # noqa: BLE001  (d-i are reported as failed; a, b and c still run)
                self._close_remote()  # the sidecar process it may have started
                self.no_sidecar = f"{_error_note(exc)} (setting up the sidecar)"
            except BaseException:
                self.close()  # the sidecar process it may have started, and the shared memory
                raise

    def _connect(self) -> None:
        import grpc

        from dspark_sidecar.client.agreement import LocalAgreement
        from dspark_sidecar.client.binding import bind_request
        from dspark_sidecar.client.config import EngineConfig
        from dspark_sidecar.client.shim import DrafterShim

        bc, device = self.bc, self.device
        self.side = SidecarUnderTest(bc, device, Path(tempfile.mkdtemp(prefix="dspark-bench-")))
        self.channel = grpc.insecure_channel(self.side.target, options=[("grpc.max_receive_message_length", 1 << 30),
                                                                        ("grpc.max_send_message_length", 1 << 30)])
        self.stub = pb_grpc.DrafterSidecarStub(self.channel)
        if not {"d", "f", "g", "h", "i"} & set(bc.modes):
            facts = pb.EngineFacts(engine_rank=0, tp_size=bc.shard_of, dp_size=1, pp_size=1,
                                   speculative_method="dspark", num_speculative_tokens=7, device=str(device))
            self.binding = self.stub.BindKV(bind_request(self.kv, facts), timeout=60)
            return
        # The engine's shim (rank 0 of shard_of, its agreements local) binds the cache and sets up the
        # data plane; d, f and g drive that same data plane's channel directly, h goes through the shim.
        self.shim = DrafterShim(
            EngineConfig(tp_size=bc.shard_of, required_tp=bc.shard_of, endpoint=self.side.target,
                         transport="doorbell", device=str(device), max_reqs=max(bc.reqs), step_deadline_s=60.0),
            None, lambda: self.kv_raw, LocalAgreement())
        why = self.shim.connect()
        if why is not None or self.shim.doorbell is None:
            raise RuntimeError(f"bench: the shim could not set up the data plane: {why or 'no doorbell (see the log)'}")
        self.binding = self.shim.binder.current
        self.bufs, self.bell = self.shim.doorbell.buffers, self.shim.doorbell.bell

    def _eager(self, ops, case: Case, streams: list = ()):
        self.model.set_ops(ops)
        return lambda: self.model.draft_step(case.embeds, case.positions, case.meta, self.kv, streams=streams)

    def _pipelined(self, case: Case) -> list[float]:
        """ms per step of PIPELINE data-plane steps sent back to back, synchronized once per batch."""
        def batch() -> None:
            for _ in range(PIPELINE):
                self._remote("d", case)
        return [ms / PIPELINE for ms in timeit(batch, self.device, _pipelined_batches(self.bc.repeats))]

    def _ahead(self, case: Case, shim: bool = False, warmup: int = 3) -> list[float]:
        """ms of GPU time per mode-d step (mode h with `shim`) queued behind lead_ms of the engine's own
        GPU work (the spin: its host is ahead by about lead_ms): from the end of that work to the hidden
        states on the engine's stream (the step's fill, ring and answer; the stream waits for the
        sidecar's writes; with the shim, its copy of them too)."""
        cycles = int(self.bc.lead_ms * _spin_cycles_per_ms(self.device))
        step = (lambda: self._shimmed(case)) if shim else (lambda: self._remote("d", case))  # noqa: E731
        gpu_times(step, self.device, warmup, cycles)
        return gpu_times(step, self.device, self.bc.repeats, cycles)

    def _remote(self, mode: str, case: Case) -> torch.Tensor:
        self.step_id += 1
        req = pb.DraftStepRequest(step_id=self.step_id, binding_id=self.binding.binding_id,
                                  binding_generation=self.binding.generation, num_requests=case.R)
        if mode == "d":
            t0 = time.perf_counter_ns()
            out = self.bufs.fill(req, self._inputs, case.host.positions, case.host.meta)
            self.bell.send(req)
            t1 = time.perf_counter_ns()
            resp = self.bell.wait(self.step_id, 60.0)
            done = time.monotonic_ns()
            self.engine_ns.append((t1 - t0, time.perf_counter_ns() - t1, *self._ring_path(resp, done)))
        else:
            m = case.host.meta
            for f, t in (("positions", case.host.positions), ("inputs_embeds", case.embeds), ("seq_lens", m.seq_lens),
                         ("block_tables", m.block_tables), ("slot_mapping", m.slot_mapping)):
                getattr(req, f).CopyFrom(codec.to_tensor_ref(t))
            resp = self.stub.DraftStep(req, timeout=60)
        if resp is None or resp.HasField("error"):  # on one line: a row's note keeps only the first (_error_note)
            why = text_format.MessageToString(resp.error, as_one_line=True) if resp is not None else "timeout"
            raise RuntimeError(f"sidecar step failed: {why}")
        if mode != "d":  # decoded once the answer is known not to be an error (which carries no hidden states)
            out = codec.from_tensor_ref(resp.hidden_states, "hidden").to(self.device)
        tm = resp.timings  # the sidecar's own host time, arrival to launch, in phases
        self.sidecar_ns.append((tm.queue_ns, tm.rendezvous_ns, tm.compute_ns, tm.total_ns, tm.prelaunched,
                                tm.validate_ns, tm.gpu_word_wait_ns, tm.gpu_start_wait_ns, tm.output_ns))
        return out

    def _forward_context(self, case: Case):
        """The forward context an engine sets around its draft model's forward, holding the step's
        attention metadata (host tensors, as d fills them; with --shim-inputs device the GPU's, as vLLM
        holds them, which the shim then reads back). h and i enter it once around their steps: the
        engine sets it whether the shim forwards or not, so its cost is not the sidecar path's (and
        vLLM's own set_forward_context is not this harness's)."""
        from dspark_sidecar.client.forward_context import set_forward_context

        return set_forward_context(case.host.meta if self.bc.shim_inputs == "host" else case.meta)

    def _shimmed(self, case: Case) -> torch.Tensor:
        """One step as the engine's model forward asks for it: the shim's maybe_forward, called inside
        `_forward_context(case)`."""
        host = self.bc.shim_inputs == "host"
        began = self.phases.start() if self.phases is not None else None
        doorbell_steps = self.shim.stats.via_doorbell  # this step counts here only if it went by the doorbell
        t0 = time.monotonic_ns()
        out = self.shim.maybe_forward(None, case.host.positions if host else case.positions, self._inputs)
        t1 = time.monotonic_ns()
        if out is None:
            raise RuntimeError(f"the shim fell back: {dict(self.shim.stats.fallbacks)}")
        if self.shim.doorbell is None or self.shim.doorbell.bell is not self.bell:
            # It dropped the link (a failed step) and answered over another doorbell or the gRPC stream:
            # not the data plane this mode is named for, and self.bell's time stamps are not this step's.
            raise RuntimeError("the shim's step left the bench's data plane (it set its link up again after a failure)")
        if self.shim.stats.via_doorbell == doorbell_steps:
            # Its doorbell kept, it sent a step that does not fit the registered buffers (more pages than
            # they hold) over the gRPC stream inline: timed as h, that is (e)'s path, under self.bell's old stamps.
            raise RuntimeError("the shim sent the step over the gRPC stream, not the bench's data plane "
                               "(the step does not fit its registered buffers)")
        self.shim_ns.append((self.bell.rung_mono_ns - t0, t1 - self.bell.answer_seen_mono_ns))
        if self.phases is not None:
            self.phases.step(t0, self.bell.rung_mono_ns, began, self.bell.answer_seen_mono_ns, t1)
        return out

    def _ring_path(self, resp: pb.DraftStepResponse | None, done: int) -> tuple[int, int, int, int]:
        """A doorbell step's ring -> answer, ns, from one clock read in both processes (time.monotonic_ns):
        until the sidecar saw the ring, the sidecar's handling until it published, from then until the
        engine saw the answer, and the engine's own work after that (parse, its stream's wait)."""
        tm, b = (resp.timings if resp is not None else pb.StepTimings()), self.bell
        if not (tm.seen_mono_ns and tm.published_mono_ns and b.answer_seen_mono_ns):
            return 0, 0, 0, 0
        return (tm.seen_mono_ns - b.rung_mono_ns, tm.published_mono_ns - tm.seen_mono_ns,
                b.answer_seen_mono_ns - tm.published_mono_ns, done - b.answer_seen_mono_ns)

    def measure(self, mode: str, case: Case) -> list[float] | str:
        """ms per step of one mode, or why it did not run."""
        if mode == "a":
            return timeit(self._eager(REFERENCE_OPS, case), self.device, self.bc.repeats)
        self.gpu_ms, self.mode_misses, self.phases = [], None, None
        if mode in ("b", "c", "g", "i") and self.device.type != "cuda":
            return "n/a: needs a GPU"
        if mode in REMOTE_MODES and self.no_sidecar is None and self.side is not None and self.side.proc.poll() is not None:
            # Gone for good (killed, crashed): every later remote row says so, not gRPC's "failed to connect".
            self.no_sidecar = (f"error: the sidecar exited (status {self.side.proc.returncode}) during the bench; "
                               f"see {self.side.work / 'sidecar.log'}")
        if mode in REMOTE_MODES and self.no_sidecar is not None:
            return self.no_sidecar
        if mode in ("b", "c"):
            fn = graphed(self._eager(GRAPHABLE_REFERENCE, case) if mode == "b" else
                         self._eager(self.gpu_ops, case, self.streams), self.device)
            wall = timeit(fn, self.device, self.bc.repeats)
            self.gpu_ms = gpu_times(fn, self.device, self.bc.repeats)
            return wall
        self.sidecar_ns, self.engine_ns, self.shim_ns = [], [], []
        if mode in ("d", "f", "g", "h", "i"):
            self._inputs = case.embeds
            if not self.bc.engine_copy:  # written where the engine's embedding lookup would have put them
                self._inputs = self.bufs.input_view(case.embeds.shape[0])
                self._inputs.copy_(case.embeds)
        if mode == "e":
            return timeit(lambda: self._remote(mode, case), self.device, self.bc.repeats)
        before = self._misses()
        if mode == "f":
            out = self._pipelined(case)
        elif mode == "g":
            out = self._ahead(case)
        elif mode == "i":
            with self._forward_context(case):
                out = self._ahead(case, shim=True)
        elif mode == "h":
            if self.bc.shim_phases:
                # Wrapped for h's steps alone: made once at connect, the wrappers stayed on the data plane's
                # stage and send_bytes, which d, f and g call too, and timed those modes with them.
                self.phases = ShimPhases(self.shim, self.shim.doorbell)
            try:
                with self._forward_context(case):
                    out = timeit(lambda: self._shimmed(case), self.device, self.bc.repeats,
                                 warmup=_settle_steps() if self.device.type == "cuda" else 3)
            finally:
                if self.phases is not None:
                    self.phases.close()
        else:
            out = timeit(lambda: self._remote(mode, case), self.device, self.bc.repeats,
                         warmup=_settle_steps() if self.device.type == "cuda" else 3)
        self.mode_misses = self._misses() - before
        return out

    def phase_fields(self, mode: str) -> dict:
        """Row fields of the last measure(mode): medians (us) of the timed steps' phases (warm-up excluded)."""
        if mode in ("b", "c"):
            return {"gpu_p50_ms": statistics.median(self.gpu_ms)} if self.gpu_ms else {}
        # f's timed steps are whole batches, not --repeats of them (45: 40): its warm-up kept out of the share.
        timed = PIPELINE * _pipelined_batches(self.bc.repeats) if mode == "f" else self.bc.repeats
        last = self.sidecar_ns[-timed:]
        # Misses over the whole mode, warm-up included: queued steps released unused (server/prelaunch.py).
        share = {"prelaunched_share": sum(t[4] for t in last) / max(1, len(last))}
        if self.mode_misses is not None:
            share["prelaunch_misses"] = self.mode_misses
        if mode == "f":
            return share
        if mode in ("h", "i"):  # the shim's own host time around the data plane's ring -> answer
            shim = self.shim_ns[-self.bc.repeats:]
            phases = self.phases.medians_us(self.bc.repeats) if self.phases is not None and mode == "h" else {}
            return {"shim_before_ring_after_answer_p50_us": [statistics.median(t[i] for t in shim) / 1e3
                                                              for i in range(2)], "shim_inputs": self.bc.shim_inputs,
                    **({"shim_phases_p50_us": phases} if phases else {}),
                    **({"prelaunch_misses": self.mode_misses} if self.mode_misses is not None else {})}
        if mode not in ("d", "e", "g"):
            return {}

        def p50_us(samples: list[tuple], i: int) -> float:
            return statistics.median(t[i] for t in samples[-self.bc.repeats:]) / 1e3

        out = {"sidecar_host_p50_us": p50_us(self.sidecar_ns, 3),
               "sidecar_queue_rendezvous_launch_p50_us": [p50_us(self.sidecar_ns, i) for i in range(3)],
               "sidecar_validate_word_start_output_p50_us": [p50_us(self.sidecar_ns, i) for i in range(5, 9)]}
        if mode in ("d", "g"):
            out |= {"engine_fill_p50_us": p50_us(self.engine_ns, 0), "ring_to_answer_p50_us": p50_us(self.engine_ns, 1),
                    "ring_seen_sidecar_published_engine_p50_us": [p50_us(self.engine_ns, i) for i in range(2, 6)],
                    **share}
        return out

    def _misses(self) -> int:
        """The sidecar's prelaunch_misses counter (GetStatus): queued steps it released unused."""
        return self.stub.GetStatus(pb.GetStatusRequest(), timeout=10).counters.prelaunch_misses

    def _close_remote(self) -> None:
        """The shim, the channel and the sidecar process, each once (what _connect got to set up)."""
        shim, channel, side, self.shim, self.channel, self.side = self.shim, self.channel, self.side, None, None, None
        if shim is not None:
            shim.close()  # its binding, then the data plane
        if channel is not None:
            channel.close()
        if side is not None:
            side.close()
            side.discard()

    def close(self) -> None:
        self._close_remote()
        self.kv = self.kv_raw = []
        for t in self._shm:
            t.close()


def run_bench(bc: BenchConfig, device: torch.device) -> dict:
    bench = Bench(bc, device)
    rows: list[dict] = []
    try:
        bw = copy_bandwidth(device)  # inside: a failure or a SIGTERM here still stops the sidecar Bench() started
        for ctx in bc.contexts:
            for R in bc.reqs:
                case = Case(bench.cfg, R, ctx, bc.page_size, bench.pages, bench.embed, device, seed=R * 7 + ctx)
                floor_ms = floor_bytes(bench.model, bench.cfg, R, ctx, bench.kv[0].element_size()) / bw * 1e3
                results: dict[str, list[float] | str] = {}
                phases: dict[str, dict] = {}
                for mode in bc.modes:
                    try:
                        results[mode] = bench.measure(mode, case)
                        if not isinstance(results[mode], str):  # a mode that did not run has no phases to read
                            phases[mode] = bench.phase_fields(mode)
                    except Exception as exc:  # noqa: BLE001  (a broken mode is reported, the run goes on)
                        results[mode] = _error_note(exc)
                base = results.get("b") if isinstance(results.get("b"), list) else None
                gpu = results.get("c") if isinstance(results.get("c"), list) else None
                gpu_time = phases.get("c", {}).get("gpu_p50_ms")  # g is GPU time: against c's GPU time
                b_gpu_time = phases.get("b", {}).get("gpu_p50_ms")  # ... and b's
                for mode, ms in results.items():
                    row = {"mode": mode, "name": NAMES[mode], "R": R, "context": ctx, "floor_ms": floor_ms}
                    if isinstance(ms, str):
                        row["note"] = ms
                    else:
                        row |= _latency_fields(ms, per_step=mode != "f")
                        p50 = row["p50_ms"]
                        b_ms = b_gpu_time if mode in ("g", "i") else statistics.median(base) if base else None
                        row |= {"x_floor": p50 / floor_ms, "x_b": p50 / b_ms if b_ms else None}
                        c_ms = gpu_time if mode in ("g", "i") else statistics.median(gpu) if gpu else None
                        if mode in ("d", "e", "f", "g", "h", "i") and c_ms:  # issue 8's sidecar targets are against (c)
                            row |= {"x_c": p50 / c_ms, "over_c_us": (p50 - c_ms) * 1e3}
                        if mode in ("g", "i"):
                            row["lead_ms"] = bc.lead_ms
                        row |= phases.get(mode, {})
                        if "gpu_p50_ms" in row:
                            row["gpu_x_floor"] = row["gpu_p50_ms"] / floor_ms
                    rows.append(row)
                    print(_fmt(row), flush=True)
    finally:
        bench.close()
    report = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(bc).items()},
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "copy_bandwidth_GBps": bw / 1e9, "rows": rows}
    bc.out_dir.mkdir(parents=True, exist_ok=True)
    (bc.out_dir / "bench.json").write_text(json_text(report))
    _plot(report, bc.out_dir / "bench.png")
    return report


def failed_rows(rows: list[dict]) -> list[str]:
    """The rows of modes that failed (a note that is an error, as _error_note and the sidecar's notes write it), each
    as "mode (R=r, context c)"; a mode that cannot run here ("n/a: ...") did not fail."""
    return [f"{r['mode']} (R={r['R']}, context {r['context']})" for r in rows if r.get("note", "").startswith("error")]


def _finite(obj):
    """obj with every NaN or infinite float as None, in dicts and lists at any depth."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def json_text(report: dict) -> str:
    """A report as strict JSON: a figure that is not one (NaN: a case no step of which was answered) is null.
    json.dumps wrote a bare NaN, which strict readers (JavaScript, Go, serde) refuse for the whole file."""
    return json.dumps(_finite(report), indent=1, allow_nan=False)


def _error_note(exc: Exception) -> str:
    """A failed mode's row note: the exception's type and the first line that says something. A
    grpc.RpcError's str() opens with "<_InactiveRpcError of RPC that terminated with:", so its status
    and details are taken instead; an exception with no message (a bare assert) is its type alone."""
    code, details = getattr(exc, "code", None), getattr(exc, "details", None)
    text = f"{code()}: {details()}" if callable(code) and callable(details) else str(exc)
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return f"error: {type(exc).__name__}" + (f": {first[:160]}" if first else "")


def _latency_fields(ms: list[float], per_step: bool = True) -> dict:
    """The median, and the nearest-rank p99 where there are at least P99_MIN_SAMPLES samples; with
    fewer (30 repeats; mode f's 3 batch means) that p99 is the maximum, so the row gives max_ms
    and the sample count instead of calling it a p99. Samples that are not per step (mode f's means of
    PIPELINE steps, which average a step's tail away) give max_ms at any count, as README says."""
    n = len(ms)
    out = {"samples": n, "p50_ms": statistics.median(ms)}
    if per_step and n >= P99_MIN_SAMPLES:
        out["p99_ms"] = percentile(ms, 99)
    else:
        out["max_ms"] = max(ms)
    return out


def _fmt(row: dict) -> str:
    head = f"{row['name']:<22} R={row['R']:>2} ctx={row['context']:>5}"
    if "note" in row:
        return f"{head}  {row['note']}"
    xb = f"{row['x_b']:.2f}x b" if row.get("x_b") else "   -   "
    # Signed: a mode can beat (c) (g's GPU time, f's per-step mean), where "+{:.0f}" printed "(+-7 us)".
    extra = f"  {row['x_c']:.2f}x c ({row['over_c_us']:+.0f} us)" if "x_c" in row else ""
    if "sidecar_host_p50_us" in row:
        q, r, c = row["sidecar_queue_rendezvous_launch_p50_us"]
        extra += f"  sidecar host {row['sidecar_host_p50_us']:.0f} us [{q:.0f}/{r:.0f}/{c:.0f}]"
        if "sidecar_validate_word_start_output_p50_us" in row:  # of those: validate, GPU word, copy started, output
            v, w, st, o = row["sidecar_validate_word_start_output_p50_us"]
            extra += f" [validate {v:.0f}, word {w:.0f}, started {st:.0f}, output {o:.0f}]"
    if "engine_fill_p50_us" in row:
        extra += f" (engine fill {row['engine_fill_p50_us']:.0f}, ring->answer {row['ring_to_answer_p50_us']:.0f} us"
        if "ring_seen_sidecar_published_engine_p50_us" in row:  # its parts: seen, sidecar, answer seen, engine
            a, b, c, d = row["ring_seen_sidecar_published_engine_p50_us"]
            extra += f" = seen {a:.0f} + sidecar {b:.0f} + back {c:.0f} + engine {d:.0f}"
        extra += ")"
    if "shim_before_ring_after_answer_p50_us" in row:
        before, after = row["shim_before_ring_after_answer_p50_us"]
        on = "; positions and metadata on the GPU" if row.get("shim_inputs") == "device" else ""
        extra += f"  (shim before ring {before:.0f} us, after answer {after:.0f} us{on})"
    if "shim_phases_p50_us" in row:  # --shim-phases: before the ring and after the answer, phase by phase (bench_phases.py)
        ph = dict(row["shim_phases_p50_us"])
        cpu, pre = ph.pop("on_cpu_share", None), ph.pop("preempted", None)
        after = {k: ph.pop(k) for k in AFTER if k in ph}
        extra += "\n    shim phases p50 us: " + ", ".join(f"{k} {v:.1f}" for k, v in ph.items())
        if cpu is not None:  # the thread's CPU time over wall time before the send; involuntary switches per step
            extra += f"; on CPU {cpu:.2f} of it, {pre:.2f} preemptions per step"
        if after:
            extra += "\n    after the answer p50 us: " + ", ".join(f"{k} {v:.1f}" for k, v in after.items())
    if "gpu_p50_ms" in row:
        extra += f"  GPU time {row['gpu_p50_ms']:.3f} ms ({row['gpu_x_floor']:.2f}x floor)"
    if "lead_ms" in row:
        extra += f"  GPU time behind {row['lead_ms']:g} ms of engine work"
    if "prelaunched_share" in row:
        extra += f"  pre-launched {100 * row['prelaunched_share']:.0f}%"
        if row.get("prelaunch_misses"):
            extra += f" ({row['prelaunch_misses']} released unused)"
    tail = (f"p99 {row['p99_ms']:8.3f} ms ({row['samples']} samples)" if "p99_ms" in row
            else f"max {row['max_ms']:8.3f} ms (max of {row['samples']})")
    return (f"{head}  p50 {row['p50_ms']:8.3f} ms  {tail}  floor {row['floor_ms']:.3f} ms  "
            f"{row['x_floor']:6.2f}x floor  {xb}{extra}")


def _plot(report: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(no matplotlib: {path.name} not written)")
        return
    contexts = sorted({r["context"] for r in report["rows"]})
    fig, axes = plt.subplots(1, len(contexts), figsize=(6 * len(contexts), 4), squeeze=False)
    for ax, ctx in zip(axes[0], contexts):
        for mode in MODES:
            # In order of R: rows come in --reqs order (e.g. 8,1,2), which a line would double back over.
            pts = sorted((r["R"], r["p50_ms"]) for r in report["rows"]
                         if r["mode"] == mode and r["context"] == ctx and "p50_ms" in r)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"{mode}: {NAMES[mode]}")
        floor = sorted({(r["R"], r["floor_ms"]) for r in report["rows"] if r["context"] == ctx})
        ax.plot(*zip(*floor), "k--", label="HBM floor")
        ax.set(title=f"context {ctx} ({report['device']})", xlabel="requests R", ylabel="ms (p50)", yscale="log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
