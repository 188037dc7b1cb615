"""The FlyDSL host runner on CPU: lazy import, the seed's refusals, KV layout checks, stale binding, launch plan."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from dspark_sidecar.drafter.kv_cache import FP8_KV, kv_planes
from dspark_sidecar.kernels.flydsl import runner as rn
from dspark_sidecar.kernels.flydsl import toolchain
from dspark_sidecar.server.refusal import EngineFacts, HostFacts

PAGE = 16
GOOD_HOST = HostFacts(on_gfx950=True, flydsl_available=True, tp_size=4)
GOOD_ENGINE = EngineFacts(tp_size=4, dp_size=1, pp_size=1, speculative_method="dspark", num_speculative_tokens=7)


def mx(n, k):
    return rn.MXLinear(torch.zeros(n, k, dtype=torch.uint8), torch.zeros(n, k // 32, dtype=torch.uint8))


def layer():
    bf = torch.bfloat16
    return rn.LayerWeights(
        qkv=mx(2304, 6144), o=mx(6144, 2048), gate_up=mx(6144, 6144), down=mx(6144, 3072),
        input_norm=torch.zeros(6144, dtype=bf), post_norm=torch.zeros(6144, dtype=bf),
        q_norm=torch.zeros(128, dtype=bf), k_norm=torch.zeros(128, dtype=bf),
    )


def kv_layers(pages=4, dtype=torch.bfloat16):
    return [torch.zeros(2, pages, PAGE, 1, 128, dtype=dtype) for _ in range(5)]


def peers():
    rx = [torch.zeros(8, 4) for _ in range(4)]
    fl = [torch.zeros(8, dtype=torch.int32) for _ in range(4)]
    return rn.PeerBuffers(rx, fl, rx[0], fl[0], torch.zeros(1, dtype=torch.int32))


def make(host=GOOD_HOST, engine=GOOD_ENGINE, kv=None, peer=True):
    return rn.DrafterRunner(
        [layer()] * 5, torch.zeros(6144, dtype=torch.bfloat16), kv if kv is not None else kv_layers(),
        peers() if peer else None, rank=0, page_size=PAGE, max_positions=64, engine=engine, host=host,
    )


def test_imports_without_flydsl():
    code = (
        "import sys; sys.modules['flydsl'] = None\n"
        "import dspark_sidecar.kernels.flydsl.runner as r\n"
        "import dspark_sidecar.kernels.flydsl.toolchain as t\n"
        # `not t.flydsl_available() is None` held for True and False alike (a bool is never None)
        "assert issubclass(r.FlyDSLUnsupported, Exception) and t.flydsl_available() is False\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@pytest.mark.parametrize(
    "host, engine, reason",
    [
        (HostFacts(False, True, 4), GOOD_ENGINE, "not gfx950"),
        (HostFacts(True, False, 4), GOOD_ENGINE, "FlyDSL not installed"),
        (GOOD_HOST, EngineFacts(2, 1, 1, "dspark", 7), "TP 2 != 4"),
        (GOOD_HOST, EngineFacts(4, 2, 1, "dspark", 7), "DP > 1"),
        (GOOD_HOST, EngineFacts(4, 1, 2, "dspark", 7), "PP > 1"),
        (GOOD_HOST, EngineFacts(4, 1, 1, "eagle", 7), "no DSpark draft"),
        (GOOD_HOST, EngineFacts(4, 1, 1, "dspark", 5), "7 speculative tokens required"),
    ],
)
def test_refuses_with_the_seed_reasons(host, engine, reason):
    with pytest.raises(rn.FlyDSLUnsupported) as exc:
        make(host=host, engine=engine)
    assert str(exc.value) == reason


def test_refuses_unbindable_kv_and_missing_peers():
    with pytest.raises(rn.FlyDSLUnsupported) as exc:
        make(kv=kv_layers(dtype=torch.float16))
    assert str(exc.value) == ("draft KV cache dtype torch.float16: the FlyDSL kernels take torch.bfloat16 or "
                              "torch.float8_e4m3fn")
    with pytest.raises(rn.FlyDSLUnsupported, match="page size"):
        make(kv=[torch.zeros(2, 4, 32, 1, 128, dtype=torch.bfloat16)] * 5)
    with pytest.raises(rn.FlyDSLUnsupported, match="exchange buffers"):
        make(peer=False)
    # One rank's RX missing: the exchange kernels take all 4 ranks' pointers (only None was tested).
    p = peers()
    with pytest.raises(rn.FlyDSLUnsupported, match="exchange buffers"):
        rn.DrafterRunner([layer()] * 5, torch.zeros(6144, dtype=torch.bfloat16), kv_layers(),
                         rn.PeerBuffers(p.rx[:3], p.flags, p.rx_local, p.flags_local, p.epoch),
                         rank=0, page_size=PAGE, max_positions=64, engine=GOOD_ENGINE, host=GOOD_HOST)
    # Or one rank's flags: the kernels poll and set all 4.
    with pytest.raises(rn.FlyDSLUnsupported, match="exchange buffers"):
        rn.DrafterRunner([layer()] * 5, torch.zeros(6144, dtype=torch.bfloat16), kv_layers(),
                         rn.PeerBuffers(p.rx, p.flags[:3], p.rx_local, p.flags_local, p.epoch),
                         rank=0, page_size=PAGE, max_positions=64, engine=GOOD_ENGINE, host=GOOD_HOST)


def test_a_layer_of_4_gib_is_refused():
    """The kernels address a layer through one buffer descriptor of 32-bit byte extent: 2^32 bytes do not
    fit it (the last byte's offset does, the size does not), one page fewer does. Meta tensors: no memory."""
    pages = 2**32 // (2 * PAGE * 128 * 2)
    full = torch.empty(2, pages, PAGE, 1, 128, dtype=torch.bfloat16, device="meta")
    assert rn.check_kv_layer(full, PAGE) == "draft KV cache layer >= 4 GiB (32-bit buffer offsets)"
    under = torch.empty(2, pages - 1, PAGE, 1, 128, dtype=torch.bfloat16, device="meta")
    assert rn.check_kv_layer(under, PAGE) is None


def with_norm(field, w):
    """make()'s layers and final norm with one norm weight replaced by `w`."""
    lw = layer()
    if field == "final":
        return [lw] * 5, w
    return [lw] * 4 + [rn.LayerWeights(**{**lw.__dict__, field: w})], torch.zeros(6144, dtype=torch.bfloat16)


@pytest.mark.parametrize("field, w, why", [
    ("final", torch.zeros(128, dtype=torch.bfloat16), r"final norm weight \[128\] torch.bfloat16: .* \[6144\]"),
    ("final", torch.zeros(6144), r"final norm weight \[6144\] torch.float32: .* torch.bfloat16"),
    ("q_norm", torch.zeros(6144, dtype=torch.bfloat16), r"layer 4 q_norm weight \[6144\] .* \[128\]"),
    ("k_norm", torch.zeros(256, dtype=torch.bfloat16)[::2], r"layer 4 k_norm weight strides \[2\]"),
    ("input_norm", torch.zeros(3072, dtype=torch.bfloat16), r"layer 4 input_norm weight \[3072\]"),
    ("post_norm", torch.zeros(1, 6144, dtype=torch.bfloat16), r"layer 4 post_norm weight \[1, 6144\]"),
], ids=["final-short", "final-fp32", "q-norm-long", "k-norm-strided", "input-norm-short", "post-norm-2d"])
def test_refuses_norm_weights_the_kernels_would_misread(field, w, why):
    """The kernels read each norm's (1 + w) as dense bf16 [6144] (the folded input/post norms, the final
    norm) or [128] (q/k) through unbounded buffer descriptors, compiled for the first weights they are given:
    a short weight was read past its end, a strided one read its neighbours', fp32 bits were read as bf16.
    Triton's norms refuse such weights (runtime.check_norm_weight); the runner refuses to bind them."""
    layers, final = with_norm(field, w)
    with pytest.raises(rn.FlyDSLUnsupported, match=why):
        rn.DrafterRunner(layers, final, kv_layers(), peers(), rank=0, page_size=PAGE, max_positions=64,
                         engine=GOOD_ENGINE, host=GOOD_HOST)


def records_layers(pages=4, offset=0, dtype=torch.bfloat16):
    """vLLM 0.34 caches [pages, 1, page_size, 256] as the sidecar binds them (their planes views), each
    starting `offset` records into its storage (a layer carved out of a larger allocation)."""
    bufs = [torch.zeros((offset + pages * PAGE) * 256, dtype=dtype) for _ in range(5)]
    return [b[offset * 256 :].view(pages, 1, PAGE, 256) for b in bufs]


@pytest.mark.parametrize("offset", [0, 3])
def test_records_cache_is_bound_as_k_v_rows_of_the_same_memory(offset):
    pages = 4
    raw = records_layers(pages, offset)
    for t in raw:
        t.copy_(torch.randn(t.shape))
    r = make(kv=[kv_planes(t) for t in raw])
    for t, bound in zip(raw, r._kv):
        assert (bound.slot_rows, bound.v_row0) == (2, 1)
        assert bound.rows.shape == (2 * pages * PAGE, 128) and bound.rows.stride() == (128, 1)
        assert bound.rows.data_ptr() == t.data_ptr()  # the first K row is the first record's start
        slot = torch.arange(pages * PAGE)
        page, off = slot // PAGE, slot % PAGE
        assert torch.equal(bound.rows[2 * slot], t[page, 0, off, :128])  # K of slot s: row 2s
        assert torch.equal(bound.rows[2 * slot + 1], t[page, 0, off, 128:])  # V of slot s: row 2s + 1
        bound.rows[2 * 37 + 1] = 5.0  # a write through the rows lands in the engine's tensor
        assert bool((t[37 // PAGE, 0, 37 % PAGE, 128:] == 5.0).all())
    r.close()


def test_planes_cache_is_bound_as_k_rows_then_v_rows():
    pages = 4
    kv = [torch.randn(2, pages, PAGE, 1, 128).to(torch.bfloat16) for _ in range(5)]
    r = make(kv=kv)
    for t, bound in zip(kv, r._kv):
        assert (bound.slot_rows, bound.v_row0) == (1, pages * PAGE)
        assert bound.rows.data_ptr() == t.data_ptr()
        assert torch.equal(bound.rows[: pages * PAGE], t[0].reshape(-1, 128))
        assert torch.equal(bound.rows[pages * PAGE :], t[1].reshape(-1, 128))
    r.close()


def test_launch_arguments_carry_the_layers_row_addressing():
    """qkv_rope and attention get each layer's rows with (slot_rows, v_row0) as their last arguments."""
    r = make(kv=[kv_planes(t) for t in records_layers()])
    n = 7
    calls = list(r._calls(1, torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64),
                          torch.zeros(1, 1, dtype=torch.int32), torch.empty(n, 6144, dtype=torch.bfloat16)))
    qkv = [args for name, _, _, args in calls if name == "qkv_rope"]
    attn = [args for name, _, _, args in calls if name == "attention"]
    assert len(qkv) == len(attn) == 5
    for i, (a, b) in enumerate(zip(qkv, attn)):
        assert a[-3] is b[1] is r._kv[i].rows
        assert a[-2:] == b[-2:] == (2, 1)
    r.close()


@pytest.mark.parametrize("kv_layout", ["planes", "records"])
def test_fp8_cache_is_bound_as_rows_of_e4m3fn_codes(kv_layout):
    """vLLM's fp8 cache (e4m3fn codes at scale 1), either layout: bound as uint8 rows over the engine's
    bytes, and served by the fp8 builds of qkv_rope and attention."""
    pages = 4
    if kv_layout == "planes":
        raw = [torch.zeros(2, pages, PAGE, 1, 128, dtype=FP8_KV) for _ in range(5)]
    else:
        raw = records_layers(pages, offset=3, dtype=FP8_KV)
    for t in raw:
        t.copy_(torch.randn(t.shape).to(FP8_KV))
    kv = [kv_planes(t) for t in raw]
    assert all(rn.check_kv_layer(t, PAGE) is None for t in kv)
    r = make(kv=kv)
    for t, bound in zip(kv, r._kv):
        assert bound.kv_dtype == "fp8" and bound.rows.dtype == torch.uint8 and bound.rows.shape == (2 * pages * PAGE, 128)
        assert bound.rows.data_ptr() == t.data_ptr()
        slot = torch.arange(pages * PAGE)
        k_rows = bound.rows[slot * bound.slot_rows]
        v_rows = bound.rows[bound.v_row0 + slot * bound.slot_rows]
        assert torch.equal(k_rows, t[0].reshape(-1, 128).view(torch.uint8))
        assert torch.equal(v_rows, t[1].reshape(-1, 128).view(torch.uint8))
    n = 7
    calls = list(r._calls(1, torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64),
                          torch.zeros(1, 1, dtype=torch.int32), torch.empty(n, 6144, dtype=torch.bfloat16)))
    names = [name for name, _, _, _ in calls]
    assert names == [name for name, _ in rn.launch_plan(1, "fp8")]
    assert names.count("qkv_rope_fp8") == names.count("attention_fp8") == 5
    assert "qkv_rope" not in names and "attention" not in names
    for i, args in enumerate(a for name, _, _, a in calls if name == "qkv_rope_fp8"):
        assert args[-3] is r._kv[i].rows
    r.close()


def test_launch_plan_names_catalog_entries_for_each_kv_dtype():
    from dspark_sidecar.kernels.flydsl.catalog import KERNELS
    from dspark_sidecar.kernels.flydsl.shapes import KV_DTYPES

    for kv_dtype in KV_DTYPES:
        assert {name for name, _ in rn.launch_plan(2, kv_dtype)} <= set(KERNELS)
    assert set(rn.KV_DTYPE_NAMES.values()) == set(KV_DTYPES)
    with pytest.raises(ValueError, match="bf16 or fp8"):
        rn.launch_plan(1, "fp16")


def other_views(pages=4):
    """Views of one layer that the portable ops serve but that are rows in neither order the kernels take."""
    bf = torch.bfloat16
    return {
        # K then V per page (FlashInfer's [pages, 2, page_size, heads, head_dim]).
        "kv per page": torch.zeros(pages, 2, PAGE, 1, 128, dtype=bf).transpose(0, 1),
        # Every other page of a larger planes cache.
        "planes slice": torch.zeros(2, 2 * pages, PAGE, 1, 128, dtype=bf)[:, ::2],
        # Records padded past K | V (stride 384 per token).
        "padded records": kv_planes(torch.zeros(pages, 1, PAGE, 384, dtype=bf)[..., :256]),
        # Every other page of a records cache.
        "records slice": kv_planes(torch.zeros(2 * pages, 1, PAGE, 256, dtype=bf)[::2]),
    }


@pytest.mark.parametrize("name", list(other_views()))
def test_other_strided_views_are_refused_with_the_reason(name):
    t = other_views()[name]
    want = (f"draft KV cache strides {list(t.stride())} are neither the contiguous planes layout nor vLLM 0.34's "
            "records layout [128, 4096, 256, 4096, 1]: the FlyDSL kernels address those two only; "
            "the Triton backend serves any")
    assert rn.check_kv_layer(t, PAGE) == want
    with pytest.raises(rn.FlyDSLUnsupported) as exc:
        make(kv=[t] * 5)
    assert str(exc.value) == want


def test_kernels_address_every_layout_the_sidecar_binds():
    from dspark_sidecar.drafter.kv_cache import KV_LAYOUTS
    from dspark_sidecar.kernels.flydsl import shapes

    assert shapes.KV_LAYOUTS == KV_LAYOUTS
    assert [shapes.kv_row_map(x, 64) for x in KV_LAYOUTS] == [(1, 64), (2, 1)]
    with pytest.raises(ValueError, match="planes or records"):
        shapes.kv_row_map("pages", 64)


def test_size_one_dimensions_strides_do_not_decide_the_layout():
    """A single head's (or page's) stride addresses nothing: [pages, page_size, 2, 1, 128] (K | V per
    token, heads innermost) is the records layout's memory and is bound as such."""
    t = torch.zeros(4, PAGE, 2, 1, 128, dtype=torch.bfloat16).permute(2, 0, 1, 3, 4)
    assert t.stride()[3] != kv_planes(torch.zeros(4, 1, PAGE, 256)).stride()[3]
    assert rn.kv_layout_of(t) == "records" and rn.check_kv_layer(t, PAGE) is None
    one_page = torch.zeros(2, 1, PAGE, 1, 128, dtype=torch.bfloat16)
    assert rn.kv_layout_of(one_page) == "planes"


def test_host_probe_on_this_machine_refuses_not_gfx950():
    # On a machine without a gfx950 GPU (CPU-only, NVIDIA) the first check fails, whatever else is installed.
    if toolchain.on_gfx950():  # the MI355X nodes this serves: the refusal cannot happen there (the README's run)
        pytest.skip("this host has a gfx950 GPU: the gfx950-marked tests cover it")
    assert toolchain.on_gfx950() is False
    with pytest.raises(rn.FlyDSLUnsupported, match="^not gfx950$"):
        rn.DrafterRunner([layer()] * 5, torch.zeros(6144), kv_layers(), peers(), 0, PAGE, 64, GOOD_ENGINE)


def test_stale_kv_binding_detected():
    kv = kv_layers()
    r = make(kv=kv)
    assert not r.stale(kv)
    moved = list(kv)
    moved[3] = kv[3].clone()  # re-allocated: new data pointer
    assert r.stale(moved)
    grown = kv_layers(pages=8)
    assert r.stale(grown)
    # Same memory, another shape or dtype (a narrower view, a re-typed cache): the data pointer alone says nothing.
    assert r.stale([*kv[:3], kv[3][:, :2], kv[4]])
    assert r.stale([*kv[:3], kv[3].view(torch.float16), kv[4]])
    r.close()


def test_launch_plan_orders_ten_exchanges():
    plan = rn.launch_plan(3)
    assert len(plan) == 5 * 10 + 1 and plan[-1] == ("final_norm", None)
    assert [x for _, x in plan if x is not None] == list(range(10))
    assert plan[:6] == [
        ("linear_qkv", None), ("qkv_rope", None), ("attention", None),
        ("attention_combine", None), ("linear_o", None), ("exchange_o", 0),
    ]
    from dspark_sidecar.kernels.flydsl.catalog import KERNELS

    assert {name for name, _ in plan} <= set(KERNELS)
    with pytest.raises(ValueError):
        rn.launch_plan(9)


def test_compile_all_compiles_what_every_launch_size_will_launch():
    """Start-up compiles (kernel, R, exchange) for R = 1..8; a later step finds all of them compiled."""
    r = make()
    compiled, launched = [], []

    def fake_kernel(name, num_reqs, exchange, args):
        key = (name, num_reqs, exchange)
        if key not in r._compiled:
            compiled.append(key)
            r._compiled[key] = lambda *a: launched.append(key)
        return r._compiled[key]

    r._kernel = fake_kernel
    count = r.compile_all()
    assert count == len(compiled) == len(set(compiled))
    assert not launched  # compiling launches nothing
    per_size = {n for n, _ in rn.launch_plan(1)} | {"final_norm"}
    assert {name for name, _, _ in compiled} == per_size
    assert {num_reqs for _, num_reqs, _ in compiled} == set(range(1, 9))
    before = len(compiled)
    n = 7 * 11  # 11 requests: launches of 8 and 3
    r.forward(torch.arange(n) + 100, torch.zeros(n, 6144, dtype=torch.bfloat16), torch.arange(n),
              torch.zeros(11, 8, dtype=torch.int32))
    assert len(compiled) == before, "a live step compiled a kernel"
    assert len(launched) == 2 * 51  # 10 kernels per layer x 5 + the final norm, per launch


def test_abandon_stops_compile_all_at_its_next_kernel():
    """A binding that went (BindKV, UnbindKV) abandons its runner's compile on the other thread: it stops at
    its next kernel, not after every kernel for R = 1..8 (minutes, the engine's old cache mapped all along)."""
    r = make()
    compiled = []

    def fake_kernel(name, num_reqs, exchange, args):
        compiled.append((name, num_reqs, exchange))
        r._compiled[compiled[-1]] = object()
        if len(compiled) == 3:
            r.abandon()

    r._kernel = fake_kernel
    assert r.compile_all() == 3 and len(compiled) == 3
    r.close()


def test_compile_runs_nothing_and_fits_every_launch(monkeypatch):
    """flyc.compile (FlyDSL 0.5) also runs the launcher when all its tensors are device tensors, and the
    compiled kernel is specialized on each tensor's unit-stride axis. So every tensor _kernel hands it
    must be a placeholder that holds no memory (meta device: on a GPU, compiling against the live
    workspaces, cache rows and peer flags launched qkv_rope into the engine's cache and the exchanges),
    and must specialize exactly as the tensors of a real launch do: compile_all's one-page block table
    [R, 1] has strides (1, 1), which made BT's row stride a static 1 for every later multi-page table."""
    # FlyDSL is the optional `flydsl` extra, which the README's install leaves out.
    flyc = pytest.importorskip("flydsl.compiler")
    from flydsl.compiler.jit_argument import TorchTensorJitArg
    from flydsl.compiler.jit_function import _is_compile_placeholder

    def sig(a):
        return TorchTensorJitArg(a).__cache_signature__() if isinstance(a, torch.Tensor) else type(a)

    compiled = {}

    def fake_compile(launcher, *args):
        key = len(compiled)
        compiled[key] = args
        return lambda *live: launched.append((key, live))

    monkeypatch.setattr(flyc, "compile", fake_compile)
    monkeypatch.delenv("ARCH", raising=False)
    monkeypatch.setenv("FLYDSL_GPU_ARCH", "gfx950")  # the target the runner checks before compiling
    launched = []
    r = make()
    r.compile_all()
    # One compile per (kernel, R, exchange) of the launch plan: the exchange index is compiled in (its tag),
    # so a cache keyed without it would launch exchange 0's code for all ten.
    assert len(compiled) == len(set(rn.launch_plan(1))) * 8
    for args in compiled.values():
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        assert tensors and all(t.device.type == "meta" for t in tensors)
        assert all(_is_compile_placeholder(TorchTensorJitArg(t)) for t in tensors)
    n = 7 * 11  # launches of 8 and 3 requests, 9 pages per request
    r.forward(torch.arange(n) + 100, torch.zeros(n, 6144, dtype=torch.bfloat16), torch.arange(n),
              torch.zeros(11, 9, dtype=torch.int32))
    assert len(launched) == 2 * 51
    assert len(compiled) == len(set(rn.launch_plan(1))) * 8, "a live step compiled a kernel"
    for key, live in launched:
        # Then the stream, the launcher's last parameter (None: FlyDSL's default queue, off the GPU).
        assert [sig(a) for a in live[:-1]] == [sig(a) for a in compiled[key]] and live[-1] is None
    r.close()


def step_inputs(reqs=2, pages=3):
    n = 7 * reqs
    return dict(positions=torch.arange(n) + 100, embeds=torch.zeros(n, 6144, dtype=torch.bfloat16),
                slots=torch.arange(n), block_tables=torch.zeros(reqs, pages, dtype=torch.int32))


@pytest.mark.parametrize("bad, why", [
    (dict(positions=torch.arange(17), embeds=torch.zeros(17, 6144, dtype=torch.bfloat16), slots=torch.arange(17)),
     r"positions \[17\]: 7 rows per request"),
    (dict(embeds=torch.zeros(13, 6144, dtype=torch.bfloat16)), r"embeds \[13, 6144\]"),
    (dict(embeds=torch.zeros(14, 4096, dtype=torch.bfloat16)), r"embeds \[14, 4096\]"),
    (dict(embeds=torch.zeros(14, 6144)), r"embeds torch.float32"),
    (dict(positions=torch.arange(14, dtype=torch.int32)), r"positions torch.int32"),
    (dict(slots=torch.arange(14, dtype=torch.int32)), r"slots torch.int32"),
    (dict(slots=torch.arange(21)), r"slots \[21\]"),
    (dict(block_tables=torch.zeros(1, 3, dtype=torch.int32)), r"block_tables \[1, 3\]"),
    (dict(block_tables=torch.zeros(2, 3, dtype=torch.int64)), r"block_tables torch.int64"),
    (dict(block_tables=torch.zeros(3, 2, dtype=torch.int32).t()), r"block_tables .*not contiguous"),
], ids=["rows-not-7R", "embeds-rows", "embeds-width", "embeds-dtype", "positions-dtype", "slots-dtype",
        "slots-rows", "block-table-rows", "block-table-dtype", "block-table-strides"])
def test_forward_refuses_inputs_the_kernels_would_misread(bad, why):
    """The compiled kernels are keyed by (kernel, R, exchange) and read every tensor as the dtype and
    unit-stride axis they were compiled for; forward checks the step before launching anything: a step of
    7R + 3 rows left its last 3 output rows uninitialized, an int32 slot tensor read as int64 put K/V in
    other slots of the engine's cache, a short block table read past its end."""
    r = make()
    launched = []
    r._kernel = lambda name, num_reqs, exchange, args: (lambda *a: launched.append(name))
    with pytest.raises(ValueError, match=why):
        r.forward(**{**step_inputs(), **bad})
    assert not launched and int(r.peers.epoch) == 0
    out = r.forward(**step_inputs())  # the same runner still serves a well-formed step
    assert out.shape == (14, 6144) and len(launched) == 51
    r.close()


def test_catalog_exchanges_are_ones_the_launch_plan_runs(monkeypatch):
    """An exchange's index is compiled in: its tag, and so the RX/flag half (parity) it addresses, is a
    constant. The catalog entry CI checks for a kernel must be one the runner launches: exchange_down
    built as exchange 0 had the o exchanges' parity, a code object no launch runs (the down exchanges
    are 1, 3, ..., 9), so the other parity's code was never compiled in CI."""
    import types

    from dspark_sidecar.kernels.flydsl.catalog import KERNELS

    built = []
    fake = types.ModuleType("exchange")
    fake.build_reduce_exchange = lambda num_reqs, which, exchange: built.append((which, exchange))
    monkeypatch.setitem(sys.modules, "dspark_sidecar.kernels.flydsl.exchange", fake)
    plan = rn.launch_plan(1)
    for name in ("exchange_o", "exchange_down"):
        built.clear()
        KERNELS[name].build(1)
        ((which, exchange),) = built
        assert name == f"exchange_{which}" and (name, exchange) in plan, (name, exchange)


def final_norm_args(r):
    """The final norm's arguments in a launch of one request, as _calls hands them to _kernel."""
    n = 7
    calls = list(r._calls(1, torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64),
                          torch.zeros(1, 1, dtype=torch.int32), torch.empty(n, 6144, dtype=torch.bfloat16)))
    assert calls[-1][:3] == ("final_norm", 1, None)
    return calls[-1][3]


def gfx950_compile_env(compile_only: bool) -> dict:
    """The compile-only toolchain's variables, with or without FlyDSL's COMPILE_ONLY."""
    why = toolchain.compile_only_unavailable_reason()
    if why is not None:
        pytest.skip(f"gfx950 compile-only toolchain missing: {why}")
    env = toolchain._compile_only_vars(toolchain.TARGET_ARCH)
    return env if compile_only else {k: v for k, v in env.items() if k != "COMPILE_ONLY"}


def test_compiled_launchers_are_called_with_every_parameter(monkeypatch):
    """A kernel compiled for real (meta placeholders: nothing runs) and called the way a step calls it,
    through FlyDSL's own argument packing with a recording stand-in for the loaded code object. The
    packing fills each ABI slot from the call's positional args, the launcher's `stream` included: a call
    without it raised IndexError at the first kernel of every fast step (and every rank exited)."""
    monkeypatch.delenv("COMPILE_ONLY", raising=False)
    env = gfx950_compile_env(compile_only=False)
    pytest.importorskip("flydsl")  # skipped above already without it: the optional `flydsl` extra
    from flydsl.compiler.jit_executor import CallState
    r = make()
    real_kernel, states, launched = r._kernel, [], []

    def kernel(name, num_reqs, exchange, args):
        if name != "final_norm":
            return lambda *a: None
        with toolchain.scoped_env(env):
            fn = real_kernel(name, num_reqs, exchange, args)
        state = CallState(fn._call_spec, lambda packed: launched.append(name))
        states.append(state)
        return lambda *a: state(a)  # CompiledFunction.__call__ minus loading the code object

    r._kernel = kernel
    r.forward(**step_inputs(reqs=1))
    assert launched == ["final_norm"]
    x, w, _ = final_norm_args(r)
    slots = states[0]._tls.storages  # per tensor: its pointer, then its layout's bytes; then the stream
    assert slots[0].value == x.data_ptr() and slots[2].value == w.data_ptr()
    assert slots[-1].value is None  # the stream: NULL, FlyDSL's default queue, for a runner off the GPU
    r.close()


def test_compile_only_environment_turns_the_path_off_with_the_reason(monkeypatch):
    """Under FlyDSL's COMPILE_ONLY flyc.compile builds the code object and returns None. Kept as the
    launcher, compile_all reported success and the first fast step called None inside its launch (every
    rank exits then); refused at compile time, the fast path is off with the reason instead."""
    env = gfx950_compile_env(compile_only=True)
    r = make()
    args = final_norm_args(r)
    with toolchain.scoped_env(env), pytest.raises(rn.FlyDSLUnsupported, match="COMPILE_ONLY is set"):
        r._kernel("final_norm", 1, None, args)
    assert r._compiled == {}
    r.close()


@pytest.mark.parametrize("env, arch", [
    ({}, "gfx942"),  # no override, no rocm_agent_enumerator (pip-installed ROCm torch): FlyDSL's fallback
    ({"FLYDSL_GPU_ARCH": "gfx942"}, "gfx942"),
    ({"FLYDSL_GPU_ARCH": "gfx950", "ARCH": "gfx942"}, "gfx942"),  # ARCH overrides FLYDSL_GPU_ARCH
], ids=["fallback", "flydsl-gpu-arch", "arch-overrides"])
def test_kernels_for_another_arch_are_refused_before_compiling(monkeypatch, env, arch):
    """FlyDSL picks its target from ARCH, else FLYDSL_GPU_ARCH / HSA_OVERRIDE_GFX_VERSION, else the first
    GPU rocm_agent_enumerator lists, else gfx942: not from the rank's GPU, which the host checks found to
    be a gfx950. Compiled for another arch, compile_all succeeded (nothing is loaded until the first call)
    and the first fast step failed to load its first kernel on every rank, after the rendezvous' GO; the
    runner refuses such a target with the reason instead, before compiling anything."""
    flyc = pytest.importorskip("flydsl.compiler")
    if env == {} and toolchain.on_gfx950():
        pytest.skip("rocm_agent_enumerator answers on this gfx950 host")
    for k in ("ARCH", "FLYDSL_GPU_ARCH", "HSA_OVERRIDE_GFX_VERSION"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    compiled = []
    monkeypatch.setattr(flyc, "compile", lambda launcher, *args: compiled.append(launcher) or (lambda *a: None))
    r = make()
    with pytest.raises(rn.FlyDSLUnsupported, match=f"compile for {arch}, not gfx950.*FLYDSL_GPU_ARCH=gfx950"):
        r.compile_all()
    assert compiled == [] and r._compiled == {}
    monkeypatch.delenv("ARCH", raising=False)
    monkeypatch.setenv("FLYDSL_GPU_ARCH", "gfx950")  # the operator's fix: every kernel compiles
    assert r.compile_all() == len(set(rn.launch_plan(1))) * 8
    r.close()


def test_every_launcher_takes_its_stream_last():
    """The runner and kernels/flydsl/bench.py append the launch's stream to each compiled launcher's
    arguments: that is right only while every catalog launcher declares `stream: fx.Stream` as its last
    parameter (FlyDSL fills the stream slot from that position of the call's arguments)."""
    import inspect

    pytest.importorskip("flydsl")  # the launchers are FlyDSL functions: the optional `flydsl` extra
    from dspark_sidecar.kernels.flydsl.catalog import KERNELS

    for name, entry in KERNELS.items():
        last = list(inspect.signature(entry.build(1).func).parameters.values())[-1]
        stream_type = last.annotation if not isinstance(last.annotation, str) else None
        assert last.name == "stream" and (getattr(stream_type, "_is_stream_param", False)
                                          or last.annotation in ("fx.Stream", "Stream")), (name, last)


def test_launch_groups_chain_the_residual_and_keep_every_exchange_tag_unique():
    """Launchers faked with the residual arithmetic the kernels do (exchange: OUT = RES + partials; final norm:
    reads x): a step of R > 8 requests is split into launches whose outputs land in request order, each launch
    starts from its own embeds though all share one workspace, and the exchange tags (epoch x 16 + index + 1)
    of all launches are distinct and increasing: a repeated tag would let an exchange pass on a stale flag."""
    r = make()
    tags = []

    def kernel(name, num_reqs, exchange, args):
        def run(*a):
            a = a[:-1]  # the stream
            if name.startswith("exchange_"):
                tags.append(int(a[13][0]) * 16 + exchange + 1)  # EPOCH, as the kernel reads it at its start
                a[2].copy_(a[1] + 1 if name == "exchange_o" else a[1] * 2)
            elif name == "final_norm":
                a[2].copy_(a[0])
        return run

    r._kernel = kernel
    for reqs in (1, 8, 11, 17):
        step = step_inputs(reqs=reqs)
        step["embeds"] = (torch.arange(7 * reqs) % 5).to(torch.bfloat16)[:, None].expand(-1, 6144).contiguous()
        want = step["embeds"].float()
        for _ in range(5):  # per layer: h = x + 1 (o exchange), x = 2h (down exchange)
            want = (want + 1) * 2
        assert torch.equal(r.forward(**step).float(), want), reqs
    launches = 1 + 1 + 2 + 3
    assert int(r.peers.epoch) == launches and len(tags) == 10 * launches
    assert tags == sorted(set(tags))
    r.close()


def test_each_launch_of_a_step_gets_its_own_requests_rows():
    """A step of R > 8 requests runs in launches of <= 8 (layout.launch_groups): each launch's qkv_rope and
    attention must get that launch's positions, slots and block-table rows. Handed the whole table, the
    second launch of an 11-request step read requests 0..2's pages for requests 8..10 (their attention ran
    over other sequences' K/V, with no error anywhere)."""
    r = make()
    seen = []

    def kernel(name, num_reqs, exchange, args):
        def run(*a):
            if name == "qkv_rope":
                seen.append(("qkv_rope", num_reqs, a[5].clone(), a[6].clone()))  # POS, SLOT
            elif name == "attention":
                seen.append(("attention", num_reqs, a[2].clone(), a[3].clone()))  # POS, BT
        return run

    r._kernel = kernel
    reqs, pages = 11, 3
    step = step_inputs(reqs=reqs, pages=pages)
    step["slots"] = torch.arange(7 * reqs) * 5
    step["block_tables"] = torch.arange(reqs * pages, dtype=torch.int32).reshape(reqs, pages)
    r.forward(**step)
    groups = [(0, 8), (8, 11)]
    for first, end in groups:
        rows = slice(7 * first, 7 * end)
        qkv = [s for s in seen if s[0] == "qkv_rope" and s[1] == end - first]
        attn = [s for s in seen if s[0] == "attention" and s[1] == end - first]
        assert len(qkv) == len(attn) == 5
        for _, _, pos, slots in qkv:
            assert torch.equal(pos, step["positions"][rows]) and torch.equal(slots, step["slots"][rows])
        for _, _, pos, bt in attn:
            assert torch.equal(pos, step["positions"][rows]) and torch.equal(bt, step["block_tables"][first:end])
    r.close()


def test_a_launch_holds_one_to_eight_requests():
    """rows_for guards every kernel builder (catalog, exchange): a launch of 0 requests compiled kernels of 0
    rows, one of 9 overran the workspaces sized for 8 (4 row tiles of 16, 64 exchange rows per rank)."""
    from dspark_sidecar.kernels.flydsl import shapes

    assert [shapes.rows_for(r) for r in (1, 8)] == [7, 56]
    assert [shapes.row_tiles(r) for r in (1, 2, 3, 8)] == [1, 1, 2, 4]
    for bad in (0, 9, -1):
        with pytest.raises(ValueError, match=r"1\.\.8 requests"):
            shapes.rows_for(bad)
