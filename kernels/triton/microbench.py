"""Micro-benchmark of the Triton kernels at one TP-4 rank's shard of the real drafter, against the HBM floor.

    python -m dspark_sidecar.kernels.triton.microbench [--rows 7 56] [--context 4096] [--sweep] [--json F]
    ... --tune      the 5-layer step under each TUNE row of tunables (what the defaults were chosen from)
    ... --profile   the step's per-kernel GPU time from the CUDA profiler
    ... --fit       one GEMM launch's fixed cost and streaming rate, Triton against cuBLAS

Shapes: hidden 6144, 16 q heads + 1 KV head of 128, FFN 3072 per rank, window 4096, 16-token pages;
n = rows query rows (R = rows / 7 requests, each with `context` committed keys). Every figure is
the median over CUDA-graph replays of a graph that runs the op on enough distinct weight and
cache copies (> 2x the L2) that the weights stream from HBM, as they do in a real step, divided
by the number of copies. Floor = bytes the op must move / the device-to-device copy bandwidth
measured here (read + write bytes per second).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch

from dspark_sidecar.drafter.kv_cache import window_width
from dspark_sidecar.kernels import reference
from dspark_sidecar.kernels.triton import attention, blas, gemm, runtime, step_meta
from dspark_sidecar.kernels.triton.ops import TRITON_OPS as T
from dspark_sidecar.kernels.timing import gpu_times
from dspark_sidecar.kernels.weights import MxFp8Weight, NormFolded

H, HQ, HK, D, ROT, FFN, WINDOW, PAGE = 6144, 16, 1, 128, 64, 3072, 4096, 16
EPS, ALPHA, LIMIT, THETA = 1e-6, 1.702, 7.0, 5_000_000.0
QPR = 7
L2_BYTES = 60 << 20
FOLD_NORMS = True  # the step's qkv and gate|up weights with their input norms folded in (weights.NormFolded)


def copy_bandwidth(dev: torch.device, nbytes: int = 2 << 30) -> float:
    """Bytes read + written per second by a device-to-device copy."""
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev)
    b = torch.empty_like(a)
    t = _time(lambda: b.copy_(a), reps=10, graph=False)
    return 2 * nbytes / t


def _time(fn: Callable[[], object], reps: int = 20, graph: bool = True) -> float:
    """Median seconds of GPU time of one call of fn (a CUDA graph of it when `graph`; kernels.timing)."""
    fn()
    torch.cuda.synchronize()
    run = fn
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    run()
    torch.cuda.synchronize()
    return statistics.median(gpu_times(run, torch.device("cuda", torch.cuda.current_device()), reps)) / 1e3


def _copies(nbytes: int, cap: int = 64) -> int:
    return max(2, min(cap, math.ceil(2 * L2_BYTES / max(nbytes, 1))))


def _per_call(make: Callable[[], Callable[[], object]], nbytes: int, graph: bool = True) -> float:
    """Time one call of the op, over distinct copies of its operands so the L2 cannot hold them."""
    fns = [make() for _ in range(_copies(nbytes))]
    return _time(lambda: [f() for f in fns], graph=graph) / len(fns)


def _weight(n: int, k: int, fp8: bool, dev: torch.device):
    w = (torch.randn(n, k, device=dev) * k ** -0.5).to(torch.bfloat16)
    return MxFp8Weight.quantize(w) if fp8 else w


def _wbytes(n: int, k: int, fp8: bool) -> int:
    return n * k + n * k // 32 if fp8 else 2 * n * k


def _kv_step(r: int, context: int, dev: torch.device):
    """One layer's cache holding r requests of `context` keys, their block rows and metadata."""
    seq = context + QPR
    per = -(-seq // PAGE)
    kv = torch.randn(2, r * per, PAGE, HK, D, device=dev).to(torch.bfloat16)
    tables = torch.randperm(r * per, device=dev).to(torch.int32).view(r, per)
    seq_lens = torch.full((r,), seq, dtype=torch.int32, device=dev)
    positions = (torch.arange(QPR, device=dev) + context).repeat(r)
    p = positions.view(r, QPR)
    slots = (tables.gather(1, p // PAGE).to(torch.int64) * PAGE + p % PAGE).reshape(-1)
    return kv, tables, seq_lens, positions, slots


def gemm_cases():
    """(name, out, in, kind) of the four linears of a layer at TP 4."""
    return [("qkv norm_linear", (HQ + 2 * HK) * D, H, "norm"), ("o_proj linear", H, HQ * D, "plain"),
            ("gate_up norm_linear_swiglu", 2 * FFN, H, "swiglu"), ("down_proj linear", H, FFN, "plain")]


def gemm_bytes(rows: int, n_out: int, k: int, kind: str, fp8: bool) -> int:
    """Bytes a GEMM case must move: its weight, x [rows, k] read and the output written, in bf16.
    SwiGLU's output is f = n_out / 2 wide (the gate and up halves never leave the kernel)."""
    return _wbytes(n_out, k, fp8) + 2 * rows * (k + (n_out // 2 if kind == "swiglu" else n_out))


def prelude_bytes(rows: int) -> int:
    """Bytes the attention prelude must move: per row, qkv read, q and the row's K and V written, in bf16,
    its fp32 cos and sin and its int64 slot read; and the q and k norm weights (bf16) once."""
    return rows * (2 * (HQ + 2 * HK) * D + 2 * HQ * D + 2 * 2 * HK * D + 2 * 4 * (ROT // 2) + 8) + 2 * 2 * D


def norm_bytes(rows: int) -> int:
    """Bytes rms_norm over [rows, H] must move: x read and y written, and its weight read once, in bf16."""
    return 2 * 2 * rows * H + 2 * H


def gemm_label(x: torch.Tensor, w, kind: str) -> str:
    """The tiling gemm.gemm runs this case with, from its own `_tiling`: `plan` alone would miss the
    device's shared memory, a folded norm's x^2 column (one more column tile: fewer K-ranges) and
    the MXFP8 block, and print a split the launch does not use."""
    n = gemm._stored(w).shape[0]
    cfg, split, _ = gemm._tiling(x, w, n // 2 if kind == "swiglu" else n, kind == "swiglu", None, kind != "plain")
    return f"bm{cfg.block_m} bn{cfg.block_n} bk{cfg.block_k} s{split} st{cfg.num_stages}"


def attention_splits(r: int, context: int, sms: int) -> int:
    """The splits attention.paged_window_attention picks for `_kv_step`'s cache: its tiled keys come from
    the block table's width (whole pages), less the narrow tile's QPR keys, not from the keys seen."""
    return attention.num_splits(r, HK, attention.tiled_keys(WINDOW, QPR, -(-(context + QPR) // PAGE), PAGE), sms)


def _gemm_fn(x, nw, w, kind, config=None, ops=None):
    if ops is not None:  # reference
        if kind == "norm":
            return lambda: ops.norm_linear(x, nw, EPS, w)
        if kind == "swiglu":
            return lambda: ops.norm_linear_swiglu(x, nw, EPS, w, ALPHA, LIMIT)
        return lambda: ops.linear(x, w)
    return lambda: gemm.gemm(x, w, nw if kind != "plain" else None, EPS,
                             swiglu=(ALPHA, LIMIT) if kind == "swiglu" else None, config=config)


def bench_ops(rows: int, context: int, bw: float, dev: torch.device, sweep: bool) -> list[dict]:
    out: list[dict] = []
    r = rows // QPR

    def rec(name, wdt, t, nbytes, ref_t=None, **extra):
        floor = nbytes / bw
        row = dict(op=name, rows=rows, weights=wdt, us=t * 1e6, floor_us=floor * 1e6, x_floor=t / floor,
                   ref_us=None if ref_t is None else ref_t * 1e6, **extra)
        out.append(row)
        ref = "" if ref_t is None else f"  reference {ref_t * 1e6:8.1f} us"
        print(f"{name:28s} rows {rows:2d} {wdt:4s} {t * 1e6:8.1f} us  floor {floor * 1e6:7.1f} us"
              f"  x{t / floor:5.2f}{ref}  {extra or ''}", flush=True)

    for fp8 in (False, True):
        wdt = "fp8" if fp8 else "bf16"
        for name, n_out, k, kind in gemm_cases():
            nbytes = gemm_bytes(rows, n_out, k, kind, fp8)
            label: list[str] = []

            def make(config=None, ref=False, vendor=False):
                x = torch.randn(rows, k, device=dev).to(torch.bfloat16)
                nw = (torch.randn(k, device=dev) * 0.1).to(torch.bfloat16)
                w = _weight(n_out, k, fp8, dev)
                if ref:
                    return _gemm_fn(x, nw, w.dequantize() if fp8 else w, kind, ops=reference)
                if FOLD_NORMS and not fp8 and kind != "plain":  # as the sidecar holds them
                    w = NormFolded.fold(w, nw)
                if not label:
                    label.append(gemm_label(x, w, kind))
                if vendor:  # blas.py's route for this GEMM, whatever its tunables say
                    if kind == "plain":
                        return lambda: blas.linear(x, w)
                    return lambda: blas.norm_linear(x, w, nw, EPS, (ALPHA, LIMIT) if kind == "swiglu" else None)
                return _gemm_fn(x, nw, w, kind, config)

            t = _per_call(make, nbytes)
            ref_t = None if fp8 else _per_call(lambda: make(ref=True), nbytes)
            extra = {}
            if not fp8 and (kind == "plain" or FOLD_NORMS):
                extra["vendor_us"] = round(_per_call(lambda: make(vendor=True), nbytes) * 1e6, 1)
            rec(name, wdt, t, nbytes, ref_t, cfg=label[0], **extra)
            if sweep and kind != "plain":  # the two largest weights
                _sweep(name, rows, n_out, k, kind, fp8, wdt, nbytes, make, rec, dev)

    qkv_w = (HQ + 2 * HK) * D
    kv_bytes = 2 * HK * D * 2

    def make_prelude():
        qkv = torch.randn(rows, qkv_w, device=dev).to(torch.bfloat16)
        qn, kn = torch.randn(D, device=dev).to(torch.bfloat16), torch.randn(D, device=dev).to(torch.bfloat16)
        kv, _, _, positions, slots = _kv_step(r, 64, dev)
        cos, sin = reference.rope_cos_sin(positions, ROT, THETA)
        return lambda: T.attn_prelude(qkv, qn, kn, cos, sin, EPS, kv, slots, HQ, HK)

    rec("attn_prelude", "-", _per_call(make_prelude, 1 << 20), prelude_bytes(rows))

    keys = min(context + QPR, WINDOW + QPR - 1)
    att_bytes = r * keys * kv_bytes + 2 * 2 * rows * HQ * D

    def make_attn(splits=None):
        kv, tables, seq_lens, positions, _ = _kv_step(r, context, dev)
        q = torch.randn(rows, HQ, D, device=dev).to(torch.bfloat16)
        return lambda: attention.paged_window_attention(q, kv, positions, seq_lens, tables, QPR, WINDOW,
                                                        D ** -0.5, splits=splits)

    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rec(f"paged_window_attention c{context}", "-", _per_call(make_attn, att_bytes), att_bytes,
        splits=attention_splits(r, context, sms))
    if sweep:
        for s in (8, 16, 32, 64):
            if s <= -(-keys // attention.BLOCK_N):
                rec(f"  attention splits={s}", "-", _per_call(lambda: make_attn(s), att_bytes), att_bytes)

    def make_norm():
        x = torch.randn(rows, H, device=dev).to(torch.bfloat16)
        w = torch.randn(H, device=dev).to(torch.bfloat16)
        return lambda: T.rms_norm(x, w, EPS)

    rec("rms_norm", "-", _per_call(make_norm, 1 << 20), norm_bytes(rows))

    def make_step_meta():  # a pre-launched step's metadata program (server/prelaunch.py), rung and valid
        _, tables, seq_lens, positions, slots = _kv_step(r, context, dev)
        outs = (torch.empty_like(positions), torch.empty_like(positions), torch.empty_like(slots),
                torch.empty_like(seq_lens), torch.empty(r, window_width(PAGE, WINDOW), dtype=torch.int32, device=dev))
        word, flags = torch.ones(1, dtype=torch.int64, device=dev), torch.zeros(r, dtype=torch.int32, device=dev)
        return lambda: step_meta.step_meta(word, word, (positions, seq_lens, tables, slots), outs, flags, num_reqs=r,
                                           width=tables.shape[1], page_size=PAGE, window=WINDOW,
                                           num_pages=tables.numel())

    # Reads positions, slots and the table row; writes five outputs. Its metadata is small and freshly
    # staged in a real step, so one copy is timed (in L2), unlike the ops above; 64 launches per graph, as
    # one launch alone is mostly the graph's own launch (run 256: 4.4-5.2 us, against 2.2-2.9 in a row).
    cols, ww = -(-(context + QPR) // PAGE), window_width(PAGE, WINDOW)
    meta_bytes = 8 * 5 * rows + 4 * r * (2 + cols + ww)
    fn = make_step_meta()
    rec("step_meta (pre-launch)", "-", _time(lambda: [fn() for _ in range(64)]) / 64, meta_bytes)
    return out


SWEEP = {  # (block_n, block_k, programs per SM, warps, stages) around the planner's choice
    "bf16": ((64, 64, 3, 4, 4), (128, 64, 2, 4, 4), (64, 32, 2, 4, 6), (64, 128, 2, 4, 3)),
    # MXFP8: stages None = as many as fit the planner's budget (gemm.plan); 8 warps at 1 program per SM
    # halve each thread's share of the dequantized tile.
    "fp8": ((128, 128, 2, 4, None), (128, 64, 1, 4, None), (64, 64, 2, 4, None), (128, 64, 1, 8, None),
            (64, 64, 1, 8, None), (128, 128, 1, 8, None), (64, 128, 1, 8, None)),
}


def _sweep(name, rows, n_out, k, kind, fp8, wdt, nbytes, make, rec, dev):
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    n_cols = n_out // 2 if kind == "swiglu" else n_out
    for bn, bk, pps, warps, stages in SWEEP[wdt]:
        p = gemm.plan(rows, n_cols, k, sms, block_n=bn, block_k=bk, programs_per_sm=pps, swiglu=kind == "swiglu",
                      weight_bytes=1 if fp8 else 2)
        # stages None: the planner's count for this tile at its budget for pps programs per SM
        cfg = gemm.GemmConfig(p.block_m, bn, bk, p.split_k, warps, stages or p.num_stages)
        t = _per_call(lambda cfg=cfg: make(cfg), nbytes)
        rec(f"  {name.split()[0]} sweep", wdt, t, nbytes,
            # st: the launch's stages (SWEEP's None printed "stNone" for every MXFP8 row, not plan's count)
            cfg=f"bn{bn} bk{bk} pps{pps} w{warps} st{cfg.num_stages} s{cfg.split_k}")


def make_step(rows: int, context: int, dev: torch.device, fp8: bool, ops) -> Callable[[], torch.Tensor]:
    """5 layers as DecoderLayer composes them (no TP exchange) on distinct weights: one rank's step."""
    r = rows // QPR
    layers = []
    for _ in range(5):
        ws = [_weight((HQ + 2 * HK) * D, H, fp8, dev), _weight(H, HQ * D, fp8, dev),
              _weight(2 * FFN, H, fp8, dev), _weight(H, FFN, fp8, dev)]
        if ops is reference:
            ws = [w.dequantize() if fp8 else w for w in ws]
        norms = [(torch.randn(n, device=dev) * 0.1).to(torch.bfloat16) for n in (H, H, D, D)]
        if FOLD_NORMS and not fp8 and ops is not reference:  # what DSparkDrafter.fold_norms does
            ws[0], ws[2] = NormFolded.fold(ws[0], norms[0]), NormFolded.fold(ws[2], norms[1])
        layers.append((ws, norms, _kv_step(r, context, dev)))
    x0 = torch.randn(rows, H, device=dev).to(torch.bfloat16)
    positions = layers[0][2][3]
    cos, sin = reference.rope_cos_sin(positions, ROT, THETA)

    def step():
        x = x0
        for (wq, wo, wgu, wd), (n1, n2, qn, kn), (kv, tables, seq_lens, pos, slots) in layers:
            q = ops.norm_qkv_prelude(x, n1, EPS, wq, qn, kn, cos, sin, kv, slots, HQ, HK)
            a = ops.paged_window_attention(q, kv, pos, seq_lens, tables, QPR, WINDOW, D ** -0.5)
            h = ops.linear(a.reshape(rows, HQ * D), wo, x, accumulate=x is not x0)  # as DecoderLayer
            x = ops.linear(ops.norm_linear_swiglu(h, n2, EPS, wgu, ALPHA, LIMIT), wd, h, accumulate=True)
        return x

    return step


def bench_step(rows: int, context: int, bw: float, dev: torch.device, fp8: bool, ops) -> dict:
    """The step of `make_step`, CUDA-graphed (eager for the reference), against the floor."""
    r = rows // QPR
    step = make_step(rows, context, dev, fp8, ops)
    graph = ops is not reference  # the reference attention reads seq_lens on the host: not capturable
    t = _time(step, reps=10, graph=graph)
    keys = min(context + QPR, WINDOW + QPR - 1)
    nbytes = 5 * (_wbytes((HQ + 2 * HK) * D, H, fp8) + _wbytes(H, HQ * D, fp8) + _wbytes(2 * FFN, H, fp8)
                  + _wbytes(H, FFN, fp8) + r * keys * 2 * HK * D * 2)
    name = f"step 5 layers {'triton' if graph else 'reference eager'}"
    print(f"{name:28s} rows {rows:2d} {'fp8' if fp8 else 'bf16':4s} {t * 1e6:8.1f} us  floor "
          f"{nbytes / bw * 1e6:7.1f} us  x{t * bw / nbytes:5.2f}", flush=True)
    return dict(op=name, rows=rows, weights="fp8" if fp8 else "bf16", us=t * 1e6, floor_us=nbytes / bw * 1e6,
                x_floor=t * bw / nbytes)


# Step-level tuning: (label, {module: {tunable: value}}) applied in order on top of the defaults.
# Each row is timed as the whole 5-layer step: what a tunable costs or saves in one kernel can
# move into its neighbours (L2 contents, the tail of one launch against the next).
TUNE = (
    ("defaults", {}),
    ("attention 16 warps", {"attention": {"NUM_WARPS": 16}}),
    ("attention 4 warps", {"attention": {"NUM_WARPS": 4}}),
    ("attention 16 warps, block_n 128", {"attention": {"NUM_WARPS": 16, "BLOCK_N": 128}}),
    ("attention 16 warps, 2 programs/SM", {"attention": {"NUM_WARPS": 16, "PROGRAMS_PER_SM": 2}}),
    ("defaults (w)", {}),
    ("every GEMM on Triton (blas.PLAIN_MIN_ROWS 0, NORM_MIN_ROWS 0)", {"blas": {"PLAIN_MIN_ROWS": 0, "NORM_MIN_ROWS": 0}}),
    ("defaults (v)", {}),
    ("plain linears on the Triton GEMM (blas.PLAIN_MIN_ROWS 0)", {"blas": {"PLAIN_MIN_ROWS": 0}}),
    ("defaults (v 2)", {}),
    ("vendor plain linears, residual added by a second launch (blas.ADDMM off)", {"blas": {"ADDMM": False}}),
    ("defaults (v 3)", {}),
    ("folded-norm GEMMs on Triton (blas.NORM_MIN_ROWS 0)", {"blas": {"NORM_MIN_ROWS": 0}}),
    ("defaults (v 4)", {}),
    ("the vendor GEMMs from 17 rows only (session 11's thresholds)",
     {"blas": {"PLAIN_MIN_ROWS": 17, "NORM_MIN_ROWS": 17}}),
    ("defaults (v 5)", {}),
    ("x^2 in every GEMM program (before SQ_COLUMN)", {"gemm": {"SQ_COLUMN": False}}),
    ("defaults (sq)", {}),
    ("x^2 in every GEMM program (before SQ_COLUMN) (2)", {"gemm": {"SQ_COLUMN": False}}),
    ("defaults (sq 2)", {}),
    ("no TMA (the weights' path before run 25)", {"gemm": {"TMA": False}}),
    ("no TMA (2)", {"gemm": {"TMA": False}}),
    ("TMA, every GEMM deep (1 program/SM)", {"gemm": {"MIN_STAGES": 99}}),
    ("norms not folded into the weights", {"step": {"FOLD_NORMS": False}}),
    ("before run 5: no deep pipeline, <= 4 stages", {"gemm": {"DEEP_SMEM": 0, "MAX_STAGES": 4}}),
    ("no deep pipeline", {"gemm": {"DEEP_SMEM": 0}}),
    ("every GEMM deep (1 program/SM)", {"gemm": {"MIN_STAGES": 99}}),
    ("defaults (2)", {}),
    ("before run 5 (2)", {"gemm": {"DEEP_SMEM": 0, "MAX_STAGES": 4}}),
    ("gemm >= 8 K tiles per split", {"gemm": {"MIN_K_TILES_PER_SPLIT": 8}}),
    ("gemm >= 12 K tiles per split", {"gemm": {"MIN_K_TILES_PER_SPLIT": 12}}),
    ("gemm >= 8 K tiles per split, 3 programs/SM", {"gemm": {"MIN_K_TILES_PER_SPLIT": 8, "PROGRAMS_PER_SM": 3}}),
    ("defaults (3)", {}),
    ("gemm block_n 64", {"gemm": {"BLOCK_N": 64}}),
    ("gemm block_n 256", {"gemm": {"BLOCK_N": 256}}),
    ("gemm block_k 32", {"gemm": {"BLOCK_K": 32}}),
    ("gemm 1 program/SM", {"gemm": {"PROGRAMS_PER_SM": 1}}),
    ("gemm 3 programs/SM", {"gemm": {"PROGRAMS_PER_SM": 3}}),
    ("attention >= 2 key tiles/split", {"attention": {"MIN_TILES_PER_SPLIT": 2}}),
    ("attention block_n 32", {"attention": {"BLOCK_N": 32}}),
    ("attention 2 programs/SM", {"attention": {"PROGRAMS_PER_SM": 2}}),
    ("attention 4 programs/SM", {"attention": {"PROGRAMS_PER_SM": 4}}),
    ("attention block_n 128", {"attention": {"BLOCK_N": 128}}),
    ("attention 2 programs/SM, block_n 128", {"attention": {"PROGRAMS_PER_SM": 2, "BLOCK_N": 128}}),
    ("defaults again (noise)", {}),
    ("attention >= 8 key tiles/split", {"attention": {"MIN_TILES_PER_SPLIT": 8}}),
    ("attention >= 4 key tiles/split", {"attention": {"MIN_TILES_PER_SPLIT": 4}}),
    ("defaults (4)", {}),
    ("attention 4 stages", {"attention": {"NUM_STAGES": 4}}),
    ("attention 5 stages", {"attention": {"NUM_STAGES": 5}}),
    ("attention 6 stages", {"attention": {"NUM_STAGES": 6}}),
    ("defaults (5)", {}),
    ("attention block_n 32, 6 stages", {"attention": {"BLOCK_N": 32, "NUM_STAGES": 6}}),
    ("gemm 8 warps", {"gemm": {"NUM_WARPS": 8}}),
    ("defaults (6)", {}),
    ("attention: splits merged by a separate kernel (before run 52)", {"attention": {"COOP_MERGE": False}}),
    ("defaults (7)", {}),
    ("attention: splits merged by a separate kernel (2)", {"attention": {"COOP_MERGE": False}}),
    ("defaults (8)", {}),
    ("no programmatic dependent launch (runtime.PDL off, before run 159)", {"runtime": {"PDL": False}}),
    ("defaults (pdl)", {}),
    ("no programmatic dependent launch (2)", {"runtime": {"PDL": False}}),
    ("defaults (pdl 2)", {}),
    ("attention >= 2 key tiles/split, merged in the launch up to 32 splits (R = 1 at 32)",
     {"attention": {"MIN_TILES_PER_SPLIT": 2, "COOP_MAX_SPLITS": 32}}),
    ("defaults (nt)", {}),
    # PDL at each kind of boundary: the kernels named launch without it (runtime.PDL_EXCEPT).
    ("PDL except the GEMMs", {"runtime": {"PDL_EXCEPT": frozenset({"gemm"})}}),
    ("PDL except the finalizes", {"runtime": {"PDL_EXCEPT": frozenset({"finalize"})}}),
    ("PDL except the GEMMs and finalizes", {"runtime": {"PDL_EXCEPT": frozenset({"gemm", "finalize"})}}),
    ("PDL except the prelude", {"runtime": {"PDL_EXCEPT": frozenset({"prelude"})}}),
    ("PDL except the attention and its merge", {"runtime": {"PDL_EXCEPT": frozenset({"attention", "merge"})}}),
    ("defaults (pdl except)", {}),
    ("gemm stages from SMEM_PER_PROGRAM alone (EXACT_RESIDENCY off, before run 173)",
     {"gemm": {"EXACT_RESIDENCY": False}}),
    ("defaults (er)", {}),
    ("gemm stages from SMEM_PER_PROGRAM alone (EXACT_RESIDENCY off) (2)", {"gemm": {"EXACT_RESIDENCY": False}}),
    ("defaults (er 2)", {}),
    # Since run 178 the x^2 column is planned into the slots and the attention runs 3 stages by default
    # (the rows that once tried each over the defaults were removed then: they had become the defaults).
    ("the x^2 column beside the slots, attention 2 stages (before run 178)",
     {"gemm": {"PLAN_SQ_COLUMN": False}, "attention": {"NUM_STAGES": 2}}),
    ("defaults (178)", {}),
    ("the x^2 column beside the slots, attention 2 stages (2)",
     {"gemm": {"PLAN_SQ_COLUMN": False}, "attention": {"NUM_STAGES": 2}}),
    ("defaults (178 2)", {}),
    # MXFP8 weights (run with --tune-fp8): the GEMMs' dequantizing paths. Run 152 measured these
    # with swap A/B off by default; since then it is on from 33 rows (gemm.FP8_SWAP_MIN_ROWS).
    ("fp8 swap A/B at every row count", {"gemm": {"FP8_SWAP_MIN_ROWS": 0}}),
    ("fp8 swap A/B never", {"gemm": {"FP8_SWAP_MIN_ROWS": 1 << 30}}),
    ("fp8 8 warps, 1 program/SM", {"gemm": {"FP8_NUM_WARPS": 8, "PROGRAMS_PER_SM": 1}}),
    ("fp8 defaults", {}),
    ("fp8 block_k 128", {"gemm": {"FP8_BLOCK_K": 128}}),
    ("fp8 block_n 64", {"gemm": {"BLOCK_N": 64}}),
    ("fp8 3 programs/SM", {"gemm": {"PROGRAMS_PER_SM": 3}}),
    ("fp8 defaults (2)", {}),
    ("fp8 fp32 dequantization (before the packed PTX)", {"gemm": {"FP8_PACKED_DEQUANT": False}}),
    ("fp8 defaults (3)", {}),
)


def tune(rows_list: list[int], context: int, bw: float, dev: torch.device, match: list[str] | None = None,
         fp8: bool = False) -> list[dict]:
    """Time the step once per TUNE row (each a set of tunables over the defaults), restoring after.

    match: only the rows whose label contains one of these, and the first ("defaults").
    fp8: the step with MXFP8 layer weights."""
    modules = {"gemm": gemm, "blas": blas, "attention": attention, "runtime": runtime, "step": sys.modules[__name__]}
    rows_run = [(label, c) for label, c in TUNE if not match or label == "defaults" or any(m in label for m in match)]
    out = []
    for rows in rows_list:
        for label, changes in rows_run:
            saved = {(m, k): getattr(modules[m], k) for m, kv in changes.items() for k in kv}  # no such tunable: raises
            try:
                for m, kv in changes.items():
                    for k, v in kv.items():
                        setattr(modules[m], k, v)
                print(f"-- {label}", flush=True)
                out.append(dict(bench_step(rows, context, bw, dev, fp8, T), tune=label))
            finally:
                for (m, k), v in saved.items():
                    setattr(modules[m], k, v)
    return out


def profile(rows: int, context: int, dev: torch.device, fp8: bool = False) -> None:
    """Per-kernel GPU time of the step, eager, from the CUDA profiler: where the step's time goes,
    and (against the graphed step) how much of it is gaps between kernels."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    step = make_step(rows, context, dev, fp8, T)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    reps = 5
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in events) / reps
    print(f"profile rows {rows}{' fp8' if fp8 else ''}: kernel time per step {total:.1f} us "
          "(sum of kernel durations)", flush=True)
    shapes = _launch_shapes(prof)
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:14]:
        print(f"  {e.self_device_time_total / reps:8.1f} us  {e.count // reps:3d} launches  {e.key[:90]}", flush=True)
        for shape in sorted(shapes.get(e.key, ())):
            print(f"{'':30s}{shape}", flush=True)


def _launch_shapes(prof) -> dict[str, set[str]]:
    """Kernel name -> its distinct launch shapes (grid, block, registers, shared memory) from the
    profiler's trace: whether a kernel's grid covers the SMs at all (e.g. a vendor GEMM's tiles)."""
    import json
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as written:  # the profiler writes the file by its name
            trace = json.load(written)
    shapes: dict[str, set[str]] = {}
    for ev in trace.get("traceEvents", []):
        a = ev.get("args") or {}
        if ev.get("cat") == "kernel" and "grid" in a:
            shapes.setdefault(ev["name"], set()).add(
                f"grid {a['grid']} block {a.get('block')} regs {a.get('registers per thread')} "
                f"smem {a.get('shared memory')} B, {a.get('blocks per SM', '?')} blocks/SM")
    return shapes


def fit_fixed_and_rate(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares line t = t0 + nbytes / B through (nbytes, seconds) points -> (t0 in s, B in bytes/s)."""
    if len({b for b, _ in points}) < 2:
        raise ValueError("fit_fixed_and_rate: needs points at two or more sizes")
    n = len(points)
    mb, mt = sum(b for b, _ in points) / n, sum(t for _, t in points) / n
    slope = sum((b - mb) * (t - mt) for b, t in points) / sum((b - mb) ** 2 for b, _ in points)
    return mt - slope * mb, 1.0 / slope


FIT_N = (2304, 6144, 12288, 24576, 36864)  # output columns: the shard's qkv and o_proj widths, then larger


def bench_fit(rows: int, k: int, bw: float, dev: torch.device) -> list[dict]:
    """A plain GEMM [rows, k] x [n, k]^T at each FIT_N, by the Triton GEMM (its plan; with split-K
    the finalize launch included) and by cuBLAS (torch.matmul) in the same run, then per backend
    the fit t = t0 + weight bytes / B: B is the rate at which a launch streams weights once it
    runs, t0 what each launch costs on top (launch, pipeline fill, tail)."""
    pts: dict[str, list[tuple[float, float]]] = {"triton": [], "cublas": []}
    for n in FIT_N:
        nbytes = 2 * n * k

        def make(cublas: bool):
            x = torch.randn(rows, k, device=dev).to(torch.bfloat16)
            w = (torch.randn(n, k, device=dev) * k ** -0.5).to(torch.bfloat16)
            return (lambda: torch.matmul(x, w.t())) if cublas else (lambda: gemm.gemm(x, w))

        for name in pts:
            pts[name].append((nbytes, _per_call(lambda name=name: make(name == "cublas"), nbytes)))
        print(f"fit rows {rows:2d} k {k} n {n:5d}: " + "  ".join(f"{name} {p[-1][1] * 1e6:7.1f} us" for name, p in pts.items()),
              flush=True)
    out = []
    for name, p in pts.items():
        t0, rate = fit_fixed_and_rate(p)
        print(f"FIT rows {rows:2d} k {k} {name:6s}: t0 {t0 * 1e6:5.2f} us per launch, streaming "
              f"{rate / 1e12:4.2f} TB/s = {rate / bw:4.2f} x the copy bandwidth", flush=True)
        out.append(dict(op=f"fit {name}", rows=rows, k=k, t0_us=t0 * 1e6, rate=rate, rate_x_copy=rate / bw,
                        points=[dict(nbytes=b, us=t * 1e6) for b, t in p]))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[7, 56])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--sweep", action="store_true", help="also time a few GEMM tilings and attention splits")
    ap.add_argument("--no-step", action="store_true", help="skip the 5-layer step figures")
    # One "only" mode at a time: --fit with --profile skipped the rows check and profiled 8 rows into a
    # kernel's shape error; --fit or --profile with --tune dropped the tuning without a word.
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--tune", action="store_true", help="only time the step under each TUNE row of tunables")
    ap.add_argument("--tune-match", nargs="+", help="with --tune: only TUNE rows whose label contains one of these (and the first)")
    ap.add_argument("--tune-fp8", action="store_true", help="with --tune or --profile: the step with MXFP8 layer weights")
    mode.add_argument("--profile", action="store_true", help="only print the step's per-kernel GPU times")
    mode.add_argument("--fit", action="store_true",
                      help="only fit one GEMM launch's fixed cost and streaming rate (Triton and cuBLAS) over N")
    ap.add_argument("--fit-k", type=int, nargs="+", default=[6144, 2048], help="with --fit: the K values")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    # Every figure but --fit's GEMMs builds r = rows / 7 requests of 7 query rows: other counts gave
    # tensors of mismatched rows (8 rows, 7 positions) that failed deep in a kernel launch.
    if not args.fit and any(r < QPR or r % QPR for r in args.rows):
        ap.error(f"--rows: multiples of {QPR} (7 query rows per request), got {args.rows}")
    # --fit's GEMMs take any row count, but not none or fewer: 0 rows timed launches that return at
    # once (a fit of nothing), a negative count failed in torch.randn after the bandwidth copy; a K of
    # 0 gave every size 0 weight bytes and the fit raised only after all the timings.
    if args.fit and any(r < 1 for r in args.rows):
        ap.error(f"--rows: with --fit, at least 1 row each, got {args.rows}")
    if any(k < 1 for k in args.fit_k):
        ap.error(f"--fit-k: at least 1 each, got {args.fit_k}")
    if args.context < 0:
        ap.error(f"--context: committed keys per request, at least 0, got {args.context}")
    if args.json and args.profile:  # profile() prints its figures only: the run ended with no file written
        ap.error("--json: --profile prints its figures and writes none")
    if args.json:  # here, not after the GPU work: a missing folder raised at the end and lost every figure
        try:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            ap.error(f"--json: cannot make the folder of {args.json}: {e}")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    bw = copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name(dev)}: copy bandwidth {bw / 1e12:.2f} TB/s (read + write)", flush=True)
    results = []
    if args.profile:
        for rows in args.rows:
            profile(rows, args.context, dev, args.tune_fp8)
        return
    if args.fit:
        results = [r for rows in args.rows for k in args.fit_k for r in bench_fit(rows, k, bw, dev)]
    elif args.tune:
        results = tune(args.rows, args.context, bw, dev, args.tune_match, args.tune_fp8)
    for rows in [] if args.tune or args.fit else args.rows:
        results += bench_ops(rows, args.context, bw, dev, args.sweep)
        if not args.no_step:
            for fp8 in (False, True):
                results.append(bench_step(rows, args.context, bw, dev, fp8, T))
            results.append(bench_step(rows, args.context, bw, dev, False, reference))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(dev), copy_bw=bw, context=args.context,
                           results=results), f, indent=1)


if __name__ == "__main__":
    main()
