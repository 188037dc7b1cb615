"""RoPE's cos/sin table for a step's positions in one launch (the reference's are ~10 small torch kernels)."""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from dspark_sidecar.kernels.triton.runtime import INTERPRET, check_device, dep_release, dep_wait, pdl_kwargs

# Positions per program. fp64 cos/sin of angles in the millions take the slow argument reduction:
# one program of 64 rows (16 values per thread) took 9.2 us on an H200 (run 99); 4 rows of a
# 32-wide table give each of the 128 threads one (cos, sin) pair, and 56 rows 14 programs.
ROWS = 4


@triton.jit
def _rope_cos_sin_kernel(pos_ptr, cos_ptr, sin_ptr, n, theta_bits, rotary_dim,
                         HALF: tl.constexpr, HALF_P2: tl.constexpr, ROWS: tl.constexpr, INTERPRET: tl.constexpr,
                         PDL: tl.constexpr = False):
    """cos/sin [n, HALF] fp32 of angle p * theta^(-2i/rotary_dim), formed in fp64.

    Same operations in the same order as reference.rope_cos_sin, so on CUDA both end in the same
    libdevice pow/cos/sin of the same doubles and the fp32 outputs are the same bits. theta comes
    as its IEEE-754 bits in an int64: Triton passes a Python float argument as fp32. The
    interpreter (triton 3.9) has no libdevice: there numpy's exp/log/cos/sin stand in (pow as
    exp(e * log theta): a few fp64 ulps, far below the fp32 output's).
    PDL (runtime.PDL): the frequencies (an fp64 pow) are formed before the wait for the positions.
    """
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, HALF_P2)
    theta = tl.full((HALF_P2,), theta_bits, tl.int64).to(tl.float64, bitcast=True)
    e = (-2.0 * cols.to(tl.float64)) / rotary_dim.to(tl.float64)
    if INTERPRET:
        inv_freq = tl.exp(e * tl.log(theta))  # [HALF_P2] fp64
    else:
        inv_freq = libdevice.pow(theta, e)
    dep_wait(PDL)
    dep_release(PDL)
    p = tl.load(pos_ptr + rows, mask=rows < n, other=0).to(tl.float64)
    ang = p[:, None] * inv_freq[None, :]  # [ROWS, HALF_P2] fp64: positions reach millions
    mask = (rows[:, None] < n) & (cols[None, :] < HALF)
    offs = rows[:, None] * HALF + cols[None, :]
    if INTERPRET:
        c, s = tl.cos(ang), tl.sin(ang)
    else:
        c, s = libdevice.cos(ang), libdevice.sin(ang)
    tl.store(cos_ptr + offs, c.to(tl.float32), mask=mask)
    tl.store(sin_ptr + offs, s.to(tl.float32), mask=mask)


def _f64_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 positions [n] -> cos, sin [n, rotary_dim/2] fp32 (reference.rope_cos_sin's contract)."""
    check_device(positions)
    half = rotary_dim // 2
    n = positions.shape[0]
    cos = torch.empty(n, half, dtype=torch.float32, device=positions.device)
    sin = torch.empty_like(cos)
    if n:
        pos = positions if positions.is_contiguous() else positions.contiguous()
        _rope_cos_sin_kernel[(triton.cdiv(n, ROWS),)](pos, cos, sin, n, _f64_bits(theta), rotary_dim,
                                                      HALF=half, HALF_P2=triton.next_power_of_2(half),
                                                      ROWS=ROWS, INTERPRET=INTERPRET, num_warps=4, **pdl_kwargs(pos, "rope"))
    return cos, sin
