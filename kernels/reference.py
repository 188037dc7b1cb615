"""Pure-torch reference ops of the draft step: the numerics contract every kernel is tested against.

All ops run on any device in bf16 or fp32. Norms, RoPE, softmax and the SwiGLU activation are
computed in fp32 and rounded once to the activation dtype, as the spec requires ("in fp32, the
`1 + w` formed in fp32").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dspark_sidecar.drafter.kv_cache import block_slots, kv_rows, write_kv_rows
from dspark_sidecar.kernels.weights import NormFolded


def linear(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None,
           accumulate: bool = False) -> torch.Tensor:
    """y = x @ weight^T [+ residual].   x [n, in], weight [out, in], residual [n, out] -> [n, out] in x.dtype.

    With a residual, y is rounded to x.dtype before the add (two roundings, as `residual + linear(x)`).
    accumulate: the sum is written over the residual, which is returned (the caller's residual is
    dead after; a GPU backend then needs no copy of it). Same values either way.

    A weight kept quantized (MxFp8Weight: --weights mxfp8) is dequantized here, exactly (E4M3
    times a power of two is a bf16 value): the twin of the kernels' in-register dequantization.
    """
    if not isinstance(weight, torch.Tensor):
        weight = weight.dequantize(x.dtype)
    y = F.linear(x, weight)
    if residual is None:
        return y
    return residual.add_(y) if accumulate else residual + y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma RMSNorm over the last dim: x * rsqrt(mean(x^2) + eps) * (1 + w), in fp32."""
    xf = x.float()
    inv = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * inv * (1.0 + weight.float())).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n, rotary_dim/2] in fp32 for int64 positions [n].

    inv_freq = theta^(-2i/rotary_dim). Angles are formed in float64: positions reach the
    millions and p * inv_freq in fp32 would lose the low bits of the phase.
    """
    half = rotary_dim // 2
    i = torch.arange(half, dtype=torch.float64, device=positions.device)
    inv_freq = theta ** (-2.0 * i / rotary_dim)
    ang = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    return torch.cos(ang).float(), torch.sin(ang).float()


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX RoPE on dims [0, rotary_dim) of each head; the rest pass through.

    x [n, heads, head_dim] fp32, cos/sin [n, rotary_dim/2]. Pairs are (i, i + rotary_dim/2).
    """
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, rest), dim=-1)


def qk_norm_rope(
    x: torch.Tensor, norm_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float
) -> torch.Tensor:
    """Per-head Gemma RMSNorm over head_dim, then partial RoPE; one rounding at the end.

    x [n, heads, head_dim] (activation dtype) -> same shape and dtype.
    """
    xf = x.float()
    inv = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    normed = xf * inv * (1.0 + norm_weight.float())
    return apply_partial_rope(normed, cos, sin).to(x.dtype)


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """SwiGLU-OAI: g = min(gate, limit), u = clamp(up, -limit, limit), g * sigmoid(alpha g) * (u + 1).

    gate_up [n, 2f] with the gate half first -> [n, f]. No lower clamp on the gate; the +1 is
    on the up half.
    """
    f = gate_up.shape[-1] // 2
    g = gate_up[:, :f].float().clamp(max=limit)
    u = gate_up[:, f:].float().clamp(min=-limit, max=limit)
    return (g * torch.sigmoid(alpha * g) * (u + 1.0)).to(gate_up.dtype)


def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Write K/V rows into one layer's paged cache at flat slots (every slot valid: no host reads,
    so a CUDA graph can capture it; the context commit drops padding slots before calling).

    kv_layer [2, num_pages, page_size, kv_heads, head_dim], any KV_LAYOUTS view (kv_cache.kv_planes);
    k, v [m, kv_heads, head_dim]; slots int64 [m], slot = page_id * page_size + offset.
    """
    write_kv_rows(kv_layer, 0, slots, k)
    write_kv_rows(kv_layer, 1, slots, v)


def paged_window_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    rows_per_req: int,
    window: int,
    scale: float,
    cooperative: bool = True,
    concurrent: int = 1,
) -> torch.Tensor:
    """Sliding-window attention of each request's block rows over its paged K/V, non-causal in the block.

    q [n, q_heads, d] with n = rows_per_req * R, request i owning rows [i*rows, (i+1)*rows);
    kv_layer [2, pages, page_size, kv_heads, d]; positions int64 [n]; seq_lens [R] (P + 7);
    block_tables int32 [R, max_pages]. The row at position p sees every key at positions
    max(0, p - (window-1)) .. seq_len-1: the window's left edge differs per row, and there is no
    causal mask inside the block. Scores and softmax in fp32 -> [n, q_heads, d] in q.dtype.
    `cooperative=False` forbids a GPU backend grid-wide waits (see DecoderLayer), and `concurrent`
    says how many such launches run at once on other streams (a step's launch groups side by side),
    so that a GPU backend sizes its grid for its share of the SMs. Neither changes the result beyond
    the backend's bound, and the reference has no grid.
    """
    n, hq, d = q.shape
    page_size, hk = kv_layer.shape[2], kv_layer.shape[3]
    group = hq // hk
    out = torch.empty_like(q)
    for i in range(seq_lens.shape[0]):
        rows = slice(i * rows_per_req, (i + 1) * rows_per_req)
        seq_len = int(seq_lens[i])
        row_pos = positions[rows]
        start = max(0, int(row_pos.min()) - (window - 1))
        key_pos = torch.arange(start, seq_len, device=q.device)
        slots = block_slots(block_tables[i], key_pos, page_size)
        kf = kv_rows(kv_layer, 0, slots).float()  # [m, hk, d]
        vf = kv_rows(kv_layer, 1, slots).float()
        qf = q[rows].float().view(rows_per_req, hk, group, d)
        scores = torch.einsum("rkgd,mkd->kgrm", qf, kf) * scale
        visible = key_pos[None, :] >= (row_pos[:, None] - (window - 1))  # [rows, m]
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.einsum("kgrm,mkd->rkgd", probs, vf)
        out[rows] = o.reshape(rows_per_req, hq, d).to(q.dtype)
    return out


# Fused entry points: the reference composes the ops above; kernel backends fuse them.

def norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor) -> torch.Tensor:
    """linear(rms_norm(x)): x [n, in] -> [n, out].

    A NormFolded weight holds W * (1 + w) already: the norm then scales by its row factor only
    (the same product, rounded at another point, as the Triton GEMM computes it).
    """
    if isinstance(weight, NormFolded):
        return linear(rms_norm(x, torch.zeros_like(norm_weight), eps), weight.check(norm_weight))
    return linear(rms_norm(x, norm_weight, eps), weight)


def norm_linear_swiglu(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                       alpha: float, limit: float) -> torch.Tensor:
    """swiglu_oai(linear(rms_norm(x))): x [n, in], weight [2f, in] (gate rows first) -> [n, f]."""
    return swiglu_oai(norm_linear(x, norm_weight, eps, weight), alpha, limit)


def attn_prelude(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, eps: float, kv_layer: torch.Tensor, slots: torch.Tensor,
                 q_heads: int, kv_heads: int) -> torch.Tensor:
    """Split qkv [n, (q_heads + 2 kv_heads) * d]; q/k norm + RoPE; write K/V at slots; return q [n, q_heads, d]."""
    d = kv_layer.shape[-1]
    q, k, v = qkv.split([q_heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q = qk_norm_rope(q.reshape(-1, q_heads, d), q_norm, cos, sin, eps)
    k = qk_norm_rope(k.reshape(-1, kv_heads, d), k_norm, cos, sin, eps)
    write_kv(kv_layer, k, v.reshape(-1, kv_heads, d), slots)
    return q


def norm_qkv_prelude(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                     q_norm: torch.Tensor, k_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     kv_layer: torch.Tensor, slots: torch.Tensor, q_heads: int, kv_heads: int) -> torch.Tensor:
    """attn_prelude(norm_linear(x)): the layer's input norm, qkv projection and prelude (one eps for
    all three norms, as the drafter has). x [n, hidden] -> q [n, q_heads, d]; K/V written at slots."""
    qkv = norm_linear(x, norm_weight, eps, weight)
    return attn_prelude(qkv, q_norm, k_norm, cos, sin, eps, kv_layer, slots, q_heads, kv_heads)


def paged_window_attention_static(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    rows_per_req: int,
    window: int,
    scale: float,
    cooperative: bool = True,
    concurrent: int = 1,
) -> torch.Tensor:
    """`paged_window_attention` with shapes fixed by the inputs' shapes alone (no host reads), so a
    CUDA graph can capture it: every request gathers the same number of keys,
    min(window + rows - 1, max_pages * page_size), ending at its last row, and masks the rest.
    Same arguments and result as the loop form; fp32 scores and softmax.
    """
    n, hq, d = q.shape
    R = seq_lens.shape[0]
    page_size, hk = kv_layer.shape[2], kv_layer.shape[3]
    group = hq // hk
    max_keys = min(window + rows_per_req - 1, block_tables.shape[1] * page_size)
    last = seq_lens.to(torch.int64)[:, None] - 1  # [R, 1]
    key_pos = last - (max_keys - 1) + torch.arange(max_keys, device=q.device)[None, :]  # [R, K]
    in_seq = key_pos >= 0
    kp = key_pos.clamp(min=0)
    slots = block_tables.to(torch.int64).gather(1, kp // page_size) * page_size + kp % page_size
    kf = kv_rows(kv_layer, 0, slots).float()  # [R, K, hk, d]
    vf = kv_rows(kv_layer, 1, slots).float()
    qf = q.float().view(R, rows_per_req, hk, group, d)
    scores = torch.einsum("rqkgd,rmkd->rkgqm", qf, kf) * scale  # [R, hk, g, rows, K]
    row_pos = positions.view(R, rows_per_req)
    visible = in_seq[:, None, :] & (key_pos[:, None, :] >= row_pos[:, :, None] - (window - 1))  # [R, rows, K]
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    o = torch.einsum("rkgqm,rmkd->rqkgd", torch.softmax(scores, dim=-1), vf)
    return o.reshape(n, hq, d).to(q.dtype)
