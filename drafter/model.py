"""The DSpark drafter: decoder layers, the draft step's forward and the context commit (spec 3A/3B)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from dspark_sidecar import layout
from dspark_sidecar.drafter.checkpoint import PREFIX, layer_prefix
from dspark_sidecar.drafter.config import DrafterConfig
from dspark_sidecar.drafter.kv_cache import StepMetadata
from dspark_sidecar.drafter.parallel import (
    ColumnParallelLinear, ParallelContext, ReplicatedLinear, RowParallelLinear, WeightSource,
)
from dspark_sidecar.kernels.ops import Ops


def step_shape_problem(inputs_embeds: torch.Tensor, positions: torch.Tensor, meta: StepMetadata,
                       attn: tuple[torch.Tensor, StepMetadata] | None, hidden: int) -> str | None:
    """Why a step's tensors are not 7 rows per request of `meta`, or None.

    Torch would not say: positions of length 1 broadcast over every row (one RoPE angle and window
    edge for an R = 1 step), rows past 7R are sliced off the answer, and rows that no request of
    the (attention) metadata owns keep uninitialised attention outputs. Shapes only: no host read.
    """
    R = meta.seq_lens.shape[0] if meta.seq_lens.dim() == 1 else None
    if R is None:
        return f"seq_lens shape {list(meta.seq_lens.shape)}, expected [R]"
    n = layout.QPR * R
    want = [("inputs_embeds", inputs_embeds, (n, hidden)), ("positions", positions, (n,)),
            ("slot_mapping", meta.slot_mapping, (n,))]
    if attn is not None:
        want += [("attention positions", attn[0], (n,)), ("attention seq_lens", attn[1].seq_lens, (R,))]
    for name, t, shape in want:
        if tuple(t.shape) != shape:
            return f"{name} shape {list(t.shape)}, expected {list(shape)} ({n} rows for {R} request(s))"
    for name, m in (("block_tables", meta), ("attention block_tables", attn[1] if attn is not None else None)):
        if m is not None and (m.block_tables.dim() != 2 or m.block_tables.shape[0] != R):
            return f"{name} shape {list(m.block_tables.shape)}, expected [{R}, max_pages]"
    return None


class Norm(nn.Module):
    """A Gemma RMSNorm weight (replicated on every rank)."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype, device=device), requires_grad=False)

    def load(self, source: WeightSource, key: str) -> None:
        self.weight.copy_(source.read(key, tuple(self.weight.shape)))


class DecoderLayer(nn.Module):
    """One pre-norm dense layer: windowed GQA attention over the paged cache, then SwiGLU-OAI."""

    def __init__(self, cfg: DrafterConfig, par: ParallelContext, ops: Ops,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.cfg, self.ops = cfg, ops
        h, tp = cfg.hidden_size, par.world_size
        self.q_heads, self.kv_heads = cfg.num_attention_heads // tp, cfg.num_key_value_heads // tp
        self.q_local, self.kv_local = self.q_heads * cfg.head_dim, self.kv_heads * cfg.head_dim
        self.input_layernorm = Norm(h, dtype, device)
        self.post_attention_layernorm = Norm(h, dtype, device)
        self.q_norm = Norm(cfg.head_dim, dtype, device)
        self.k_norm = Norm(cfg.head_dim, dtype, device)
        self.qkv_proj = ColumnParallelLinear(h, [cfg.q_size, cfg.kv_size, cfg.kv_size], par, ops, dtype, device)
        self.o_proj = RowParallelLinear(cfg.q_size, h, par, ops, dtype, device)
        self.gate_up_proj = ColumnParallelLinear(h, [cfg.ffn_hidden_size] * 2, par, ops, dtype, device)
        self.down_proj = RowParallelLinear(cfg.ffn_hidden_size, h, par, ops, dtype, device)
        self.kv_unfolded: torch.Tensor | None = None  # k|v rows kept as loaded once the norms are folded
        # A rank with exchange lanes runs launch groups side by side at TP > 1: one group's all-reduce
        # kernels hold SMs while they wait on the peers, whose progress may wait on this GPU's other
        # streams. A cooperative attention grid (resident all at once, ~1 program per SM) could then
        # wait for SMs that wait on it, so such ranks merge the attention's splits in a plain kernel.
        self.attn_cooperative = not par.lanes

    def load(self, source: WeightSource, i: int) -> None:
        p = layer_prefix(i)
        self.input_layernorm.load(source, f"{p}input_layernorm.weight")
        self.post_attention_layernorm.load(source, f"{p}post_attention_layernorm.weight")
        self.q_norm.load(source, f"{p}self_attn.q_norm.weight")
        self.k_norm.load(source, f"{p}self_attn.k_norm.weight")
        self.qkv_proj.load(source, [f"{p}self_attn.{x}_proj.weight" for x in "qkv"])
        self.o_proj.load(source, f"{p}self_attn.o_proj.weight")
        self.gate_up_proj.load(source, [f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"])
        self.down_proj.load(source, f"{p}mlp.down_proj.weight")

    def kv_weight(self) -> torch.Tensor:
        """The local k|v rows of the fused qkv weight [2 * kv_local, hidden] (a view), without any folded norm."""
        if self.kv_unfolded is not None:
            return self.kv_unfolded
        return self.qkv_proj.weight[self.q_local :]

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Context rows -> (K normed and rotated, V), each [m, kv_heads, head_dim]."""
        kv = self.ops.linear(x, self.kv_weight())
        k, v = kv.split([self.kv_local, self.kv_local], dim=-1)
        d = self.cfg.head_dim
        k = self.ops.qk_norm_rope(k.view(-1, self.kv_heads, d), self.k_norm.weight, cos, sin, self.cfg.rms_norm_eps)
        return k, v.reshape(-1, self.kv_heads, d)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: StepMetadata, kv_layer: torch.Tensor, x_is_scratch: bool = False, lane: int = 0,
                concurrent: int = 1) -> torch.Tensor:
        """x [n, hidden] -> [n, hidden]; writes this launch's block K/V into kv_layer at the slots.

        The residual sums are written over their dead inputs (Ops.linear's accumulate): h over x
        when x_is_scratch (not the caller's tensor), the output over h always. `lane`: the
        exchange lane that sums the two row-parallel outputs (ParallelContext.lanes). `concurrent`:
        launch groups running at once, side by side (the attention splits for its share of the SMs).

        `positions`/`meta` address the attention; they may be window-relative (see
        `window_metadata`): only differences of positions and the slots' pages matter there,
        while RoPE (cos/sin) and the K/V writes (meta.slot_mapping) are absolute.
        """
        cfg, ops = self.cfg, self.ops
        q = ops.norm_qkv_prelude(x, self.input_layernorm.weight, cfg.rms_norm_eps, self.qkv_proj.weight,
                                 self.q_norm.weight, self.k_norm.weight, cos, sin, kv_layer, meta.slot_mapping,
                                 self.q_heads, self.kv_heads)
        attn = ops.paged_window_attention(q, kv_layer, positions, meta.seq_lens, meta.block_tables,
                                          layout.QPR, cfg.sliding_window, cfg.attn_scale,
                                          cooperative=self.attn_cooperative, concurrent=concurrent)
        h = self.o_proj(attn.reshape(-1, self.q_local), residual=x, accumulate=x_is_scratch, lane=lane)
        act = ops.norm_linear_swiglu(h, self.post_attention_layernorm.weight, cfg.rms_norm_eps,
                                     self.gate_up_proj.weight, cfg.swiglu_alpha, cfg.swiglu_limit)
        return self.down_proj(act, residual=h, accumulate=True, lane=lane)


class DSparkDrafter(nn.Module):
    """The drafter's layers on one TP rank: the draft step (3B) and the context commit (3A)."""

    def __init__(self, cfg: DrafterConfig, par: ParallelContext, ops: Ops,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu") -> None:
        super().__init__()
        cfg.check_tp(par.world_size)
        self.cfg, self.par, self.ops, self.dtype = cfg, par, ops, dtype
        self.device = torch.device(device)
        self.fc = ReplicatedLinear(cfg.tap_size, cfg.hidden_size, ops, dtype, device)
        self.hidden_norm = Norm(cfg.hidden_size, dtype, device)
        self.final_norm = Norm(cfg.hidden_size, dtype, device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, par, ops, dtype, device) for _ in range(cfg.num_hidden_layers))

    @torch.no_grad()
    def load(self, source: WeightSource) -> DSparkDrafter:
        """Load this rank's shard of every weight (the reader reads only the slices)."""
        self.fc.load(source, f"{PREFIX}fc.weight")
        self.hidden_norm.load(source, f"{PREFIX}hidden_norm.weight")
        self.final_norm.load(source, f"{PREFIX}final_norm.weight")
        for i, layer in enumerate(self.layers):
            layer.load(source, i)
        return self

    def convert_layer_weights(self, convert) -> DSparkDrafter:
        """Replace each layer's four linear weights [out, in] by convert(weight) (e.g. kept as MXFP8).

        The ops receive whatever object results (Ops.linear and friends accept MxFp8Weight); the
        embeddings' fc and the norms stay dense.
        """
        for i, layer in enumerate(self.layers):
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                lin = getattr(layer, name)
                try:
                    converted = convert(lin.weight.detach())
                except ValueError as err:  # which weight could not be converted, for the operator
                    raise ValueError(f"layer {i} {name}: {err}") from err
                del lin.weight  # a Parameter slot cannot hold another type
                lin.weight = converted
        return self

    def fold_norms(self, fold) -> DSparkDrafter:
        """Replace each layer's qkv and gate|up weights by fold(weight, norm weight) of the norm before
        them (kernels.weights.NormFolded.fold: W * (1 + w), which the Triton GEMMs read with x
        as loaded). The context commit projects k|v without the input norm: those rows are kept
        unfolded first (3 MB per layer at TP 4)."""
        for layer in self.layers:
            layer.kv_unfolded = layer.kv_weight().detach().clone()
            for lin, norm in ((layer.qkv_proj, layer.input_layernorm),
                              (layer.gate_up_proj, layer.post_attention_layernorm)):
                w = lin.weight
                del lin.weight  # a Parameter slot cannot hold another type
                lin.weight = fold(w.detach(), norm.weight)
        return self

    def set_ops(self, ops: Ops) -> DSparkDrafter:
        """Compute with another backend's ops from now on (same weights; used by benchmarks)."""
        for m in self.modules():
            if hasattr(m, "ops"):
                m.ops = ops
        return self

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.rope_cos_sin(positions, self.cfg.rotary_dim, self.cfg.rope_theta)

    @torch.no_grad()
    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, meta: StepMetadata,
                kv_caches: list[torch.Tensor], attn: tuple[torch.Tensor, StepMetadata] | None = None,
                lane: int = 0, concurrent: int = 1) -> torch.Tensor:
        """One launch: inputs_embeds [n, hidden], positions int64 [n] -> final-normed hidden [n, hidden].

        attn: optional window-relative (positions, metadata) for the attention (static shapes for
        CUDA graphs); by default the absolute ones. lane: the exchange lane of the partial sums.
        concurrent: launches running at once beside this one (DecoderLayer.forward)."""
        self._check_step(inputs_embeds, positions, meta, attn, kv_caches)
        cos, sin = self._rope(positions)
        a_pos, a_meta = attn if attn is not None else (positions, meta)
        a_meta = StepMetadata(a_meta.seq_lens, a_meta.block_tables, meta.slot_mapping)
        x = inputs_embeds.to(self.dtype)
        for layer, kv_layer in zip(self.layers, kv_caches, strict=True):
            x = layer(x, a_pos, cos, sin, a_meta, kv_layer, x_is_scratch=x is not inputs_embeds, lane=lane,
                      concurrent=concurrent)
        return self.ops.rms_norm(x, self.final_norm.weight, self.cfg.rms_norm_eps)

    @torch.no_grad()
    def draft_step(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, meta: StepMetadata,
                   kv_caches: list[torch.Tensor], launch_reqs: int = layout.LAUNCH_REQS,
                   attn: tuple[torch.Tensor, StepMetadata] | None = None,
                   streams: Sequence[torch.cuda.Stream] = ()) -> torch.Tensor:
        """A whole step of R requests in launches of at most `launch_reqs` requests; row order kept.

        streams (two or more, CUDA): the launch groups run side by side, group i on streams[i % len]
        with exchange lane i % len (see _side_by_side). With an exchange (TP > 1) the rank needs a
        lane per stream (ParallelContext.lanes): the collectives of one communicator must not be
        issued from several streams.
        """
        q = layout.QPR
        self._check_step(inputs_embeds, positions, meta, attn, kv_caches)  # whole: a launch's slices hide rows past 7R
        groups = layout.launch_groups(meta.num_reqs, launch_reqs)

        def group(s: int, e: int, lane: int = 0, concurrent: int = 1) -> torch.Tensor:
            return self.forward(inputs_embeds[s * q : e * q], positions[s * q : e * q], meta.requests(s, e), kv_caches,
                                None if attn is None else (attn[0][s * q : e * q], attn[1].requests(s, e)), lane=lane,
                                concurrent=concurrent)

        if len(streams) > self.par.num_lanes and not self.par.local:
            raise ValueError(f"draft_step: launch groups on {len(streams)} streams need TP 1 or an exchange lane per "
                             f"stream; this rank (one of {self.par.world_size}) has {self.par.num_lanes} "
                             "(serve with --launch-streams 1, or let the server make the lanes)")
        if len(groups) > 1 and len(streams) > 1:
            outs = self._side_by_side(groups, group, streams)
        else:
            outs = [group(s, e) for s, e in groups]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _check_step(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, meta: StepMetadata,
                    attn: tuple[torch.Tensor, StepMetadata] | None, kv_caches: Sequence[torch.Tensor]) -> None:
        problem = (step_shape_problem(inputs_embeds, positions, meta, attn, self.cfg.hidden_size)
                   or self._caches_problem(kv_caches))
        if problem is not None:
            raise ValueError(f"draft step: {problem}")

    def _caches_problem(self, kv_caches: Sequence[torch.Tensor]) -> str | None:
        """Why kv_caches is not one cache per layer, or None. Checked up front: the layers' zip(strict=True)
        said so only after the layers before the missing cache (or all of them) had written their K/V."""
        if len(kv_caches) != len(self.layers):
            return f"{len(kv_caches)} KV cache layers for the drafter's {len(self.layers)}, expected one per layer"
        return None

    def _side_by_side(self, groups: list[tuple[int, int]], group, streams: Sequence[torch.cuda.Stream]) -> list:
        """Each launch group on its own stream, forked from the current stream and joined back to it.

        The groups are independent (their own requests' rows, K/V windows and slots), so each runs
        the same operations on the same inputs as in sequence. Side by side, one group's
        latency-bound attention and small kernels overlap another's weight streaming, and groups at
        the same layer read its weights from L2 rather than HBM (R=32 on an H200: 1.72 -> 1.24 ms,
        BENCHMARKS.md runs 106-107). Each group's attention is told how many groups run at once, so
        that it splits its keys for its share of the SMs and the groups' grids fit on the GPU
        together (1.23 -> 1.07 ms, run 149). Where that changes the split count (long windows), the
        merge of the splits associates differently from in order, within the attention's bound;
        otherwise the bits are those of in order. In a CUDA graph capture the fork and join become
        graph edges.
        """
        main = torch.cuda.current_stream(self.device)
        used = list(streams[: len(groups)])
        for st in used:
            st.wait_stream(main)
        outs = []
        for i, (s, e) in enumerate(groups):
            j = i % len(used)  # stream j's groups sum their partials through exchange lane j
            with torch.cuda.stream(used[j]):
                outs.append(group(s, e, lane=j, concurrent=len(used)))
        for st in used:
            main.wait_stream(st)
        if not torch.cuda.is_current_stream_capturing():
            for o in outs:  # made on a side stream, read by the caller on this one
                o.record_stream(main)
        return outs

    @torch.no_grad()
    def commit_context(self, taps: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                       kv_caches: list[torch.Tensor]) -> None:
        """Spec 3A: committed rows' taps [m, num_taps * hidden] -> every layer's K/V at `slots` (int64 [m];
        -1 = padding, skipped). Context rows never pass through the layers or input_layernorm."""
        m = slots.shape[0] if slots.dim() == 1 else -1
        # Checked, not broadcast: a single position rotated every row's K at it, without an error.
        if slots.dim() != 1 or tuple(positions.shape) != (m,) or tuple(taps.shape) != (m, self.cfg.tap_size):
            raise ValueError(f"context commit: taps {list(taps.shape)}, positions {list(positions.shape)} and slots "
                             f"{list(slots.shape)}; expected [m, {self.cfg.tap_size}], [m] and [m], one row per slot")
        problem = self._caches_problem(kv_caches)
        if problem is not None:
            raise ValueError(f"context commit: {problem}")
        keep = slots >= 0  # padding rows (slot -1) are dropped here, once, not in every write
        if not bool(keep.all()):
            taps, positions, slots = taps[keep], positions[keep], slots[keep]
        c = self.ops.rms_norm(self.fc(taps.to(self.dtype)), self.hidden_norm.weight, self.cfg.rms_norm_eps)
        cos, sin = self._rope(positions)
        for layer, kv_layer in zip(self.layers, kv_caches, strict=True):
            k, v = layer.project_kv(c, cos, sin)
            self.ops.write_kv(kv_layer, k, v, slots)
