"""The FlyDSL fast path of a rank: MXFP8 weight shards and peer buffers bound at start-up, a DrafterRunner per KV binding.

Selected by server/backend.py only when every host check passes (the seed's, then the kernel
shapes); the portable model stays loaded and serves every step `ready()` refuses. The decision
for a binding is a pure function of facts every rank shares (host, engine facts, the cache
layout the engine binds on every rank alike, the collectively mapped peers), so the 4 ranks take
the same path on the same step: one rank in the exchange kernel while a peer runs the portable
all-reduce would never finish. A runner that one rank alone fails to build (out of device memory)
turns only that rank's verdict off; the step's rendezvous runs the fast path only where every rank
offers it (Verdict.fast), so the ranks still take one path.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Sequence

import torch

from dspark_sidecar.drafter.checkpoint import (
    SCALE_SUFFIX, CheckpointReader, layer_prefix, quantize_mxfp8,
)
from dspark_sidecar.drafter.config import DrafterConfig
from dspark_sidecar.drafter.kv_cache import StepMetadata
from dspark_sidecar.drafter.model import DSparkDrafter
from dspark_sidecar.drafter.parallel import ParallelContext, WeightSource
from dspark_sidecar.kernels.flydsl import shapes
from dspark_sidecar.kernels.flydsl.runner import (
    NUM_LAYERS, DrafterRunner, FlyDSLUnsupported, LayerWeights, MXLinear, PeerBuffers, check_kv_layer,
)
from dspark_sidecar.server.kv_binding import KVBinding
from dspark_sidecar.server.refusal import HostFacts, fast_path_refusal

log = logging.getLogger("dspark_sidecar.server")

# RoPE table rows the runner builds (f32 [max_positions, 64]: 256 MB at 2^20). qkv_rope reads the
# table through an unbounded descriptor, so a position past it would read whatever memory follows
# (not zeros): a step with any such position takes the portable layers (Rank._fast_ready), which
# take any position.
MAX_POSITIONS = 1 << 20


def kernel_mismatch(cfg: DrafterConfig, dtype: torch.dtype) -> str | None:
    """Why this drafter is not the one the FlyDSL kernels are built for (shapes.py), or None."""
    want = {
        "num_hidden_layers": NUM_LAYERS, "hidden_size": shapes.HIDDEN, "head_dim": shapes.HEAD_DIM,
        "num_attention_heads": shapes.Q_HEADS * shapes.TP, "num_key_value_heads": shapes.KV_HEADS * shapes.TP,
        "ffn_hidden_size": shapes.FFN * shapes.TP, "rotary_dim": shapes.ROTARY_DIM,
        "sliding_window": shapes.SLIDING_WINDOW, "quant_block": shapes.MX_BLOCK, "rms_norm_eps": shapes.RMS_EPS,
        "rope_theta": shapes.ROPE_THETA, "swiglu_alpha": shapes.SWIGLU_ALPHA, "swiglu_limit": shapes.SWIGLU_LIMIT,
    }
    for name, value in want.items():
        if getattr(cfg, name) != value:
            return f"drafter {name} {getattr(cfg, name)} != {value} of the FlyDSL kernels"
    if dtype != torch.bfloat16:
        return f"FlyDSL kernels compute in bfloat16, not {dtype} (--dtype)"
    return None


# Weights -----------------------------------------------------------------------------------------

def read_mx(source: WeightSource, key: str, shape: tuple[int, int], block: int,
            rows: slice | None = None, cols: slice | None = None) -> MXLinear:
    """One linear's slice as MXFP8: E4M3 bits uint8 [n, k], E8M0 scales uint8 [n, k/block] (on CPU).

    A checkpoint's bytes are taken as stored (no dequant/requant round trip); a source without
    stored MXFP8 (random weights) is quantized here, as the checkpoint writer would.
    """
    if isinstance(source, CheckpointReader):
        bits = source.read_stored(key, shape, rows, cols)
        # Before the scale is read: a dense linear has none (check_checkpoint accepts it without), and its
        # CheckpointError would stop the rank where this path only has to turn itself off.
        if bits.dtype != torch.float8_e4m3fn:
            raise FlyDSLUnsupported(f"{key}: stored as {bits.dtype}, the kernels need F8_E4M3 + U8 scales")
        scols = slice(cols.start // block, cols.stop // block) if cols is not None else None
        scale = source.read_stored(key + SCALE_SUFFIX, (shape[0], shape[1] // block), rows, scols)
        if scale.dtype != torch.uint8:
            raise FlyDSLUnsupported(f"{key}: scales stored as {scale.dtype}, the kernels need F8_E4M3 + U8 scales")
    else:
        bits, scale = quantize_mxfp8(source.read(key, shape, rows, cols).float().cpu(), block)
    return MXLinear(bits.view(torch.uint8).contiguous(), scale.contiguous())


def _cat(parts: Sequence[MXLinear]) -> MXLinear:
    return MXLinear(torch.cat([p.bits for p in parts]), torch.cat([p.scale for p in parts]))


def layer_weights(source: WeightSource, cfg: DrafterConfig, par: ParallelContext, model: DSparkDrafter,
                  i: int, device: torch.device) -> LayerWeights:
    """Layer i's rank shard in the runner's layout: q|k|v and gate|up fused as the model fuses them
    (column-parallel: this rank's rows), o and down this rank's input columns (row-parallel)."""
    p, b, h, f = layer_prefix(i), cfg.quant_block, cfg.hidden_size, cfg.ffn_hidden_size
    qkv = _cat([read_mx(source, f"{p}self_attn.{x}_proj.weight", (n, h), b, rows=par.shard(n))
                for x, n in (("q", cfg.q_size), ("k", cfg.kv_size), ("v", cfg.kv_size))])
    gate_up = _cat([read_mx(source, f"{p}mlp.{x}_proj.weight", (f, h), b, rows=par.shard(f)) for x in ("gate", "up")])
    o = read_mx(source, f"{p}self_attn.o_proj.weight", (h, cfg.q_size), b, cols=par.shard(cfg.q_size))
    down = read_mx(source, f"{p}mlp.down_proj.weight", (h, f), b, cols=par.shard(f))
    layer = model.layers[i]

    def dev(mx: MXLinear) -> MXLinear:
        return MXLinear(mx.bits.to(device), mx.scale.to(device))

    return LayerWeights(
        qkv=dev(qkv), o=dev(o), gate_up=dev(gate_up), down=dev(down),
        input_norm=layer.input_layernorm.weight, post_norm=layer.post_attention_layernorm.weight,
        q_norm=layer.q_norm.weight, k_norm=layer.k_norm.weight,
    )


# The fast path -----------------------------------------------------------------------------------

class FlyDSLFastPath:
    """server.rank.FastPath over DrafterRunner; `reason` says why the current binding is not served by it."""

    def __init__(self, layers: Sequence[LayerWeights], final_norm: torch.Tensor, peers: PeerBuffers | None,
                 rank: int, host: HostFacts, startup_reason: str | None = None,
                 max_positions: int = MAX_POSITIONS, runner_factory: Callable[..., DrafterRunner] = DrafterRunner,
                 compile_ahead: bool = True) -> None:
        self.layers, self.final_norm, self.peers = list(layers), final_norm, peers
        self.rank, self.host, self.max_positions = rank, host, max_positions
        self.startup_reason = startup_reason  # peers/weights failed at start-up: never ready
        self.runner_factory = runner_factory
        self.reason: str | None = startup_reason
        self.listeners: list[Callable[[], None]] = []  # told when `reason` changes (health, strict refusal)
        self._runner: DrafterRunner | None = None
        self._key: tuple[int, int] | None = None  # (binding_id, generation) the runner or the verdict is for
        self._lock = threading.RLock()
        # Compile every kernel off the step path before the runner serves: until then this rank
        # offers the portable layers, and the rendezvous keeps all ranks on them (Verdict.fast).
        self.compile_ahead = compile_ahead
        self._building: DrafterRunner | None = None
        self._building_since = 0.0  # time.monotonic() when the compile in flight began (pending())
        # (binding_id, generation) whose last step this rank offered the fast path for and the rendezvous
        # ran on the portable layers (a peer did not offer it: agreed()); None once a step ran fast.
        self._declined: tuple[int, int] | None = None

    @property
    def runner(self) -> DrafterRunner | None:
        return self._runner

    def refusal(self, kv: KVBinding | None) -> str | None:
        """Why `kv` is (or will be) served by the portable backend; None when this path serves it.

        A binding not yet seen by ready() gets the checks that need no allocation, so BindKV
        answers with the reason before any step."""
        with self._lock:
            if self.startup_reason is not None or kv is None:
                return self.startup_reason
            if self._key == (kv.binding_id, kv.generation):
                return self.reason
            return self._preview(kv)

    def pending(self, kv: KVBinding | None) -> str | None:
        """Why `kv`, which this path will serve (refusal() is None), is not served yet; None once it is.

        Its kernels compile in the background from the binding's first step (ready()): every kernel for
        R = 1..8, for as long as that takes (not measured on an MI355X yet), and the portable layers serve
        its steps meanwhile. Ready here, the steps still run the portable layers while a peer rank does
        not offer the path (agreed()). For GetStatus only: no refusal of the deployment (BindKV's answer,
        health and --strict-refusal read refusal())."""
        with self._lock:
            if kv is None or self.refusal(kv) is not None:
                return None
            name = f"FlyDSL kernels for binding {kv.binding_id} gen {kv.generation}"
            if self._key != (kv.binding_id, kv.generation):
                if not self.compile_ahead:  # built at the first step and compiled inside it: served from there
                    return None
                return (f"{name} not compiled yet: they compile in the background from the binding's first "
                        "step; the portable layers serve its steps until then")
            if self._building is not None:
                return (f"{name} compiling ({time.monotonic() - self._building_since:.0f} s so far): the "
                        "portable layers serve its steps until they are ready")
            if self._declined == self._key:
                # Ready here, but a peer's runner failed to build or compile (its own reason) or still
                # compiles: the rendezvous runs the fast path only where every rank offers it.
                return (f"FlyDSL fast path ready on rank {self.rank} for binding {kv.binding_id} gen {kv.generation}, "
                        "but a peer rank did not offer it at the last step (its GetStatus says why): every rank "
                        "runs the portable layers")
            return None

    def agreed(self, kv: KVBinding, fast: bool) -> None:
        """After a GO for a step this rank offered the fast path for: whether every rank did (Verdict.fast)."""
        with self._lock:
            self._declined = None if fast else (kv.binding_id, kv.generation)

    def _preview(self, kv: KVBinding) -> str | None:
        why = fast_path_refusal(self.host, kv.engine)
        if why is not None:
            return why
        if len(kv.layers) != NUM_LAYERS:
            return f"{len(kv.layers)} KV layers bound, kernels need {NUM_LAYERS}"
        for t in kv.layers:
            why = check_kv_layer(t, kv.page_size)
            if why is not None:
                return why
        return None

    def ready(self, kv: KVBinding) -> bool:
        """True when `kv` is served here; (re)builds the runner for a new binding or a stale one."""
        with self._lock:
            key = (kv.binding_id, kv.generation)
            if self._runner is not None and self._key == key and not self._runner.stale(kv.layers):
                return True
            if self._runner is None and self._key == key:  # refused (the reason stands) or still compiling
                return False
            # Told when the verdict differs from `reason` as the last binding left it, or from what BindKV
            # answered and health published for this one (its preview): compared with the first alone, the
            # same failure again for a new binding told no one, and a strict rank stayed SERVING.
            before, previewed = self.reason, self.refusal(kv)
            self._drop_runner()
            self._key = key
            if self.startup_reason is not None:
                self.reason = self.startup_reason
            elif previewed is not None:
                # Refused by the checks that need no allocation, in their words as BindKV answered them: the runner
                # makes the same checks in its own ("drafter has 5 layers / 4 KV layers" for "4 KV layers bound"),
                # and built for it, one binding's reason changed at its first step.
                self.reason = previewed
            else:
                try:
                    runner = self.runner_factory(
                        self.layers, self.final_norm, kv.layers, self.peers, self.rank, kv.page_size,
                        self.max_positions, kv.engine, host=self.host)
                    self.reason = None
                except FlyDSLUnsupported as exc:
                    self.reason = str(exc)
                except Exception as exc:  # noqa: BLE001
                    # Out of device memory for the workspaces (torch.OutOfMemoryError is a RuntimeError),
                    # a HIP/driver error, or any other: this binding is refused as above, not a rank exit
                    # (RankLoop._guarded). Safe to decide alone: ready() runs before the step's
                    # rendezvous, which runs the fast path only where every rank offers it.
                    log.exception("rank %d: the FlyDSL runner could not be built", self.rank)
                    self.reason = f"FlyDSL runner could not be built: {type(exc).__name__}: {exc}"
                else:
                    if self.compile_ahead:
                        self._building, self._building_since = runner, time.monotonic()
                        threading.Thread(target=self._compile, args=(runner, key), daemon=True,
                                         name=f"dspark-flydsl-compile-{self.rank}").start()
                    else:
                        self._runner = runner
            changed, ok = self.reason != before or self.reason != previewed, self._runner is not None
        if changed:
            log.info("rank %d: FlyDSL fast path for binding %d gen %d: %s", self.rank, key[0], key[1],
                     self.reason or "on")
            for cb in list(self.listeners):
                cb()
        return ok

    def unbound(self, retire: Callable[[Callable[[], None]], None] = lambda close: close()) -> None:
        """UnbindKV, or BindKV replacing the binding: no runner may keep the old cache's views (each keeps
        its mapping, and so the engine's IPC allocation, alive). The runner is closed through retire(close)
        (RankLoop.after_device: once the device no longer reads it); a compile in flight stops at its next
        kernel and closes its own."""
        with self._lock:
            runner, self._runner, self._key = self._runner, None, None
            self._abandon_building()
        if runner is not None:
            retire(runner.close)

    def _compile(self, runner: DrafterRunner, key: tuple[int, int]) -> None:
        """Background: compile every kernel, then let the runner serve (if its binding is still current)."""
        t = time.perf_counter()
        try:
            count = runner.compile_all()
        except Exception as exc:  # noqa: BLE001  (any compiler failure turns the path off, with the reason)
            log.exception("rank %d: FlyDSL kernels failed to compile", self.rank)
            with self._lock:
                if self._building is runner:
                    self._building = None
                    self.reason = f"FlyDSL kernels failed to compile: {type(exc).__name__}: {exc}"
            runner.close()
            for cb in list(self.listeners):
                cb()
            return
        with self._lock:
            current = self._building is runner and self._key == key
            if current:
                self._building, self._runner = None, runner
        if not current:  # re-bound while compiling: this runner is for an old binding
            runner.close()
            return
        log.info("rank %d: %d FlyDSL kernels compiled in %.1f s; fast path on for binding %d gen %d",
                 self.rank, count, time.perf_counter() - t, key[0], key[1])

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        """embeds [7R, 6144], positions i64 [7R], meta on the device -> final-normed hidden bf16 [7R, 6144]."""
        runner = self._runner
        if runner is None:
            raise RuntimeError("FlyDSL fast path: forward without a ready binding")
        return runner.forward(positions.to(torch.int64).contiguous(), embeds.to(torch.bfloat16).contiguous(),
                              meta.slot_mapping.to(torch.int64).contiguous(),
                              meta.block_tables.to(torch.int32).contiguous())

    def _abandon_building(self) -> None:
        """A compile still running for an old binding stops at its next kernel, then closes its runner
        itself (_compile): left to finish, it kept the old cache mapped through every kernel for R = 1..8.
        Closed from its own thread, not after the device: that runner never launched anything."""
        if self._building is not None:
            self._building.abandon()
            self._building = None

    def _drop_runner(self) -> None:
        self._abandon_building()
        if self._runner is not None:
            self._runner.close()
            self._runner = None

    def close(self) -> None:
        """The device first, then the runner (it holds the peer tensors), then the peer mappings.

        The teardown's only device wait on a FlyDSL rank: it has no step graphs (whose close synchronizes), and a
        step's answer is an event, not a wait, so the last step's kernels may still read the exchange buffers
        this frees and the peers' memory it unmaps. Their exchange is symmetric: once this rank's kernels are
        done, no peer's kernel still writes into this rank's buffers."""
        if self.final_norm.device.type == "cuda":
            torch.cuda.synchronize(self.final_norm.device)
        with self._lock:
            self._drop_runner()
            close = getattr(self.peers, "close", None)
            self.peers = None
        if close is not None:
            close()


def build_fast_path(cfg: DrafterConfig, model: DSparkDrafter, source: WeightSource, host: HostFacts,
                    group, rank: int, make_runtime=None) -> FlyDSLFastPath:
    """Start-up, collectively on every rank of `group` (a CPU group): weight shards, then the peer mapping.

    A failure of the weights or of the mapping (made the same on every rank by peers.map_peers)
    becomes the path's permanent reason, so the portable backend serves and health says why. Only a
    peer lost in the mapping's collectives raises (RuntimeError from gloo), on the ranks still there."""
    from dspark_sidecar.kernels.flydsl.peers import HipRuntime, map_peers

    device = model.device
    par = ParallelContext(rank, shapes.TP)
    layers, local = [], None
    try:
        layers = [layer_weights(source, cfg, par, model, i, device) for i in range(cfg.num_hidden_layers)]
    except FlyDSLUnsupported as exc:  # posted in the peer protocol: the other ranks must turn it off too
        local = f"could not bind its weights: {exc}"
    except Exception as exc:  # noqa: BLE001
        # Out of device memory for the shards (torch.OutOfMemoryError is a RuntimeError), a HIP error, a
        # read that fails (CheckpointError, safetensors' own SafetensorError), any other: posted as above.
        # Raised here, it stopped this rank alone while its peers waited in map_peers' collective; the
        # portable model, loaded already, serves without these shards.
        log.exception("rank %d: the FlyDSL weight shards could not be bound", rank)
        local = f"could not bind its weights: {type(exc).__name__}: {exc}"
    peers, why = None, None
    try:
        peers = map_peers(group, make_runtime or (lambda: HipRuntime(device)), device, local_failure=local)
    except FlyDSLUnsupported as exc:
        why = str(exc)
    if why is not None:
        log.warning("rank %d: FlyDSL fast path off: %s", rank, why)
        # Off for good (ready() never builds a runner): kept, the shards this rank did bind held ~430 MB of
        # device memory a rank (M3.1) for the rank's life, beside the portable model that serves every step.
        layers = []
    return FlyDSLFastPath(layers, model.final_norm.weight, peers, rank, host, why)
