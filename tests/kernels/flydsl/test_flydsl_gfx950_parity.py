"""On an MI355X (gfx950): each FlyDSL kernel run on the GPU against its torch model, plus the benchmark.

Runs only where a gfx950 GPU is visible (`pytest -m gfx950 tests/kernels/flydsl`); everywhere
else every test skips. The models are checked against kernels/reference.py on CPU
(test_flydsl_tiling_model.py), so model parity here closes the loop to the reference. The
exchange test runs 4 "ranks" on 4 streams of one GPU (all buffers local) in a subprocess with a
deadline, because a protocol bug would spin forever.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from dspark_sidecar.drafter.kv_cache import FP8_KV, to_cache
from dspark_sidecar.kernels.flydsl import shapes
from dspark_sidecar.kernels.flydsl import tiling_model as tm
from dspark_sidecar.kernels.flydsl.toolchain import on_gfx950

pytestmark = [
    pytest.mark.gfx950,
    pytest.mark.gpu,
    pytest.mark.skipif(not on_gfx950(), reason="needs an AMD MI355X (gfx950) GPU"),
]

PAGE = 16
# Against the models: same roundings, only the MFMA's in-step summation order and exp2/rsqrt
# hardware approximations differ.
TOL = 2e-3


def rel_l2(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm())


def mx_weight(n, k, gen):
    from dspark_sidecar.drafter.checkpoint import quantize_mxfp8

    q, s = quantize_mxfp8(torch.randn(n, k, generator=gen) * 0.02, shapes.MX_BLOCK)
    return q.view(torch.uint8), s


@pytest.mark.parametrize("name", list(shapes.SCHEDULES))
@pytest.mark.parametrize("num_reqs", [1, 4, 8])
def test_linear(name, num_reqs):
    from dspark_sidecar.kernels.flydsl.linear import build_linear

    sched = shapes.SCHEDULES[name]
    gen = torch.Generator().manual_seed(num_reqs)
    rows, mp = shapes.rows_for(num_reqs), 16 * shapes.row_tiles(num_reqs)
    x = torch.randn(rows, sched.k, generator=gen).to(torch.bfloat16)
    nw = (torch.randn(sched.k, generator=gen) * 0.1).to(torch.bfloat16)
    bits, scale = mx_weight(sched.n, sched.k, gen)
    p = torch.full((sched.split, mp, sched.n), float("nan"), device="cuda")
    ss = torch.zeros(sched.split, mp, device="cuda")
    build_linear(sched, num_reqs)(x.cuda(), bits.cuda(), scale.cuda(), nw.cuda(), p, ss)
    torch.cuda.synchronize()
    p_ref, ss_ref = tm.linear_model(x, bits, scale, nw, sched, num_reqs)
    assert rel_l2(p, p_ref) < TOL
    if sched.norm:
        assert rel_l2(ss, ss_ref) < TOL


@pytest.mark.parametrize("kv_layout", shapes.KV_LAYOUTS)
@pytest.mark.parametrize("num_reqs", [1, 5])
def test_qkv_rope(num_reqs, kv_layout):
    from dspark_sidecar.kernels.flydsl.qkv_rope import build_qkv_rope

    sched = shapes.SCHEDULES["qkv"]
    gen = torch.Generator().manual_seed(7)
    rows, mp = shapes.rows_for(num_reqs), 16 * shapes.row_tiles(num_reqs)
    p = torch.randn(sched.split, mp, sched.n, generator=gen)
    ss = torch.rand(sched.split, mp, generator=gen) * 100 + 1
    qn, kn = [(torch.randn(128, generator=gen) * 0.1).to(torch.bfloat16) for _ in range(2)]
    from dspark_sidecar.kernels import reference as ref

    cos, sin = ref.rope_cos_sin(torch.arange(6000), shapes.ROTARY_DIM, shapes.ROPE_THETA)
    cs = torch.cat([cos, sin], -1)
    pos = (torch.randint(0, 5000, (num_reqs,), generator=gen)[:, None] + torch.arange(7)).reshape(-1)
    num_slots = 64 * PAGE
    slots = torch.randperm(num_slots, generator=gen)[:rows]
    slots[0] = -1
    row_map = shapes.kv_row_map(kv_layout, num_slots)
    kv = torch.zeros(2 * num_slots, 128, dtype=torch.bfloat16)
    q_ref = tm.qkv_rope_model(p, ss, qn, kn, cs, pos, slots, kv, *row_map, rows)
    kv_dev = torch.zeros(2 * num_slots, 128, dtype=torch.bfloat16, device="cuda")
    q = torch.empty(rows, shapes.O_K, dtype=torch.bfloat16, device="cuda")
    args = [t.cuda() for t in (p, ss, qn, kn, cs, pos, slots)]
    build_qkv_rope(num_reqs)(*args, q, kv_dev, *row_map)
    torch.cuda.synchronize()
    assert rel_l2(q, q_ref) < TOL
    assert rel_l2(kv_dev, kv) < TOL
    # The fp8 build over the same inputs stores exactly to_cache of the bf16 build's K/V: the GPU's
    # saturation and rounding to nearest even are kv_cache.to_cache's (V scaled up to saturate).
    args[0] = args[0] * 100
    codes = torch.zeros(2 * num_slots, 128, dtype=torch.uint8, device="cuda")
    build_qkv_rope(num_reqs)(*args, q, kv_dev, *row_map)
    build_qkv_rope(num_reqs, "fp8")(*args, q, codes, *row_map)
    torch.cuda.synchronize()
    assert torch.equal(codes.cpu(), to_cache(kv_dev.cpu(), FP8_KV).view(torch.uint8))
    assert bool((codes.view(FP8_KV).float().abs() == 448.0).any())


@pytest.mark.parametrize("kv_dtype", shapes.KV_DTYPES)
@pytest.mark.parametrize("kv_layout", shapes.KV_LAYOUTS)
@pytest.mark.parametrize("num_reqs", [1, 3])
def test_attention_and_combine(num_reqs, kv_layout, kv_dtype):
    from dspark_sidecar.kernels.flydsl.attention import build_attention, build_attention_combine

    gen = torch.Generator().manual_seed(11)
    rows = shapes.rows_for(num_reqs)
    anchors = [4300] + torch.randint(0, 900, (num_reqs - 1,), generator=gen).tolist()
    max_pages = max(-(-(a + 7) // PAGE) for a in anchors)
    pages = max_pages * num_reqs
    bt = torch.randperm(pages, generator=gen).view(num_reqs, max_pages).to(torch.int32)
    kv = torch.randn(2 * pages * PAGE, 128, generator=gen).to(torch.bfloat16)
    if kv_dtype == "fp8":  # the cache's e4m3fn codes, as the runner hands them over (uint8 rows)
        kv = to_cache(kv * 4, FP8_KV).view(torch.uint8)
    q = (torch.randn(rows, shapes.O_K, generator=gen) * 2).to(torch.bfloat16)
    pos = (torch.tensor(anchors)[:, None] + torch.arange(7)).reshape(-1)
    row_map = shapes.kv_row_map(kv_layout, pages * PAGE)
    want = tm.attention_model(q, kv, *row_map, pos, bt, PAGE, num_reqs)
    parts = num_reqs * shapes.NSPLIT * 7 * shapes.Q_HEADS
    op = torch.empty(parts, 128, device="cuda")
    ml = torch.empty(parts, 2, device="cuda")
    out = torch.empty(rows, shapes.O_K, dtype=torch.bfloat16, device="cuda")
    build_attention(num_reqs, PAGE, kv_dtype)(q.cuda(), kv.cuda(), pos.cuda(), bt.cuda(), op, ml, *row_map)
    build_attention_combine(num_reqs)(op, ml, out)
    torch.cuda.synchronize()
    assert rel_l2(out, want) < TOL


def test_swiglu_reduce_and_final_norm():
    from dspark_sidecar.kernels.flydsl.rmsnorm import build_rmsnorm
    from dspark_sidecar.kernels.flydsl.swiglu import build_swiglu_reduce

    gen = torch.Generator().manual_seed(13)
    sched, num_reqs = shapes.SCHEDULES["gate_up"], 6
    rows, mp = shapes.rows_for(num_reqs), 16 * shapes.row_tiles(num_reqs)
    p = torch.randn(sched.split, mp, sched.n, generator=gen) * 30
    ss = torch.rand(sched.split, mp, generator=gen) * 1000 + 1
    act = torch.empty(rows, shapes.FFN, dtype=torch.bfloat16, device="cuda")
    build_swiglu_reduce(num_reqs)(p.cuda(), ss.cuda(), act)
    x = torch.randn(rows, shapes.HIDDEN, generator=gen).to(torch.bfloat16)
    w = (torch.randn(shapes.HIDDEN, generator=gen) * 0.1).to(torch.bfloat16)
    y = torch.empty_like(x, device="cuda")
    build_rmsnorm(num_reqs)(x.cuda(), w.cuda(), y)
    torch.cuda.synchronize()
    assert rel_l2(act, tm.swiglu_reduce_model(p, ss, rows)) < TOL
    assert rel_l2(y, tm.final_norm_model(x, w)) < TOL


EXCHANGE_WORKER = textwrap.dedent(
    """
    import torch
    from dspark_sidecar.kernels.flydsl import shapes, tiling_model as tm
    from dspark_sidecar.kernels.flydsl.exchange import build_reduce_exchange, MP_MAX, NBLK
    R = 3; rows, mp = shapes.rows_for(R), 16 * shapes.row_tiles(R); split = shapes.SCHEDULES["o"].split
    gen = torch.Generator().manual_seed(5)
    parts = [torch.randn(split, mp, shapes.HIDDEN, generator=gen) for _ in range(4)]
    res = torch.randn(rows, shapes.HIDDEN, generator=gen).to(torch.bfloat16)
    want = tm.exchange_model(parts, res)
    rx = [torch.zeros(2 * 4 * MP_MAX, shapes.HIDDEN, device="cuda") for _ in range(4)]
    fl = [torch.zeros(2 * 4 * NBLK, dtype=torch.int32, device="cuda") for _ in range(4)]
    epoch = torch.zeros(1, dtype=torch.int32, device="cuda")
    outs = [torch.empty(rows, shapes.HIDDEN, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
    streams = [torch.cuda.Stream() for _ in range(4)]
    parts_dev, res_dev = [p.cuda() for p in parts], res.cuda()
    torch.cuda.synchronize()
    for step in range(3):  # three launches: tags and parities advance, flags are never cleared
        for ex in range(2):
            fn = build_reduce_exchange(R, "o", ex)
            for r in range(4):
                with torch.cuda.stream(streams[r]):
                    fn(parts_dev[r], res_dev, outs[r], *rx, *fl, rx[r], fl[r], epoch, r, stream=streams[r])
            torch.cuda.synchronize()
            for r in range(4):
                assert torch.equal(outs[r], outs[0]), "ranks disagree"
            err = float((outs[0].double().cpu() - want.double()).norm() / want.double().norm())
            assert err < 1e-3, err
        epoch.add_(1)
    print("ok")
    """
)


def test_exchange_four_ranks_on_four_streams():
    out = subprocess.run([sys.executable, "-c", EXCHANGE_WORKER], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_benchmark_reports_step_time_against_floor(capsys):
    from dspark_sidecar.kernels.flydsl.bench import bench_rank

    res = [bench_rank(r, 4096, iters=5) for r in (1, 8)]
    with capsys.disabled():
        for x in res:
            print(f"\nFlyDSL rank chain R={x['reqs']} ctx={x['context']}: {x['step_s'] * 1e3:.3f} ms, "
                  f"floor {x['floor_s'] * 1e3:.3f} ms ({x['x_floor']:.2f}x)")
    assert all(x["step_s"] > x["floor_s"] * 0.5 for x in res)  # faster than half the floor = broken timing
