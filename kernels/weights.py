"""Weight formats the GEMMs take besides a dense tensor (backend-neutral): MxFp8Weight (kept quantized) and NormFolded.

MxFp8Weight: an MXFP8 linear weight kept quantized (F8_E4M3 + U8 E8M0 1x32 scales).

How a loader builds one from the checkpoint without ever dequantizing (`from_checkpoint`):
`CheckpointReader._slice(key, shape, rows, cols)` returns the raw F8_E4M3 slice of `<...>.weight`;
the same call on `<...>.weight_scale_inv` with shape [out, in/32] and the column slice divided by 32
returns the raw U8 exponents. A column-parallel linear passes `rows=par.shard(out)` and
concatenates q|k|v (or gate|up) with `MxFp8Weight.cat`; a row-parallel one passes
`cols=par.shard(in)`, which must cut whole 32-blocks (DrafterConfig.check_tp guarantees it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark_sidecar.drafter.checkpoint import (MAX_EXPONENT, SCALE_SUFFIX, CheckpointError, check_f8_codes,
                                               check_scales, dequantize_mxfp8, quantize_mxfp8)


@dataclass(frozen=True)
class MxFp8Weight:
    """qweight float8_e4m3fn [out, in]; scale uint8 [out, in / block], value v meaning 2^(v - 127).

    The kernels take finite codes and v <= MAX_EXPONENT; `quantize` and `from_checkpoint` refuse
    anything else (checked once there, not on every view: slicing runs inside captured steps).

    The kernels dequantize a weight tile in registers (exact in bf16: 3 mantissa bits times a power
    of two) and feed bf16 tensor-core dots, so HBM traffic is 1 + 1/32 bytes per weight.
    """

    qweight: torch.Tensor
    scale: torch.Tensor
    block: int = 32

    def __post_init__(self) -> None:
        out, inp = self.qweight.shape
        if self.qweight.dtype != torch.float8_e4m3fn or self.scale.dtype != torch.uint8:
            raise TypeError(f"MxFp8Weight: need float8_e4m3fn + uint8, got {self.qweight.dtype} + {self.scale.dtype}")
        if self.block < 1 or self.block & (self.block - 1):
            # The GEMMs split each weight tile into [rows, tile / block, block] (Triton shapes are powers
            # of two): any other block (a config.json's weight_block_size [1, 48]) would fail at the first step.
            raise ValueError(f"MxFp8Weight: block {self.block} is not a power of two (the kernels' tiles need one)")
        if inp % self.block or tuple(self.scale.shape) != (out, inp // self.block):
            raise ValueError(f"MxFp8Weight: scale shape {list(self.scale.shape)} does not match "
                             f"weight {[out, inp]} with block {self.block}")

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    @property
    def nbytes(self) -> int:
        """Bytes a GEMM streams: 1 per weight plus 1 per block for the scales."""
        return self.qweight.numel() + self.scale.numel()

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.qweight.dtype

    def __getitem__(self, rows: slice) -> MxFp8Weight:
        """A row slice (e.g. the k|v rows of a fused qkv weight), as a view."""
        if not isinstance(rows, slice):
            raise TypeError("MxFp8Weight supports row slices only")
        return MxFp8Weight(self.qweight[rows], self.scale[rows], self.block)

    def to(self, device: torch.device | str) -> MxFp8Weight:
        return MxFp8Weight(self.qweight.to(device), self.scale.to(device), self.block)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The dense weight [out, in] (exact in bf16 and fp32): what the reference ops compute with."""
        return dequantize_mxfp8(self.qweight, self.scale, self.block).to(dtype)

    @classmethod
    def quantize(cls, w: torch.Tensor, block: int = 32) -> MxFp8Weight:
        """Quantize a dense weight exactly as the checkpoint writer does; a weight that is not [out, in] of
        whole blocks, a non-finite weight, or one needing a block scale above 2^(MAX_EXPONENT - 127), is
        refused (ValueError), as from_checkpoint refuses NaN codes and such scales."""
        # Before quantize_mxfp8's reshape, whose RuntimeError (or ZeroDivisionError) named neither the weight
        # nor the block, and which convert_layer_weights does not catch to name the layer.
        if w.dim() != 2 or block < 1 or w.shape[1] % block:
            raise ValueError(f"MxFp8Weight.quantize: weight {list(w.shape)} is not whole blocks of {block} per row")
        if not torch.isfinite(w).all():  # NaN would land on the NaN code, which the kernels read as finite
            raise ValueError(f"MxFp8Weight.quantize: {int((~torch.isfinite(w)).sum())} non-finite weights")
        q, s = quantize_mxfp8(w, block)
        if (s > MAX_EXPONENT).any():
            raise ValueError(f"MxFp8Weight.quantize: block exponent {int(s.max())} above {MAX_EXPONENT} "
                             f"(|w| up to {float(w.abs().max()):.3g}; the GPU kernels take scales up to 2^7)")
        return cls(q.to(w.device), s.to(w.device), block)

    @classmethod
    def cat(cls, parts: list[MxFp8Weight]) -> MxFp8Weight:
        """Concatenate along the output dim (fused q|k|v or gate|up shards)."""
        if len({p.block for p in parts}) != 1:
            raise ValueError("MxFp8Weight.cat: parts with different blocks")
        return cls(torch.cat([p.qweight for p in parts]), torch.cat([p.scale for p in parts]), parts[0].block)

    @classmethod
    def from_checkpoint(cls, reader, key: str, shape: tuple[int, int], rows: slice | None = None,
                        cols: slice | None = None, device: torch.device | str = "cpu") -> MxFp8Weight:
        """Read `key`'s raw F8 slice and its raw U8 scale slice through `CheckpointReader._slice`."""
        block = reader.block
        if cols is not None and (cols.start % block or cols.stop % block):
            raise CheckpointError(f"{key}: column slice {cols} cuts MXFP8 blocks of {block}")
        q = reader._slice(key, shape, rows, cols)
        if q.dtype != torch.float8_e4m3fn:
            raise CheckpointError(f"{key}: dtype {q.dtype}, expected F8_E4M3")
        check_f8_codes(key, q, " in this rank's slice")
        scols = slice(cols.start // block, cols.stop // block) if cols is not None else None
        s = reader._slice(key + SCALE_SUFFIX, (shape[0], shape[1] // block), rows, scols)
        check_scales(key + SCALE_SUFFIX, s)  # the NVIDIA kernels' packed dequantization holds 2^(e - 7) in a bf16
        return cls(q.contiguous().to(device), s.contiguous().to(device), block)


@dataclass(frozen=True)
class NormFolded:
    """A norm-fused linear's dense weight with the Gemma norm's (1 + w) folded into its columns.

    rms_norm(x) @ W^T = inv_r * (x @ (W * (1 + w))^T) per row r: with W' = round(W * (1 + w))
    stored once, the GEMM no longer loads (1 + w) and scales every x tile in its K loop; it still
    sums x^2 for inv_r. (It was kept first for feeding x to the tensor cores straight from shared
    memory; that gave wrong sums on 64-row tiles and was undone, see gemm._gemm_kernel. Folded
    still measured slightly faster: 488-491 against 495 us for the step at 56 rows on an H200.)
    One rounding per weight instead of one per scaled activation: the same size of error.
    `norm_weight` is the norm it folds; the ops refuse any other.
    """

    weight: torch.Tensor  # W' [out, in], dense
    norm_weight: torch.Tensor  # w [in]

    @classmethod
    def fold(cls, weight: torch.Tensor, norm_weight: torch.Tensor) -> NormFolded:
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"NormFolded: folds a dense weight, not {type(weight).__name__} (MXFP8 blocks share "
                            "one scale across 32 columns, which (1 + w) would change one by one)")
        if weight.dim() != 2 or norm_weight.shape != (weight.shape[1],):
            raise ValueError(f"NormFolded: norm {list(norm_weight.shape)} does not match weight {list(weight.shape)}")
        return cls((weight.float() * (1.0 + norm_weight.float())).to(weight.dtype), norm_weight)

    def check(self, norm_weight: torch.Tensor) -> torch.Tensor:
        """The folded weight, for a call that normalizes with `norm_weight` (which must be the folded one)."""
        if norm_weight is not self.norm_weight:
            raise ValueError("NormFolded: called with another norm weight than the one folded in")
        return self.weight

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype


def prepare_layer_weights(model, mode: str, block: int, fold: bool) -> None:
    """A loaded DSparkDrafter's layer weights in the form its GEMMs read: kept MXFP8 (mode "mxfp8",
    any backend: the reference dequantizes), else, for the Triton GEMMs (`fold`), dense with the
    input norms folded in (NormFolded). The one place the sidecar and the bench do this."""
    if mode == "mxfp8":
        model.convert_layer_weights(lambda w: MxFp8Weight.quantize(w, block))
    elif fold:
        model.fold_norms(NormFolded.fold)
