"""The FlyDSL fast path in the server on CPU: selection, refusal reasons, weight binding, stale bindings, routing.

FlyDSL kernels cannot launch without an AMD GPU, so the runner is the real DrafterRunner where
only its binding is exercised and a recording fake where a step would launch. The last test runs
a real step through the fast path on an MI355X x4 and skips elsewhere.
"""

from __future__ import annotations

import contextlib
import threading
from types import SimpleNamespace

import pytest
import torch

from dspark_sidecar.drafter.checkpoint import CheckpointReader, SyntheticSource
from dspark_sidecar.drafter.config import PRESETS
from dspark_sidecar.drafter.kv_cache import StepMetadata, kv_planes
from dspark_sidecar.drafter.model import DSparkDrafter
from dspark_sidecar.drafter.parallel import ParallelContext
from dspark_sidecar.kernels.flydsl import runner as rn
from dspark_sidecar.kernels.flydsl.tiling_model import dequant_like_kernel
from dspark_sidecar.kernels.ops import REFERENCE_OPS
from dspark_sidecar.server.backend import BackendUnavailable, choose_backend
from dspark_sidecar.server.config import ServeConfig
from dspark_sidecar.server import fast_path as fast_path_mod
from dspark_sidecar.server.fast_path import FlyDSLFastPath, kernel_mismatch, layer_weights
from dspark_sidecar.server.kv_binding import KVBinding
from dspark_sidecar.server.refusal import EngineFacts, HostFacts
from dspark_sidecar.server.servicer import DrafterServicer, Lifecycle
from helpers.fake_hip import fast_path_rank
from helpers.ranks import run_ranks
from helpers.waiting import wait_until

GOOD_HOST = HostFacts(on_gfx950=True, flydsl_available=True, tp_size=4)
GOOD_ENGINE = EngineFacts(tp_size=4, dp_size=1, pp_size=1, speculative_method="dspark", num_speculative_tokens=7)
M31 = PRESETS["minimax-m3.1"]
CPU = torch.device("cpu")
PAGE = 16
F16_REFUSAL = "draft KV cache dtype torch.float16: the FlyDSL kernels take torch.bfloat16 or torch.float8_e4m3fn"


# Selection ---------------------------------------------------------------------------------------

GPU = torch.device("cuda", 0)  # only named: choose_backend reads its type, nothing touches a device


def test_every_host_check_passes_selects_flydsl_over_the_portable_ops(monkeypatch):
    from dspark_sidecar.server import backend

    monkeypatch.setattr(backend, "_triton_reason", lambda device: "Triton not installed")
    for want in ("auto", "flydsl"):
        choice = choose_backend(ServeConfig(backend=want), GOOD_HOST, GPU, M31)
        assert (choice.name, choice.fallback, choice.flydsl_refusal) == ("flydsl", "reference", None)
        assert choice.ops is REFERENCE_OPS  # what serves the steps the fast path refuses


def test_a_cpu_rank_on_a_gfx950_host_does_not_select_flydsl():
    """The host checks probe the machine (device 0 is a gfx950, FlyDSL importable, TP 4), not the rank's
    device: `--device cpu` on an MI355X host passed them all, so auto chose FlyDSL for a CPU rank. Every
    rank then allocated and IPC-mapped its exchange buffers on GPU 0 (HipRuntime(cpu) sets device 0),
    and the runner bound a CPU cache and CPU workspaces, which the FlyDSL kernels (GPU code taking raw
    pointers) would be launched on. The FlyDSL kernels need the rank's GPU, like the Triton backend."""
    choice = choose_backend(ServeConfig(device="cpu"), GOOD_HOST, CPU, M31)
    assert (choice.name, choice.ops) == ("reference", REFERENCE_OPS)
    assert choice.flydsl_refusal == "FlyDSL kernels need a GPU (this rank computes on cpu)"
    with pytest.raises(BackendUnavailable, match=r"^--backend flydsl: FlyDSL kernels need a GPU \(this rank"):
        # (ServeConfig refuses --backend flydsl with --device cpu itself: here the rank's device is the CPU)
        choose_backend(ServeConfig(backend="flydsl"), GOOD_HOST, CPU, M31)


def test_triton_interpret_on_a_gpu_rank_is_not_the_triton_backend(monkeypatch):
    """TRITON_INTERPRET (CI's switch) set on a GPU host made every Triton kernel run in numpy over copies
    of the GPU tensors, chosen silently under auto: seconds a step, and a failed graph capture."""
    pytest.importorskip("triton")
    from dspark_sidecar.kernels.triton import runtime

    monkeypatch.setattr(runtime, "INTERPRET", True)
    host = HostFacts(False, True, 4)
    assert choose_backend(ServeConfig(), host, GPU, M31).name == "reference"
    with pytest.raises(BackendUnavailable, match="^--backend triton: TRITON_INTERPRET is set: every Triton kernel"):
        choose_backend(ServeConfig(backend="triton"), host, GPU, M31)
    monkeypatch.setattr(runtime, "INTERPRET", False)
    assert choose_backend(ServeConfig(), host, GPU, M31).name == "triton"


@pytest.mark.parametrize("host, reason", [
    (HostFacts(False, True, 4), "not gfx950"),
    (HostFacts(True, False, 4), "FlyDSL not installed"),
    (HostFacts(True, True, 2), "TP 2 != 4"),
])
def test_failing_host_check_reports_the_seed_reason(host, reason):
    choice = choose_backend(ServeConfig(), host, CPU, M31)
    assert (choice.name, choice.flydsl_refusal) == ("reference", reason)
    with pytest.raises(BackendUnavailable, match=f"^--backend flydsl: {reason}$"):
        choose_backend(ServeConfig(backend="flydsl"), host, CPU, M31)


def test_drafter_the_kernels_are_not_built_for_is_refused():
    assert kernel_mismatch(M31, torch.bfloat16) is None
    why = "drafter hidden_size 256 != 6144 of the FlyDSL kernels"
    assert kernel_mismatch(PRESETS["tiny"], torch.bfloat16) == why
    assert choose_backend(ServeConfig(), GOOD_HOST, CPU, PRESETS["tiny"]).flydsl_refusal == why
    with pytest.raises(BackendUnavailable, match="--backend flydsl: FlyDSL kernels compute in bfloat16"):
        choose_backend(ServeConfig(backend="flydsl", dtype="fp32"), GOOD_HOST, CPU, M31, torch.float32)


@pytest.mark.parametrize("field,value", [("rms_norm_eps", 1e-5), ("rope_theta", 10_000.0), ("rotary_dim", 128),
                                         ("swiglu_alpha", 1.0), ("swiglu_limit", 10.0), ("sliding_window", 8192)])
def test_numerics_the_kernels_hard_code_are_refused_when_the_config_differs(field, value):
    """The FlyDSL kernels compile eps, theta, rotary dims, SwiGLU alpha/limit and the window in
    (shapes.py), while the spec has the drafter read them from config.json: a config that differs must
    send the step to a backend that takes them as arguments, or the kernels serve the wrong numbers."""
    import dataclasses
    cfg = dataclasses.replace(M31, **{field: value})
    assert kernel_mismatch(cfg, torch.bfloat16) == f"drafter {field} {value} != {getattr(M31, field)} of the FlyDSL kernels"


@pytest.mark.parametrize("field,value", [("num_hidden_layers", 6), ("hidden_size", 4096), ("head_dim", 64),
                                         ("num_attention_heads", 32), ("num_key_value_heads", 8),
                                         ("ffn_hidden_size", 6144), ("quant_block", 64)])
def test_shapes_the_kernels_are_built_for_are_refused_when_the_config_differs(field, value):
    """The kernels are compiled for the M3.1 rank shard (shapes.py). Past this check nothing compares the
    KV heads, query heads, FFN width or MX block with them: such a drafter's shards bind and the kernels read
    them with the M3.1 tiling (wrong numbers, scales read past their end). The tiny preset differs first in
    hidden_size, so a shape field dropped from kernel_mismatch's table went unnoticed."""
    import dataclasses
    cfg = dataclasses.replace(M31, **{field: value})
    assert kernel_mismatch(cfg, torch.bfloat16) == f"drafter {field} {value} != {getattr(M31, field)} of the FlyDSL kernels"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_a_compute_dtype_other_than_bfloat16_is_refused(dtype):
    assert kernel_mismatch(M31, dtype) == f"FlyDSL kernels compute in bfloat16, not {dtype} (--dtype)"


def test_portable_backend_asked_for_on_a_good_host_says_so():
    choice = choose_backend(ServeConfig(backend="reference"), GOOD_HOST, GPU, M31)
    assert (choice.name, choice.flydsl_refusal) == ("reference", "--backend reference selected")


# Weight binding ----------------------------------------------------------------------------------

@pytest.mark.parametrize("rank", [1, 3])
def test_weight_shards_are_the_checkpoint_bytes_the_portable_model_uses(tiny_ckpt, rank):
    cfg = PRESETS["tiny"]
    reader = CheckpointReader(tiny_ckpt[0], torch.bfloat16, cfg.quant_block)
    par = ParallelContext(rank, 4)
    model = DSparkDrafter(cfg, par, REFERENCE_OPS).load(reader)
    for i in (0, 4):
        lw, layer = layer_weights(reader, cfg, par, model, i, CPU), model.layers[i]
        for mx, w in ((lw.qkv, layer.qkv_proj.weight), (lw.gate_up, layer.gate_up_proj.weight),
                      (lw.o, layer.o_proj.weight), (lw.down, layer.down_proj.weight)):
            assert mx.bits.dtype == mx.scale.dtype == torch.uint8
            assert mx.scale.shape == (w.shape[0], w.shape[1] // 32)
            # Dequantized as the kernel does, the shard is exactly the model's bf16 weight.
            assert torch.equal(dequant_like_kernel(mx.bits, mx.scale).to(torch.bfloat16), w)
        # Each norm the kernel applies where the model does: a swapped pair is silently wrong numbers.
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight, layer.q_norm.weight,
                 layer.k_norm.weight)
        assert [a is b for a, b in zip((lw.input_norm, lw.post_norm, lw.q_norm, lw.k_norm), norms)] == [True] * 4


def test_a_checkpoint_of_dense_linears_turns_the_path_off_instead_of_failing_the_rank(tiny_ckpt, tmp_path):
    """Layer linears saved dequantized carry no `_scale_inv` (check_checkpoint accepts exactly that, and
    refuses a stale scale beside a dense weight). The missing scale was read before the weight's dtype
    was looked at: a CheckpointError that stopped the rank, where FlyDSLUnsupported keeps the portable path."""
    from safetensors.torch import load_file, save_file

    from dspark_sidecar.drafter.checkpoint import SCALE_SUFFIX, check_checkpoint, dequantize_mxfp8
    from dspark_sidecar.kernels.flydsl.runner import FlyDSLUnsupported

    cfg = PRESETS["tiny"]
    t = load_file(str(tiny_ckpt[0] / "model.safetensors"))
    for k in [k for k in t if k.endswith(SCALE_SUFFIX)]:
        w = k[: -len(SCALE_SUFFIX)]
        t[w] = dequantize_mxfp8(t[w], t.pop(k), cfg.quant_block).to(torch.bfloat16)
    d = tmp_path / "dense"
    d.mkdir()
    save_file(t, str(d / "model.safetensors"))
    (d / "config.json").write_text((tiny_ckpt[0] / "config.json").read_text())
    check_checkpoint(cfg, d, tiny_ckpt[1])  # a servable checkpoint
    reader = CheckpointReader(d, torch.bfloat16, cfg.quant_block)
    par = ParallelContext(1, 4)
    model = DSparkDrafter(cfg, par, REFERENCE_OPS).load(reader)
    with pytest.raises(FlyDSLUnsupported, match="q_proj.weight: stored as torch.bfloat16, the kernels need F8_E4M3"):
        layer_weights(reader, cfg, par, model, 0, CPU)


def test_random_weights_are_quantized_for_the_kernels():
    cfg = PRESETS["tiny"]
    src = SyntheticSource(cfg, torch.bfloat16)
    par = ParallelContext(2, 4)
    model = DSparkDrafter(cfg, par, REFERENCE_OPS).load(src)
    lw = layer_weights(src, cfg, par, model, 1, CPU)
    w = model.layers[1].down_proj.weight.float()
    got = dequant_like_kernel(lw.down.bits, lw.down.scale)
    assert got.shape == w.shape and float((got - w).norm() / w.norm()) < 0.05  # E4M3: ~3 mantissa bits


def test_start_up_binds_weights_and_maps_peers_on_four_ranks(tiny_ckpt, tmp_path):
    res = run_ranks(4, fast_path_rank, str(tmp_path / "ok"), str(tiny_ckpt[0]), None)
    assert [(r["reason"], r["layers"], r["mapped"], r["live"]) for r in res] == [(None, 5, True, 0)] * 4
    assert res[0]["qkv"] == (256 + 2 * 128, 256)  # this rank's q | k | v rows
    # One rank cannot export: every rank keeps the same permanent reason, nothing stays mapped.
    res = run_ranks(4, fast_path_rank, str(tmp_path / "bad"), str(tiny_ckpt[0]), "alloc")
    assert {r["reason"] for r in res} == {"rank 0 could not export its exchange buffers: "
                                          "hipExtMallocWithFlags(hipDeviceMallocUncached) failed: out of memory"}
    assert all(not r["mapped"] and r["live"] == 0 for r in res)
    # Rank 0's checkpoint holds bf16 linears: the weights fail there only, the path is off everywhere.
    res = run_ranks(4, fast_path_rank, str(tmp_path / "w"), str(tiny_ckpt[0]), "weights")
    assert {r["reason"] for r in res} == {
        "rank 0 could not bind its weights: language_model.model.dspark.layers.0.decoder_layer.self_attn.q_proj.weight: "
        "stored as torch.bfloat16, the kernels need F8_E4M3 + U8 scales"}
    assert all(not r["mapped"] and r["live"] == 0 for r in res)


def test_a_weight_shard_out_of_memory_on_one_rank_turns_the_path_off_on_every_rank(tiny_ckpt, tmp_path):
    # Rank 0 runs out of device memory for its shards (or a HIP error, a failed read). Only FlyDSLUnsupported
    # was posted: this raised on rank 0 alone, which exited while its 3 peers sat in map_peers' all_gather.
    # timeout_s: were it still raised, the peers would fail within seconds instead of gloo's 30 minutes.
    res = run_ranks(4, fast_path_rank, str(tmp_path), str(tiny_ckpt[0]), "weights_oom", timeout_s=60)
    assert {r["reason"] for r in res} == {
        "rank 0 could not bind its weights: OutOfMemoryError: HIP out of memory. Tried to allocate 96.00 MiB"}
    assert all(not r["mapped"] and r["live"] == 0 for r in res)


def test_a_path_off_for_good_at_start_up_keeps_no_weight_shards(tiny_ckpt, tmp_path):
    """A start-up reason is permanent (ready() never builds a runner), yet every rank that had bound its
    MXFP8 shards kept them on the device for the life of the rank: ~430 MB a rank at the M3.1 shard, beside
    the portable model that serves every step. One rank's export failing, or one rank's weights, leaves
    none bound anywhere now."""
    res = run_ranks(4, fast_path_rank, str(tmp_path), str(tiny_ckpt[0]), "alloc")
    assert all(r["reason"] is not None for r in res)
    assert [r["layers"] for r in res] == [0] * 4


def test_the_start_up_line_says_the_path_is_off_when_it_failed_to_start(tiny_ckpt, monkeypatch, caplog):
    """The rank's "shard loaded" line read the backend choice's reason alone: a path that the choice
    selected and whose weights or peer mapping then failed (its permanent reason, warned just before)
    was logged as "FlyDSL path: on"."""
    from dspark_sidecar.server import app
    from dspark_sidecar.server.backend import BackendChoice

    why = "rank 0 could not export its exchange buffers: out of memory"
    monkeypatch.setattr(app, "probe_host", lambda world: GOOD_HOST)
    choice = BackendChoice("flydsl", REFERENCE_OPS, CPU, None, "reference")
    monkeypatch.setattr(app, "choose_backend", lambda *a: choice)
    monkeypatch.setattr(app, "build_fast_path", lambda *a, **k: SimpleNamespace(startup_reason=why))
    cfg = ServeConfig(tp=4, device="cpu", dtype="fp32", checkpoint=tiny_ckpt[0], target_checkpoint=tiny_ckpt[1])
    with caplog.at_level("INFO", logger="dspark_sidecar.server"):
        app._load(cfg, 0, 1, CPU, None, app.StartUp(0, threading.Event()))
    loaded = [r.getMessage() for r in caplog.records if "shard loaded" in r.getMessage()]
    assert len(loaded) == 1 and loaded[0].endswith(f"backend flydsl; FlyDSL path: {why})"), loaded


def test_the_ranks_of_a_mixed_host_choose_their_backend_from_facts_every_rank_shares(tiny_ckpt, monkeypatch):
    """on_gfx950 asks the rank's own GPU (toolchain: another GPU model on a mixed host), and each rank chose its
    backend from its own answer: the ranks on a gfx950 chose FlyDSL and entered build_fast_path's collectives
    while the others went on to the next start-up collective, which hung until --startup-timeout-s ("a peer
    rank left" on every rank). The exchange needs every rank's kernels: a check fails for all where it fails on one."""
    from dspark_sidecar.server import app
    from dspark_sidecar.server.backend import BackendChoice

    other = HostFacts(on_gfx950=False, flydsl_available=True, tp_size=4)  # rank 2's GPU is another model
    monkeypatch.setattr(app, "probe_host", lambda world: GOOD_HOST)
    monkeypatch.setattr(app.dist, "all_gather_object", lambda out, obj, group=None: out.__setitem__(
        slice(None), [obj, obj, other, obj]))
    seen = []
    choice = BackendChoice("reference", REFERENCE_OPS, CPU, "not gfx950")
    monkeypatch.setattr(app, "choose_backend", lambda cfg, host, *a: seen.append(host) or choice)
    cfg = ServeConfig(tp=4, device="cpu", dtype="fp32", checkpoint=tiny_ckpt[0], target_checkpoint=tiny_ckpt[1])
    host = app._load(cfg, 0, 4, CPU, None, app.StartUp(0, threading.Event()))[4]
    assert seen == [other] and host == other  # the backend, and health's reasons (Lifecycle.host), alike on every rank


def test_backend_flydsl_whose_path_failed_to_start_is_unavailable(tiny_ckpt, monkeypatch):
    """--backend flydsl asks for the FlyDSL path or nothing: a path that the choice selected and whose weights or
    peer mapping then failed must stop the rank with its reason, not serve every step on the portable layers."""
    import re

    from dspark_sidecar.server import app
    from dspark_sidecar.server.backend import BackendChoice

    why = "rank 0 could not export its exchange buffers: out of memory"
    monkeypatch.setattr(app, "probe_host", lambda world: GOOD_HOST)
    choice = BackendChoice("flydsl", REFERENCE_OPS, CPU, None, "reference")
    monkeypatch.setattr(app, "choose_backend", lambda *a: choice)
    monkeypatch.setattr(app, "build_fast_path", lambda *a, **k: SimpleNamespace(startup_reason=why))
    cfg = ServeConfig(tp=4, backend="flydsl", dtype="fp32", checkpoint=tiny_ckpt[0],
                      target_checkpoint=tiny_ckpt[1])
    with pytest.raises(BackendUnavailable, match=f"^--backend flydsl: {re.escape(why)}$"):
        app._load(cfg, 0, 1, CPU, None, app.StartUp(0, threading.Event()))


def test_a_weight_shard_read_error_is_posted_to_the_peers_not_raised(monkeypatch):
    """A read that fails while this rank binds its shards (CheckpointError, a ValueError) must reach map_peers
    as this rank's failure, so every rank turns the path off together. Raised instead, it stopped this rank
    alone while its peers waited in map_peers' collective."""
    from dspark_sidecar.drafter.checkpoint import CheckpointError
    from dspark_sidecar.kernels.flydsl import peers as peers_mod
    from dspark_sidecar.server.fast_path import build_fast_path

    cfg = PRESETS["tiny"]
    err = "language_model.model.dspark.layers.0.decoder_layer.self_attn.q_proj.weight: unreadable in model.safetensors"

    class Unreadable(SyntheticSource):
        def read(self, key, shape, rows=None, cols=None):
            raise CheckpointError(err)

    posted = []

    def map_peers(group, make_runtime, device, local_failure=None):
        posted.append(local_failure)  # what peers.map_peers posts in place of an offer
        raise rn.FlyDSLUnsupported(f"rank 0 {local_failure}")

    monkeypatch.setattr(peers_mod, "map_peers", map_peers)
    model = DSparkDrafter(cfg, ParallelContext(0, 4), REFERENCE_OPS).load(SyntheticSource(cfg, torch.bfloat16))
    fast = build_fast_path(cfg, model, Unreadable(cfg, torch.bfloat16), GOOD_HOST, None, 0)
    assert posted == [f"could not bind its weights: CheckpointError: {err}"]
    assert fast.startup_reason == f"rank 0 {posted[0]}" and fast.layers == [] and fast.peers is None


def test_a_weight_shard_error_of_any_type_is_posted_to_the_peers_not_raised(monkeypatch):
    """Only the types named (RuntimeError, OSError, MemoryError, CheckpointError) were posted: a read whose slice
    failed in safetensors itself (SafetensorError, an Exception), or any other error of binding a shard, raised
    on this rank alone while its peers waited in map_peers' collective, and start-up failed on every rank
    (a peer lost) where the portable model, loaded already, could have served with the path off."""
    from safetensors import SafetensorError

    from dspark_sidecar.kernels.flydsl import peers as peers_mod
    from dspark_sidecar.server.fast_path import build_fast_path

    cfg = PRESETS["tiny"]

    class Unreadable(SyntheticSource):
        def read(self, key, shape, rows=None, cols=None):
            raise SafetensorError("Error during slicing [0:256] with shape [1024, 256]")

    posted = []

    def map_peers(group, make_runtime, device, local_failure=None):
        posted.append(local_failure)
        raise rn.FlyDSLUnsupported(f"rank 0 {local_failure}")

    monkeypatch.setattr(peers_mod, "map_peers", map_peers)
    model = DSparkDrafter(cfg, ParallelContext(0, 4), REFERENCE_OPS).load(SyntheticSource(cfg, torch.bfloat16))
    fast = build_fast_path(cfg, model, Unreadable(cfg, torch.bfloat16), GOOD_HOST, None, 0)
    assert posted == ["could not bind its weights: SafetensorError: Error during slicing [0:256] with shape [1024, 256]"]
    assert fast.startup_reason == f"rank 0 {posted[0]}" and fast.layers == [] and fast.peers is None


def test_a_peer_lost_while_the_path_is_built_is_one_line(tiny_ckpt, monkeypatch):
    # A peer killed while binding its shards (the OOM killer) reaches the others in map_peers' all_gather as
    # gloo's RuntimeError: it escaped as a traceback that reads as a second failure, not PeerLost as at the
    # start-up barriers (StartUp._collective).
    from dspark_sidecar.server import app
    from dspark_sidecar.server.backend import BackendChoice

    def lost(*_a, **_k):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:49330. This is "
                           "typically caused by a remote worker crashing.")

    monkeypatch.setattr(app, "probe_host", lambda world: GOOD_HOST)
    choice = BackendChoice("flydsl", REFERENCE_OPS, CPU, None, "reference")
    monkeypatch.setattr(app, "choose_backend", lambda *a: choice)
    monkeypatch.setattr(app, "build_fast_path", lost)
    # The ranks' host facts, gathered before the choice (every rank on the same host): no group here.
    monkeypatch.setattr(app.dist, "all_gather_object", lambda out, obj, group=None: out.__setitem__(
        slice(None), [obj] * len(out)))
    cfg = ServeConfig(tp=4, device="cpu", dtype="fp32", checkpoint=tiny_ckpt[0], target_checkpoint=tiny_ckpt[1])
    start_up = app.StartUp(0, threading.Event())
    start_up.bound_s = 600
    from dspark_sidecar.server.process_group import PeerLost

    with pytest.raises(PeerLost, match=r"^rank 0: a peer rank left during start-up or did not catch up within "
                                           r"--startup-timeout-s 600 s \(\[gloo.*Connection closed by peer"):
        app._load(cfg, 0, 4, CPU, None, start_up)


# Binding and routing -----------------------------------------------------------------------------

def mx(n, k):
    return rn.MXLinear(torch.zeros(n, k, dtype=torch.uint8), torch.zeros(n, k // 32, dtype=torch.uint8))


def layer():
    bf = torch.bfloat16
    return rn.LayerWeights(qkv=mx(2304, 6144), o=mx(6144, 2048), gate_up=mx(6144, 6144), down=mx(6144, 3072),
                           input_norm=torch.zeros(6144, dtype=bf), post_norm=torch.zeros(6144, dtype=bf),
                           q_norm=torch.zeros(128, dtype=bf), k_norm=torch.zeros(128, dtype=bf))


def peers():
    rx = [torch.zeros(8, 4) for _ in range(4)]
    fl = [torch.zeros(8, dtype=torch.int32) for _ in range(4)]
    return rn.PeerBuffers(rx, fl, rx[0], fl[0], torch.zeros(1, dtype=torch.int32))


def binding(gen=1, dtype=torch.bfloat16, engine=GOOD_ENGINE, pages=4, layout="planes"):
    """layout: planes [2, pages, page_size, 1, 128]; records, the planes views of vLLM 0.34 caches
    [pages, 1, page_size, 256] (K | V records); or pages, of caches [pages, 2, page_size, 1, 128]
    (K then V per page, as FlashInfer's): a view the portable ops serve but the FlyDSL kernels do not."""
    if layout == "records":
        layers = [kv_planes(torch.zeros(pages, 1, PAGE, 256, dtype=dtype)) for _ in range(5)]
    elif layout == "pages":
        layers = [torch.zeros(pages, 2, PAGE, 1, 128, dtype=dtype).transpose(0, 1) for _ in range(5)]
    else:
        layers = [torch.zeros(2, pages, PAGE, 1, 128, dtype=dtype) for _ in range(5)]
    return KVBinding(binding_id=7, generation=gen, layers=layers, num_pages=pages, page_size=PAGE,
                     engine=engine, mappings=[])


class Counting:
    """The real DrafterRunner (its checks and binding), counted; closes recorded."""

    def __init__(self):
        self.built: list[rn.DrafterRunner] = []
        self.closed = 0

    def __call__(self, *args, **kw):
        r = rn.DrafterRunner(*args, **kw)
        close = r.close
        r.close = lambda: (setattr(self, "closed", self.closed + 1), close())
        self.built.append(r)
        return r


def fast_path(factory=None, startup_reason=None, compile_ahead=False):
    fp = FlyDSLFastPath([layer()] * 5, torch.zeros(6144, dtype=torch.bfloat16), peers(), 0, GOOD_HOST,
                        startup_reason, max_positions=64, runner_factory=factory or Counting(),
                        compile_ahead=compile_ahead)
    told = []
    fp.listeners.append(lambda: told.append(fp.reason))
    return fp, told


@pytest.mark.parametrize("kv, reason", [
    (binding(dtype=torch.float16), F16_REFUSAL),
    (binding(engine=EngineFacts(4, 2, 1, "dspark", 7)), "DP > 1"),
    # The seed's checks before the cache's: with only one failing, either order passed.
    (binding(dtype=torch.float16, engine=EngineFacts(4, 1, 2, "dspark", 7)), "PP > 1"),
    (binding(engine=EngineFacts(4, 1, 1, "dspark", 5)), "7 speculative tokens required"),
    (binding(layout="pages"), "draft KV cache strides [2048, 4096, 128, 128, 1] are neither the contiguous planes "
                              "layout nor vLLM 0.34's records layout [128, 4096, 256, 4096, 1]: the FlyDSL kernels "
                              "address those two only; the Triton backend serves any"),
])
def test_unservable_binding_refused_with_its_reason(kv, reason):
    fp, told = fast_path()
    assert fp.refusal(kv) == reason  # what BindKV reports, before any step
    assert fp.ready(kv) is False
    assert fp.reason == reason and told == [reason]
    assert fp.ready(kv) is False and told == [reason]  # judged once per binding
    assert fp.runner is None and not fp.runner_factory.built


def test_startup_failure_is_permanent():
    fp, told = fast_path(startup_reason="TP exchange needs 4 ranks, the group has 1")
    kv = binding()
    assert fp.refusal(kv) == fp.refusal(None) == "TP exchange needs 4 ranks, the group has 1"
    assert fp.ready(kv) is False and told == []  # the reason did not change
    assert not fp.runner_factory.built


def test_good_binding_binds_once_and_stale_or_rebound_rebuilds():
    fp, told = fast_path()
    kv = binding()
    assert fp.refusal(kv) is None
    assert fp.ready(kv) and fp.ready(kv)
    factory = fp.runner_factory
    assert len(factory.built) == 1 and told == []  # None -> None: health unchanged
    first = factory.built[0]
    # The engine re-allocated a layer under the same binding: the runner notices and is rebuilt.
    kv.layers[2] = kv.layers[2].clone()
    assert first.stale(kv.layers) and fp.ready(kv)
    assert len(factory.built) == 2 and factory.closed == 1 and fp.runner is factory.built[1]
    # A re-bind (new generation) with an unservable layout: refused, the old runner closed.
    bad = binding(gen=2, dtype=torch.float16)
    assert not fp.ready(bad) and fp.runner is None and factory.closed == 2
    assert told == [F16_REFUSAL]
    # And back to a good binding: served again, health told the reason cleared.
    assert fp.ready(binding(gen=3)) and told[-1] is None and len(factory.built) == 3
    fp.close()
    assert factory.closed == 3


def test_records_binding_is_served_as_interleaved_rows():
    """vLLM 0.34's cache: the runner binds each layer's records as K | V rows of the same memory."""
    fp, told = fast_path()
    kv = binding(layout="records")
    assert fp.refusal(kv) is None
    assert fp.ready(kv) and told == []
    for t, bound in zip(kv.layers, fp.runner._kv):
        assert (bound.slot_rows, bound.v_row0) == (2, 1)
        assert bound.rows.shape == (2 * 4 * PAGE, 128) and bound.rows.data_ptr() == t.data_ptr()
    fp.close()


@pytest.mark.parametrize("layout", ["planes", "records"])
def test_fp8_binding_is_served_as_rows_of_codes(layout):
    """vLLM's fp8 cache (e4m3fn codes at scale 1) is served by the fast path in either layout (it ran
    the Triton backend before the kernels took fp8): no refusal, the layers bound as uint8 rows."""
    fp, told = fast_path()
    kv = binding(dtype=torch.float8_e4m3fn, layout=layout)
    assert fp.refusal(kv) is None
    assert fp.ready(kv) and told == []
    for t, bound in zip(kv.layers, fp.runner._kv):
        assert bound.kv_dtype == "fp8" and bound.rows.dtype == torch.uint8 and bound.rows.data_ptr() == t.data_ptr()
    fp.close()


class GatedCompile:
    """A runner factory whose runners' compile_all waits for a gate (or fails), recording each call."""

    def __init__(self, fail: bool = False):
        self.gate, self.fail, self.compiled, self.closed = threading.Event(), fail, [], []

    def __call__(self, *args, **kw):
        factory = self

        class Runner:
            def stale(self, kv_layers):
                return False

            def compile_all(self):
                factory.gate.wait(10)
                if factory.fail:
                    raise RuntimeError("ld.lld: undefined symbol")
                factory.compiled.append(self)
                return 96

            def abandon(self):
                pass  # compile_all here is one wait: it stops when its gate opens

            def close(self):
                factory.closed.append(self)

        return Runner()


def test_kernels_compile_off_the_step_path_before_the_runner_serves():
    factory = GatedCompile()
    fp, told = fast_path(factory=factory, compile_ahead=True)
    kv = binding()
    assert not fp.ready(kv) and not fp.ready(kv)  # compiling: this rank offers the portable layers
    assert fp.reason is None and told == []  # nothing is wrong: health stays as it is
    factory.gate.set()
    wait_until(lambda: fp.ready(kv), 5, "the fast path ready once its kernels compiled")
    assert len(factory.compiled) == 1 and fp.runner is factory.compiled[0]


def test_a_compile_failure_turns_the_path_off_with_the_reason():
    factory = GatedCompile(fail=True)
    fp, told = fast_path(factory=factory, compile_ahead=True)
    kv = binding()
    factory.gate.set()
    assert not fp.ready(kv)
    wait_until(lambda: fp.reason is not None, 5, "the failed compile gives the fast path a reason")
    assert fp.reason == "FlyDSL kernels failed to compile: RuntimeError: ld.lld: undefined symbol"
    assert told == [fp.reason] and not fp.ready(kv) and len(factory.closed) == 1


def test_a_rebind_while_compiling_drops_the_old_runner():
    factory = GatedCompile()
    fp, _ = fast_path(factory=factory, compile_ahead=True)
    assert not fp.ready(binding(gen=1))
    assert not fp.ready(binding(gen=2))  # re-bound before the first compile finished
    factory.gate.set()
    wait_until(lambda: fp.ready(binding(gen=2)), 5, "the fast path ready for the gen-2 binding")
    # The gen-1 runner closed itself when its compile ended.
    wait_until(lambda: len(factory.closed) == 1, 5, lambda: f"one runner closed: {factory.closed}")
    assert fp.runner is not factory.closed[0]


def test_a_failed_compile_of_a_binding_that_went_leaves_the_new_binding_alone():
    """The old binding's runner, abandoned mid-compile, can still fail on the kernel in hand. That failure is
    the old binding's: taken for the current one, it turned the path off for the new binding (refusal, health)
    and dropped the new runner's compile in flight, so the new binding was never served."""
    gates, closed, built = [threading.Event(), threading.Event()], [], []

    class Runner:
        def __init__(self, i):
            self.i = i

        def stale(self, kv_layers):
            return False

        def compile_all(self):
            gates[self.i].wait(10)
            if self.i == 0:
                raise RuntimeError("ld.lld: undefined symbol")
            return 96

        def abandon(self):
            pass  # compile_all here is one wait: it ends when its gate opens

        def close(self):
            closed.append(self.i)

    def factory(*args, **kw):
        built.append(Runner(len(built)))
        return built[-1]

    fp, _ = fast_path(factory=factory, compile_ahead=True)
    kv2 = binding(gen=2)
    assert not fp.ready(binding(gen=1)) and not fp.ready(kv2)  # re-bound while gen 1 compiles
    gates[0].set()
    wait_until(lambda: closed == [0], 5, lambda: f"the gen-1 runner closed after its failed compile: {closed}")
    assert fp.reason is None and fp.refusal(kv2) is None
    gates[1].set()
    wait_until(lambda: fp.ready(kv2), 5, "the fast path ready for the gen-2 binding")
    assert fp.runner is built[1] and closed == [0]
    fp.close()


def test_status_says_the_kernels_compile_until_the_runner_serves_and_strict_health_stays_serving():
    """From BindKV until the background compile ended (every kernel for R = 1..8), GetStatus said
    fast_path_refusal "" (on) while every step ran the portable layers: ready() offered nothing. Now
    GetStatus says why the path does not serve yet. That is no refusal of the deployment: BindKV's
    answer, health and --strict-refusal (servicer.refusal) stay as they were, or a strict rank would be
    NOT_SERVING for the length of every compile and the shim would read it as refused for good."""
    from grpc_health.v1 import health, health_pb2

    from dspark_sidecar.proto import sidecar_pb2 as pb
    from dspark_sidecar.server.health import HealthPublisher
    from dspark_sidecar.server.metrics import Metrics

    factory = GatedCompile()
    fp, _ = fast_path(factory=factory, compile_ahead=True)
    kv = binding()
    ctx = SimpleNamespace(rank=0, fast=fp, cfg=M31, memory=SimpleNamespace(kv=kv),
                          model=SimpleNamespace(dtype=torch.bfloat16), metrics=Metrics(0))
    life = Lifecycle(backend="flydsl", host=GOOD_HOST, strict=True)
    svc = DrafterServicer(ctx, None, life, pb.Limits(), pb.Parallel(), "mxfp8")
    hs = health.HealthServicer()
    publish = HealthPublisher(life, svc, ctx, hs, SimpleNamespace(set_serving=lambda serving: None))
    publish("SERVING")

    def status() -> str:
        return svc.GetStatus(pb.GetStatusRequest(), None).fast_path_refusal

    def health_status():
        return hs.Check(health_pb2.HealthCheckRequest(service=""), None).status

    assert status() == ("FlyDSL kernels for binding 7 gen 1 not compiled yet: they compile in the background "
                        "from the binding's first step; the portable layers serve its steps until then")
    assert not fp.ready(kv)  # the first step starts the compile and runs the portable layers
    assert status().startswith("FlyDSL kernels for binding 7 gen 1 compiling (")
    assert status().endswith("s so far): the portable layers serve its steps until they are ready")
    assert svc.refusal() == "" and fp.refusal(kv) is None  # BindKV's and health's reading: not refused
    publish()
    assert life.state == "SERVING" and health_status() == health_pb2.HealthCheckResponse.SERVING
    assert ctx.refusal is None  # strict: steps are not refused while the kernels compile
    factory.gate.set()
    wait_until(lambda: fp.ready(kv), 5, "the fast path ready once its kernels compiled")
    assert status() == ""  # served by the fast path now
    # A re-bind: not compiled for the new binding until its own compile ends.
    ctx.memory.kv = kv2 = binding(gen=2)
    assert "binding 7 gen 2 not compiled yet" in status()
    factory.gate.clear()
    assert not fp.ready(kv2) and "binding 7 gen 2 compiling" in status()
    factory.gate.set()
    wait_until(lambda: fp.ready(kv2), 5, "the fast path ready for the new binding")
    assert status() == ""
    fp.close()


def test_status_says_when_a_peer_rank_keeps_every_rank_off_the_fast_path():
    """A runner that one rank alone fails to build (out of device memory) or compile turns only that rank's
    offer off, and the rendezvous then runs every rank's steps on the portable layers (Verdict.fast). The
    other ranks' GetStatus said fast_path_refusal "" ("empty when it is on") for good while no step ran
    fast. Now a rank that offered and was outvoted says so (GetStatus only: health, --strict-refusal and
    BindKV read refusal(), which is about this rank's own verdict), until a step runs fast again."""
    from dspark_sidecar.proto import sidecar_pb2 as pb
    from dspark_sidecar.server.metrics import Metrics

    fp, told = fast_path()
    kv = binding()
    ctx = SimpleNamespace(rank=0, fast=fp, cfg=M31, memory=SimpleNamespace(kv=kv),
                          model=SimpleNamespace(dtype=torch.bfloat16), metrics=Metrics(0))
    svc = DrafterServicer(ctx, None, Lifecycle(backend="flydsl", host=GOOD_HOST), pb.Limits(), pb.Parallel(), "mxfp8")

    def status() -> str:
        return svc.GetStatus(pb.GetStatusRequest(), None).fast_path_refusal

    assert fp.ready(kv) and status() == ""
    fp.agreed(kv, False)  # this rank offered, a peer did not: the step ran the portable layers
    assert status() == ("FlyDSL fast path ready on rank 0 for binding 7 gen 1, but a peer rank did not offer it at the "
                        "last step (its GetStatus says why): every rank runs the portable layers")
    assert svc.refusal() == "" and fp.refusal(kv) is None and told == []  # no refusal of this rank's deployment
    fp.agreed(kv, True)  # the peer caught up (its compile ended): served by the fast path
    assert status() == ""
    fp.agreed(kv, False)
    ctx.memory.kv = kv2 = binding(gen=2)  # a re-bind: the old binding's outcome says nothing of the new one
    assert fp.ready(kv2) and status() == ""
    fp.close()


class GatedKernels(Counting):
    """Real DrafterRunners whose every kernel compile (_kernel) is recorded and waits for a gate."""

    def __init__(self):
        super().__init__()
        self.gate, self.kernels = threading.Event(), []

    def __call__(self, *args, **kw):
        r = super().__call__(*args, **kw)

        def kernel(name, num_reqs, exchange, args):
            self.kernels.append(r)
            self.gate.wait(10)

        r._kernel = kernel
        return r


@pytest.mark.parametrize("how", ["UnbindKV", "a step of a new binding"])
def test_a_compile_for_a_binding_that_went_stops_at_its_next_kernel(how):
    """A runner whose binding went (UnbindKV, BindKV, or a step of a new binding) while its kernels
    compiled was left to finish every kernel for R = 1..8 before its thread closed it, its views of the
    old cache keeping the engine's allocation mapped all that while. Now it stops at its next kernel."""
    factory = GatedKernels()
    fp, _ = fast_path(factory=factory, compile_ahead=True)
    assert not fp.ready(binding(gen=1))
    wait_until(lambda: factory.kernels, 5, "inside its first kernel's compile")
    old = factory.built[0]
    kv2 = binding(gen=2)
    if how == "UnbindKV":
        fp.unbound()  # BindKV makes the same call (servicer.BindKV)
    else:
        assert not fp.ready(kv2)
    factory.gate.set()
    wait_until(lambda: old._kv == [], 5, "the old runner closed by its own thread once the kernel in hand compiled")
    assert factory.kernels.count(old) == 1
    if how != "UnbindKV":  # the new binding's compile runs to the end and serves
        wait_until(lambda: fp.ready(kv2), 5, "the fast path ready for the new binding")
        new = factory.built[1]
        assert fp.runner is new and factory.kernels.count(new) > 8 * 10
    fp.close()


def test_forward_calls_the_runner_with_the_kernel_tensors():
    calls = []

    class FakeRunner:
        def __init__(self, *args, **kw):
            self.args = args

        def stale(self, kv_layers):
            return False

        def forward(self, positions, embeds, slots, block_tables):
            calls.append((positions, embeds, slots, block_tables))
            return embeds + 1

        def close(self):
            pass

    fp, _ = fast_path(factory=FakeRunner)
    kv = binding()
    assert fp.ready(kv)
    assert fp.runner.args[2] is kv.layers and fp.runner.args[5] == PAGE and fp.runner.args[7] == GOOD_ENGINE
    n = 14
    embeds = torch.randn(n, 6144)
    positions = torch.arange(100, 100 + n, dtype=torch.int32)
    meta = StepMetadata(torch.tensor([107, 114], dtype=torch.int32), torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int64),
                        torch.arange(n, dtype=torch.int64) + 3)
    out = fp.forward(embeds, positions, meta)
    (pos, emb, slots, bt), = calls
    assert pos.dtype == torch.int64 and torch.equal(pos, positions.long())
    assert emb.dtype == torch.bfloat16 and torch.equal(emb, embeds.to(torch.bfloat16))
    assert slots is meta.slot_mapping
    assert bt.dtype == torch.int32 and torch.equal(bt, meta.block_tables.int())
    assert torch.equal(out, emb + 1)


def test_forward_without_a_ready_binding_is_refused_with_the_reason():
    """forward() runs only where ready() said so; called otherwise (no binding served, or a refused one), it says
    so in its own words rather than an AttributeError on a runner that is not there."""
    fp, _ = fast_path()
    meta = StepMetadata(torch.tensor([7], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int64),
                        torch.arange(7, dtype=torch.int64))
    for kv in (None, binding(dtype=torch.float16)):
        if kv is not None:
            assert not fp.ready(kv)
        with pytest.raises(RuntimeError, match="^FlyDSL fast path: forward without a ready binding$"):
            fp.forward(torch.zeros(7, 6144), torch.arange(7), meta)


def test_servicer_reports_the_fast_path_reason_and_republishes():
    fp, _ = fast_path()
    kv = binding(dtype=torch.float16)
    ctx = SimpleNamespace(fast=fp, memory=SimpleNamespace(kv=None))
    published = []
    life = Lifecycle(backend="flydsl", host=GOOD_HOST, on_change=[lambda: published.append(1)])
    svc = DrafterServicer(ctx, None, life, None, None, "mxfp8->bf16")
    assert svc.refusal().startswith("no engine bound yet")
    ctx.memory.kv = kv
    assert svc.refusal() == F16_REFUSAL
    assert not fp.ready(kv) and published == [1]  # the verdict at bind time reached health
    # An f16 cache too: with a servable cache, "the seed's checks come first" held whatever the order.
    ctx.memory.kv = binding(gen=2, dtype=torch.float16, engine=EngineFacts(4, 1, 2, "dspark", 7))
    assert svc.refusal() == "PP > 1"  # the seed's checks come first
    # No fast path built (a portable backend was asked for): the choice's reason.
    svc2 = DrafterServicer(SimpleNamespace(fast=None, memory=SimpleNamespace(kv=binding())), None,
                           Lifecycle(backend="triton", host=GOOD_HOST, flydsl_off="--backend triton selected"),
                           None, None, "")
    assert svc2.refusal() == "--backend triton selected"


def test_unbinding_lets_the_runner_drop_the_unbound_caches_views():
    """UnbindKV is how an engine about to free its cache (or sleep) lets it go, and the binding's
    mappings are closed, each unmapped once no view of it is left. The runner kept its views of every
    layer (KVRows) until a step of another binding rebuilt it: after an UnbindKV with no step behind
    it, never, so the engine's IPC allocation stayed alive in this process for good. Unbound, the
    runner is closed (once the device is done: through the loop's after_device) and a later binding
    builds its own."""
    from dspark_sidecar.proto import sidecar_pb2 as pb
    from dspark_sidecar.server.kv_binding import MemoryBindings

    class Loop:  # no GPU: nothing queued ahead of a release
        def exclusive(self, wait=True, quiesce=True, give_up=None):
            return contextlib.nullcontext()

        def after_device(self, fn, wait=None):
            fn()

    fp, _ = fast_path()
    mem = MemoryBindings(M31, 4, 0, torch.bfloat16, CPU)
    mem.kv = kv = binding()
    assert fp.ready(kv)
    runner = fp.runner
    svc = DrafterServicer(SimpleNamespace(fast=fp, memory=mem, rank=0), Loop(),
                          Lifecycle(backend="flydsl", host=GOOD_HOST), None, None, "mxfp8")
    svc.UnbindKV(pb.UnbindKVRequest(binding_id=kv.binding_id), SimpleNamespace(peer=lambda: "unix:/s"))
    assert mem.kv is None
    assert fp.runner is None and fp.runner_factory.closed == 1 and runner._kv == []
    assert fp.ready(binding(gen=2)) and len(fp.runner_factory.built) == 2  # a new binding: a runner of its own
    fp.close()


def test_close_waits_for_the_device_then_closes_the_runner_then_the_peer_mappings_once(monkeypatch):
    """The rank's teardown: the runner (whose kernels address the peers' exchange buffers) goes first, then the
    mappings (peers.MappedPeers.close: the peers' IPC handles closed, this rank's buffers freed). Left open, a
    stopped rank kept every peer's exchange buffers mapped; closed twice, a handle was closed again. Before both,
    the device: a FlyDSL rank has no step graphs, so nothing in the teardown synchronized it before this close,
    and the last step's kernels (queued, not waited for: its answer is an event) could still read what it frees."""
    order = []
    monkeypatch.setattr(fast_path_mod.torch.cuda, "synchronize", lambda device=None: order.append(("sync", device)))

    class Mapped(rn.PeerBuffers):
        def close(self):
            order.append("peers")

    class Runners(Counting):
        def __call__(self, *args, **kw):
            r = super().__call__(*args, **kw)
            close = r.close
            r.close = lambda: (order.append("runner"), close())
            return r

    fp, _ = fast_path(factory=Runners())
    p = fp.peers
    fp.peers = Mapped(p.rx, p.flags, p.rx_local, p.flags_local, p.epoch)
    assert fp.ready(binding()) and fp.runner.peers is fp.peers and order == []
    fp.final_norm = SimpleNamespace(device=torch.device("cuda", 2))  # a GPU rank's weights, without a GPU here
    fp.close()
    sync = ("sync", torch.device("cuda", 2))
    assert order == [sync, "runner", "peers"] and fp.runner is None and fp.peers is None
    fp.close()
    assert order == [sync, "runner", "peers", sync]  # the device again; nothing closed twice


def test_a_rebind_closes_the_old_runner_at_once_not_at_the_next_step():
    """A re-bind left the runner with its views of the replaced cache until a step of the new binding
    rebuilt it: the close ran inside ready(), on that step's path, and with no step behind the BindKV
    the engine's old IPC allocation stayed alive in this process. BindKV now retires the old runner as
    UnbindKV does (through the loop's after_device, once the device no longer reads it)."""
    from dspark_sidecar.proto import sidecar_pb2 as pb

    class Memory:  # MemoryBindings.bind's contract: the new binding current, the old one retired
        def __init__(self, kv):
            self.kv = kv

        def bind(self, req, retire):
            old, self.kv = self.kv, binding(gen=self.kv.generation + 1)
            retire(old.close)
            return self.kv

    retired = []

    class Loop:
        def exclusive(self, wait=True, quiesce=True, give_up=None):
            return contextlib.nullcontext()

        def after_device(self, fn, wait=None):
            retired.append(fn)
            fn()

    fp, _ = fast_path()
    mem = Memory(binding())
    assert fp.ready(mem.kv)
    runner = fp.runner
    ctx = SimpleNamespace(fast=fp, memory=mem, rank=0, metrics=SimpleNamespace(bound=lambda: None))
    svc = DrafterServicer(ctx, Loop(), Lifecycle(backend="flydsl", host=GOOD_HOST), None, None, "mxfp8")
    resp = svc.BindKV(pb.BindKVRequest(), SimpleNamespace(peer=lambda: "unix:/s"))
    assert resp.generation == 2 and resp.fast_path_refusal == ""
    assert fp.runner is None and fp.runner_factory.closed == 1 and runner._kv == []
    assert runner.close in retired  # after the device, as the old cache's own mappings
    assert fp.ready(mem.kv) and len(fp.runner_factory.built) == 2
    assert fp.runner_factory.closed == 1  # the step built the new runner and closed nothing
    fp.close()


def test_bindkv_names_the_portable_backend_that_serves_a_binding_the_fast_path_refuses():
    """BindKVResponse.backend is "the kernel backend that will serve steps against this binding" (proto), but
    it was the start-up choice whatever the binding: "flydsl" for a binding the fast path refuses (the engine
    logged "backend flydsl, FlyDSL off: DP > 1") while every one of its steps ran on the Triton or reference
    layers. It now names that portable backend (BackendChoice.fallback), and "flydsl" where the path serves."""
    from dspark_sidecar.proto import sidecar_pb2 as pb

    class Memory:
        def __init__(self):
            self.kv, self.next = None, None

        def bind(self, req, retire):
            self.kv = self.next
            return self.kv

    class Loop:
        def exclusive(self, wait=True, quiesce=True, give_up=None):
            return contextlib.nullcontext()

        def after_device(self, fn, wait=None):
            fn()

    fp, _ = fast_path()
    mem = Memory()
    ctx = SimpleNamespace(fast=fp, memory=mem, rank=0, metrics=SimpleNamespace(bound=lambda: None))
    svc = DrafterServicer(ctx, Loop(), Lifecycle(backend="flydsl", fallback="triton", host=GOOD_HOST), None, None,
                          "mxfp8")
    peer = SimpleNamespace(peer=lambda: "unix:/s")
    mem.next = binding(gen=1, engine=EngineFacts(4, 2, 1, "dspark", 7))
    resp = svc.BindKV(pb.BindKVRequest(), peer)
    assert (resp.fast_path_refusal, resp.backend) == ("DP > 1", "triton")
    mem.next = binding(gen=2)
    resp = svc.BindKV(pb.BindKVRequest(), peer)
    assert (resp.fast_path_refusal, resp.backend) == ("", "flydsl")
    fp.close()


# On hardware -------------------------------------------------------------------------------------

def _four_gfx950() -> bool:
    from dspark_sidecar.kernels.flydsl.toolchain import on_gfx950

    return on_gfx950() and torch.cuda.device_count() >= 4


@pytest.mark.gfx950
@pytest.mark.gpu
@pytest.mark.multi_gpu
@pytest.mark.skipif(not _four_gfx950(), reason="needs 4 AMD MI355X (gfx950) GPUs")
@pytest.mark.parametrize("kv_layout", ["planes", "records"])
def test_real_step_through_the_fast_path_matches_the_reference_on_mi355x_x4(kv_layout):
    from helpers.flydsl_step import step_rank

    res = run_ranks(4, step_rank, kv_layout)
    for r, out in enumerate(res):
        assert "error" not in out, f"rank {r}: {out.get('error')}"
        # bf16 end to end over 5 layers; the kernels round where the tiling models do (kernels/flydsl).
        assert out["err"] < 2e-2, f"rank {r}: hidden rel L2 {out['err']:.3g}"
        assert out["kv_err"] < 2e-2, f"rank {r}: block K/V rel L2 {out['kv_err']:.3g}"
    for out in res[1:]:  # the exchange sums in rank order: every rank holds the same hidden state
        assert torch.equal(out["hidden"], res[0]["hidden"])


def test_a_runner_that_fails_to_build_turns_the_path_off_for_that_binding_with_the_error():
    """Only FlyDSLUnsupported was caught: out of memory allocating the runner's workspaces (or a HIP
    error) escaped ready() into RankLoop._guarded, and the rank exited 3. ready() runs before the
    step's rendezvous, whose fast offer all ranks must make (Verdict.fast), so a rank that answers
    False keeps every rank on the portable layers: the refusal is reported like any other."""
    calls = []

    def oom(*args, **kw):
        calls.append(1)
        raise torch.OutOfMemoryError("HIP out of memory. Tried to allocate 96.00 MiB")

    fp, told = fast_path(factory=oom)
    kv = binding()
    assert fp.ready(kv) is False and fp.runner is None
    assert fp.reason == "FlyDSL runner could not be built: OutOfMemoryError: HIP out of memory. Tried to allocate 96.00 MiB"
    assert told == [fp.reason] and fp.refusal(kv) == fp.reason  # health / GetStatus say why
    assert fp.ready(kv) is False and len(calls) == 1  # judged once per binding
    assert fp.ready(binding(gen=2)) is False and len(calls) == 2  # a re-bind tries again


def test_health_is_told_when_a_new_binding_fails_to_build_with_the_last_bindings_reason():
    """ready() compared the new reason with `reason` as the last binding left it, not with what the
    new binding was judged by (BindKV's preview, health published from it): a runner that failed the
    same way for the next binding (the same OOM, a deterministic driver error) changed nothing, health
    was not told, and a strict rank stayed SERVING while GetStatus and BindKV said the path was off."""
    def oom(*args, **kw):
        raise torch.OutOfMemoryError("HIP out of memory. Tried to allocate 96.00 MiB")

    fp, told = fast_path(factory=oom)
    assert fp.ready(binding()) is False and told == [fp.reason]
    fp.unbound()  # BindKV of the next binding: the old runner (none here) goes
    kv = binding(gen=2)
    assert fp.refusal(kv) is None  # what BindKV answered and health published for it
    assert fp.ready(kv) is False
    assert fp.refusal(kv) == fp.reason is not None
    assert told == [fp.reason, fp.reason]  # health judged again: the path is off for this binding too


@pytest.mark.parametrize("exc", [ValueError("page_size 0"), KeyError("gate_up"), AssertionError("rows 36 > 32")])
def test_a_runner_failing_with_an_error_of_any_type_turns_the_path_off_not_the_rank(exc):
    """Only FlyDSLUnsupported, RuntimeError, OSError and MemoryError were caught: any other error of building
    the runner escaped ready() into RankLoop._guarded, which ended the rank (exit 3) and so the group, where
    refusing the binding alone is safe (ready() runs before the rendezvous). Its key was set already, its reason
    left as it was (None): had the rank lived, GetStatus said the path served a binding it never would."""
    def broken(*args, **kw):
        raise exc

    fp, told = fast_path(factory=broken)
    kv = binding()
    assert fp.ready(kv) is False and fp.runner is None
    assert fp.reason == f"FlyDSL runner could not be built: {type(exc).__name__}: {exc}"
    assert told == [fp.reason] and fp.refusal(kv) == fp.reason


def _servicer_whose_runner_fails(factory):
    """A servicer over a FlyDSL path whose runner `factory` raises, its binding's first step (ready) behind it."""
    from dspark_sidecar.proto import sidecar_pb2 as pb
    from dspark_sidecar.server.metrics import Metrics

    fp, _ = fast_path(factory=factory)
    kv = binding()
    ctx = SimpleNamespace(rank=0, fast=fp, cfg=M31, memory=SimpleNamespace(kv=kv),
                          model=SimpleNamespace(dtype=torch.bfloat16), metrics=Metrics(0))
    svc = DrafterServicer(ctx, None, Lifecycle(backend="flydsl", host=GOOD_HOST), pb.Limits(), pb.Parallel(), "mxfp8")
    assert not fp.ready(kv)
    return svc


def test_a_long_or_undecodable_reason_reaches_getstatus_clipped_and_encodable():
    """A reason carries the error's own message: a compiler's (an MLIR dump, hundreds of KB, many lines) or one
    naming a path with a byte the OS could not decode (a lone surrogate, surrogateescape). GetStatus, BindKV's
    answer and health's strict refusal carried it whole, and one undecodable byte made the protobuf string
    raise (UnicodeEncodeError): every GetStatus of the rank failed (UNKNOWN) for as long as the binding stood."""
    from dspark_sidecar.proto import sidecar_pb2 as pb
    from dspark_sidecar.server.errors import MESSAGE_LIMIT

    dump = "".join(f"loc(\"/cache/fly\udcff/k.mlir\":{i}:1): error: 'rocdl.mfma' op operand #0\n" for i in range(4000))

    def broken(*args, **kw):
        raise RuntimeError(dump)

    svc = _servicer_whose_runner_fails(broken)
    why = svc.GetStatus(pb.GetStatusRequest(), None).fast_path_refusal
    assert why.startswith("FlyDSL runner could not be built: RuntimeError: loc(\"/cache/fly\\udcff/k.mlir\":0:1)")
    assert why.endswith(" bytes, clipped)") and len(why.encode()) <= MESSAGE_LIMIT
    assert svc.refusal() == why  # BindKV's answer and health's (strict) reading


@pytest.mark.parametrize("count", [4, 6])
def test_a_binding_of_another_kv_layer_count_is_refused_before_any_step(count):
    kv = binding()
    kv = KVBinding(binding_id=7, generation=1, layers=kv.layers[:1] * count, num_pages=4, page_size=PAGE,
                   engine=GOOD_ENGINE, mappings=[])
    fp, _ = fast_path()
    assert fp.refusal(kv) == f"{count} KV layers bound, kernels need 5"  # BindKV's answer, before any step
    assert not fp.ready(kv) and fp.refusal(kv) is not None


def test_without_compile_ahead_status_says_nothing_is_pending_before_the_first_step():
    """compile_ahead off: the runner is built at the binding's first step and compiles inside it, so there is
    no background compile to wait for: GetStatus must not say one is coming."""
    fp, _ = fast_path(compile_ahead=False)
    kv = binding()
    assert fp.refusal(kv) is None and fp.pending(kv) is None
    assert fp.ready(kv) and fp.pending(kv) is None
    fp.close()
    fp, _ = fast_path(factory=GatedCompile(), compile_ahead=True)  # the contrast: compiled ahead, it is pending
    assert "not compiled yet" in fp.pending(kv)


def test_a_verdict_read_while_a_runner_is_built_is_the_new_bindings_not_the_last_ones():
    """GetStatus / health (refusal(), another thread) while a step's ready() builds the runner for a new binding:
    the key is the new binding's already, `reason` still the last binding's until the build ends. Read under
    the path's lock, the reader waits for the build and gets the new binding's verdict."""
    def oom(*args, **kw):
        raise torch.OutOfMemoryError("HIP out of memory. Tried to allocate 96.00 MiB")

    read, readers = [], []

    def broken_after_a_read(*args, **kw):
        readers.append(threading.Thread(target=lambda: read.append(fp.refusal(kv2))))
        readers[0].start()
        readers[0].join(0.5)  # bounded: with the lock held it waits for ready() whatever this allows
        raise ValueError("a new error")

    fp, _ = fast_path(factory=oom)
    assert not fp.ready(binding()) and fp.reason.endswith("OutOfMemoryError: HIP out of memory. Tried to allocate 96.00 MiB")
    fp.runner_factory, kv2 = broken_after_a_read, binding(gen=2)
    assert not fp.ready(kv2)
    readers[0].join(5)
    assert read == [fp.reason] and fp.reason == "FlyDSL runner could not be built: ValueError: a new error"


def test_a_reason_of_several_lines_goes_out_on_one_line():
    """A HIP error's message runs over several lines (torch appends its advice to the driver's words), and so does
    a compiler's diagnostic. The reason went out with its line breaks: GetStatus, BindKV's answer and a strict
    rank's step refusal carried them, and the probe's line for the rank ("PATH: NOT_SERVING (REFUSED: ...)") broke
    over several, the rest reading as lines of no rank. Now the error's words on one line (the log has it whole)."""
    from dspark_sidecar.proto import sidecar_pb2 as pb

    def oom(*args, **kw):
        raise torch.OutOfMemoryError("HIP error: out of memory\nHIP kernel errors might be asynchronously reported "
                                     "at some other API call\r\n  For debugging consider passing AMD_SERIALIZE_KERNEL=3\n")

    svc = _servicer_whose_runner_fails(oom)
    want = ("FlyDSL runner could not be built: OutOfMemoryError: HIP error: out of memory HIP kernel errors might be "
            "asynchronously reported at some other API call For debugging consider passing AMD_SERIALIZE_KERNEL=3")
    assert svc.refusal() == want  # BindKV's answer, health's and a strict rank's step refusal
    assert svc.GetStatus(pb.GetStatusRequest(), None).fast_path_refusal == want


@pytest.mark.parametrize("count", [4, 6])
def test_a_binding_refused_before_any_step_keeps_its_reason_s_words_at_the_first_step(count):
    """BindKV answered (and health, GetStatus published) "4 KV layers bound, kernels need 5"; the binding's first step
    built the runner anyway, whose own check of the same said "drafter has 5 layers / 4 KV layers, kernels need 5",
    and that became the reason: one binding, two reasons, where an operator alerts on them verbatim. A binding the
    checks that need no allocation refuse is refused in their words, and nothing is built for it."""
    kv = binding()
    kv = KVBinding(binding_id=7, generation=1, layers=kv.layers[:1] * count, num_pages=4, page_size=PAGE,
                   engine=GOOD_ENGINE, mappings=[])
    calls = []

    def factory(*args, **kw):
        calls.append(1)
        return rn.DrafterRunner(*args, **kw)

    fp, told = fast_path(factory=factory)
    why = fp.refusal(kv)
    assert not fp.ready(kv)
    assert fp.refusal(kv) == fp.reason == why == f"{count} KV layers bound, kernels need 5"
    assert told == [why] and not calls


def test_a_compile_that_ends_after_the_path_closed_closes_its_runner_and_serves_nothing():
    """The rank's teardown (close) while a binding's kernels still compile: the compile, past its last abandon check,
    ends on its own thread. Its runner is no longer the one being built: it is closed there, not installed on the
    closed path (where it held the peer tensors and the cache's views, never closed)."""
    factory = GatedCompile()
    fp, _ = fast_path(factory=factory, compile_ahead=True)
    kv = binding()
    assert not fp.ready(kv)  # the first step starts the compile
    fp.close()
    factory.gate.set()
    wait_until(lambda: factory.compiled, 5, "the compile in flight ends")
    wait_until(lambda: factory.closed, 5, lambda: f"its runner closed by its own thread: {factory.closed}")
    assert fp.runner is None and factory.closed == factory.compiled and not fp.ready(kv)


def test_nothing_is_pending_for_a_binding_the_path_refuses():
    """pending() is about a binding this path will serve: one it refuses has its refusal (GetStatus says that),
    never "not compiled yet", whatever the path's state."""
    fp, _ = fast_path(factory=GatedCompile(), compile_ahead=True)
    refused = binding(engine=EngineFacts(4, 2, 1, "dspark", 7))
    assert fp.refusal(refused) == "DP > 1" and fp.pending(refused) is None
    assert not fp.ready(refused) and fp.pending(refused) is None
