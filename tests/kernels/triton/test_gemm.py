"""Parity of the Triton skinny GEMMs (linear, norm_linear, norm_linear_swiglu; bf16/fp32 and MXFP8) with the reference."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from dspark_sidecar.kernels import reference  # noqa: E402
from dspark_sidecar.kernels.triton import gemm  # noqa: E402
from dspark_sidecar.kernels.triton.ops import TRITON_OPS  # noqa: E402
from dspark_sidecar.kernels.weights import MxFp8Weight, NormFolded  # noqa: E402

EPS, ALPHA, LIMIT = 1e-6, 1.702, 7.0
# (rows, in, out): one block, three blocks with ragged K/N tiles, a full launch of 8 requests,
# 20 requests (three row tiles of 64, the last ragged: the GEMM takes any row count).
SHAPES = [(7, 256, 96), (21, 320, 200), (56, 128, 64), (140, 128, 96)]
# None: the planner's choice; then one K-range (direct epilogue) and three (workspace + finalize).
CONFIGS = {"plan": None, "split1": gemm.GemmConfig(32, 32, 64, 1), "split3": gemm.GemmConfig(16, 64, 64, 3)}


def _inputs(rows: int, k: int, n: int, dtype: torch.dtype, device: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen) * 2.0
    w = torch.randn(n, k, generator=gen) * k ** -0.5
    nw = torch.randn(k, generator=gen) * 0.1
    return x.to(device, dtype), w.to(device, dtype), nw.to(device, dtype)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_linear_ops(device, shape, dtype, seed, parity):
    x, w, nw = _inputs(*shape, dtype, device, seed)
    refs = (reference.linear(x, w), reference.norm_linear(x, nw, EPS, w),
            reference.norm_linear_swiglu(x, nw, EPS, w, ALPHA, LIMIT))
    outs = (TRITON_OPS.linear(x, w), TRITON_OPS.norm_linear(x, nw, EPS, w),
            TRITON_OPS.norm_linear_swiglu(x, nw, EPS, w, ALPHA, LIMIT))
    for out, ref in zip(outs, refs, strict=True):
        parity(out, ref)


@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16w", "fp8w"])
def test_split_k_and_fp8(device, config, fp8, parity):
    """Every epilogue path (direct, split-K workspace) with bf16 and MXFP8 weights."""
    x, w, nw = _inputs(21, 320, 200, torch.bfloat16, device, seed=2)
    weight = MxFp8Weight.quantize(w) if fp8 else w
    dense = weight.dequantize(torch.bfloat16) if fp8 else w  # what the reference computes with
    ref_nl = reference.norm_linear(x, nw, EPS, dense)
    ref_sw = reference.norm_linear_swiglu(x, nw, EPS, dense, ALPHA, LIMIT)
    cfg = CONFIGS[config]
    parity(gemm.gemm(x, weight, nw, EPS, config=cfg), ref_nl)
    parity(gemm.gemm(x, weight, nw, EPS, swiglu=(ALPHA, LIMIT), config=cfg), ref_sw)


@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
def test_residual_in_epilogue(device, config, parity):
    """linear(x, w, residual): the residual added in both epilogues (direct and finalize), after
    the product's rounding, as reference.linear's `residual + y`; a residual far larger than
    the product would hide a missing add, so it is of the same size."""
    x, w, _ = _inputs(21, 320, 200, torch.bfloat16, device, seed=6)
    res = torch.randn(21, 200, generator=torch.Generator().manual_seed(7)).to(device, torch.bfloat16)
    ref = reference.linear(x, w, res)
    out = gemm.gemm(x, w, residual=res, config=CONFIGS[config])
    parity(out, ref)
    assert (out - reference.linear(x, w)).abs().max() > 0.5  # the add happened
    # Two roundings, as the reference's: the product rounded to bf16, then the sum. Adding the residual
    # to the fp32 product (one rounding) stays within parity's tolerance but is not the reference's maths.
    assert torch.equal(out, (gemm.gemm(x, w, config=CONFIGS[config]).float() + res.float()).to(torch.bfloat16))
    with pytest.raises(ValueError, match="residual"):
        gemm.gemm(x, w, residual=res[:, :100])
    # The kernels read the residual at unit column stride: a column-strided one is refused, not misread.
    with pytest.raises(ValueError, match="residual"):
        gemm.gemm(x, w, residual=res.t().contiguous().t())


def test_residual_dtype_must_be_the_activations(device):
    """A residual wider than x (fp32 under bf16 activations): the reference's `residual + y` returns
    the fp32 sum, while the GEMM wrote it in x.dtype, the residual stream silently rounded to bf16
    (and with accumulate, over an fp32 residual, was refused as a wrong `out`). Refused, named."""
    x, w, _ = _inputs(7, 64, 32, torch.bfloat16, device, seed=19)
    res = torch.randn(7, 32, generator=torch.Generator().manual_seed(20)).to(device)
    assert reference.linear(x, w, res).dtype == torch.float32
    for cfg in (CONFIGS["split1"], CONFIGS["split3"]):
        with pytest.raises(ValueError, match="residual dtype"):
            gemm.gemm(x, w, residual=res, config=cfg)
    with pytest.raises(ValueError, match="residual dtype"):
        gemm.gemm(x, w, residual=res, out=res)  # Ops.linear's accumulate


@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
def test_sum_written_over_the_residual(device, config):
    """out=residual (Ops.linear's accumulate): each residual element is read by the program that
    writes it, in the direct epilogue and in the finalize: the same bits as a fresh output."""
    x, w, _ = _inputs(21, 320, 200, torch.bfloat16, device, seed=16)
    res = torch.randn(21, 200, generator=torch.Generator().manual_seed(17)).to(device, torch.bfloat16)
    fresh = gemm.gemm(x, w, residual=res, config=CONFIGS[config])
    acc = res.clone()
    got = gemm.gemm(x, w, residual=acc, out=acc, config=CONFIGS[config])
    assert got.data_ptr() == acc.data_ptr() and torch.equal(got, fresh)
    assert torch.equal(TRITON_OPS.linear(x, w, res.clone(), accumulate=True), TRITON_OPS.linear(x, w, res))
    with pytest.raises(ValueError, match="out"):
        gemm.gemm(x, w, residual=res, out=torch.empty(21, 200, dtype=torch.float32, device=device))
    # The right shape and dtype but column-major: written as if row-major, every element misplaced.
    with pytest.raises(ValueError, match="out"):
        gemm.gemm(x, w, residual=res, out=torch.empty(200, 21, dtype=torch.bfloat16, device=device).t())


@pytest.mark.parametrize(("fp8", "swap"), [(False, False), (True, False), (True, True)],
                         ids=["bf16w", "fp8w", "fp8w-swap"])
@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
def test_weights_through_tensor_descriptors(device, config, fp8, swap, parity, monkeypatch):
    """The TMA path an H100/H200 takes (in the interpreter, by claiming sm_90 there), for dense
    weights and for MXFP8's bits, against the pointer path: ragged N and K (the copy's zero fill
    past the ends), a gate tile that reaches past N into the up rows (columns never stored), the
    residual, split-K. Both read the same tiles into the same dots: the same bits."""
    x, w, nw = _inputs(21, 320, 200, torch.bfloat16, device, seed=9)
    if fp8:
        w = MxFp8Weight.quantize(w)
    monkeypatch.setattr(gemm, "FP8_SWAP_MIN_ROWS", 0 if swap else 1 << 30)  # MXFP8 tiles as the dot's left operand
    res = torch.randn(21, 200, generator=torch.Generator().manual_seed(10)).to(device, torch.bfloat16)
    cfg = CONFIGS[config]

    def run():
        return (gemm.gemm(x, w, nw, EPS, config=cfg), gemm.gemm(x, w, nw, EPS, swiglu=(ALPHA, LIMIT), config=cfg),
                gemm.gemm(x, w, residual=res, config=cfg))

    monkeypatch.setattr(gemm, "TMA", False)
    by_pointers = run()
    monkeypatch.setattr(gemm, "TMA", True)
    if device == "cpu":
        monkeypatch.setattr(gemm, "sm90_of", lambda t: True)
    by_tma = run()
    dense = w.dequantize() if fp8 else w
    refs = (reference.norm_linear(x, nw, EPS, dense), reference.norm_linear_swiglu(x, nw, EPS, dense, ALPHA, LIMIT),
            reference.linear(x, dense, res))
    for tma, ptr, ref in zip(by_tma, by_pointers, refs, strict=True):
        parity(tma, ref)
        assert torch.equal(tma, ptr)


def test_fp8_scales_applied_in_kernel(device):
    """A weight whose blocks span 2^-20..2^12 (block exponents up to MAX_EXPONENT): a kernel ignoring
    or misplacing them is off by orders. A block needing more is refused when quantized."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(64, 128, generator=gen) * torch.exp2(torch.randint(-20, 13, (64, 4), generator=gen).float()).repeat_interleave(32, 1)
    with pytest.raises(ValueError, match="above 134"):
        MxFp8Weight.quantize(w * 2.0 ** 6)
    weight = MxFp8Weight.quantize(w).to(device)
    x = torch.randn(7, 128, generator=gen).to(device, torch.bfloat16)
    ref = reference.linear(x, weight.dequantize())
    out = TRITON_OPS.linear(x, weight)
    rel = ((out.double() - ref.double()).abs() / ref.double().abs().clamp(min=1e-30)).median()
    assert rel < 2.0 ** -6, f"median relative error {rel:.3g}"


def test_fp8_dequant_is_exact_for_every_code(device):
    """Every finite F8_E4M3 code (subnormals and both zeros included) at block exponents from 10 to
    134 (MAX_EXPONENT), where every value stays a normal bf16, as the dequantizing kernel sees it
    (on an H100/H200 the packed PTX path, else the fp32 one): the identity
    times W^T gives W's dequantized values back, equal to the reference's bit for bit. (The NaN
    code, S.1111.111, is refused at load: test_mxfp8_weight_refuses_nan_codes.)"""
    k, n = 64, 256  # two 32-blocks; row r holds the codes (r + 3 k) % 256, the NaN codes made zeros
    codes = (torch.arange(n)[:, None] + 3 * torch.arange(k)[None, :]) % 256
    codes = torch.where(codes % 128 == 127, 0, codes)
    exps = torch.tensor([10, 100, 118, 127, 131, 134], dtype=torch.uint8)
    scale = exps[(torch.arange(n)[:, None] + 5 * torch.arange(k // 32)[None, :]) % len(exps)]
    weight = MxFp8Weight(codes.to(torch.uint8).view(torch.float8_e4m3fn), scale).to(device)
    eye = torch.eye(k, dtype=torch.bfloat16, device=device)
    out = TRITON_OPS.linear(eye, weight)  # [k, n]: out[j, r] = W[r, j]
    ref = weight.dequantize(torch.float32).to(torch.bfloat16).t()
    assert ref.abs().min() == 0 and ref.abs().max() == 448 * 2.0 ** 7
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_swiglu_oai(device, dtype, parity):
    """Gates and ups well past +-7, so both clamps and the unclamped negative gate are exercised."""
    gu = (torch.randn(14, 2 * 96, generator=torch.Generator().manual_seed(4)) * 6.0).to(device, dtype)
    assert (gu[:, :96] > LIMIT).any() and (gu[:, 96:] < -LIMIT).any() and (gu[:, :96] < -LIMIT).any()
    out = TRITON_OPS.swiglu_oai(gu, ALPHA, LIMIT)
    parity(out, reference.swiglu_oai(gu, ALPHA, LIMIT))
    # A column-major gate|up (the kernel reads rows at unit stride): the same result.
    assert torch.equal(TRITON_OPS.swiglu_oai(gu.t().contiguous().t(), ALPHA, LIMIT), out)


@pytest.mark.parametrize("config", ["split1", "split3"])
def test_norm_eps_counts_for_rows_of_small_magnitude(device, config, parity):
    """rsqrt(mean(x^2) + eps) on rows whose mean square is about eps (x ~ 1e-3), and a zero row (0, where
    rsqrt(0) would make it NaN): at unit-size activations an eps dropped or misscaled in the direct
    epilogue or the finalize is invisible. One column tile (32 <= block_n) with three K-ranges: the
    partial sums of squares are stored by the only column tile there is."""
    x, w, nw = _inputs(7, 192, 32, torch.float32, device, seed=21)
    x = x * 5e-4
    x[2] = 0.0
    cfg = CONFIGS[config]
    assert gemm._tiling(x, w, 32, False, cfg)[1] == cfg.split_k
    parity(gemm.gemm(x, w, nw, EPS, config=cfg), reference.norm_linear(x, nw, EPS, w))
    parity(gemm.gemm(x, NormFolded.fold(w, nw), nw, EPS, swiglu=(ALPHA, LIMIT), config=cfg),
           reference.norm_linear_swiglu(x, nw, EPS, w, ALPHA, LIMIT))


def test_plan_fills_an_h200():
    """At the TP-4 rank shapes the grid covers the 132 SMs and the K-ranges tile K exactly."""
    for rows in (7, 56):
        for n, k in ((2304, 6144), (6144, 2048), (3072, 6144), (6144, 3072)):  # gate_up: 3072 per half
            cfg = gemm.plan(rows, n, k, 132)
            # The K per range gemm._tiling launches (whole K tiles): every range holds some of K.
            # (With ceil(k / split_k), not rounded to whole tiles, the check held for any split_k here.)
            k_per = -(-(-(-k // cfg.split_k)) // cfg.block_k) * cfg.block_k
            assert (cfg.split_k - 1) * k_per < k <= cfg.split_k * k_per
            assert -(-n // cfg.block_n) * -(-rows // cfg.block_m) * cfg.split_k >= 132
            assert cfg.block_m >= rows or cfg.block_m == 64


def test_plan_can_count_the_x2_column_among_the_slots(monkeypatch):
    """qkv at 56 rows, folded: 18 column tiles + the x^2 column. Counted (PLAN_SQ_COLUMN, the default
    since run 177), the whole grid fits the 264 two-per-SM slots; not counted, 14 K-ranges make 266
    programs. A plain linear's plan is the same either way."""
    on = gemm.plan(56, 2304, 6144, 132, sq_column=True)
    monkeypatch.setattr(gemm, "PLAN_SQ_COLUMN", False)
    off = gemm.plan(56, 2304, 6144, 132, sq_column=True)
    assert off.split_k == 14 and 19 * off.split_k == 266
    k_per = -(-(6144 // 64) // on.split_k) * 64
    assert 19 * -(-6144 // k_per) <= 2 * 132 < 19 * off.split_k
    assert gemm.plan(56, 6144, 2048, 132) == gemm.plan(56, 6144, 2048, 132, sq_column=False)


@pytest.mark.parametrize("max_smem", [227 << 10, 160 << 10], ids=["h200", "mi355x"])
def test_plan_deep_pipeline_within_the_device(max_smem):
    """gate|up at 56 rows: a stage (x 8 KB + two 16 KB weight tiles) leaves < 3 stages in the
    shared budget, so the planner goes to one program per SM with a deeper pipeline that still
    fits the device's shared memory (less on an MI355X); the other GEMMs keep two per SM."""
    cfg = gemm.plan(56, 3072, 6144, 132, swiglu=True, max_smem=max_smem)
    stage = 64 * 64 * 2 + 2 * 64 * 128 * 2
    assert cfg.block_n == 128 and cfg.num_stages >= 3
    assert cfg.num_stages * stage <= max_smem - gemm.SMEM_RESERVE
    assert cfg.split_k * (3072 // 128) <= 132  # one program per SM: a single wave
    qkv = gemm.plan(56, 2304, 6144, 132, max_smem=max_smem)
    assert qkv.split_k * (2304 // 128) > 132  # two per SM


@pytest.mark.parametrize("weight_bytes", [2, 1], ids=["bf16w", "fp8w"])
@pytest.mark.parametrize("rows", [7, 56])
def test_plan_fits_a_device_with_less_shared_memory_than_a_program_budget(rows, weight_bytes):
    """An MI300X (the Triton backend serves it: not gfx950) gives a program 64 KB of LDS, less than
    SMEM_PER_PROGRAM: the two-per-SM stages were counted from that budget alone, and the 7-row qkv
    (5 stages of 18 KB) compiled for gfx942 to 66 KB, the 7-row down_proj to 72 KB, which do not
    launch. Every stage beyond the 2 a pipeline needs fits the device (below the compiler's reserve)."""
    max_smem = 64 << 10
    for n, k, swiglu in ((2304, 6144, False), (6144, 2048, False), (3072, 6144, True), (6144, 3072, False)):
        cfg = gemm.plan(rows, n, k, 304, swiglu=swiglu, weight_bytes=weight_bytes, max_smem=max_smem)
        stage = gemm.stage_bytes(cfg.block_m, cfg.block_n, cfg.block_k, swiglu, weight_bytes)
        assert cfg.num_stages == 2 or cfg.num_stages * stage <= max_smem - gemm.SMEM_RESERVE, (n, k, cfg)


def test_mxfp8_weight_from_checkpoint(tiny_ckpt, tiny_cfg):
    """The raw F8/U8 slices read by the loader path dequantize to what CheckpointReader.read returns."""
    from dspark_sidecar.drafter.checkpoint import CheckpointReader, layer_prefix

    reader = CheckpointReader(tiny_ckpt[0], torch.float32)
    key = f"{layer_prefix(0)}mlp.down_proj.weight"
    shape = (tiny_cfg.hidden_size, tiny_cfg.ffn_hidden_size)
    cols = slice(128, 256)
    w = MxFp8Weight.from_checkpoint(reader, key, shape, cols=cols)
    assert w.shape == (shape[0], 128) and w.scale.shape == (shape[0], 4)
    assert torch.equal(w.dequantize(torch.float32), reader.read(key, shape, cols=cols))
    rows = MxFp8Weight.cat([w[0:16], w[16:]])
    assert torch.equal(rows.qweight.view(torch.uint8), w.qweight.view(torch.uint8))
    with pytest.raises(ValueError):
        MxFp8Weight.from_checkpoint(reader, key, shape, cols=slice(8, 40))
    with pytest.raises(ValueError):
        MxFp8Weight(w.qweight, w.scale[:, :3])


class _OneWeightReader:
    """CheckpointReader's two members that MxFp8Weight.from_checkpoint uses, for one weight: its
    F8_E4M3 bits (u8 [rows, cols]) and one block exponent everywhere."""

    block = 32

    def __init__(self, bits: torch.Tensor, exponent: int = 120):
        self.bits, self.exponent = bits, exponent

    def _slice(self, key, shape, rows, cols):
        if key.endswith("_scale_inv"):
            return torch.full(shape, self.exponent, dtype=torch.uint8)
        return self.bits.view(torch.float8_e4m3fn)


def test_mxfp8_weight_refuses_nan_codes():
    """A slice holding the F8_E4M3 NaN code is a corrupt checkpoint: refused at load, naming the key
    and where (the kernels' dequantization reads that code as a finite value, gemm._dequant)."""
    from dspark_sidecar.drafter.checkpoint import CheckpointError

    bits = torch.full((4, 64), 0x38, dtype=torch.uint8)  # 1.0
    assert MxFp8Weight.from_checkpoint(_OneWeightReader(bits), "w", (4, 64)).shape == (4, 64)
    bits[2, 33] = 0xFF
    with pytest.raises(CheckpointError, match=r"w: 1 NaN F8_E4M3 codes .* \[2, 33\]"):
        MxFp8Weight.from_checkpoint(_OneWeightReader(bits), "w", (4, 64))


def test_mxfp8_weight_refuses_scales_the_kernels_do_not_take():
    """Block exponents above MAX_EXPONENT (2^7) are refused at load, naming the scale's key: the
    packed dequantization (gemm._dequant_sm90) holds 2^(e - 7) in a bf16."""
    from dspark_sidecar.drafter.checkpoint import CheckpointError
    from dspark_sidecar.kernels.weights import MAX_EXPONENT

    bits = torch.full((4, 64), 0x38, dtype=torch.uint8)
    assert MxFp8Weight.from_checkpoint(_OneWeightReader(bits, MAX_EXPONENT), "w", (4, 64)).scale.max() == MAX_EXPONENT
    with pytest.raises(CheckpointError, match=r"w_scale_inv: block exponent 135 above 134"):
        MxFp8Weight.from_checkpoint(_OneWeightReader(bits, MAX_EXPONENT + 1), "w", (4, 64))


# The TP-4 rank shard of the real drafter: hidden 6144, 16 q + 1 k + 1 v heads of 128 (qkv 2304
# rows), o_proj in 2048, gate|up 2 x 3072 rows, down_proj in 3072. GPU only (too big to interpret).
REAL = {"qkv": (2304, 6144, "norm"), "o_proj": (6144, 2048, "plain"),
        "gate_up": (6144, 6144, "swiglu"), "down_proj": (6144, 3072, "plain")}


# How dense weights reach the GEMM on an H100/H200: tensor descriptors (TMA, the default) or
# per-thread pointer loads (the path of MXFP8 weights and AMD GPUs), both checked there.
WEIGHTS_BY = {"tma": True, "pointers": False}


@pytest.mark.gpu
@pytest.mark.parametrize(("fp8", "weights_by", "swap"),
                         [(False, "tma", False), (False, "pointers", False), (True, "tma", False),
                          (True, "pointers", False), (True, "tma", True)],
                         ids=["bf16w-tma", "bf16w-pointers", "fp8w-tma", "fp8w-pointers", "fp8w-tma-swap"])
@pytest.mark.parametrize("rows", [7, 56])
@pytest.mark.parametrize("name", list(REAL))
def test_real_shapes(cuda, name, rows, fp8, weights_by, swap, parity, monkeypatch):
    """swap: MXFP8 tiles as the dot's left operand (gemm.FP8_SWAP_MIN_ROWS). Each is launched twice: the
    same bits both times (a wrong operand hand-off gave run-to-run different sums once, see
    test_real_shapes_folded_are_right_and_repeatable)."""
    monkeypatch.setattr(gemm, "TMA", WEIGHTS_BY[weights_by])
    monkeypatch.setattr(gemm, "FP8_SWAP_MIN_ROWS", 0 if swap else 1 << 30)
    n, k, kind = REAL[name]
    x, w, nw = _inputs(rows, k, n, torch.bfloat16, cuda, seed=5)
    weight = MxFp8Weight.quantize(w) if fp8 else w
    dense = weight.dequantize(torch.bfloat16) if fp8 else w
    res = torch.randn(rows, n, generator=torch.Generator().manual_seed(8)).to(cuda, torch.bfloat16)
    if kind == "norm":
        ref, run = reference.norm_linear(x, nw, EPS, dense), lambda: TRITON_OPS.norm_linear(x, nw, EPS, weight)
    elif kind == "swiglu":
        ref = reference.norm_linear_swiglu(x, nw, EPS, dense, ALPHA, LIMIT)
        run = lambda: TRITON_OPS.norm_linear_swiglu(x, nw, EPS, weight, ALPHA, LIMIT)  # noqa: E731
    else:
        ref, run = reference.linear(x, dense, res), lambda: TRITON_OPS.linear(x, weight, res)
    out = run()
    parity(out, ref)
    assert torch.equal(run(), out)


@pytest.mark.gpu
@pytest.mark.parametrize("weights_by", list(WEIGHTS_BY))
@pytest.mark.parametrize("rows", [7, 56])
def test_real_shapes_folded_are_right_and_repeatable(cuda, rows, weights_by, parity, monkeypatch):
    """The weights as the sidecar holds them (norms folded into qkv and gate|up) at the shard's
    shapes: the reference's result, and the same bits on every launch. At 56 rows (wgmma tiles)
    the folded GEMMs, their dot fed from x's pipelined shared-memory tile, gave wrong sums that
    differed from launch to launch on an H200; this is the test that caught it."""
    monkeypatch.setattr(gemm, "TMA", WEIGHTS_BY[weights_by])
    for name, (n, k, kind) in REAL.items():
        if kind == "plain":
            continue
        x, w, nw = _inputs(rows, k, n, torch.bfloat16, cuda, seed=11)
        folded = NormFolded.fold(w, nw)
        if kind == "swiglu":
            ref = reference.norm_linear_swiglu(x, nw, EPS, w, ALPHA, LIMIT)
            runs = [TRITON_OPS.norm_linear_swiglu(x, nw, EPS, folded, ALPHA, LIMIT) for _ in range(5)]
        else:
            ref = reference.norm_linear(x, nw, EPS, w)
            runs = [TRITON_OPS.norm_linear(x, nw, EPS, folded) for _ in range(5)]
        parity(runs[0], ref)
        assert all(torch.equal(r, runs[0]) for r in runs[1:]), f"{name}: launches differ"


@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_norm_folded_into_the_weight(device, config, dtype, parity):
    """A NormFolded weight (W * (1 + w)) gives the reference's norm_linear and norm_linear_swiglu
    of the unfolded weight, in both epilogues; the reference twin takes the folded weight too."""
    x, w, nw = _inputs(21, 320, 200, dtype, device, seed=4)
    folded = NormFolded.fold(w, nw)
    ref_nl = reference.norm_linear(x, nw, EPS, w)
    ref_sw = reference.norm_linear_swiglu(x, nw, EPS, w, ALPHA, LIMIT)
    cfg = CONFIGS[config]
    parity(gemm.gemm(x, folded, nw, EPS, config=cfg), ref_nl)
    parity(gemm.gemm(x, folded, nw, EPS, swiglu=(ALPHA, LIMIT), config=cfg), ref_sw)
    parity(reference.norm_linear(x, nw, EPS, folded), ref_nl)


@pytest.mark.parametrize("swiglu", [False, True], ids=["norm_linear", "swiglu"])
def test_folded_squares_summed_by_their_own_grid_column(device, swiglu, monkeypatch):
    """gemm.SQ_COLUMN: a folded split-K GEMM's x^2 row sums come from an extra grid column of x-only
    programs. Into a NaN-poisoned workspace, every K-range's sums must be written, equal to the
    sums each column tile accumulated in its own K loop before (exactly in the interpreter, where
    both reduce the same tiles in the same order; on a GPU to fp32 rounding, the two loops' tiles
    may be laid out differently across threads), and the partial products are unchanged."""
    x, w, nw = _inputs(21, 320, 200, torch.bfloat16, device, seed=6)
    folded = NormFolded.fold(torch.cat([w, w.flip(0)]) if swiglu else w, nw)
    cfg, split, k_per = gemm._tiling(x, folded, 200, swiglu, CONFIGS["split3"])
    assert split == 3
    got = {}
    for column in (True, False):
        monkeypatch.setattr(gemm, "SQ_COLUMN", column)
        ws, sq = gemm._workspace(x, folded, split)
        ws.fill_(float("nan"))
        sq.fill_(float("nan"))
        gemm._launch(x, folded, nw, EPS, (ALPHA, LIMIT) if swiglu else None, cfg, k_per, ws, sq, None)
        got[column] = ws, sq
    (ws_c, sq_c), (ws_l, sq_l) = got[True], got[False]
    assert torch.isfinite(sq_c).all() and torch.isfinite(ws_c).all()
    assert torch.equal(ws_c, ws_l)
    if device == "cpu":
        assert torch.equal(sq_c, sq_l)
    else:
        torch.testing.assert_close(sq_c, sq_l, rtol=1e-6, atol=0)


def test_norm_folded_is_refused_where_it_would_be_wrong():
    """With another norm weight, or with none (a plain linear), a folded weight is an error, never
    a silently different product; MXFP8 weights cannot be folded (one scale per 32 columns)."""
    x, w, nw = _inputs(7, 64, 32, torch.float32, "cpu", seed=5)
    folded = NormFolded.fold(w, nw)
    with pytest.raises(ValueError, match="another norm weight"):
        reference.norm_linear(x, nw.clone(), EPS, folded)
    with pytest.raises(ValueError, match="another norm weight"):
        gemm._launch(x, folded, nw.clone(), EPS, None, CONFIGS["split1"], 64, x.new_empty(7, 32), x, None)
    with pytest.raises(TypeError, match="dense weight"):
        NormFolded.fold(MxFp8Weight.quantize(w), nw)


def test_no_rows(device):
    """0 rows (an empty launch): every GEMM entry point returns its empty result, as the reference
    does; the qkv GEMM's partials planned their tiling first and divided by 0 row tiles."""
    x, w, nw = _inputs(7, 64, 32, torch.float32, device, seed=7)
    x = x[:0]
    assert gemm.gemm(x, w, nw, EPS).shape == (0, 32)
    assert gemm.norm_linear_partials(x, w, nw, EPS).ws.shape[1:] == (0, 32)
    q_heads, kv_heads, d = 2, 1, 8
    kv = torch.zeros(2, 4, 4, kv_heads, d, device=device)
    cos, sin = reference.rope_cos_sin(torch.zeros(0, dtype=torch.int64, device=device), 4, 1e4)
    slots = torch.zeros(0, dtype=torch.int64, device=device)
    args = (x, nw, EPS, w, nw[:d], nw[:d], cos, sin, kv, slots, q_heads, kv_heads)
    assert TRITON_OPS.norm_qkv_prelude(*args).shape == reference.norm_qkv_prelude(*args).shape == (0, q_heads, d)


def test_norm_weight_and_gate_up_that_do_not_match_are_refused(device):
    """A norm weight shorter than x's rows was read past its end (the kernel masks its loads by K
    alone), and a gate|up weight with an odd row count lost its last row, where the reference raises."""
    x, w, nw = _inputs(7, 64, 32, torch.float32, device, seed=6)
    with pytest.raises(RuntimeError):
        reference.norm_linear(x, nw[:48], EPS, w)
    for cfg in (CONFIGS["split1"], CONFIGS["split3"]):
        with pytest.raises(ValueError, match="norm weight"):
            gemm.gemm(x, w, nw[:48], EPS, config=cfg)
        with pytest.raises(ValueError, match="odd number of rows"):
            gemm.gemm(x, w[:31], nw, EPS, swiglu=(ALPHA, LIMIT), config=cfg)
    with pytest.raises(ValueError, match="norm weight"):
        gemm.norm_linear_partials(x, w, nw[:48], EPS, config=CONFIGS["split3"])


@pytest.mark.parametrize("swap", [False, True], ids=["x-left", "swap"])
@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
def test_fp8_weights_keep_fp32_activations_exact(device, config, swap, parity, monkeypatch):
    """--dtype fp32 --weights mxfp8: the dequantized weights (E4M3 times 2^(s - 127) per 1x32 block
    along the input dim, spec section 1, formed here from the raw codes, not by the code under test)
    are exact in fp32, so the GEMM must give the fp32 reference's result (2e-5), in every epilogue;
    a dot that rounds the fp32 activations to bf16 is off by about 2^-9 (1e-3)."""
    monkeypatch.setattr(gemm, "FP8_SWAP_MIN_ROWS", 0 if swap else 1 << 30)
    x, w, nw = _inputs(21, 320, 200, torch.float32, device, seed=12)
    weight = MxFp8Weight.quantize(w)
    codes, exps = weight.qweight.float().cpu(), weight.scale.float().cpu()
    dense = (codes * torch.exp2(exps - 127.0).repeat_interleave(32, dim=1)).to(device)
    cfg = CONFIGS[config]
    parity(gemm.gemm(x, weight, config=cfg), reference.linear(x, dense))
    parity(gemm.gemm(x, weight, nw, EPS, config=cfg), reference.norm_linear(x, nw, EPS, dense))
    parity(gemm.gemm(x, weight, nw, EPS, swiglu=(ALPHA, LIMIT), config=cfg),
           reference.norm_linear_swiglu(x, nw, EPS, dense, ALPHA, LIMIT))


@pytest.mark.parametrize("block", [16, 128])
def test_fp8_blocks_other_than_32_are_served_or_refused_at_load(device, block, parity):
    """config.json's weight_block_size [1, B] is read, not pinned to 32: a block wider than the
    MXFP8 K tile (64) must get a tile holding whole blocks (the kernel splits a tile into
    tile / B blocks: 0 of them crashed the launch), against the dequantization formed from the raw
    codes; a block that is no power of two is refused when the weight is built (at start-up), not
    at the first step; an explicit tile that cuts blocks is refused with why."""
    x, w, _ = _inputs(7, 384, 64, torch.bfloat16, device, seed=13)
    weight = MxFp8Weight.quantize(w, block)
    codes, exps = weight.qweight.float().cpu(), weight.scale.float().cpu()
    dense = (codes * torch.exp2(exps - 127.0).repeat_interleave(block, dim=1)).to(device, torch.bfloat16)
    parity(gemm.gemm(x, weight), reference.linear(x, dense))
    parity(gemm.gemm(x, weight, config=gemm.GemmConfig(16, 32, 128, 2)), reference.linear(x, dense))
    if block > 64:
        with pytest.raises(ValueError, match="whole MXFP8 blocks"):
            gemm.gemm(x, weight, config=gemm.GemmConfig(16, 32, 64, 1))
    with pytest.raises(ValueError, match="block 48 is not a power of two"):
        MxFp8Weight.quantize(w, 48)


def test_strided_norm_weight_is_read_as_the_reference_reads_it(device, parity):
    """The GEMM loads (1 + w) at x's K offsets as a contiguous vector: a strided view of the norm
    weight (the right length) was read from its neighbours' elements, a silently different product."""
    x, w, _ = _inputs(7, 64, 32, torch.float32, device, seed=14)
    nw = (torch.randn(128, generator=torch.Generator().manual_seed(15)) * 0.1).to(device)[::2]
    for cfg in (CONFIGS["split1"], CONFIGS["split3"]):
        parity(gemm.gemm(x, w, nw, EPS, config=cfg), reference.norm_linear(x, nw, EPS, w))
        parity(gemm.gemm(x, torch.cat([w, w.flip(0)]), nw, EPS, swiglu=(ALPHA, LIMIT), config=cfg),
               reference.norm_linear_swiglu(x, nw, EPS, torch.cat([w, w.flip(0)]), ALPHA, LIMIT))


def test_weight_dtype_must_be_the_activations(device):
    """A dense weight in another dtype than x: the reference's F.linear raises, while the GEMM fed
    the dot in the weight's dtype, rounding fp32 activations to bf16 (1e-3, not the fp32 path's
    2e-5) under an fp32 result, or bf16 ones to fp16 (inf past 65504). Folded weights alike.
    MXFP8 weights take any activation dtype (test_fp8_weights_keep_fp32_activations_exact)."""
    x, w, nw = _inputs(7, 64, 32, torch.float32, device, seed=16)
    with pytest.raises(RuntimeError):
        reference.linear(x, w.bfloat16())
    for xx, ww in ((x, w.bfloat16()), (x.bfloat16(), w.half()), (x.bfloat16(), w)):
        with pytest.raises(ValueError, match="dtype"):
            gemm.gemm(xx, ww)
        with pytest.raises(ValueError, match="dtype"):
            gemm.gemm(xx, NormFolded.fold(ww, nw), nw, EPS)
        with pytest.raises(ValueError, match="dtype"):
            gemm.norm_linear_partials(xx, ww, nw, EPS)


def test_swiglu_oai_refuses_an_odd_width(device):
    """gate_up [n, 2f]: an odd width has no gate/up halves. The reference raises; the kernel paired
    gate column j with column f + j of a width it floored and dropped the last column unseen."""
    gu = torch.randn(7, 9, generator=torch.Generator().manual_seed(17)).to(device)
    with pytest.raises(RuntimeError):
        reference.swiglu_oai(gu, ALPHA, LIMIT)
    with pytest.raises(ValueError, match="odd"):
        TRITON_OPS.swiglu_oai(gu, ALPHA, LIMIT)


@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
def test_swiglu_keeps_a_nan_a_nan(device, config):
    """The reference's clamps (torch) keep NaN; tl.minimum / tl.maximum by default return the other
    operand (minnum: a NaN gate became the limit, 7, a NaN up -7 or 7), so a NaN gate|up product
    came out of the MLP as a finite value. Both epilogues and the standalone op."""
    x, w, nw = _inputs(7, 64, 32, torch.float32, device, seed=18)
    w = torch.cat([w, w.flip(0)])
    w[3] = float("nan")  # gate column 3
    w[32 + 5] = float("nan")  # up column 5
    ref = reference.norm_linear_swiglu(x, nw, EPS, w, ALPHA, LIMIT)
    out = gemm.gemm(x, w, nw, EPS, swiglu=(ALPHA, LIMIT), config=CONFIGS[config])
    assert torch.equal(out.isnan(), ref.isnan()) and ref[:, [3, 5]].isnan().all()
    gu = reference.linear(x, w)
    assert torch.equal(TRITON_OPS.swiglu_oai(gu, ALPHA, LIMIT).isnan(), reference.swiglu_oai(gu, ALPHA, LIMIT).isnan())


def test_activations_of_a_dtype_the_kernels_do_not_take_are_refused(device):
    """The kernels round to bf16, fp16 or fp32 (runtime.tl_dtype): fp64 activations under an MXFP8
    weight (which takes any activation dtype) or with an fp64 dense weight, integer ones, an fp64
    gate|up reached the launch and failed there with a bare KeyError: torch.float64. Refused, named."""
    x, w, nw = _inputs(7, 64, 32, torch.float32, device, seed=22)
    q = MxFp8Weight.quantize(w.cpu()).to(device)
    for xx, ww in ((x.double(), q), (x.double(), w.double()), (x.to(torch.int32), w.to(torch.int32))):
        with pytest.raises(ValueError, match=r"x dtype torch\.(float64|int32)"):
            gemm.gemm(xx, ww)
        with pytest.raises(ValueError, match=r"x dtype torch\.(float64|int32)"):
            gemm.norm_linear_partials(xx, ww, nw, EPS)
    with pytest.raises(ValueError, match=r"gate\|up dtype torch\.float64"):
        gemm.swiglu_oai(x.double(), ALPHA, LIMIT)


def test_empty_outputs_and_an_empty_k(device):
    """No output columns (a weight of 0 rows, a gate|up of width 0): the reference's empty result;
    the split-K finalize sized its column blocks from next_power_of_2(0) = 0 and divided by it.
    K = 0 has nothing to normalize or reduce: refused by name, not a ZeroDivisionError in plan."""
    x, w, nw = _inputs(7, 320, 32, torch.float32, device, seed=23)
    for cfg in (CONFIGS["split3"], None):
        assert gemm.gemm(x, w[:0], config=cfg).shape == reference.linear(x, w[:0]).shape == (7, 0)
        assert gemm.gemm(x, w[:0], nw, EPS, swiglu=(ALPHA, LIMIT), config=cfg).shape == (7, 0)
    wide = torch.zeros(7, 4096, device=device)  # the planner's split-K (more than one K-range)
    assert gemm._tiling(wide, w.new_zeros(0, 4096), 0, False, None)[1] > 1
    assert gemm.gemm(wide, w.new_zeros(0, 4096)).shape == (7, 0)
    assert TRITON_OPS.swiglu_oai(x[:, :0], ALPHA, LIMIT).shape == reference.swiglu_oai(x[:, :0], ALPHA, LIMIT).shape
    for call in (lambda: gemm.gemm(x[:, :0], w[:, :0]), lambda: gemm.norm_linear_partials(x[:, :0], w[:, :0], nw[:0], EPS)):
        with pytest.raises(ValueError, match="no columns"):
            call()


def test_operands_on_another_device_are_refused(device):
    """Every operand must live on x's device: the kernels take raw pointers, so a weight, norm weight,
    residual or output elsewhere (another rank's GPU) was read as if local (on a GPU a fault or a
    silent peer read; here, meta tensors, a NotImplementedError from the interpreter). The
    reference's F.linear refuses; the GEMM names the operand."""
    x, w, nw = _inputs(7, 64, 32, torch.float32, device, seed=24)
    meta = torch.device("meta")
    q = MxFp8Weight.quantize(w.cpu()).to(device)
    cases = {"weight": lambda: gemm.gemm(x, w.to(meta)),
             "norm weight": lambda: gemm.gemm(x, w, nw.to(meta), EPS),
             "residual": lambda: gemm.gemm(x, w, residual=torch.zeros(7, 32, device=meta)),
             "out": lambda: gemm.gemm(x, w, out=torch.zeros(7, 32, device=meta))}
    for name, call in cases.items():
        with pytest.raises(ValueError, match=f"{name} .*on meta"):
            call()
    with pytest.raises(ValueError, match="weight scales .*on meta"):  # the E8M0 exponents are read too
        gemm.gemm(x, MxFp8Weight(q.qweight, q.scale.to(meta)))
    with pytest.raises(ValueError, match="norm weight .*on meta"):
        gemm.norm_linear_partials(x, w, nw.to(meta), EPS)


@pytest.mark.parametrize("weight_bytes", [4, 1], ids=["fp32w", "fp8w"])
def test_plan_counts_fp32_activations_in_the_stage(monkeypatch, weight_bytes):
    """serve --dtype fp32 on a GPU: x's tile is 4 bytes an element, not the bf16 stage_bytes assumed.
    o_proj at 56 rows planned 5 stages of "40 KB" (really 48 KB: 240 KB) for an H200's 227 KB;
    every stage beyond the 2 a pipeline needs must fit the device, counted with x as it is."""
    monkeypatch.setattr(gemm, "smem_of", lambda t: 227 << 10)
    monkeypatch.setattr(gemm, "sms_of", lambda t: 132)
    x = torch.zeros(56, 2048)
    w = torch.zeros(256, 2048) if weight_bytes == 4 else MxFp8Weight.quantize(torch.zeros(256, 2048))
    cfg = gemm._tiling(x, w, 256, False, None)[0]
    stage = cfg.block_m * cfg.block_k * 4 + cfg.block_k * cfg.block_n * weight_bytes
    assert cfg.num_stages == 2 or cfg.num_stages * stage <= (227 << 10) - gemm.SMEM_RESERVE, cfg
    assert gemm.stage_bytes(64, 128, 64, False, 4, x_bytes=4) == 64 * 64 * 4 + 64 * 128 * 4
    assert gemm._tiling(x.bfloat16(), w if weight_bytes == 1 else w.bfloat16(), 256, False, None)[0] == gemm.plan(
        56, 256, 2048, 132, weight_bytes=min(weight_bytes, 2), max_smem=227 << 10)  # bf16 x: the plan as before


def test_gemm_config_is_checked_when_built():
    """A hand-made config (tests, microbench) that no launch can run: split_k 0 divided by zero in
    _tiling, a tile that is no power of two failed inside Triton (arange), one under 16 rows or
    columns is below the tensor-core dot's minimum on a GPU. Refused when built, naming the field."""
    assert gemm.GemmConfig(16, 32, 64, 1).split_k == 1
    for bad, field in (((16, 32, 64, 0), "split_k"), ((16, 48, 64, 1), "block_n"), ((8, 32, 64, 1), "block_m"),
                       ((16, 32, 0, 1), "block_k"), ((16, 32, 64, 1, 3), "num_warps"),
                       ((16, 32, 64, 1, 4, 0), "num_stages")):
        with pytest.raises(ValueError, match=field):
            gemm.GemmConfig(*bad)


def test_plan_tiles_and_k_ranges_over_a_grid_of_shapes():
    """Row counts in and out of 7..56, ragged and tiny K, one SM to many: the row tile is the least
    of 16/32/64 holding the rows, at least 2 stages, and the K-ranges plan reports are the ones
    _tiling launches (each non-empty, of whole K tiles, and with split-K at least
    MIN_K_TILES_PER_SPLIT tiles: below that the partials' traffic outweighs the parallelism)."""
    for m in (0, 1, 7, 16, 17, 32, 33, 56, 140):
        for n, k in ((96, 32), (200, 320), (2304, 6144), (6144, 2048), (64, 6145)):
            for sms in (1, 4, 100, 132):
                cfg = gemm.plan(m, n, k, sms, max_smem=64 << 10)
                assert cfg.block_m == (16 if m <= 16 else 32 if m <= 32 else 64), (m, cfg)
                assert cfg.num_stages >= 2
                got, split, k_per = gemm._tiling(torch.empty(m, k), torch.empty(n, k), n, False, cfg)
                assert got is cfg and split == cfg.split_k >= 1, (m, n, k, sms, cfg)
                assert k_per % cfg.block_k == 0 and (split - 1) * k_per < k <= split * k_per
                assert split == 1 or k_per >= gemm.MIN_K_TILES_PER_SPLIT * cfg.block_k, (m, n, k, sms, cfg)
    # A stage over the whole deep budget (fp32 gate|up tiles on a 64 KB device): still the 2 a pipeline needs.
    assert gemm.plan(56, 3072, 6144, 132, swiglu=True, weight_bytes=4, max_smem=64 << 10).num_stages == 2
    # A hand-made split_k that whole K tiles cannot fill: the ranges actually launched (k = 320: 3 of 128).
    assert gemm._tiling(torch.empty(7, 320), torch.empty(32, 320), 32, False, gemm.GemmConfig(16, 32, 64, 4))[1:] == (3, 128)
