"""Tensor parallelism: the parallel context, the partial-sum exchange and column/row-parallel linears."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from dspark_sidecar.kernels.ops import Ops


class Exchange(Protocol):
    """Sums a row-parallel layer's partial outputs over the TP group, in place."""

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor: ...


class LocalExchange:
    """TP 1: nothing to exchange."""

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t


class DistExchange:
    """A torch.distributed all-reduce over the given group (gloo on CPU, NCCL/RCCL on GPU)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=self.group)
        return t


@dataclass(frozen=True)
class ParallelContext:
    """Who this rank is in the TP group; passed in, never read from a global group.

    `lanes`: exchanges over the same ranks beside `exchange` (lane 0), one more per extra CUDA
    stream that a step's launch groups run on side by side (DSparkDrafter.draft_step). Each
    lane is its own communicator: collectives of one communicator issued from several streams
    could run in different orders on different ranks and wait on each other for ever, while
    each lane's collectives come from one stream, in the same order on every rank.
    """

    rank: int = 0
    world_size: int = 1
    exchange: Exchange = field(default_factory=LocalExchange)
    lanes: tuple[Exchange, ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world size {self.world_size}")

    @property
    def num_lanes(self) -> int:
        """Streams whose collectives this context can keep apart (1 + len(lanes))."""
        return 1 + len(self.lanes)

    @property
    def local(self) -> bool:
        """Nothing is exchanged (TP 1, or one shard computed alone): every lane may share `exchange`."""
        return isinstance(self.exchange, LocalExchange)

    def exchange_of(self, lane: int) -> Exchange:
        """The exchange of lane `lane` (0: `exchange`)."""
        if lane < 0 or (lane >= self.num_lanes and not self.local):
            raise ValueError(f"exchange lane {lane} outside the {self.num_lanes} this rank has")
        return self.exchange if lane == 0 or self.local else self.lanes[lane - 1]

    def shard(self, size: int) -> slice:
        """This rank's contiguous slice of a dimension of `size` (must divide evenly)."""
        if size % self.world_size:
            raise ValueError(f"dimension {size} not divisible by TP size {self.world_size}")
        per = size // self.world_size
        return slice(self.rank * per, (self.rank + 1) * per)


class WeightSource(Protocol):
    """Reads one (dequantized) weight, or only a slice of it, from a checkpoint."""

    def read(self, key: str, shape: tuple[int, ...], rows: slice | None = None,
             cols: slice | None = None) -> torch.Tensor: ...


class ColumnParallelLinear(nn.Module):
    """Output features split over ranks: y_local = x @ W[rows_r]^T, no exchange.

    Several checkpoint matrices can be fused along the output dim (q|k|v, gate|up): each is
    sharded on its own and the local shards are concatenated, so one matmul serves them all.
    """

    def __init__(self, in_features: int, out_features: list[int], par: ParallelContext,
                 ops: Ops, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.par, self.ops, self.in_features = par, ops, in_features
        self.out_features = list(out_features)
        self.local_out = [o // par.world_size for o in out_features]
        self.weight = nn.Parameter(
            torch.empty(sum(self.local_out), in_features, dtype=dtype, device=device), requires_grad=False
        )

    def load(self, source: WeightSource, keys: list[str]) -> None:
        parts = [
            source.read(k, (o, self.in_features), rows=self.par.shard(o))
            for k, o in zip(keys, self.out_features, strict=True)
        ]
        self.weight.copy_(torch.cat(parts, dim=0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, in] -> [n, sum(local_out)]."""
        return self.ops.linear(x, self.weight)


class RowParallelLinear(nn.Module):
    """Input features split over ranks: each rank's partial x_r @ W[:, cols_r]^T is summed by the exchange.

    This is one of the two places per layer where ranks exchange partial sums (o_proj, down_proj).
    """

    def __init__(self, in_features: int, out_features: int, par: ParallelContext,
                 ops: Ops, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.par, self.ops = par, ops
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features // par.world_size, dtype=dtype, device=device),
            requires_grad=False,
        )

    def load(self, source: WeightSource, key: str) -> None:
        self.weight.copy_(source.read(key, (self.out_features, self.in_features),
                                      cols=self.par.shard(self.in_features)))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, accumulate: bool = False,
                lane: int = 0) -> torch.Tensor:
        """x [n, in/tp] (this rank's slice) -> [n, out] summed over ranks [+ residual [n, out]];
        accumulate: rank 0 may write the sum over the residual (dead after; Ops.linear); lane: whose
        exchange sums it (ParallelContext.lanes: the launch group's stream's).

        The residual joins rank 0's partial, in the GEMM's epilogue, so the exchange adds it once
        and no separate add is launched. The sum is the same, but not its rounding: a bf16
        all-reduce rounds its running sum at every hop, and with the residual inside it that
        running sum is residual-sized, so at TP > 1 the residual stream is rounded once per hop
        instead of once. Against a float64 step (tiny drafter, bf16, ranks summed in order) the
        hidden states' relative L2 error is 6.5e-3 / 8.4e-3 / 1.1e-2 at TP 1 / 2 / 4 this way and
        6.5e-3 / 6.6e-3 / 6.7e-3 in vLLM's order, x + all_reduce(partials). Kept for the ten adds
        per step it saves: the drafts are checked by the target model, and both stay within the
        TP tests' bf16 tolerance (tests/drafter/test_tensor_parallel.py). fp32 is unaffected.
        """
        res = residual if self.par.rank == 0 else None
        return self.par.exchange_of(lane).all_reduce(self.ops.linear(x, self.weight, res, accumulate=accumulate))


class ReplicatedLinear(nn.Module):
    """Same full weight on every rank (fc)."""

    def __init__(self, in_features: int, out_features: int, ops: Ops,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.ops, self.shape = ops, (out_features, in_features)
        self.weight = nn.Parameter(torch.empty(self.shape, dtype=dtype, device=device), requires_grad=False)

    def load(self, source: WeightSource, key: str) -> None:
        self.weight.copy_(source.read(key, self.shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.weight)
