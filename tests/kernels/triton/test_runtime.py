"""runtime: where the Triton kernels run, and programmatic dependent launch (PDL) between them."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from dspark_sidecar.kernels.triton import microbench, runtime  # noqa: E402
from dspark_sidecar.kernels.triton.ops import TRITON_OPS  # noqa: E402


def test_pdl_only_on_an_nvidia_gpu_of_sm90(monkeypatch):
    """PDL is a launch attribute of sm_90 and later: never for the interpreter's CPU tensors (whose
    launcher takes no such keyword), and never while the tunable is off."""
    monkeypatch.setattr(runtime, "PDL", True)
    assert not runtime.pdl_of(torch.zeros(1))
    assert runtime.pdl_kwargs(torch.zeros(1), "gemm") == {"PDL": False}
    if torch.cuda.is_available():
        on_gpu = torch.zeros(1, device="cuda")
        assert runtime.pdl_of(on_gpu) == runtime.sm90_of(on_gpu)
        assert runtime.pdl_kwargs(on_gpu, "gemm") == ({"PDL": True, "launch_pdl": True} if runtime.sm90_of(on_gpu)
                                                      else {"PDL": False})
        monkeypatch.setattr(runtime, "PDL", False)
        assert not runtime.pdl_of(on_gpu)


def test_kernels_named_in_pdl_except_launch_without_it(monkeypatch):
    """PDL_EXCEPT turns PDL off for the kernels it names, and only for them."""
    monkeypatch.setattr(runtime, "pdl_of", lambda t: True)
    monkeypatch.setattr(runtime, "PDL_EXCEPT", frozenset({"gemm", "finalize"}))
    t = torch.zeros(1)
    assert runtime.pdl_kwargs(t, "gemm") == runtime.pdl_kwargs(t, "finalize") == {"PDL": False}
    assert runtime.pdl_kwargs(t, "prelude") == {"PDL": True, "launch_pdl": True}


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "mxfp8"])
@pytest.mark.parametrize("rows", [56, 7])
def test_pdl_gives_the_same_bits(cuda, rows, fp8, monkeypatch):
    """The 5-layer step at the TP-4 shard's shapes and a 4096 context (microbench.make_step: the
    qkv GEMM's partials, the prelude writing q and the block K/V, the attention reading them; 56 rows
    merge the splits in the cooperative launch, 7 in the merge kernel; with MXFP8 weights every GEMM
    is a Triton launch and its finalize), eager and CUDA-graphed with PDL off, on, and on for all but
    the GEMMs and finalizes (boundaries of both kinds in one chain): the same bits. A kernel that read
    its predecessor's output before the wait would read stale q or K/V on some launches."""
    if not runtime.sm90_of(torch.zeros(1, device=cuda)):
        pytest.skip("PDL needs compute capability 9.0")
    torch.manual_seed(0)
    step = microbench.make_step(rows, 4096, torch.device(cuda), fp8, TRITON_OPS)
    got = {}
    for pdl, except_ in ((False, frozenset()), (True, frozenset()), ("mixed", frozenset({"gemm", "finalize"}))):
        monkeypatch.setattr(runtime, "PDL", bool(pdl))
        monkeypatch.setattr(runtime, "PDL_EXCEPT", except_)
        eager = step().clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        replays = []
        for _ in range(3):
            graph.replay()
            replays.append(out.clone())
        torch.cuda.synchronize()
        got[pdl] = [eager, *replays]
    for other in (True, "mixed"):
        for a, b in zip(got[False], got[other], strict=True):
            assert torch.equal(a, b)
        assert all(torch.equal(got[other][0], r) for r in got[other][1:])


def _fp8_cases() -> torch.Tensor:
    """Every finite e4m3 value, the midpoints between neighbours (ties) and the values next to them,
    values past +-448, and small values of either sign that round to (signed) zero."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    s = codes[torch.isfinite(codes)].unique().sort().values
    mid = (s[1:] + s[:-1]) / 2
    up, down = torch.tensor(float("inf")), torch.tensor(float("-inf"))
    edge = torch.tensor([449.0, 464.0, 465.0, 1e4, -1e4, 0.0, -0.0, 2.0 ** -11, -2.0 ** -11, -2.0 ** -12, -1e-6])
    return torch.cat([s, mid, torch.nextafter(mid, up), torch.nextafter(mid, down), edge])


def test_cast_to_fp8_saturates_and_rounds_as_torch_does_sign_of_zero_included(device):
    """cast(x, float8e4nv) is the fp8 KV cache's store: the same e4m3 code as the reference's
    to_cache (clamp to +-448, then torch's round to nearest even), bit for bit, so a negative value
    that rounds to zero is -0 (0x80), as the GPU's and vLLM's saturating conversions give it."""
    import triton
    import triton.language as tl

    from dspark_sidecar.drafter.kv_cache import FP8_KV, to_cache

    @triton.jit
    def store(x_ptr, y_ptr, n, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
        o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + o, runtime.cast(tl.load(x_ptr + o, mask=o < n), tl.float8e4nv, INTERPRET), mask=o < n)

    x = _fp8_cases()
    y = torch.empty(x.numel(), dtype=FP8_KV, device=device)
    store[(triton.cdiv(x.numel(), 256),)](x.to(device), y, x.numel(), BLOCK=256, INTERPRET=runtime.INTERPRET)
    want = to_cache(x, FP8_KV).view(torch.uint8)
    got = y.cpu().view(torch.uint8)
    bad = (got != want).nonzero().flatten()[:8]
    assert not len(bad), f"x {x[bad].tolist()}: codes {got[bad].tolist()}, want {want[bad].tolist()}"


def test_cast_to_fp8_keeps_a_nan_a_nan(device):
    """torch.clamp (the reference's to_cache) keeps NaN; tl.clamp's default would leave it to the
    hardware's min/max, which may give +-448: a NaN K/V value must not become a finite one."""
    import triton
    import triton.language as tl

    @triton.jit
    def store(x_ptr, y_ptr, INTERPRET: tl.constexpr):
        o = tl.arange(0, 4)
        tl.store(y_ptr + o, runtime.cast(tl.load(x_ptr + o), tl.float8e4nv, INTERPRET))

    x = torch.tensor([float("nan"), -float("nan"), 1.0, 1000.0], device=device)
    y = torch.empty(4, dtype=torch.float8_e4m3fn, device=device)
    store[(1,)](x, y, INTERPRET=runtime.INTERPRET)
    got = y.float().cpu()
    assert torch.isnan(got[:2]).all() and got[2:].tolist() == [1.0, 448.0]


def test_cast_to_bf16_keeps_a_nan_a_nan_and_rounds_the_rest_as_torch_does(device):
    """cast(x, bfloat16) from fp32: torch's (and the GPU's) round to nearest even, and a NaN stays NaN
    whatever its payload. The interpreter's software rounding added 0x7FFF to the bits of a NaN too:
    one whose payload lies in the low 16 bits carried into the exponent's all-ones (+-inf), and one
    with every mantissa bit set carried past the sign bit (+-0), so a NaN hidden state became finite."""
    import triton
    import triton.language as tl

    @triton.jit
    def store(x_ptr, y_ptr, n, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
        o = tl.arange(0, BLOCK)
        tl.store(y_ptr + o, runtime.cast(tl.load(x_ptr + o, mask=o < n), tl.bfloat16, INTERPRET), mask=o < n)

    nan_bits = [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF807FFF, 0x7F808000, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FFF8000]
    finite_bits = [0x3F808000, 0x3F818000, 0x3F800001, 0x7F7FFFFF, 0xFF7F8000, 0xBF828000, 0xC0FF8000, 0x7F800000]
    bits = torch.tensor(nan_bits + finite_bits, dtype=torch.int64)
    x = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)
    y = torch.empty(x.numel(), dtype=torch.bfloat16, device=device)
    store[(1,)](x.to(device), y, x.numel(), BLOCK=16, INTERPRET=runtime.INTERPRET)
    got = y.cpu()
    k = len(nan_bits)
    assert torch.isnan(got[:k]).all(), f"NaNs {[hex(b) for b in nan_bits]} stored as {got[:k].tolist()}"
    assert torch.equal(got[k:].view(torch.int16), x[k:].to(torch.bfloat16).view(torch.int16)), got[k:].tolist()


@pytest.mark.parametrize("value", ["y", "Y", "1", "0"])
def test_interpret_is_what_triton_decided(value):
    """INTERPRET must say what triton did when it decorated the kernels. It parsed TRITON_INTERPRET a
    second time, accepting fewer spellings than triton (which takes y/Y too): with TRITON_INTERPRET=y
    triton interpreted every kernel while INTERPRET said compiled, so a CPU tensor was refused ("set
    TRITON_INTERPRET=1", which was set) and on a GPU mma/cast skipped the interpreter's fixes."""
    import os
    import subprocess
    import sys

    code = ("from triton.runtime.interpreter import InterpretedFunction\n"
            "from dspark_sidecar.kernels.triton import prelude, runtime\n"
            "print(runtime.INTERPRET, isinstance(prelude._prelude_kernel, InterpretedFunction))\n")
    env = {**os.environ, "TRITON_INTERPRET": value}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    said, did = res.stdout.split()
    assert said == did, f"TRITON_INTERPRET={value!r}: runtime.INTERPRET {said}, triton interpreted: {did}"
