"""Host runner of the FlyDSL draft step: refuses unsupported deployments, binds weights/KV/peer buffers once, launches.

Importable without FlyDSL or a GPU: flydsl is imported only when a kernel is compiled. The
deployment checks are the seed's, in its words (server/refusal.py); any other reason the fast
path cannot bind (cache layout, missing peer buffers) is raised the same way, so the caller
reports it and serves through the portable backend.

One launch covers 1..8 requests (layout.launch_groups splits larger steps). Its sequence per
layer is: qkv linear -> qkv epilogue (norms, RoPE, K/V write) -> attention -> combine ->
o linear -> reduce+exchange+residual -> gate_up linear -> SwiGLU reduce -> down linear ->
reduce+exchange+residual; then the final norm. Every launch is stream-ordered and the epoch
counter is bumped on the device, so the whole step is CUDA/HIP-graph capturable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ...drafter.kv_cache import FP8_KV
from ...layout import LAUNCH_REQS, QPR, launch_groups
from .shapes import (HEAD_DIM, HIDDEN, KV_HEADS, KV_LAYOUTS, NSPLIT, O_K, Q_HEADS, ROPE_THETA, ROTARY_DIM, SCHEDULES,
                     TP, kv_row_map, kv_variant, rows_for)

NUM_LAYERS = 5
# The cache dtypes the kernels take (shapes.KV_DTYPES): bf16, or fp8 e4m3fn codes at scale 1 (kv_cache.FP8_KV).
KV_DTYPE_NAMES = {torch.bfloat16: "bf16", FP8_KV: "fp8"}


class FlyDSLUnsupported(RuntimeError):
    """The FlyDSL fast path cannot serve this deployment; str(exc) is the reason health reports."""


@dataclass(frozen=True)
class KVIdentity:
    """What identifies one layer's draft KV binding: a re-allocation changes at least one field."""

    data_ptr: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: str

    @classmethod
    def of(cls, t: torch.Tensor) -> "KVIdentity":
        return cls(t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device))


@dataclass(frozen=True)
class MXLinear:
    """One MXFP8 linear shard: E4M3 bits as uint8 [N, K] and E8M0 scales uint8 [N, K/32]."""

    bits: torch.Tensor
    scale: torch.Tensor


@dataclass(frozen=True)
class LayerWeights:
    qkv: MXLinear
    o: MXLinear
    gate_up: MXLinear
    down: MXLinear
    input_norm: torch.Tensor  # bf16 [6144]
    post_norm: torch.Tensor  # bf16 [6144]
    q_norm: torch.Tensor  # bf16 [128]
    k_norm: torch.Tensor  # bf16 [128]


@dataclass(frozen=True)
class PeerBuffers:
    """The exchange's peer-mapped memory (exchange.py): RX/flags of the 4 ranks by rank, this
    rank's own through its local mapping, and the device epoch counter."""

    rx: Sequence[torch.Tensor]
    flags: Sequence[torch.Tensor]
    rx_local: torch.Tensor
    flags_local: torch.Tensor
    epoch: torch.Tensor


def _kv_strides(kv_layout: str, shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of the 5-D view [2, pages, page_size, 1, 128] of a cache allocated in `kv_layout`:
    planes contiguous; records [pages, 1, page_size, 256] (drafter/kv_cache.py: kv_planes)."""
    _, pages, page, heads, d = shape
    if kv_layout == "planes":
        return (pages * page * heads * d, page * heads * d, heads * d, d, 1)
    return (d, page * 2 * d, 2 * d, page * 2 * d, 1)  # one KV head: a slot's record is K | V


def kv_layout_of(t: torch.Tensor) -> str | None:
    """'planes' or 'records' when the 5-D view `t` has exactly that layout's strides, else None.

    Strides of size-1 dimensions (the one KV head; a single page) are not compared: they address
    nothing, as in torch's is_contiguous. Other views (a slice of pages, a permutation) are valid
    for the portable ops but not rows [2 * num_slots, 128] in either order the kernels take."""
    for kv_layout in KV_LAYOUTS:
        want = _kv_strides(kv_layout, t.shape)
        if all(n == 1 or s == w for n, s, w in zip(t.shape, t.stride(), want)):
            return kv_layout
    return None


def check_kv_layer(t: torch.Tensor, page_size: int) -> str | None:
    """Why a layer's KV cache cannot be bound by the kernels, or None.

    The kernels read it as [2 * num_slots, 128] rows (KVRows) of bf16 or fp8 e4m3fn codes: the 5-D
    view [2, pages, page_size, 1, 128] of a planes or a records cache, on the GPU.
    """
    if t.dtype not in KV_DTYPE_NAMES:
        return f"draft KV cache dtype {t.dtype}: the FlyDSL kernels take {' or '.join(map(str, KV_DTYPE_NAMES))}"
    if t.dim() != 5 or t.shape[0] != 2 or t.shape[3:] != (KV_HEADS, HEAD_DIM):
        return f"draft KV cache shape {tuple(t.shape)} is not [2, pages, page_size, {KV_HEADS}, {HEAD_DIM}]"
    if t.shape[2] != page_size:
        return f"draft KV page size {t.shape[2]} != {page_size}"
    if kv_layout_of(t) is None:
        return (f"draft KV cache strides {list(t.stride())} are neither the contiguous planes layout nor vLLM 0.34's "
                f"records layout {list(_kv_strides('records', t.shape))}: the FlyDSL kernels address those two only; "
                "the Triton backend serves any")
    if t.numel() * t.element_size() >= 2**32:
        return "draft KV cache layer >= 4 GiB (32-bit buffer offsets)"
    return None


# The width of each norm weight the kernels read (1 + w) from: the folded input and post-attention norms
# (linear.py) and the final norm (rmsnorm.py) over the hidden size, q/k norms (qkv_rope.py) over a head.
NORM_WIDTHS = {"input_norm": HIDDEN, "post_norm": HIDDEN, "q_norm": HEAD_DIM, "k_norm": HEAD_DIM}


def check_norm_weight(name: str, w: torch.Tensor, k: int) -> str | None:
    """Why norm weight `name` cannot be bound, or None: the kernels read it as k dense bf16 values.

    Through an unbounded buffer descriptor, and compiled for the weight first given (keyed by kernel and R,
    not by arguments): a shorter weight was read past its end, a strided one read its neighbours', another
    dtype's bits were read as bf16. Triton's norms refuse the same (triton/runtime.check_norm_weight)."""
    if tuple(w.shape) != (k,) or w.dtype != torch.bfloat16:
        return f"{name} weight {list(w.shape)} {w.dtype}: the FlyDSL kernels read [{k}] {torch.bfloat16}"
    if w.stride() != (1,):
        return f"{name} weight strides {list(w.stride())}: the FlyDSL kernels read it dense"
    return None


@dataclass(frozen=True)
class KVRows:
    """One layer's cache as the kernels take it: rows [2 * num_slots, 128] over the engine's memory,
    K of slot s at row s * slot_rows and V at row v_row0 + s * slot_rows. A bf16 cache's rows are bf16;
    an fp8 cache's are uint8 (128 one-byte e4m3fn codes a row: the kernels load and store bytes, as
    they load the MXFP8 weights); kv_dtype names the kernel variant that reads and writes them."""

    rows: torch.Tensor
    slot_rows: int
    v_row0: int
    kv_dtype: str

    @classmethod
    def of(cls, t: torch.Tensor) -> "KVRows":
        """The rows of a 5-D view check_kv_layer accepted. Both layouts fill exactly the 2 * num_slots
        rows from the view's first element on (a planes cache's first K row, a records cache's first
        record), so one as_strided view serves both; writes through it land in the engine's tensor."""
        num_slots = t.shape[1] * t.shape[2]
        kv_dtype = KV_DTYPE_NAMES[t.dtype]
        # Same element size: the byte view keeps the view's strides and offset over the same memory.
        codes = t.view(torch.uint8) if kv_dtype == "fp8" else t
        rows = codes.as_strided((2 * num_slots, HEAD_DIM), (HEAD_DIM, 1), codes.storage_offset())
        return cls(rows, *kv_row_map(kv_layout_of(t), num_slots), kv_dtype)


def launch_plan(num_reqs: int, kv_dtype: str = "bf16") -> list[tuple[str, int | None]]:
    """The kernel sequence of one launch over a `kv_dtype` cache: (catalog name, exchange index or None)."""
    if not 1 <= num_reqs <= LAUNCH_REQS:
        raise ValueError(f"a launch holds 1..{LAUNCH_REQS} requests")
    qkv_rope, attention = kv_variant("qkv_rope", kv_dtype), kv_variant("attention", kv_dtype)
    plan: list[tuple[str, int | None]] = []
    for layer in range(NUM_LAYERS):
        plan += [("linear_qkv", None), (qkv_rope, None), (attention, None), ("attention_combine", None)]
        plan += [("linear_o", None), ("exchange_o", 2 * layer)]
        plan += [("linear_gate_up", None), ("swiglu_reduce", None), ("linear_down", None), ("exchange_down", 2 * layer + 1)]
    plan.append(("final_norm", None))
    return plan


def check_step(positions: torch.Tensor, embeds: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor) -> None:
    """Raise ValueError unless the step's tensors are what DrafterRunner.forward's kernels read.

    Host metadata only (no device sync), checked before any launch: a compiled kernel is keyed by
    (kernel, R, exchange), not by its arguments, and reads each tensor as the dtype and unit-stride axis
    it was compiled for (_placeholder). Unchecked, an int32 slot tensor read as int64 writes K/V into
    other slots of the engine's cache, a step of 7R + k rows leaves its last k output rows unwritten,
    and a block table of fewer than R rows is read past its end."""
    n = positions.numel()
    if positions.dim() != 1 or n % QPR:
        raise ValueError(f"positions {list(positions.shape)}: {QPR} rows per request, as one dimension")
    r = n // QPR
    want = (
        ("positions", positions, torch.int64, (n,)),
        ("embeds", embeds, torch.bfloat16, (n, HIDDEN)),
        ("slots", slots, torch.int64, (n,)),
        ("block_tables", block_tables, torch.int32, (r, block_tables.shape[-1] if block_tables.dim() else 0)),
    )
    for name, t, dtype, shape in want:
        if t.dtype != dtype:
            raise ValueError(f"{name} {t.dtype}: the FlyDSL kernels read {dtype}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} {list(t.shape)}: expected {list(shape)} for {r} requests")
        if not t.is_contiguous():
            raise ValueError(f"{name} strides {list(t.stride())} are not contiguous")


def _placeholder(a):
    """What flyc.compile gets for a launch argument: tensors as meta-device placeholders, the rest as is.

    flyc.compile (FlyDSL 0.5) also *runs* the launcher when every tensor argument is a device tensor
    (`_compile_or_execute`): compiling against the live ones would launch qkv_rope (K/V written into the
    engine's cache at the placeholder slots) and the exchanges (flags set to the next launch's tags, so its
    waits pass before the peers' partials land; a peer not compiling leaves the kernel spinning). A
    compiled kernel is specialized on each tensor's dtype, rank and unit-stride axis (the first axis of
    stride 1, static from then on); sizes and the other strides are read at each launch. A contiguous
    placeholder with every size >= 2 puts that axis last, as in every tensor _calls passes: a [R, 1] block
    table (stride (1, 1)) would make the row stride a static 1, and request i would read row 0's entries
    from column i on."""
    if isinstance(a, torch.Tensor):
        return torch.empty(tuple(max(2, n) for n in a.shape), dtype=a.dtype, device="meta")
    return a


class DrafterRunner:
    """Binds one TP rank's drafter weights, draft KV layers and peer buffers once; runs draft steps."""

    def __init__(
        self,
        layers: Sequence[LayerWeights],
        final_norm: torch.Tensor,
        kv_layers: Sequence[torch.Tensor],
        peers: PeerBuffers | None,
        rank: int,
        page_size: int,
        max_positions: int,
        engine,
        host=None,
    ) -> None:
        from ...server.refusal import fast_path_refusal, probe_host

        why = fast_path_refusal(host if host is not None else probe_host(TP), engine)
        if why is not None:
            raise FlyDSLUnsupported(why)
        if len(layers) != NUM_LAYERS or len(kv_layers) != NUM_LAYERS:
            raise FlyDSLUnsupported(f"drafter has {len(layers)} layers / {len(kv_layers)} KV layers, kernels need {NUM_LAYERS}")
        for t in kv_layers:
            why = check_kv_layer(t, page_size)
            if why is not None:
                raise FlyDSLUnsupported(why)
        norms = [(f"layer {i} {f}", getattr(lw, f), k) for i, lw in enumerate(layers) for f, k in NORM_WIDTHS.items()]
        for name, w, k in norms + [("final norm", final_norm, HIDDEN)]:
            why = check_norm_weight(name, w, k)
            if why is not None:
                raise FlyDSLUnsupported(why)
        if peers is None or len(peers.rx) != TP or len(peers.flags) != TP:
            raise FlyDSLUnsupported("TP exchange buffers not mapped (need the 4 ranks' IPC handles)")
        self.layers = list(layers)
        self.final_norm = final_norm
        self.peers = peers
        self.rank = rank
        self.page_size = page_size
        self._kv_ids = [KVIdentity.of(t) for t in kv_layers]
        self._kv = [KVRows.of(t) for t in kv_layers]
        self.device = device = kv_layers[0].device
        # Same angles as the stock layers: reference.rope_cos_sin forms them in float64.
        from ..reference import rope_cos_sin

        cos, sin = rope_cos_sin(torch.arange(max_positions, device=device), ROTARY_DIM, ROPE_THETA)
        self._cos_sin = torch.cat([cos, sin], dim=-1).contiguous()
        self._ws = self._workspaces(device)
        self._compiled: dict[tuple[str, int, int | None], object] = {}
        self._abandoned = False  # abandon(): compile_all stops at its next kernel

    # -- binding ------------------------------------------------------------------------

    def stale(self, kv_layers: Sequence[torch.Tensor]) -> bool:
        """True when the engine re-bound its draft KV cache (new allocation, shape or dtype)."""
        return [KVIdentity.of(t) for t in kv_layers] != self._kv_ids

    def abandon(self) -> None:
        """Stop a compile_all running on another thread at its next kernel (its binding went): until it
        returns, the cache views it compiles against keep the engine's allocation mapped. Only a flag:
        that thread still owns the runner, and closes it once compile_all returns."""
        self._abandoned = True

    def close(self) -> None:
        self._compiled.clear()
        self._ws.clear()
        self._kv = []

    @staticmethod
    def _workspaces(device: torch.device) -> dict[str, torch.Tensor]:
        """Scratch sized for the largest launch (8 requests, 4 row tiles); reused every launch."""
        mp, rows = 64, rows_for(LAUNCH_REQS)
        f32 = dict(device=device, dtype=torch.float32)
        bf = dict(device=device, dtype=torch.bfloat16)
        ws = {f"P_{n}": torch.empty(s.split, mp, s.n, **f32) for n, s in SCHEDULES.items()}
        ws.update({f"SS_{n}": torch.empty(s.split, mp, **f32) for n, s in SCHEDULES.items()})
        parts = LAUNCH_REQS * NSPLIT * QPR * Q_HEADS
        ws.update(
            q=torch.empty(rows, O_K, **bf),
            attn=torch.empty(rows, O_K, **bf),
            op=torch.empty(parts, HEAD_DIM, **f32),
            ml=torch.empty(parts, 2, **f32),
            act=torch.empty(rows, SCHEDULES["gate_up"].n // 2, **bf),
            x=torch.empty(rows, HIDDEN, **bf),
            h=torch.empty(rows, HIDDEN, **bf),
            no_norm=torch.zeros(1, **bf),
        )
        return ws

    # -- launching ----------------------------------------------------------------------

    def _kernel(self, name: str, num_reqs: int, exchange: int | None, args: tuple):
        """The compiled launcher for (kernel, R[, exchange]); compiled on first use."""
        key = (name, num_reqs, exchange)
        fn = self._compiled.get(key)
        if fn is None:
            import flydsl.compiler as flyc
            from flydsl.compiler.backends import current_target

            from .catalog import KERNELS
            from .toolchain import TARGET_ARCH

            # FlyDSL's target is not this rank's GPU (which the host checks found a gfx950) but ARCH, else
            # FLYDSL_GPU_ARCH / HSA_OVERRIDE_GFX_VERSION, else the first GPU rocm_agent_enumerator lists, else
            # gfx942. Another arch's code objects compile fine and fail to load at the first fast step's first
            # launch, after every rank agreed to run it.
            arch = current_target().arch
            if arch != TARGET_ARCH:
                raise FlyDSLUnsupported(f"FlyDSL would compile for {arch}, not {TARGET_ARCH} (its target is ARCH, "
                                        "else FLYDSL_GPU_ARCH or HSA_OVERRIDE_GFX_VERSION, else the first GPU "
                                        "rocm_agent_enumerator lists, else gfx942): unset ARCH and set "
                                        f"FLYDSL_GPU_ARCH={TARGET_ARCH}")

            if exchange is not None:
                from .exchange import build_reduce_exchange

                launcher = build_reduce_exchange(num_reqs, name.split("_", 1)[1], exchange)
            elif KERNELS[name].paged:
                launcher = KERNELS[name].build(num_reqs, self.page_size)
            else:
                launcher = KERNELS[name].build(num_reqs)
            fn = flyc.compile(launcher, *map(_placeholder, args))
            if fn is None:  # kept, the first live step called None and every rank exited mid-launch
                raise FlyDSLUnsupported(f"flyc.compile returned no launcher for {name}: COMPILE_ONLY is set in this "
                                        "environment (FlyDSL then builds code objects without loading them)")
            self._compiled[key] = fn
        return fn

    def _run(self, name: str, num_reqs: int, exchange: int | None, stream, *args) -> None:
        """Launch on `stream`. A compiled launcher takes every parameter of the launcher positionally, its
        last one the stream (FlyDSL 0.5 fills that slot from the call's args, so a call without it raised
        IndexError before launching anything)."""
        self._kernel(name, num_reqs, exchange, args)(*args, stream)

    def _stream(self):
        """torch's current stream on the runner's device: the kernels are then ordered with the launch's torch
        ops (the embeds copy, the epoch bump) and captured with them. None (FlyDSL's default queue) off the
        GPU, where only the CPU tests run a runner."""
        return torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        """positions i64 [7R], embeds bf16 [7R, 6144], slots i64 [7R], block_tables i32 [R, pages] -> bf16 [7R, 6144]."""
        check_step(positions, embeds, slots, block_tables)
        out = torch.empty_like(embeds)
        for first, end in launch_groups(positions.numel() // QPR):
            rows = slice(first * QPR, end * QPR)
            out[rows] = self._launch(end - first, positions[rows], embeds[rows], slots[rows], block_tables[first:end])
        return out

    def _launch(self, r: int, pos, embeds, slots, bt) -> torch.Tensor:
        x = self._ws["x"][: rows_for(r)]
        x.copy_(embeds)
        out = torch.empty_like(x)
        stream = self._stream()
        for name, num_reqs, exchange, args in self._calls(r, pos, slots, bt, out):
            self._run(name, num_reqs, exchange, stream, *args)
        # Device-side: the next launch's tags differ from every tag of this one (exchange.py).
        self.peers.epoch.add_(1)
        return out

    def _calls(self, r: int, pos, slots, bt, out):
        """One launch's kernels in order: (catalog name, R, exchange index or None, args)."""
        ws, p = self._ws, self.peers
        n, mp = rows_for(r), 16 * -(-rows_for(r) // 16)
        x, h = ws["x"][:n], ws["h"][:n]

        def P(name):
            return ws[f"P_{name}"][:, :mp], ws[f"SS_{name}"][:, :mp]

        peer_args = (*p.rx, *p.flags, p.rx_local, p.flags_local, p.epoch, self.rank)
        for i, lw in enumerate(self.layers):
            kv = self._kv[i]
            yield "linear_qkv", r, None, (x, lw.qkv.bits, lw.qkv.scale, lw.input_norm, *P("qkv"))
            yield kv_variant("qkv_rope", kv.kv_dtype), r, None, (*P("qkv"), lw.q_norm, lw.k_norm, self._cos_sin, pos,
                                                                 slots, ws["q"][:n], kv.rows, kv.slot_rows, kv.v_row0)
            yield kv_variant("attention", kv.kv_dtype), r, None, (ws["q"][:n], kv.rows, pos, bt, ws["op"], ws["ml"],
                                                                  kv.slot_rows, kv.v_row0)
            yield "attention_combine", r, None, (ws["op"], ws["ml"], ws["attn"][:n])
            yield "linear_o", r, None, (ws["attn"][:n], lw.o.bits, lw.o.scale, ws["no_norm"], *P("o"))
            yield "exchange_o", r, 2 * i, (P("o")[0], x, h, *peer_args)
            yield "linear_gate_up", r, None, (h, lw.gate_up.bits, lw.gate_up.scale, lw.post_norm, *P("gate_up"))
            yield "swiglu_reduce", r, None, (*P("gate_up"), ws["act"][:n])
            yield "linear_down", r, None, (ws["act"][:n], lw.down.bits, lw.down.scale, ws["no_norm"], *P("down"))
            yield "exchange_down", r, 2 * i + 1, (P("down")[0], h, x, *peer_args)
        yield "final_norm", r, None, (x, self.final_norm, out)

    def compile_all(self) -> int:
        """Compile every kernel of every launch size 1..LAUNCH_REQS now, launching nothing, so no live step
        waits for a compiler. Arguments are placeholders of the launch's dtypes and shapes (one page per
        request; _kernel compiles against meta-device copies of them, _placeholder says why). Returns the
        number of compiled kernels; fewer once abandon() was called."""
        dev = self._ws["x"].device
        for r in range(1, LAUNCH_REQS + 1):
            n = QPR * r
            pos = torch.zeros(n, dtype=torch.int64, device=dev)
            slots = torch.zeros(n, dtype=torch.int64, device=dev)
            bt = torch.zeros(r, 1, dtype=torch.int32, device=dev)
            out = torch.empty(rows_for(r), HIDDEN, dtype=torch.bfloat16, device=dev)
            for name, num_reqs, exchange, args in self._calls(r, pos, slots, bt, out):
                if self._abandoned:
                    return len(self._compiled)
                self._kernel(name, num_reqs, exchange, args)
        return len(self._compiled)
