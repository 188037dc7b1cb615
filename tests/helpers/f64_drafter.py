"""An independent float64 DSpark draft step for the tests, from a `dspark/` folder and the spec alone."""

# It reads the weights with safetensors and the constants from the folder's config.json under the
# names of spec section 2 (with section 1's defaults), and never calls the package (not its layers,
# its checkpoint reader or its DrafterConfig): a misunderstanding, or a misread config field, would
# have to be written twice to pass. K/V are dense per position, not paged.

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file

P = "language_model.model.dspark."
# Spec section 2: fields the public config may lack are read when present, else these (section 1).
DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 5_000_000.0, "rotary_dim": 64, "swiglu_alpha": 1.702,
            "swiglu_limit": 7.0}


def load_f64(dspark_dir: Path, block: int) -> dict[str, torch.Tensor]:
    """Every tensor of the folder in float64, MXFP8 weights dequantized by hand: v * 2^(s-127) per 1 x block."""
    raw: dict[str, torch.Tensor] = {}
    for f in sorted(Path(dspark_dir).glob("*.safetensors")):
        raw.update(load_file(str(f)))
    out = {}
    for k, t in raw.items():
        if k.endswith("_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            s = raw[k + "_scale_inv"].to(torch.float64)
            assert s.shape == (t.shape[0], t.shape[1] // block), f"{k}: scales {tuple(s.shape)} for blocks of {block}"
            out[k] = t.to(torch.float64) * (2.0 ** (s - 127.0)).repeat_interleave(block, dim=1)
        else:
            out[k] = t.to(torch.float64)
    return out


class F64Drafter:
    def __init__(self, dspark_dir: Path) -> None:
        j = json.loads((Path(dspark_dir) / "config.json").read_text())
        t = {**DEFAULTS, **j["text_config"]}
        self.layers, self.heads, self.kv_heads = t["num_hidden_layers"], t["num_attention_heads"], t["num_key_value_heads"]
        self.head_dim, self.window = t["head_dim"], t["sliding_window"]
        self.eps, self.theta, self.rotary_dim = t["rms_norm_eps"], t["rope_theta"], t["rotary_dim"]
        self.alpha, self.limit = t["swiglu_alpha"], t["swiglu_limit"]
        self.W = load_f64(dspark_dir, j["quantization_config"]["weight_block_size"][1])

    def norm(self, x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + self.eps) * (1 + w)

    def rope(self, x, pos):
        """x [m, heads, d]: NeoX pairs (i, i + rotary_dim/2) rotate; dims from rotary_dim on pass through."""
        half = self.rotary_dim // 2
        ang = pos.to(torch.float64)[:, None] * self.theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / self.rotary_dim)
        c, s = torch.cos(ang)[:, None], torch.sin(ang)[:, None]
        a, b = x[..., :half], x[..., half : 2 * half]
        return torch.cat([a * c - b * s, b * c + a * s, x[..., 2 * half :]], -1)

    def L(self, i, name):
        return self.W[f"{P}layers.{i}.decoder_layer.{name}"]

    def kv_of(self, i, x, pos):
        m = x.shape[0]  # not -1: a request with no context has m = 0
        k = (x @ self.L(i, "self_attn.k_proj.weight").T).view(m, self.kv_heads, self.head_dim)
        v = (x @ self.L(i, "self_attn.v_proj.weight").T).view(m, self.kv_heads, self.head_dim)
        return self.rope(self.norm(k, self.L(i, "self_attn.k_norm.weight")), pos), v

    def context_kv(self, taps, pos):
        """Per layer (K, V) [m, kv_heads, d] of committed rows: spec 3A."""
        c = self.norm(taps @ self.W[f"{P}fc.weight"].T, self.W[f"{P}hidden_norm.weight"])
        return [self.kv_of(i, c, pos) for i in range(self.layers)]

    def step(self, embeds, P_, ctx_kv, first=0):
        """One request, spec 3B: embeds [7, h] at positions P..P+6 -> (final-normed hidden [7, h], per layer
        the block's (K, V) [7, kv_heads, d] that the step writes to the cache).

        ctx_kv: context_kv of positions first..P-1; first may skip keys no row's window reaches
        (a large P without P committed rows) and must not cut into one."""
        rows = embeds.shape[0]
        pos = torch.arange(P_, P_ + rows)
        x = embeds.to(torch.float64)
        group = self.heads // self.kv_heads  # query head h reads KV head h // group
        block_kv = []
        for i in range(self.layers):
            n1 = self.norm(x, self.L(i, "input_layernorm.weight"))
            q = (n1 @ self.L(i, "self_attn.q_proj.weight").T).view(rows, self.heads, self.head_dim)
            q = self.rope(self.norm(q, self.L(i, "self_attn.q_norm.weight")), pos)
            kb, vb = self.kv_of(i, n1, pos)
            block_kv.append((kb, vb))
            K = torch.cat([ctx_kv[i][0], kb]).repeat_interleave(group, dim=1)  # [P+7-first, heads, d]
            V = torch.cat([ctx_kv[i][1], vb]).repeat_interleave(group, dim=1)
            o = torch.empty(rows, self.heads, self.head_dim, dtype=torch.float64)
            for r in range(rows):
                # Keys max(0, p - (window-1)) .. P+6: each row its own left edge, no causal mask in the block.
                lo = max(0, P_ + r - (self.window - 1))
                assert lo >= first, f"row {r} at P={P_} needs keys from {lo}, the context starts at {first}"
                s = torch.einsum("hd,mhd->hm", q[r], K[lo - first :]) / math.sqrt(self.head_dim)
                o[r] = torch.einsum("hm,mhd->hd", torch.softmax(s, -1), V[lo - first :])
            x = x + o.reshape(rows, -1) @ self.L(i, "self_attn.o_proj.weight").T
            n2 = self.norm(x, self.L(i, "post_attention_layernorm.weight"))
            g = torch.clamp(n2 @ self.L(i, "mlp.gate_proj.weight").T, max=self.limit)  # no lower clamp on the gate
            u = torch.clamp(n2 @ self.L(i, "mlp.up_proj.weight").T, -self.limit, self.limit)
            x = x + (g * torch.sigmoid(self.alpha * g) * (u + 1)) @ self.L(i, "mlp.down_proj.weight").T
        return self.norm(x, self.W[f"{P}final_norm.weight"]), block_kv
