"""The frozen, validated DSpark drafter config: from `dspark/config.json` or a named preset."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dspark_sidecar import layout

ARCHITECTURE = "DSparkMiniMaxDraftModel"
# Fields whose config.json key is not the attribute's name: errors name the key, which is what the operator edits.
JSON_KEYS = {"ffn_hidden_size": "dspark_ffn_hidden_size", "markov_rank": "dspark_markov_rank",
             "block_size": "dspark_block_size"}
SLIDING_WINDOW_MAX = 1 << 20  # tokens (DrafterConfig.__post_init__ says why)


class ConfigError(ValueError):
    """A drafter config field is missing or invalid; the message names the field."""


@dataclass(frozen=True)
class DrafterConfig:
    """Shape and numerics of the drafter (spec draft-step.md, sections 1-2)."""

    name: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    ffn_hidden_size: int
    markov_rank: int
    block_size: int
    noise_token_id: int
    sliding_window: int
    target_layer_ids: tuple[int, ...]
    # Fields the public config may lack: spec section 1 defaults.
    rms_norm_eps: float = 1e-6
    rope_theta: float = 5_000_000.0
    rotary_dim: int = 64
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    quant_block: int = 32
    enable_confidence_head: bool = True

    def __post_init__(self) -> None:
        positive = (
            "num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads",
            "num_key_value_heads", "head_dim", "ffn_hidden_size", "markov_rank",
            "block_size", "sliding_window", "rotary_dim", "quant_block",
        )
        for f in positive:
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"{JSON_KEYS.get(f, f)}: must be a positive integer, got {v!r}")
        for f in ("rms_norm_eps", "rope_theta", "swiglu_alpha", "swiglu_limit"):
            v = getattr(self, f)
            # json reads Infinity too: eps = inf zeroes every norm's output, theta = inf freezes RoPE.
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not (v > 0 and _finite(v)):
                raise ConfigError(f"{f}: must be a positive finite number, got {v!r}")
        # The step's window-relative block tables hold the window's pages for every request (kv_cache.window_width,
        # the graphs' buffers, at warm-up): 2**32 asked 256 Mi pages of each. A million tokens is past any context
        # served here (4096 in the spec) and StatusReport's uint32.
        if self.sliding_window > SLIDING_WINDOW_MAX:
            raise ConfigError(f"sliding_window: at most {SLIDING_WINDOW_MAX} tokens, got {self.sliding_window}")
        if self.block_size != layout.QPR:
            raise ConfigError(f"dspark_block_size: must be {layout.QPR} (the served block), got {self.block_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_key_value_heads: {self.num_key_value_heads} must divide "
                f"num_attention_heads {self.num_attention_heads}"
            )
        if self.rotary_dim > self.head_dim or self.rotary_dim % 2:
            raise ConfigError(f"rotary_dim: must be even and <= head_dim {self.head_dim}, got {self.rotary_dim}")
        for f in ("hidden_size", "ffn_hidden_size"):
            if getattr(self, f) % self.quant_block:
                raise ConfigError(f"{JSON_KEYS.get(f, f)}: must be a multiple of the MXFP8 block {self.quant_block}")
        if (self.num_attention_heads * self.head_dim) % self.quant_block:
            raise ConfigError("num_attention_heads * head_dim: must be a multiple of the MXFP8 block")
        # A float passed the range check and was cut to another token in the block rows; true read as token 1.
        if not isinstance(self.noise_token_id, int) or isinstance(self.noise_token_id, bool):
            raise ConfigError(f"dspark_noise_token_id: must be an integer, got {self.noise_token_id!r}")
        if not 0 <= self.noise_token_id < self.vocab_size:
            raise ConfigError(f"dspark_noise_token_id: {self.noise_token_id} outside vocab [0, {self.vocab_size})")
        if len(self.target_layer_ids) == 0:
            raise ConfigError("dspark_target_layer_ids: must not be empty")
        # Only their count is used here (fc's input width), but each names a layer whose output the engine taps:
        # null, "3", 3.5, true or -1 is no layer, and a nested list left this frozen config unhashable.
        bad = [i for i in self.target_layer_ids if not isinstance(i, int) or isinstance(i, bool) or i < 0]
        if bad:
            raise ConfigError(f"dspark_target_layer_ids: {bad[0]!r} is not a target layer (a non-negative integer)")

    # Derived sizes ---------------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def tap_size(self) -> int:
        """Width of the concatenated target taps fed to `fc`: num_taps x hidden."""
        return self.num_taps * self.hidden_size

    @property
    def attn_scale(self) -> float:
        return self.head_dim ** -0.5

    def check_tp(self, world_size: int) -> None:
        """Raise ConfigError unless this config shards evenly over `world_size` ranks."""
        # 0 raised ZeroDivisionError below, and a negative size divides every field (8 % -4 == 0): refused here.
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ConfigError(f"TP size: must be a positive integer, got {world_size!r}")
        checks = (
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("dspark_ffn_hidden_size", self.ffn_hidden_size),
        )
        for f, v in checks:
            if v % world_size:
                raise ConfigError(f"{f}: {v} is not divisible by TP size {world_size}")
        # Row-parallel inputs are sharded along the MXFP8 block axis: keep whole blocks.
        for f, v in (("num_attention_heads * head_dim", self.q_size), ("dspark_ffn_hidden_size", self.ffn_hidden_size)):
            if (v // world_size) % self.quant_block:
                raise ConfigError(f"{f}: per-rank slice {v // world_size} is not a multiple of {self.quant_block}")

    def param_count(self) -> int:
        """Parameters of the 5 layers, fc, norms, Markov and confidence heads (not the shared embeddings)."""
        h = self.hidden_size
        per_layer = (
            2 * h + 2 * self.head_dim
            + self.q_size * h + 2 * self.kv_size * h + h * self.q_size
            + 3 * self.ffn_hidden_size * h
        )
        glob = h * self.tap_size + 2 * h + 2 * self.vocab_size * self.markov_rank + (h + self.markov_rank + 1)
        return self.num_hidden_layers * per_layer + glob

    # Serialisation ------------------------------------------------------------------
    def to_hf_json(self) -> dict[str, Any]:
        """The `dspark/config.json` form of this config (text_config + quantization_config)."""
        text = {
            "num_hidden_layers": self.num_hidden_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "dspark_ffn_hidden_size": self.ffn_hidden_size,
            "dspark_markov_rank": self.markov_rank,
            "dspark_markov_head_type": "vanilla",
            "dspark_block_size": self.block_size,
            "dspark_noise_token_id": self.noise_token_id,
            "sliding_window": self.sliding_window,
            "dspark_target_layer_ids": list(self.target_layer_ids),
            "layer_types": ["sliding_attention"] * self.num_hidden_layers,
            "use_gemma_norm": True,
            "enable_confidence_head": self.enable_confidence_head,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rotary_dim": self.rotary_dim,
            "swiglu_alpha": self.swiglu_alpha,
            "swiglu_limit": self.swiglu_limit,
        }
        return {
            "architectures": [ARCHITECTURE],
            "model_name": self.name,
            "text_config": text,
            "quantization_config": {"quant_method": "mxfp8", "weight_block_size": [1, self.quant_block]},
        }

    @classmethod
    def from_hf_json(cls, data: dict[str, Any], name: str = "checkpoint") -> DrafterConfig:
        """Build from a parsed `dspark/config.json`; raises ConfigError naming the bad field."""
        if not isinstance(data, dict):
            raise ConfigError(f"config.json: expected a JSON object, got {type(data).__name__}")
        arch = data.get("architectures")
        if arch != [ARCHITECTURE]:
            raise ConfigError(f"architectures: expected [{ARCHITECTURE!r}], got {arch!r}")
        text = data.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError("text_config: missing or not an object")
        text = _plain_rope(text)

        def req(key: str) -> Any:
            if key not in text:
                raise ConfigError(f"text_config.{key}: missing")
            return text[key]

        if text.get("use_gemma_norm", True) is not True:
            raise ConfigError("text_config.use_gemma_norm: only Gemma RMSNorm is supported")
        head_type = text.get("dspark_markov_head_type", "vanilla")
        if head_type != "vanilla":
            raise ConfigError(f"text_config.dspark_markov_head_type: only 'vanilla' is supported, got {head_type!r}")
        quant = data.get("quantization_config", {"quant_method": "mxfp8", "weight_block_size": [1, 32]})
        if not isinstance(quant, dict):
            raise ConfigError(f"quantization_config: expected an object, got {quant!r}")
        if quant.get("quant_method") != "mxfp8":
            raise ConfigError(f"quantization_config.quant_method: expected 'mxfp8', got {quant.get('quant_method')!r}")
        wbs = quant.get("weight_block_size")
        # B checked here: the dataclass would name it text_config.quant_block, a key no config.json has.
        if not (isinstance(wbs, list) and len(wbs) == 2 and wbs[0] == 1 and isinstance(wbs[1], int)
                and not isinstance(wbs[1], bool) and wbs[1] > 0):
            raise ConfigError(f"quantization_config.weight_block_size: expected [1, B] with B a positive integer, "
                              f"got {wbs!r}")
        num_layers = req("num_hidden_layers")
        if not isinstance(req("dspark_target_layer_ids"), list):
            raise ConfigError(f"text_config.dspark_target_layer_ids: expected a list, got {text['dspark_target_layer_ids']!r}")
        confidence = text.get("enable_confidence_head", True)
        if not isinstance(confidence, bool):
            raise ConfigError(f"text_config.enable_confidence_head: expected true or false, got {confidence!r}")
        rotary = text.get("partial_rotary_factor", 1.0)
        if isinstance(rotary, bool) or not isinstance(rotary, (int, float)):
            raise ConfigError(f"text_config.partial_rotary_factor: expected a number, got {rotary!r}")
        layer_types = text.get("layer_types")
        if layer_types is not None and not isinstance(layer_types, list):
            raise ConfigError(f"text_config.layer_types: expected a list of {num_layers} entries, got {layer_types!r}")
        # A num_hidden_layers that is no count is named by the dataclass's check, not blamed on layer_types.
        if (layer_types is not None and isinstance(num_layers, int) and not isinstance(num_layers, bool)
                and len(layer_types) != num_layers):
            raise ConfigError(f"text_config.layer_types: {len(layer_types)} entries for {num_layers} layers")
        # Every layer is served as sliding-window attention (spec section 1): a layer the config names as
        # full attention would be served with another mask, its drafts quietly worse. Other spellings are
        # not known from the spec, so only the Hugging Face name of the contradicting kind is refused.
        full = [i for i, t in enumerate(layer_types or []) if t == "full_attention"]
        if full:
            raise ConfigError(f"text_config.layer_types: layer(s) {full} are 'full_attention'; this drafter serves "
                              "sliding-window attention on every layer (draft-step.md section 1)")
        kw: dict[str, Any] = dict(
            name=str(data.get("model_name", name)),
            num_hidden_layers=num_layers,
            hidden_size=req("hidden_size"),
            vocab_size=req("vocab_size"),
            num_attention_heads=req("num_attention_heads"),
            num_key_value_heads=req("num_key_value_heads"),
            head_dim=req("head_dim"),
            ffn_hidden_size=req("dspark_ffn_hidden_size"),
            markov_rank=req("dspark_markov_rank"),
            block_size=req("dspark_block_size"),
            noise_token_id=req("dspark_noise_token_id"),
            sliding_window=req("sliding_window"),
            target_layer_ids=tuple(req("dspark_target_layer_ids")),
            quant_block=wbs[1],
            enable_confidence_head=confidence,
        )
        optional = {
            "rms_norm_eps": "rms_norm_eps", "rope_theta": "rope_theta", "rotary_dim": "rotary_dim",
            "swiglu_alpha": "swiglu_alpha", "swiglu_limit": "swiglu_limit",
        }
        for field, key in optional.items():
            if key in text:
                kw[field] = text[key]
        if "partial_rotary_factor" in text:
            _rotary_from_factor(rotary, kw)
        try:
            return cls(**kw)
        except ConfigError as e:
            raise ConfigError(f"text_config.{e}") from None
        except (TypeError, ValueError) as e:  # a field of the wrong JSON type, met by the dataclass's own checks
            raise ConfigError(f"text_config: a field has the wrong type ({e})") from None

    @classmethod
    def from_json_file(cls, path: str | Path) -> DrafterConfig:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:  # ValueError: JSONDecodeError, and UnicodeDecodeError (a UTF-16 file)
            raise ConfigError(f"{path}: cannot read config.json: {e}") from None
        return cls.from_hf_json(data, name=path.parent.name or "checkpoint")

    def replace(self, **changes: Any) -> DrafterConfig:
        return dataclasses.replace(self, **changes)


def _finite(v: int | float) -> bool:
    """math.isfinite, False for a JSON integer past a float's range (10**400 raised OverflowError: a traceback)."""
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _rotary_from_factor(factor: float, kw: dict[str, Any]) -> None:
    """Set kw["rotary_dim"] from partial_rotary_factor x head_dim, or check it against a rotary_dim given too.

    The product must be a whole number: int() cut 0.3 x 128 = 38.4 to 38 and RoPE rotated a band the
    checkpoint was never trained with. A head_dim that is no positive integer is left to the dataclass to name."""
    head_dim = kw["head_dim"]
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim <= 0:
        return
    if not _finite(factor):
        raise ConfigError(f"text_config.partial_rotary_factor: expected a finite number, got {factor!r}")
    # A fraction of head_dim: 1e307 x 128 is inf, whose round() raised OverflowError (a traceback), and a factor
    # above 1 or not above 0 was blamed on rotary_dim, a key this config.json need not have.
    if not 0 < factor <= 1:
        raise ConfigError(f"text_config.partial_rotary_factor: expected a fraction of head_dim in (0, 1], got {factor!r}")
    dims = factor * head_dim
    whole = round(dims)
    if abs(dims - whole) > 1e-6:
        raise ConfigError(f"text_config.partial_rotary_factor: {factor} x head_dim {head_dim} = {dims:g}, "
                          "not a whole number of rotary dims")
    if "rotary_dim" in kw and kw["rotary_dim"] != whole:
        raise ConfigError(f"text_config.partial_rotary_factor: {factor} x head_dim {head_dim} = {whole}, "
                          f"but rotary_dim is {kw['rotary_dim']!r}")
    kw.setdefault("rotary_dim", whole)  # a rotary_dim given is kept as given, for the dataclass to check


def _plain_rope(text: dict[str, Any]) -> dict[str, Any]:
    """`text` with rope_parameters' rope_theta and partial_rotary_factor (where transformers 5 writes them) as
    top-level keys; refuses scaled RoPE positions (YaRN, linear, dynamic, llama3, ...), as the layers rotate by
    plain RoPE from rope_theta and the rotary dims only: such a checkpoint was served without its scaling, and
    a theta given only inside rope_parameters was replaced by the default. Absent, null or "default" is plain."""
    for key in ("rope_scaling", "rope_parameters"):
        rope = text.get(key)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise ConfigError(f"text_config.{key}: expected an object or null, got {rope!r}")
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise ConfigError(f"text_config.{key}: rope type {kind!r} is not served; this drafter rotates by plain "
                              "RoPE from rope_theta (draft-step.md section 1)")
    lifted = dict(text)
    for key in ("rope_theta", "partial_rotary_factor"):
        if key not in (text.get("rope_parameters") or {}):
            continue
        value = text["rope_parameters"][key]
        if key in text and text[key] != value:
            raise ConfigError(f"text_config.rope_parameters.{key}: {value!r}, but text_config.{key} is {text[key]!r}")
        lifted[key] = value
    return lifted


PRESETS: dict[str, DrafterConfig] = {
    # The released MiniMax-M3.1 `dspark/` drafter (spec section 1).
    "minimax-m3.1": DrafterConfig(
        name="minimax-m3.1",
        num_hidden_layers=5,
        hidden_size=6144,
        vocab_size=200064,
        num_attention_heads=64,
        num_key_value_heads=4,
        head_dim=128,
        ffn_hidden_size=12288,
        markov_rank=256,
        block_size=7,
        noise_token_id=200058,
        sliding_window=4096,
        target_layer_ids=(3, 17, 31, 45, 59),
    ),
    # Same structure (5 layers, GQA with 4 KV heads, head_dim 128 with 64 rotary dims,
    # 4096 window, 7-row block, 5 taps), dimensions scaled down so it runs on a CPU and
    # shards over TP 1, 2 and 4.
    "tiny": DrafterConfig(
        name="tiny",
        num_hidden_layers=5,
        hidden_size=256,
        vocab_size=2048,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=128,
        ffn_hidden_size=512,
        markov_rank=32,
        block_size=7,
        noise_token_id=2042,
        sliding_window=4096,
        target_layer_ids=(1, 3, 5, 7, 9),
    ),
}


def load_config(preset: str | None = None, checkpoint: str | Path | None = None) -> DrafterConfig:
    """The drafter config of a checkpoint folder (its config.json) or of a named preset."""
    if checkpoint is not None:
        return DrafterConfig.from_json_file(Path(checkpoint) / "config.json")
    if preset not in PRESETS:
        raise ConfigError(f"preset: unknown {preset!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[preset]
