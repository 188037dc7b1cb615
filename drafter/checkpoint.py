"""The `dspark/` checkpoint: key layout, MXFP8 (de)quantization, a synthetic writer and a sharding reader."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from dspark_sidecar import layout
from dspark_sidecar.drafter.config import DrafterConfig

PREFIX = "language_model.model.dspark."
EMBED_KEY = "language_model.model.embed_tokens.weight"
LM_HEAD_KEY = "language_model.lm_head.weight"
SCALE_SUFFIX = "_scale_inv"  # "<...>.weight" -> "<...>.weight_scale_inv"
# The largest E8M0 block exponent loaded (2^7: weights up to 448 * 2^7; real checkpoints' scales
# are far below 1). The GPU kernels need it (kernels/triton/gemm.py _dequant_sm90 multiplies by
# 2^(e - 7) held in a bf16), and above it a weight is corruption, not a model.
MAX_EXPONENT = 134
FP8_MAX = 448.0  # largest finite float8_e4m3fn
LAYER_LINEARS = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)


class CheckpointError(ValueError):
    """A checkpoint tensor is missing, mis-shaped or unreadable; the message names the key."""


@dataclass(frozen=True)
class TensorSpec:
    key: str
    shape: tuple[int, ...]
    mxfp8: bool  # F8_E4M3 + U8 E8M0 scale per 1 x quant_block along the input dim
    init_std: float
    init_mean: float = 0.0


def layer_prefix(i: int) -> str:
    return f"{PREFIX}layers.{i}.decoder_layer."


def linear_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, int]]:
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    return {
        "self_attn.q_proj": (cfg.q_size, h), "self_attn.k_proj": (cfg.kv_size, h),
        "self_attn.v_proj": (cfg.kv_size, h), "self_attn.o_proj": (h, cfg.q_size),
        "mlp.gate_proj": (f, h), "mlp.up_proj": (f, h), "mlp.down_proj": (h, f),
    }


def tensor_specs(cfg: DrafterConfig) -> list[TensorSpec]:
    """Every weight of `dspark/` (62 for 5 layers; 97 tensors with the 35 MXFP8 scales), with a synthetic init that keeps activations O(1)."""
    h = cfg.hidden_size
    specs = [
        TensorSpec(f"{PREFIX}fc.weight", (h, cfg.tap_size), False, cfg.tap_size ** -0.5),
        TensorSpec(f"{PREFIX}hidden_norm.weight", (h,), False, 0.1),
        TensorSpec(f"{PREFIX}final_norm.weight", (h,), False, 0.1),
        TensorSpec(f"{PREFIX}markov_head.markov_w1.weight", (cfg.vocab_size, cfg.markov_rank), False, 0.5),
        TensorSpec(f"{PREFIX}markov_head.markov_w2.weight", (cfg.vocab_size, cfg.markov_rank), False, 0.5),
        TensorSpec(f"{PREFIX}confidence_head.proj.weight", (1, h + cfg.markov_rank), False, 0.02),
        TensorSpec(f"{PREFIX}confidence_head.proj.bias", (1,), False, 0.02),
    ]
    residual_scale = (2 * cfg.num_hidden_layers) ** -0.5
    for i in range(cfg.num_hidden_layers):
        p = layer_prefix(i)
        specs += [
            TensorSpec(f"{p}input_layernorm.weight", (h,), False, 0.1),
            TensorSpec(f"{p}post_attention_layernorm.weight", (h,), False, 0.1),
            TensorSpec(f"{p}self_attn.q_norm.weight", (cfg.head_dim,), False, 0.1),
            TensorSpec(f"{p}self_attn.k_norm.weight", (cfg.head_dim,), False, 0.1),
        ]
        for name, (out, inp) in linear_shapes(cfg).items():
            std = inp ** -0.5 * (residual_scale if name in ("self_attn.o_proj", "mlp.down_proj") else 1.0)
            specs.append(TensorSpec(f"{p}{name}.weight", (out, inp), True, std))
    return specs


def shared_specs(cfg: DrafterConfig) -> list[TensorSpec]:
    """embed_tokens and lm_head: not in `dspark/`, shared with the target model."""
    return [
        TensorSpec(EMBED_KEY, (cfg.vocab_size, cfg.hidden_size), False, 1.0),
        TensorSpec(LM_HEAD_KEY, (cfg.vocab_size, cfg.hidden_size), False, cfg.hidden_size ** -0.5),
    ]


# MXFP8 -------------------------------------------------------------------------------------

def quantize_mxfp8(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [rows, cols] -> (F8_E4M3 [rows, cols], U8 E8M0 scale [rows, cols/block]).

    Each 1 x block run shares a power-of-two scale 2^e, e = ceil(log2(amax / 448)), so every
    scaled value fits E4M3's range; the scale byte is e + 127.
    """
    rows, cols = w.shape
    blocks = w.float().reshape(rows, cols // block, block)
    amax = blocks.abs().amax(dim=-1)
    e = torch.ceil(torch.log2(amax.clamp(min=2.0 ** -120) / FP8_MAX)).clamp(-127, 127)
    q = (blocks / torch.exp2(e)[..., None]).reshape(rows, cols).to(torch.float8_e4m3fn)
    return q, (e + 127).to(torch.uint8)


def dequantize_mxfp8(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """Exact: each F8 value times 2^(scale - 127), in fp32 (every product is representable)."""
    rows, cols = q.shape
    factor = torch.exp2(scale.float() - 127.0)
    return (q.float().reshape(rows, cols // block, block) * factor[..., None]).reshape(rows, cols)


def check_f8_codes(key: str, q: torch.Tensor, where: str = "") -> None:
    """No NaN code (S.1111.111) among F8_E4M3 bits [rows, cols]: the kernels' dequantization does not
    carry NaN through, so a corrupt shard would serve silently."""
    nan = (q.view(torch.uint8) & 0x7F) == 0x7F
    if nan.any():
        r, c = (int(i) for i in nan.nonzero()[0])
        raise CheckpointError(f"{key}: {int(nan.sum())} NaN F8_E4M3 codes{where} (first at [{r}, {c}]); "
                              "the checkpoint is corrupt")


def stale_scale(key: str, dtype: str) -> CheckpointError:
    """The error for a dense `key` stored next to a block scale: a converter that cast F8 codes up and kept
    the scale leaves weights 2^(v - 127) off, which loading as dense would serve silently."""
    return CheckpointError(f"{key}{SCALE_SUFFIX}: a block scale for {key}, which is stored as {dtype}, not "
                           "F8_E4M3; a dense linear has none (remove the scale if the weight is dequantized already)")


def check_scales(skey: str, s: torch.Tensor) -> None:
    """U8 E8M0 block exponents no larger than MAX_EXPONENT (255, E8M0's NaN, included)."""
    if s.dtype != torch.uint8:
        raise CheckpointError(f"{skey}: dtype {s.dtype}, expected U8 (E8M0 exponents)")
    if (s > MAX_EXPONENT).any():
        raise CheckpointError(f"{skey}: block exponent {int(s.max())} above {MAX_EXPONENT} (a scale over "
                              f"2^{MAX_EXPONENT - 127}); the checkpoint is corrupt")


# Writer ---------------------------------------------------------------------------------------

def _synthetic(spec: TensorSpec, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(spec.key.encode()))
    return torch.randn(spec.shape, generator=gen) * spec.init_std + spec.init_mean


def _save_sharded(tensors: list[tuple[str, torch.Tensor]], folder: Path, max_shard_bytes: int) -> None:
    # A folder written again: the reader follows an index and otherwise reads every *.safetensors, so an earlier
    # layout's index (or shards) would be read instead of, or beside, these tensors.
    for old in [folder / "model.safetensors.index.json", *folder.glob("model*.safetensors")]:
        old.unlink(missing_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in tensors:
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t.contiguous()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )


def write_synthetic_checkpoint(cfg: DrafterConfig, out_dir: str | Path, seed: int = 0,
                               max_shard_bytes: int = 2 << 30) -> tuple[Path, Path]:
    """Write a deterministic `dspark/` folder (real key names, MXFP8 layer linears, bf16 rest,
    config.json, index when sharded) and a `target/` folder holding embed_tokens and lm_head.

    Returns (dspark_dir, target_dir). Same cfg and seed -> byte-identical tensors.
    """
    out = Path(out_dir)
    dspark, target = out / "dspark", out / "target"
    dspark.mkdir(parents=True, exist_ok=True)
    target.mkdir(parents=True, exist_ok=True)
    tensors: list[tuple[str, torch.Tensor]] = []
    for spec in tensor_specs(cfg):
        w = _synthetic(spec, seed)
        if spec.mxfp8:
            q, s = quantize_mxfp8(w, cfg.quant_block)
            tensors += [(spec.key, q), (spec.key + SCALE_SUFFIX, s)]
        else:
            tensors.append((spec.key, w.to(torch.bfloat16)))
    _save_sharded(tensors, dspark, max_shard_bytes)
    (dspark / "config.json").write_text(json.dumps(cfg.to_hf_json(), indent=2))
    _save_sharded([(s.key, _synthetic(s, seed).to(torch.bfloat16)) for s in shared_specs(cfg)],
                  target, max_shard_bytes)
    return dspark, target


def default_checkpoint_dir(cfg: DrafterConfig, seed: int = 0) -> Path:
    """Where the embedded synthetic checkpoint of a preset lives (written on first use)."""
    # Set but empty is unset (XDG spec): Path("") is the working folder, gigabytes written wherever serve started.
    root = Path(os.environ.get("XDG_CACHE_HOME") or tempfile.gettempdir())
    # The config's digest in the name: a preset whose shapes changed in a release (or two configs of one name)
    # would otherwise read the other's copy, every rank then refusing a tensor's shape until it was removed.
    digest = hashlib.sha256(json.dumps(cfg.to_hf_json(), sort_keys=True).encode()).hexdigest()[:12]
    return root / "dspark-sidecar" / f"{cfg.name}-seed{seed}-{digest}"


def _remove_unfinished(out: Path) -> None:
    """Remove `out` if it has no COMPLETE. A finished copy arrives by one rename with COMPLETE inside, so such a
    folder is what is left of one (a removal cut short; in /tmp, tmpfiles aging out COMPLETE, only ever stat'ed,
    before the shards every start reads): never to be trusted, and in the way of any new copy's rename."""
    if not out.is_dir():  # none (or a file, which the new copy's rename then names)
        return
    stale = out.with_name(out.name + f".stale{os.getpid()}")
    shutil.rmtree(stale, ignore_errors=True)  # what a killed run of this pid left
    try:
        out.rename(stale)  # first, so that it is gone from `out` at once, whatever the removal then takes
    except OSError:  # another process moved it first, or this one may not: the new copy's rename says so
        return
    if (stale / "COMPLETE").exists():  # another process's copy, finished since this one looked: it stays
        with contextlib.suppress(OSError):  # unless a third put one back already
            stale.rename(out)
    shutil.rmtree(stale, ignore_errors=True)


# How long a dead writer's folder must have been untouched before a start removes it. The pid alone does not say:
# a writer in another pid namespace sharing XDG_CACHE_HOME (two containers, one host folder) looks dead from here,
# and one that is writing touches its files far more often than this.
ABANDONED_S = 600.0


def _sweep_abandoned(out: Path) -> None:
    """Remove the `<name>.tmp<pid>` and `<name>.stale<pid>` folders beside `out` whose writer no longer runs here
    and that nothing has touched for ABANDONED_S. A writer killed outright (SIGKILL: the OOM killer, a
    supervisor's last resort) runs no cleanup, and its folder (gigabytes for the full preset) stayed for good,
    one more per killed start; one killed between its COMPLETE mark and its rename too, beside the next start's
    copy. Run at every start, a finished copy's too (a dead writer's folder is too recent to go at first)."""
    try:
        siblings = list(out.parent.iterdir())
    except OSError:  # no cache folder yet, or unreadable: nothing of ours to sweep (the write says what is wrong)
        return
    cutoff = time.time() - ABANDONED_S
    mine = re.compile(re.escape(out.name) + r"\.(?:tmp|stale)([0-9]+)")  # the names ensure_synthetic_checkpoint gives
    for path in siblings:
        m = mine.fullmatch(path.name)
        pid = int(m[1]) if m else 0
        # Not a copy of this checkpoint's, no pid (a larger number would overflow os.kill), or this process's own
        # (its own code removes it).
        if not 0 < pid <= layout.PID_MAX or pid == os.getpid():
            continue
        if _gone(pid) and _untouched_since(path, cutoff):
            shutil.rmtree(path, ignore_errors=True)


def _gone(pid: int) -> bool:
    """Whether no process of this pid namespace has `pid` (another user's counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: it runs, as another user
        return False
    return False


def _untouched_since(folder: Path, cutoff: float) -> bool:
    """Whether `folder` and everything under it (not following links) were last modified before `cutoff`."""
    try:
        if folder.lstat().st_mtime >= cutoff:
            return False
        for root, dirs, files in os.walk(folder):
            for name in dirs + files:
                if os.lstat(os.path.join(root, name)).st_mtime >= cutoff:
                    return False
    except OSError:  # removed meanwhile (its writer's rename, another sweep): not this one's to remove
        return False
    return True


def ensure_synthetic_checkpoint(cfg: DrafterConfig, seed: int = 0) -> tuple[Path, Path]:
    """The embedded synthetic checkpoint's (dspark_dir, target_dir), writing it once if absent."""
    out = default_checkpoint_dir(cfg, seed)
    _sweep_abandoned(out)
    done = out / "COMPLETE"
    if not done.exists():
        _remove_unfinished(out)
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        try:
            write_synthetic_checkpoint(cfg, tmp, seed)
            (tmp / "COMPLETE").write_text("ok\n")
        except BaseException as e:
            # Whatever stopped the write (Ctrl-C too), the partial folder (gigabytes for the full preset) goes,
            # or each restart would leave another one on a disk that may just have run out.
            shutil.rmtree(tmp, ignore_errors=True)
            # XDG_CACHE_HOME a file, a full or read-only disk: say where, not a traceback. safetensors'
            # save_file reports its I/O errors (a disk that fills up mid-shard) as SafetensorError, not OSError.
            if isinstance(e, (OSError, SafetensorError)):
                raise CheckpointError(f"{out}: cannot write the synthetic checkpoint "
                                      f"({getattr(e, 'strerror', None) or e}); point XDG_CACHE_HOME at a writable "
                                      "folder with room, or pass --checkpoint") from None
            raise
        try:
            tmp.rename(out)
        except OSError as e:  # another process finished first: its copy is identical
            shutil.rmtree(tmp, ignore_errors=True)
            if not done.exists():  # something else holds the name: not a checkpoint to hand out
                raise CheckpointError(f"{out}: cannot put the synthetic checkpoint in place ({e.strerror or e}); "
                                      "remove it") from None
    return out / "dspark", out / "target"


# The check before any rank starts ---------------------------------------------------------------

DENSE_DTYPES = ("BF16", "F16", "F32")
# Tensors the engine uses after the step (spec section 3) and the sidecar never loads: a checkpoint
# without them (enable_confidence_head false, another Markov head type) still serves.
ENGINE_ONLY = (f"{PREFIX}markov_head.", f"{PREFIX}confidence_head.")


def check_checkpoint(cfg: DrafterConfig, dspark_dir: str | Path, target_dir: str | Path | None) -> None:
    """Every tensor the config names, and nothing else: its shape and dtype from the safetensors
    headers, then its values as stored (NaN or inf, F8_E4M3 NaN codes, block exponents), one tensor
    at a time and never dequantized. `serve` runs it once before it starts the ranks, so a wrong or
    corrupt folder is one line and exit 2 instead of a line or traceback per rank after they listen.
    The ranks check their own slices again as they load them (CheckpointReader.read)."""
    reader = CheckpointReader(dspark_dir, torch.float32, cfg.quant_block)
    named = set()
    for spec in tensor_specs(cfg):
        if spec.key.startswith(ENGINE_ONLY) and not reader.has(spec.key):
            continue  # the engine's heads (its Markov chain, its confidence): checked when present, not required
        dtype = reader.header(spec.key, spec.shape)
        named.add(spec.key)
        if spec.mxfp8 and dtype == "F8_E4M3":
            skey = spec.key + SCALE_SUFFIX
            check_f8_codes(spec.key, reader.read_stored(spec.key, spec.shape))
            check_scales(skey, reader.read_stored(skey, (spec.shape[0], spec.shape[1] // cfg.quant_block)))
            named.add(skey)
        elif dtype not in DENSE_DTYPES:
            allowed = ("F8_E4M3 (with a U8 scale), " if spec.mxfp8 else "") + ", ".join(DENSE_DTYPES)
            raise CheckpointError(f"{spec.key}: dtype {dtype}, expected {allowed}")
        else:
            if reader.has(spec.key + SCALE_SUFFIX):  # any dense tensor: named as the scale it is, not as a stray key
                raise stale_scale(spec.key, dtype)
            bad = int((~torch.isfinite(reader.read_stored(spec.key, spec.shape))).sum())
            if bad:
                raise CheckpointError(f"{spec.key}: {bad} non-finite values (NaN or inf)")
    extra = sorted(set(reader.keys()) - named)
    if extra:  # e.g. a config.json of 4 layers over a 5-layer checkpoint: layer 4 would be dropped silently
        raise CheckpointError(f"{reader.folder}: {len(extra)} tensor(s) config.json does not name ({extra[0]}"
                              f"{', ...' if len(extra) > 1 else ''}; num_hidden_layers is {cfg.num_hidden_layers}): "
                              "is config.json this checkpoint's?")
    if target_dir is not None:
        dtype = CheckpointReader(target_dir, torch.float32).header(EMBED_KEY, (cfg.vocab_size, cfg.hidden_size))
        if dtype not in DENSE_DTYPES:
            raise CheckpointError(f"{EMBED_KEY}: dtype {dtype}, expected one of {', '.join(DENSE_DTYPES)}")


# Reader ---------------------------------------------------------------------------------------

class CheckpointReader:
    """Reads tensors (or only a rank's slice of them) from a safetensors folder, dequantizing MXFP8.

    Implements `parallel.WeightSource`.
    """

    def __init__(self, folder: str | Path, dtype: torch.dtype, quant_block: int = 32,
                 device: torch.device | str = "cpu") -> None:
        self.folder, self.dtype, self.block, self.device = Path(folder), dtype, quant_block, device
        if not self.folder.is_dir():
            raise CheckpointError(f"{self.folder}: checkpoint folder does not exist")
        index = self.folder / "model.safetensors.index.json"
        self._files: dict[str, Path] = {}
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                self._files = {str(k): self.folder / str(f) for k, f in weight_map.items()}
            except (ValueError, KeyError, TypeError, AttributeError) as e:  # JSONDecodeError is a ValueError
                raise CheckpointError(f"{index}: not a safetensors index with a weight_map "
                                      f"({type(e).__name__}: {e})") from None
            except OSError as e:  # a folder in its place, or no read permission
                raise CheckpointError(f"{index}: unreadable ({e.strerror or e})") from None
            for k, f in weight_map.items():
                # Held to the folder by name (not resolved: a file in it may link elsewhere, as the Hugging Face
                # cache's snapshots do): the folder given is the one whose weights are served.
                if Path(str(f)).is_absolute() or ".." in Path(str(f)).parts:
                    raise CheckpointError(f"{index}: {k} is in {str(f)!r}, outside {self.folder}; an index names "
                                          "files of its own folder")
        else:
            for f in sorted(self.folder.glob("*.safetensors")):
                with self._open(f) as h:
                    for k in h.keys():
                        if k in self._files:  # without an index, which file holds it would be a guess
                            raise CheckpointError(f"{k}: in both {self._files[k].name} and {f.name}; remove the "
                                                  "stale file or add a model.safetensors.index.json")
                        self._files[k] = f
        if not self._files:
            raise CheckpointError(f"{self.folder}: no safetensors files")

    def _open(self, path: Path):
        try:
            return safe_open(str(path), framework="pt")
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path}: unreadable safetensors file: {e}") from None

    def has(self, key: str) -> bool:
        return key in self._files

    def keys(self) -> list[str]:
        return list(self._files)

    def header(self, key: str, shape: tuple[int, ...]) -> str:
        """The stored dtype of `key` ("BF16", "F8_E4M3", "U8", ...) from its file's header, no data read;
        CheckpointError when it is missing or not of `shape`."""
        with self._stored(key, shape) as sl:
            return str(sl.get_dtype())

    @contextlib.contextmanager
    def _stored(self, key: str, shape: tuple[int, ...]) -> Iterator:
        """`key`'s safetensors slice (its file open while inside), checked present and of `shape`."""
        if key not in self._files:
            raise CheckpointError(f"{key}: missing from {self.folder} (expected shape {list(shape)})")
        with self._open(self._files[key]) as h:
            try:
                sl = h.get_slice(key)
            except SafetensorError as e:
                raise CheckpointError(f"{key}: unreadable in {self._files[key].name}: {e}") from None
            if tuple(sl.get_shape()) != tuple(shape):
                raise CheckpointError(f"{key}: shape {list(sl.get_shape())}, expected {list(shape)}")
            yield sl

    def read_stored(self, key: str, shape: tuple[int, ...], rows: slice | None = None,
                    cols: slice | None = None) -> torch.Tensor:
        """The tensor `key` restricted to rows/cols exactly as stored (F8_E4M3 bits, U8 E8M0 scales
        stay as they are): for kernels that dequantize themselves. `read` is the dequantizing twin."""
        return self._slice(key, shape, rows, cols)

    def _slice(self, key: str, shape: tuple[int, ...], rows: slice | None, cols: slice | None) -> torch.Tensor:
        with self._stored(key, shape) as sl:
            idx = (rows or slice(None),) + ((cols,) if cols is not None else ())
            return sl[idx] if len(shape) > 1 or rows is not None else sl[:]

    def read(self, key: str, shape: tuple[int, ...], rows: slice | None = None,
             cols: slice | None = None) -> torch.Tensor:
        """The tensor `key` (of full shape `shape`), restricted to rows/cols, in the reader's dtype."""
        t = self._slice(key, shape, rows, cols)
        if t.dtype == torch.float8_e4m3fn:
            skey = key + SCALE_SUFFIX
            if len(shape) != 2:  # MXFP8 blocks run along a linear's input dim; a norm has none
                raise CheckpointError(f"{key}: F8_E4M3 for a tensor of shape {list(shape)}; only [rows, cols] "
                                      "linears are stored as MXFP8")
            if cols is not None and (cols.start % self.block or cols.stop % self.block):
                raise CheckpointError(f"{key}: column slice {cols} cuts MXFP8 blocks of {self.block}")
            scols = slice(cols.start // self.block, cols.stop // self.block) if cols is not None else None
            s = self._slice(skey, (shape[0], shape[1] // self.block), rows, scols)
            check_scales(skey, s)  # a scale past 2^7 is finite in bf16, so it would load: corruption all the same
            t = dequantize_mxfp8(t, s, self.block)
        elif t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise CheckpointError(f"{key}: unsupported dtype {t.dtype}")
        elif self.has(key + SCALE_SUFFIX):
            raise stale_scale(key, str(t.dtype))
        t = t.to(device=self.device, dtype=self.dtype)
        bad = int(t.numel() - torch.isfinite(t).sum())
        if bad:  # a NaN or inf weight would load and serve silently: every draft wrong, nothing said
            fp8 = f" (F8_E4M3 NaN codes, or {key + SCALE_SUFFIX} exponents of 255 or too large)" if self.has(
                key + SCALE_SUFFIX) else ""
            raise CheckpointError(f"{key}: {bad} non-finite values (NaN or inf) after loading{fp8}")
        return t



class SyntheticSource:
    """A WeightSource that draws every weight on the fly (no files): for benchmarks of the real shape.

    Same initial distributions as the synthetic writer, generated on `device` (fast for 2 B
    parameters on a GPU), MXFP8 round trip skipped: values differ from a written checkpoint.
    """

    def __init__(self, cfg: DrafterConfig, dtype: torch.dtype, device: torch.device | str = "cpu",
                 seed: int = 0) -> None:
        self.specs = {s.key: s for s in tensor_specs(cfg) + shared_specs(cfg)}
        self.dtype, self.device, self.seed = dtype, torch.device(device), seed

    def read(self, key: str, shape: tuple[int, ...], rows: slice | None = None,
             cols: slice | None = None) -> torch.Tensor:
        spec = self.specs.get(key)
        if spec is None or spec.shape != tuple(shape):
            raise CheckpointError(f"{key}: not a drafter tensor of shape {list(shape)}")
        gen = torch.Generator(self.device).manual_seed(self.seed * 1_000_003 + zlib.crc32(key.encode()))
        # Drawn whole, then sliced: rank k's rows are rows k of the one weight. Drawing only the slice's
        # row count gave every rank rank 0's rows (the same q/k/v heads and FFN columns on all ranks).
        t = torch.randn(tuple(shape), generator=gen, device=self.device, dtype=torch.float32)
        if rows is not None:
            t = t[rows]
        if cols is not None:
            t = t[:, cols]
        return (t * spec.init_std + spec.init_mean).to(self.dtype).contiguous()
