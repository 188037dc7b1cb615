"""An independent float64 DSpark drafter for the tests: dense (unpaged) K/V, straight from the spec.

It reads the checkpoint with safetensors directly and never calls the package's layers, so a
shared misunderstanding would have to be written twice to pass.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors.torch import load_file

P = "language_model.model.dspark."


def load_f64(dspark_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder in float64, MXFP8 weights dequantized by hand: v * 2^(s-127)."""
    raw: dict[str, torch.Tensor] = {}
    for f in sorted(Path(dspark_dir).glob("*.safetensors")):
        raw.update(load_file(str(f)))
    out = {}
    for k, t in raw.items():
        if k.endswith("_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            s = raw[k + "_scale_inv"].to(torch.float64)
            w = t.to(torch.float64)
            out[k] = w * (2.0 ** (s - 127.0)).repeat_interleave(w.shape[1] // s.shape[1], dim=1)
        else:
            out[k] = t.to(torch.float64)
    return out


class F64Drafter:
    def __init__(self, W: dict[str, torch.Tensor], cfg) -> None:
        self.W, self.cfg = W, cfg

    def norm(self, x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + self.cfg.rms_norm_eps) * (1 + w)

    def rope(self, x, pos):  # x [m, heads, d]
        half = self.cfg.rotary_dim // 2
        out = x.clone()
        for i in range(half):
            ang = pos.to(torch.float64) * self.cfg.rope_theta ** (-2.0 * i / self.cfg.rotary_dim)
            c, s = torch.cos(ang)[:, None], torch.sin(ang)[:, None]
            a, b = x[:, :, i], x[:, :, i + half]
            out[:, :, i] = a * c - b * s
            out[:, :, i + half] = b * c + a * s
        return out

    def L(self, i, name):
        return self.W[f"{P}layers.{i}.decoder_layer.{name}"]

    def kv_of(self, i, x, pos):
        c = self.cfg
        k = (x @ self.L(i, "self_attn.k_proj.weight").T).view(-1, c.num_key_value_heads, c.head_dim)
        v = (x @ self.L(i, "self_attn.v_proj.weight").T).view(-1, c.num_key_value_heads, c.head_dim)
        return self.rope(self.norm(k, self.L(i, "self_attn.k_norm.weight")), pos), v

    def context_kv(self, taps, pos):
        """Per layer (K, V) [m, kv_heads, d] of committed rows: spec 3A."""
        c = self.norm(taps @ self.W[f"{P}fc.weight"].T, self.W[f"{P}hidden_norm.weight"])
        return [self.kv_of(i, c, pos) for i in range(self.cfg.num_hidden_layers)]

    def step(self, embeds, P_, ctx_kv):
        """One request: embeds [7, h] at positions P..P+6; ctx_kv from context_kv (positions 0..P-1)."""
        c = self.cfg
        pos = torch.arange(P_, P_ + 7)
        x = embeds.to(torch.float64)
        group = c.num_attention_heads // c.num_key_value_heads
        for i in range(c.num_hidden_layers):
            n1 = self.norm(x, self.L(i, "input_layernorm.weight"))
            q = (n1 @ self.L(i, "self_attn.q_proj.weight").T).view(7, c.num_attention_heads, c.head_dim)
            q = self.rope(self.norm(q, self.L(i, "self_attn.q_norm.weight")), pos)
            kb, vb = self.kv_of(i, n1, pos)
            K = torch.cat([ctx_kv[i][0], kb])  # [P+7, kv, d] positions 0..P+6
            V = torch.cat([ctx_kv[i][1], vb])
            o = torch.empty(7, c.num_attention_heads, c.head_dim, dtype=torch.float64)
            for r in range(7):
                lo = max(0, P_ + r - (c.sliding_window - 1))
                for h in range(c.num_attention_heads):
                    kh = h // group
                    s = (K[lo:, kh] @ q[r, h]) / math.sqrt(c.head_dim)
                    o[r, h] = torch.softmax(s, 0) @ V[lo:, kh]
            x = x + o.reshape(7, -1) @ self.L(i, "self_attn.o_proj.weight").T
            n2 = self.norm(x, self.L(i, "post_attention_layernorm.weight"))
            g = torch.clamp(n2 @ self.L(i, "mlp.gate_proj.weight").T, max=c.swiglu_limit)
            u = torch.clamp(n2 @ self.L(i, "mlp.up_proj.weight").T, -c.swiglu_limit, c.swiglu_limit)
            x = x + (g * torch.sigmoid(c.swiglu_alpha * g) * (u + 1)) @ self.L(i, "mlp.down_proj.weight").T
        return self.norm(x, self.W[f"{P}final_norm.weight"])
