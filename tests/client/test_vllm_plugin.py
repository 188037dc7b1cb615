"""The vLLM plug-in against fakes of vLLM's registry, forward context, TP group and attention metadata."""

from __future__ import annotations

import inspect
import sys
import types
import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Generic, TypeVar

import pytest
import torch
from torch import nn

from dspark_sidecar.client import shim as S
from dspark_sidecar.client import vllm_plugin, vllm_refusals
from dspark_sidecar.proto import codec
from helpers.engine_fakes import HIDDEN, FakeServer, FakeSidecar, shm_kv_cache, short_socket_dir

ARCH = "DSparkMiniMaxDraftModel"


class FakeAttention(nn.Module):
    """vLLM's Attention layer as far as KV binding goes: one empty tensor until allocated (vLLM 0.34),
    or in older releases a list of them indexed by virtual engine (KV_FORM)."""

    def __init__(self) -> None:
        super().__init__()
        self.kv_cache = [torch.tensor([])] if KV_FORM["list"] else torch.tensor([])


KV_FORM = {"list": False}


class StockDrafter(nn.Module):
    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__()
        self.layers = nn.ModuleList(FakeAttention() for _ in range(5))
        self.table = torch.randn(64, HIDDEN, generator=torch.Generator().manual_seed(1))
        self.stock_calls = 0

    def embed_input_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table[ids]

    def forward(self, input_ids, positions, hidden_states=None, inputs_embeds=None):
        self.stock_calls += 1
        return torch.full((positions.numel(), HIDDEN), -1.0)


class LazyEntry:
    """vLLM's _LazyRegisteredModel: the class is imported only when asked for."""

    def load_model_cls(self):
        return StockDrafter


class FlashAttentionMetadata:
    """vLLM V1 attention metadata, padded for a CUDA graph of more requests/tokens than the step has."""

    def __init__(self, r: int, pad_reqs: int = 3, pad_tokens: int = 5) -> None:
        starts = [20 + 3 * i for i in range(r)]
        self.seq_lens = torch.tensor([p + 7 for p in starts] + [0] * pad_reqs, dtype=torch.int32)
        self.block_table = torch.zeros(r + pad_reqs, 10, dtype=torch.int32)
        self.block_table[:r, :3] = torch.tensor([0, 1, 2], dtype=torch.int32)
        self.slot_mapping = torch.tensor(sum(([p + j for j in range(7)] for p in starts), []) + [-1] * pad_tokens)
        self.positions = torch.tensor(sum(([p + j for j in range(7)] for p in starts), []), dtype=torch.int64)


@pytest.fixture
def fake_vllm(monkeypatch):
    vllm = types.ModuleType("vllm")
    registry = SimpleNamespace(models={ARCH: LazyEntry()})
    registry.register_model = lambda arch, cls: registry.models.__setitem__(arch, cls)
    vllm.ModelRegistry = registry
    fc = types.ModuleType("vllm.forward_context")
    fc.ctx = None
    fc.is_forward_context_available = lambda: fc.ctx is not None
    fc.get_forward_context = lambda: fc.ctx
    vllm.forward_context = fc
    ps = types.ModuleType("vllm.distributed.parallel_state")
    ps.get_tp_group = lambda: SimpleNamespace(rank_in_group=0, world_size=4, all_min=lambda v: v)
    for name, mod in (("vllm", vllm), ("vllm.forward_context", fc), ("vllm.distributed", types.ModuleType("d")),
                      ("vllm.distributed.parallel_state", ps)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.delenv("DSPARK_SOCKET_DIR", raising=False)
    return SimpleNamespace(registry=registry, fc=fc)


@pytest.fixture
def roomy_deadlines(monkeypatch):
    """The plugin's EngineConfig with 30 s connect / bind / step deadlines. Why: a CI box under load (load 16
    beside other suites) once took more than the 1 s default connect deadline for the in-process fake, and a test
    of the forwarding path fell back instead; the deadlines' own behaviour is tested in tests/client/test_shim_*."""
    real = vllm_plugin.engine_config_from_vllm

    def roomy(*args, **kwargs):
        return dataclasses.replace(real(*args, **kwargs), connect_deadline_s=30.0, bind_deadline_s=30.0,
                                   step_deadline_s=30.0)
    monkeypatch.setattr(vllm_plugin, "engine_config_from_vllm", roomy)


def vllm_config(tp: int = 4, method: str = "dspark", k: int = 7, sleep_mode: bool = False, dp: int = 1, pp: int = 1,
                anchor: bool | None = None, draft_dcp: int | None = None, extensible: bool | None = False,
                cumem: bool = False):
    """anchor: the draft checkpoint's sample_from_anchor (None: unset, as MiniMax's, vLLM's default True); draft_dcp:
    speculative_config.draft_decode_context_parallel_size as vLLM resolves it (None: not set yet); extensible:
    cache_config.enable_extensible_kv_cache as vLLM resolves it (on by default on CUDA and ROCm; False here, as the
    deployments start vLLM with --disable-extensible-kv-cache; None: not resolved yet); cumem:
    model_config.enable_cumem_allocator (--enable-cumem-allocator; vLLM 0.34 turns it on for sleep mode too,
    config/model.py)."""
    hf = SimpleNamespace() if anchor is None else SimpleNamespace(sample_from_anchor=anchor)
    return SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, data_parallel_size=dp, pipeline_parallel_size=pp),
        speculative_config=SimpleNamespace(method=method, num_speculative_tokens=k,
                                           draft_model_config=SimpleNamespace(hf_config=hf),
                                           draft_decode_context_parallel_size=draft_dcp),
        device_config=SimpleNamespace(device="cpu"),
        model_config=SimpleNamespace(enable_sleep_mode=sleep_mode, enable_cumem_allocator=cumem or sleep_mode),
        cache_config=SimpleNamespace(enable_extensible_kv_cache=extensible))


def test_register_without_vllm_is_a_no_op(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    assert vllm_plugin.register() == []


def test_register_wraps_the_draft_model_once(fake_vllm):
    assert vllm_plugin.register() == [ARCH]
    cls = fake_vllm.registry.models[ARCH]
    assert issubclass(cls, StockDrafter) and cls.__name__ == "SidecarStockDrafter"
    assert vllm_plugin.register() == []  # already wrapped
    assert vllm_plugin.make_sidecar_class(cls) is cls  # and never wrapped twice, whoever asks
    assert vllm_plugin.engine_config_from_vllm(vllm_config(tp=2), 1).tp_size == 2


class VllmLazyEntry:
    """vLLM's _LazyRegisteredModel as vLLM builds it: two strings, the module imported by load_model_cls."""

    def __init__(self, module_name: str, class_name: str) -> None:
        self.module_name, self.class_name = module_name, class_name

    def load_model_cls(self):
        import importlib

        return getattr(importlib.import_module(self.module_name), self.class_name)


def test_a_lazily_registered_draft_class_is_wrapped_without_importing_it(fake_vllm, monkeypatch):
    """vLLM registers its models as "<module>:<Class>" so that a process imports a model's module only when it
    loads that model (a module touching CUDA in the API server breaks the workers vLLM forks). register()
    loaded the stock class in every process; now the registry gets a lazy entry of this plug-in's, resolved
    (and the stock module imported) only where vLLM loads the class, once per process, and re-registering
    in a process that already has it changes nothing."""
    stock_module = types.ModuleType("fake_vllm_dspark_model")
    stock_module.StockDrafter = StockDrafter
    monkeypatch.delitem(sys.modules, "fake_vllm_dspark_model", raising=False)
    monkeypatch.setattr(fake_vllm.registry, "register_model", lambda arch, cls: fake_vllm.registry.models.__setitem__(
        arch, VllmLazyEntry(*cls.split(":")) if isinstance(cls, str) else cls))
    fake_vllm.registry.models = {ARCH: VllmLazyEntry("fake_vllm_dspark_model", "StockDrafter")}
    sys.modules["vllm"].__version__ = "0.34.0+cu128"

    assert vllm_plugin.register() == [ARCH]
    entry = fake_vllm.registry.models[ARCH]
    assert entry.module_name == "dspark_sidecar.client.vllm_plugin"
    assert "fake_vllm_dspark_model" not in sys.modules  # nothing of the stock model imported by the plug-in
    assert vllm_plugin.register() == []  # a second call (another process's plug-in load) leaves it as is
    assert fake_vllm.registry.models[ARCH] is entry

    monkeypatch.setitem(sys.modules, "fake_vllm_dspark_model", stock_module)
    cls = entry.load_model_cls()  # what vLLM does where it builds the model
    assert issubclass(cls, StockDrafter) and cls.__name__ == "SidecarStockDrafter"
    assert entry.load_model_cls() is cls
    model = cls(vllm_config=vllm_config())
    md = FlashAttentionMetadata(1)
    fake_vllm.fc.ctx = SimpleNamespace(attn_metadata=md)
    model(torch.arange(7), md.positions)
    assert model.stock_calls == 1 and model.dspark_shim().refusal == "no sidecar endpoint configured"
    with pytest.raises(AttributeError, match="no attribute 'Sidecar__'"):
        vllm_plugin.Sidecar__  # noqa: B018  (only well-formed names resolve)
    with pytest.raises(AttributeError, match="no attribute 'NotOurs__x__collections.OrderedDict'"):
        getattr(vllm_plugin, "NotOurs__x__collections.OrderedDict")  # only this plug-in's prefix imports anything


class BrokenEntry:
    """A lazily registered model whose module cannot be imported on this host (a dependency missing, or
    a module that fails as it runs)."""

    error: Exception = ImportError("No module named 'some_kernel_lib'")

    def load_model_cls(self):
        raise self.error


@pytest.mark.parametrize("error", [ImportError("No module named 'some_kernel_lib'"),
                                   RuntimeError("some_kernel_lib: no GPU found")], ids=["import", "runtime"])
def test_a_draft_class_that_fails_to_load_is_left_alone_and_vllm_starts(fake_vllm, monkeypatch, caplog, error):
    """vLLM calls every general plug-in in every process, whatever model it serves, and lets what one
    raises through: register() loading a DSpark class whose module cannot import stopped vLLM from
    starting at all, where vLLM alone fails only if that model is used. That arch stays unwrapped
    (logged by name) and the others are still wrapped, whatever the module raised."""
    monkeypatch.setattr(BrokenEntry, "error", error)
    fake_vllm.registry.models = {"MiniMaxM3DSparkModel": BrokenEntry(), ARCH: LazyEntry()}
    with caplog.at_level("WARNING", logger="dspark_sidecar.client"):
        assert vllm_plugin.register() == [ARCH]
    assert isinstance(fake_vllm.registry.models["MiniMaxM3DSparkModel"], BrokenEntry)
    assert "MiniMaxM3DSparkModel not wrapped" in caplog.text and "some_kernel_lib" in caplog.text


def test_without_a_socket_dir_every_step_runs_the_stock_forward(fake_vllm, caplog):
    """The plug-in is loaded in every vLLM process: one without a sidecar configured is the plain case, with
    no WARNING or ERROR of the sidecar staying off (shim_off_reason leaves it unsaid)."""
    vllm_plugin.register()
    model = fake_vllm.registry.models[ARCH](vllm_config=vllm_config())
    md = FlashAttentionMetadata(2)
    fake_vllm.fc.ctx = SimpleNamespace(attn_metadata={"layers.0.attn": md})
    with caplog.at_level("WARNING", logger="dspark_sidecar"):
        out = model(torch.arange(14) % 64, md.positions)
    assert torch.equal(out, torch.full((14, HIDDEN), -1.0)) and model.stock_calls == 1
    assert model.dspark_shim().refusal == "no sidecar endpoint configured"
    assert caplog.records == []


@pytest.mark.parametrize("as_list,kv_layout", [(False, "records"), (True, "planes")],
                         ids=["kv_cache-tensor-records", "kv_cache-list-planes"])
def test_forward_goes_through_the_sidecar_with_vllm_metadata(fake_vllm, roomy_deadlines, monkeypatch, as_list,
                                                              kv_layout):
    """vLLM 0.34 (one tensor per layer, K | V records) and older releases (a list, K and V planes)."""
    monkeypatch.setitem(KV_FORM, "list", as_list)
    folder = short_socket_dir()
    server = FakeServer(FakeSidecar(0, 4), folder / "rank0.sock").start()
    try:
        monkeypatch.setenv("DSPARK_SOCKET_DIR", str(folder))
        vllm_plugin.register()
        model = fake_vllm.registry.models[ARCH](vllm_config=vllm_config())
        ids = torch.arange(21) % 64
        md = FlashAttentionMetadata(3)

        # profiling run: no attention metadata -> stock
        fake_vllm.fc.ctx = SimpleNamespace(attn_metadata=None)
        model(ids, md.positions)
        # KV not allocated yet -> stock, nothing sent
        fake_vllm.fc.ctx = SimpleNamespace(attn_metadata={"layers.0.attn": md, "layers.1.attn": md})
        model(ids, md.positions)
        assert model.stock_calls == 2 and server.sidecar.remote_calls() == 0
        shim = model.dspark_shim()
        assert shim.stats.fallbacks == {S.NO_METADATA: 1, S.NO_KV: 1}
        assert shim.config.connect_deadline_s == 30.0  # roomy_deadlines reached the shim

        kv = shm_kv_cache(kv_layout=kv_layout)
        for layer, seg in zip(model.layers, kv):
            layer.kv_cache = [seg.tensor] if as_list else seg.tensor
        out = model(ids, md.positions)
        assert model.stock_calls == 2, f"fell back: {shim.stats.fallbacks}"
        assert torch.equal(out, model.table[ids] * 2)
        (req,) = server.sidecar.requests
        (bound,) = server.sidecar.binds  # always the planes view [2, pages, page_size, heads, head_dim]
        assert list(bound.layers[0].shape) == [2, 8, 16, 1, 128] and bound.page_size == 16
        assert list(bound.layers[0].strides) == ([128, 16 * 256, 256, 16 * 256, 1] if kv_layout == "records"
                                                 else [16 * 128 * 8, 16 * 128, 128, 128, 1])
        assert req.num_requests == 3
        assert torch.equal(codec.from_tensor_ref(req.seq_lens, "s"), md.seq_lens[:3])
        assert torch.equal(codec.from_tensor_ref(req.slot_mapping, "s"), md.slot_mapping[:21])
        assert codec.from_tensor_ref(req.block_tables, "b").shape == (3, 3)  # rows trimmed, pages to ceil(33/16)
        # inputs_embeds given by the caller: used as is
        emb = torch.ones(21, HIDDEN)
        assert torch.equal(model(None, md.positions, None, inputs_embeds=emb), emb * 2)
        shim.close()
        for seg in kv:
            seg.close()
    finally:
        server.stop()


def test_a_wrong_deployment_is_refused_for_the_process(fake_vllm, monkeypatch):
    monkeypatch.setenv("DSPARK_SOCKET_DIR", str(short_socket_dir()))
    vllm_plugin.register()
    model = fake_vllm.registry.models[ARCH](vllm_config=vllm_config(k=5))
    md = FlashAttentionMetadata(1)
    fake_vllm.fc.ctx = SimpleNamespace(attn_metadata=md)
    model(torch.arange(7), md.positions)
    assert model.stock_calls == 1 and model.dspark_shim().refusal == "7 speculative tokens required"


def test_full_cuda_graph_decode_is_named_since_its_steps_never_reach_the_shim():
    def config(name):
        mode = SimpleNamespace(decode_mode=lambda: SimpleNamespace(name=name))
        return SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_mode=mode))

    assert vllm_plugin.full_graph_decode(config("FULL"))
    assert not vllm_plugin.full_graph_decode(config("PIECEWISE"))
    assert not vllm_plugin.full_graph_decode(SimpleNamespace())  # older vLLM: no cudagraph_mode


def test_an_fp8_cache_is_passed_as_e4m3_codes_only_at_scale_one_on_an_e4m3fn_platform(fake_vllm, monkeypatch):
    """vLLM holds kv_cache_dtype fp8 as uint8 codes of x / scale: read as float8_e4m3fn only where
    that is what they are; any other case goes on as uint8, which BindKV refuses by name."""
    plat = types.ModuleType("vllm.platforms")
    plat.current_platform = SimpleNamespace(fp8_dtype=lambda: torch.float8_e4m3fn)
    monkeypatch.setitem(sys.modules, "vllm.platforms", plat)

    def provided(raw, kv_dtype="fp8", k=1.0, v=1.0):
        """The cache kv_cache_provider hands the shim for one attention layer holding `raw`."""
        model = nn.Module()
        model.attn = FakeAttention()
        model.attn.kv_cache, model.attn.kv_cache_dtype = raw, kv_dtype
        model.attn._k_scale_float, model.attn._v_scale_float = k, v
        (t,) = vllm_plugin.kv_cache_provider(model)()
        return t

    raw = torch.tensor([[0x38, 0x40, 0xC8]], dtype=torch.uint8)  # e4m3fn codes of 1.0, 2.0, -4.0
    codes = provided(raw)
    assert codes.dtype == torch.float8_e4m3fn and codes.data_ptr() == raw.data_ptr()
    assert codes.float().tolist() == [[1.0, 2.0, -4.0]]
    for other in (dict(k=0.5), dict(v=2.0), dict(kv_dtype="fp8_e5m2"), dict(kv_dtype="auto")):
        assert provided(raw, **other) is raw
    bf16 = torch.zeros(2, dtype=torch.bfloat16)
    assert provided(bf16) is bf16
    plat.current_platform = SimpleNamespace(fp8_dtype=lambda: torch.float8_e4m3fnuz)  # gfx942's fp8
    assert provided(raw) is raw


def test_a_float8_cache_with_kv_scales_goes_on_as_its_uint8_codes_which_bindkv_refuses(fake_vllm):
    """A cache held as float8_e4m3fn itself (not vLLM 0.34's uint8) whose layer has a k or v scale other than
    1 holds codes of x / scale: passed as is, the sidecar read them as the values and drafted from K/V off by
    the scale (helper 86). Its uint8 view goes on instead, and BindKV's request refuses it for good, by name;
    at scale 1, or with no scales at all, the float8 cache is the values and goes on as it is."""
    from dspark_sidecar.client.binding import BindError, bind_request
    from dspark_sidecar.proto import sidecar_pb2 as pb

    def provided(raw, **scales):
        model = nn.Module()
        model.attn = FakeAttention()
        model.attn.kv_cache, model.attn.kv_cache_dtype = raw, "fp8"
        for name, value in scales.items():
            setattr(model.attn, name, value)
        (t,) = vllm_plugin.kv_cache_provider(model)()
        return t

    raw = torch.zeros(2, 4, 16, 1, 8).to(torch.float8_e4m3fn)
    for scales in (dict(_k_scale_float=0.5, _v_scale_float=1.0), dict(_k_scale_float=1.0, _v_scale_float=3.0)):
        t = provided(raw, **scales)
        assert t.dtype == torch.uint8 and t.data_ptr() == raw.data_ptr()
        with pytest.raises(BindError, match="calibrated KV scales") as err:
            bind_request([t], pb.EngineFacts())
        assert err.value.permanent
    assert provided(raw, _k_scale_float=1.0, _v_scale_float=1.0) is raw
    assert provided(raw) is raw  # a layer naming no scales


@pytest.fixture
def fake_speculator(fake_vllm, monkeypatch):
    """vLLM 0.34's DSparkSpeculator as far as its CUDA-graph mode goes: init_cudagraph_manager
    records the mode it is given (FULL, vLLM's default decode mode, or NONE: the draft eager)."""
    compilation = types.ModuleType("vllm.config.compilation")
    compilation.CUDAGraphMode = SimpleNamespace(NONE="NONE", FULL="FULL", FULL_DECODE_ONLY="FULL_DECODE_ONLY")

    class DSparkSpeculator:
        def init_cudagraph_manager(self, cudagraph_mode):
            self.mode = cudagraph_mode

    speculator = types.ModuleType("vllm.v1.worker.gpu.spec_decode.dspark.speculator")
    speculator.DSparkSpeculator = DSparkSpeculator
    names = ["vllm.config", "vllm.v1", "vllm.v1.worker", "vllm.v1.worker.gpu", "vllm.v1.worker.gpu.spec_decode",
             "vllm.v1.worker.gpu.spec_decode.dspark"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.config.compilation", compilation)
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu.spec_decode.dspark.speculator", speculator)
    monkeypatch.delenv("DSPARK_DRAFT_CUDAGRAPHS", raising=False)
    return DSparkSpeculator


def test_with_a_sidecar_configured_the_draft_steps_run_eagerly_so_each_reaches_the_shim(fake_speculator, monkeypatch,
                                                                                          caplog):
    spec = fake_speculator()
    spec.init_cudagraph_manager("FULL")
    assert spec.mode == "FULL"  # vLLM as it is: a full graph, whose replays skip the shim
    monkeypatch.setenv("DSPARK_SOCKET_DIR", str(short_socket_dir()))
    with caplog.at_level("INFO", logger="dspark_sidecar.client"):
        assert vllm_plugin.register() == [ARCH]
    assert "draft steps run eagerly" in caplog.text
    spec = fake_speculator()
    spec.init_cudagraph_manager("FULL")
    assert spec.mode == "NONE" and vllm_plugin.draft_steps_eager()
    assert vllm_plugin.eager_draft_steps() == "draft steps already run eagerly"  # once per process


@pytest.mark.parametrize("env, sleep_mode, said", [
    ({"DSPARK_STEP_DEADLINE_MS": "soon"}, False, "DSPARK_STEP_DEADLINE_MS='soon'"),
    ({}, True, "vLLM sleep mode is enabled"),
])
def test_an_engine_whose_shim_will_stay_off_keeps_its_draft_graphs(fake_speculator, monkeypatch, caplog, env,
                                                                      sleep_mode, said):
    """The eager steps cost the engine its draft step's graphs; where the shim is bound to stay off (a bad
    DSPARK_* value, sleep mode), they would buy nothing, so vLLM's own mode is kept, and the log says why."""
    monkeypatch.setenv("DSPARK_SOCKET_DIR", str(short_socket_dir()))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert "draft steps run eagerly" in vllm_plugin.eager_draft_steps()
    spec = fake_speculator()
    spec.vllm_config = vllm_config(sleep_mode=sleep_mode)
    with caplog.at_level("WARNING", logger="dspark_sidecar.client"):
        spec.init_cudagraph_manager("FULL")
    assert spec.mode == "FULL" and said in caplog.text
    healthy = fake_speculator()  # the same process, a config the shim can run with: eager
    healthy.vllm_config = vllm_config()
    monkeypatch.delenv("DSPARK_STEP_DEADLINE_MS", raising=False)
    healthy.init_cudagraph_manager("FULL")
    assert healthy.mode == "NONE"


@pytest.mark.parametrize("env, said", [
    ({}, "no sidecar configured"),
    ({"DSPARK_SOCKET_DIR": "/run/dspark", "DSPARK_DRAFT_CUDAGRAPHS": "keep"}, "DSPARK_DRAFT_CUDAGRAPHS=keep"),
    ({"DSPARK_SOCKET_DIR": "/run/dspark", "DSPARK_DRAFT_CUDAGRAPHS": "Keep "}, "DSPARK_DRAFT_CUDAGRAPHS=keep"),
])
def test_the_draft_graphs_are_left_alone_without_a_sidecar_or_when_asked(fake_speculator, monkeypatch, env, said):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert said in vllm_plugin.eager_draft_steps()
    spec = fake_speculator()
    spec.init_cudagraph_manager("FULL")
    assert spec.mode == "FULL" and not vllm_plugin.draft_steps_eager()


def test_a_vllm_serving_no_dspark_draft_keeps_its_draft_graphs(fake_vllm, fake_speculator, monkeypatch):
    """The plug-in is loaded in every vLLM process: where no DSpark draft model is registered, nothing is
    wrapped and nothing else changed, the speculator's CUDA graphs included, a sidecar configured or not."""
    fake_vllm.registry.models = {}
    monkeypatch.setenv("DSPARK_SOCKET_DIR", str(short_socket_dir()))
    assert vllm_plugin.register() == []
    assert not vllm_plugin.draft_steps_eager()


def test_a_vllm_without_the_dspark_speculator_is_left_alone(fake_vllm, monkeypatch):
    monkeypatch.setenv("DSPARK_SOCKET_DIR", "/run/dspark")
    monkeypatch.setitem(sys.modules, "vllm.v1", None)  # import -> ImportError
    assert "no DSparkSpeculator to adjust" in vllm_plugin.eager_draft_steps()
    assert not vllm_plugin.draft_steps_eager()


def test_the_fp8_view_is_the_same_object_step_after_step_until_vllm_reallocates(fake_vllm, monkeypatch):
    """A fresh view per step would miss the binder's cheap same-objects check every step; a scale
    that leaves 1 makes the provider hand back the uint8 cache (refused at bind, by name)."""
    plat = types.ModuleType("vllm.platforms")
    plat.current_platform = SimpleNamespace(fp8_dtype=lambda: torch.float8_e4m3fn)
    monkeypatch.setitem(sys.modules, "vllm.platforms", plat)
    model = nn.Module()
    model.layers = nn.ModuleList(FakeAttention() for _ in range(2))
    for m in model.layers:
        m.kv_cache = torch.zeros(4, 1, 16, 256, dtype=torch.uint8)
        m.kv_cache_dtype, m._k_scale_float, m._v_scale_float = "fp8", 1.0, 1.0
    caches = vllm_plugin.kv_cache_provider(model)
    first, again = caches(), caches()
    assert all(a.dtype == torch.float8_e4m3fn and a is b for a, b in zip(first, again))
    model.layers[1].kv_cache = torch.zeros(4, 1, 16, 256, dtype=torch.uint8)  # vLLM re-allocated layer 1
    third = caches()
    assert third[0] is first[0] and third[1] is not first[1]
    assert third[1].data_ptr() == model.layers[1].kv_cache.data_ptr()
    model.layers[0]._k_scale_float = 0.5  # scales computed on the fly
    assert caches()[0].dtype == torch.uint8


@pytest.mark.parametrize("change", [
    lambda t: setattr(t, "data", torch.zeros(8, 1, 16, 256, dtype=torch.uint8)),  # new memory, same object
    lambda t: t.as_strided_(t.shape, t.stride(), 16 * 256),  # moved within its storage
    lambda t: t.as_strided_((2, 1, 16, 256), t.stride()),  # fewer pages
    lambda t: t.as_strided_(t.shape, (2 * t.stride(0),) + t.stride()[1:]),  # same pages, spaced out
], ids=["new-memory", "offset", "shape", "stride"])
def test_an_fp8_cache_changed_in_place_is_seen_by_the_binder(fake_vllm, monkeypatch, change):
    """The binder catches a layer that keeps its tensor object but changes its memory or layout in place
    (test_binding_identity). Over an fp8 cache it watches the provider's float8 view, which was reused for as
    long as vLLM held the same uint8 object: a cache moved in place kept the stale view, the binder saw the
    same view unchanged, and the sidecar went on reading and writing the old memory while the engine used
    the new."""
    from dspark_sidecar.client.binding import Binding, KVBinder, _watch, cache_identity
    from dspark_sidecar.proto import sidecar_pb2 as pb

    plat = types.ModuleType("vllm.platforms")
    plat.current_platform = SimpleNamespace(fp8_dtype=lambda: torch.float8_e4m3fn)
    monkeypatch.setitem(sys.modules, "vllm.platforms", plat)
    model = nn.Module()
    model.attn = FakeAttention()
    model.attn.kv_cache = torch.zeros(16, 1, 16, 256, dtype=torch.uint8)[:4]
    model.attn.kv_cache_dtype, model.attn._k_scale_float, model.attn._v_scale_float = "fp8", 1.0, 1.0
    caches = vllm_plugin.kv_cache_provider(model)
    bound = caches()
    binder = KVBinder(pb.EngineFacts())
    binder.current = Binding(1, 1, cache_identity(bound), _watch(bound))  # as bind() leaves it
    assert not binder.needs_bind(caches())
    change(model.attn.kv_cache)
    (now,) = caches()
    raw = model.attn.kv_cache
    assert now.dtype == torch.float8_e4m3fn
    assert (now.data_ptr(), now.shape, now.stride()) == (raw.data_ptr(), raw.shape, raw.stride())
    assert binder.needs_bind([now])


def _first_forward_runs_the_stock_layers(fake_vllm, caplog, **config):
    """The drafter's first forward under the environment set (and vllm_config(**config)): it builds the
    shim, which stays off, and the stock layers answer; returns the model."""
    vllm_plugin.register()
    model = fake_vllm.registry.models[ARCH](vllm_config=vllm_config(**config))
    md = FlashAttentionMetadata(1)
    fake_vllm.fc.ctx = SimpleNamespace(attn_metadata=md)
    with caplog.at_level("ERROR", logger="dspark_sidecar.client"):
        out = model(torch.arange(7), md.positions)
    assert torch.equal(out, torch.full((7, HIDDEN), -1.0)) and model.stock_calls == 1
    return model


@pytest.mark.parametrize("value", ["fast", "0", "0.5", "-5", "nan", "inf"])
def test_a_bad_step_deadline_variable_keeps_the_sidecar_off_instead_of_raising_in_vllm(fake_vllm, monkeypatch,
                                                                                      caplog, value):
    """The shim is built at the drafter's first forward, inside vLLM: an EngineConfigError from a bad
    DSPARK_STEP_DEADLINE_MS raised out of that forward and failed the engine's step. The plug-in must
    log the variable and run the stock layers, as it does for every other deployment it cannot serve."""
    monkeypatch.setenv("DSPARK_SOCKET_DIR", str(short_socket_dir()))
    monkeypatch.setenv("DSPARK_STEP_DEADLINE_MS", value)
    model = _first_forward_runs_the_stock_layers(fake_vllm, caplog)
    assert model.dspark_shim().refusal.startswith(f"DSPARK_STEP_DEADLINE_MS={value!r}: ")
    assert f"DSPARK_STEP_DEADLINE_MS={value!r}" in caplog.text


@pytest.mark.parametrize("blank", ["", "  "], ids=["empty", "spaces"])
def test_a_blank_step_deadline_variable_keeps_the_sidecar_off_and_names_it(fake_vllm, fake_speculator, monkeypatch,
                                                                            caplog, blank):
    """`DSPARK_STEP_DEADLINE_MS=$UNSET_VAR`: set but empty. The plug-in read '' as unset and ran every step at the
    2000 ms default without a word (the operator's deadline lost), while '  ' was refused as "expected a number":
    two answers for one mistake. Both are refused as DSPARK_SOCKET_DIR and `serve`'s variables are, naming the
    variable, and the draft graphs are kept."""
    monkeypatch.setenv("DSPARK_SOCKET_DIR", str(short_socket_dir()))
    monkeypatch.setenv("DSPARK_STEP_DEADLINE_MS", blank)
    model = _first_forward_runs_the_stock_layers(fake_vllm, caplog)
    refusal = model.dspark_shim().refusal
    assert refusal.startswith(f"DSPARK_STEP_DEADLINE_MS={blank!r} is set but empty") and refusal in caplog.text
    spec = fake_speculator()
    spec.vllm_config = vllm_config()
    spec.init_cudagraph_manager("FULL")
    assert spec.mode == "FULL"


@pytest.mark.parametrize("folder, said", [
    ("/run/dspark?x", "'?'"),
    ("/run/dspark,b", "','"),
    ("/run/" + "d" * 120, "at most 107"),
    # the engine's working directory is not the sidecar's: each side read another folder
    ("run/dspark", "a relative path, which the engine resolves against its own working directory"),
    ("./dspark", "give the absolute folder `dspark-sidecar serve` uses (--socket-dir)"),
])
def test_a_socket_dir_grpc_cannot_dial_keeps_the_sidecar_off_and_says_why(fake_vllm, monkeypatch, caplog, folder,
                                                                         said):
    """`serve` refuses such a folder at start-up; the engine's side read it unchecked and dialled a
    target gRPC parses otherwise ('?' ends the path, ',' splits it) or the kernel refuses (too long),
    so every step fell back with no word of the variable. The shim stays off and names it."""
    monkeypatch.setenv("DSPARK_SOCKET_DIR", folder)
    model = _first_forward_runs_the_stock_layers(fake_vllm, caplog)
    refusal = model.dspark_shim().refusal
    assert refusal.startswith(f"DSPARK_SOCKET_DIR={folder!r}: ") and said in refusal
    assert f"DSPARK_SOCKET_DIR={folder!r}" in caplog.text


@pytest.mark.parametrize("blank", ["", "   ", "\t"], ids=["empty", "spaces", "tab"])
def test_a_blank_socket_dir_keeps_the_sidecar_off_as_serve_refuses_it(fake_vllm, fake_speculator, monkeypatch, caplog,
                                                                      blank):
    """`serve` refuses DSPARK_SOCKET_DIR set but blank (`=$UNSET_VAR`, a stray space) as "set but empty". The
    plug-in took '' as no sidecar, unsaid, and '   ' as a folder: each rank dialled the relative unix:   /rank{r}.sock,
    its draft steps ran without their CUDA graphs, and every step fell back with no word of the variable. Both
    sides agree now: the shim stays off naming the variable, and the draft graphs are kept."""
    monkeypatch.setenv("DSPARK_SOCKET_DIR", blank)
    model = _first_forward_runs_the_stock_layers(fake_vllm, caplog)
    refusal = model.dspark_shim().refusal
    assert refusal.startswith(f"DSPARK_SOCKET_DIR={blank!r} is set but empty") and refusal in caplog.text
    # Left alone by register() itself, not only undone per engine by init_cudagraph_manager's own check below.
    assert not vllm_plugin.draft_steps_eager()
    spec = fake_speculator()
    spec.vllm_config = vllm_config()
    spec.init_cudagraph_manager("FULL")
    assert spec.mode == "FULL"


def test_a_lazy_entry_resolves_whatever_vllm_version_tags_it(monkeypatch):
    """The tag is vLLM's version with its runs of other characters made '_'; one ending in such a character
    ('0.34.0+') left '_' before the '__' that ends the tag, and the parse took the stock module as '_<module>'."""
    stock_module = types.ModuleType("fake_vllm_dspark_model")
    stock_module.StockDrafter = StockDrafter
    monkeypatch.setitem(sys.modules, "fake_vllm_dspark_model", stock_module)
    for version in ("0.34.0+", "+0.34.0", "0.34.0rc1.dev7+g1a2b3c.d20261204"):
        name = vllm_plugin._lazy_name("fake_vllm_dspark_model", "StockDrafter", version)
        assert name.count(":") == 0 and issubclass(getattr(vllm_plugin, name), StockDrafter)


def test_vllm_sleep_mode_keeps_the_sidecar_off(fake_vllm, monkeypatch, caplog):
    """A wake-up maps new memory under the same KV tensors and addresses, which the shim's identity check
    cannot see and no vLLM hook reports (client/FAILURE_MODES.md): the sidecar would go on using the
    memory it mapped before the sleep, and its drafts would not be the stock layers'. So with
    model_config.enable_sleep_mode the shim is off on every rank alike, and says why."""
    monkeypatch.setenv("DSPARK_SOCKET_DIR", str(short_socket_dir()))
    model = _first_forward_runs_the_stock_layers(fake_vllm, caplog, sleep_mode=True)
    assert "sleep mode" in model.dspark_shim().refusal
    assert "sleep mode" in caplog.text


@pytest.mark.parametrize("config, said", [
    (dict(tp=8), "TP 8 != 4"),
    (dict(k=5), "7 speculative tokens required"),
    (dict(method="eagle"), "no DSpark draft"),
    (dict(dp=2), "DP > 1"),  # read from vLLM's parallel_config, not assumed 1
    (dict(pp=2), "PP > 1"),
    # vLLM 0.34 drafts 8 rows per request for such a checkpoint (dspark/speculator.py), and splits the draft's cache
    # with a draft DCP above 1: every step would fall back, the graphs given away for nothing.
    (dict(anchor=False), "the DSpark checkpoint has sample_from_anchor false: vLLM drafts 1 + 7 rows per request, "
                         "and the sidecar serves the spec's 7"),
    (dict(draft_dcp=2), "draft decode context parallel size 2: each rank holds part of the draft KV cache, and the "
                        "sidecar binds whole caches (set draft_decode_context_parallel_size 1)"),
    # vLLM 0.34's default on CUDA and ROCm: a driver-mapped cache, which no BindKV could share
    (dict(extensible=True), "vLLM's extensible KV cache is on (driver-mapped memory, which CUDA/HIP IPC cannot share "
                            "with the sidecar): start vLLM with --disable-extensible-kv-cache to use it"),
    # Without sleep mode too, the flag allocates the KV cache in vLLM's CuMemAllocator pool (gpu_worker.py
    # _maybe_get_memory_pool_context(tag="kv_cache")): cuMemCreate / cuMemMap memory, which no BindKV could export.
    (dict(cumem=True), "vLLM's cumem allocator is on (--enable-cumem-allocator: the KV cache is driver-mapped memory, "
                       "which CUDA/HIP IPC cannot share with the sidecar): start vLLM without it to use it"),
])
def test_a_deployment_the_sidecar_cannot_serve_keeps_its_draft_graphs_and_says_why(fake_vllm, fake_speculator,
                                                                                      monkeypatch, caplog, config, said):
    """A sidecar configured (DSPARK_SOCKET_DIR) for an engine the shim refuses for good (config_refusal: TP other
    than 4, DP or PP > 1, another draft method or token count): the shim never forwards a step. The plug-in
    still ran the draft steps eagerly, costing the engine its draft graphs for nothing, and the only word of
    the refusal was the shim's INFO line, below vLLM's default log level: a sidecar off without a word."""
    monkeypatch.setenv("DSPARK_SOCKET_DIR", str(short_socket_dir()))
    assert vllm_plugin.register() == [ARCH]
    spec = fake_speculator()
    spec.vllm_config = vllm_config(**config)
    with caplog.at_level("WARNING", logger="dspark_sidecar"):
        spec.init_cudagraph_manager("FULL")
        assert spec.mode == "FULL" and said in caplog.text
        caplog.clear()
        model = fake_vllm.registry.models[ARCH](vllm_config=vllm_config(**config))
        md = FlashAttentionMetadata(1)
        fake_vllm.fc.ctx = SimpleNamespace(attn_metadata=md)
        model(torch.arange(7), md.positions)
    assert model.stock_calls == 1 and model.dspark_shim().refusal == said
    assert said in caplog.text and "sidecar stays off" in caplog.text


@pytest.mark.parametrize("env, warned", [({}, False), ({"DSPARK_STEP_DEADLINE_MS": "soon"}, False),
                                         ({"DSPARK_DRAFT_CUDAGRAPHS": "keep"}, True)])
def test_the_full_graph_warning_is_given_only_where_the_shim_could_forward(fake_vllm, monkeypatch, caplog, env,
                                                                           warned):
    """build_shim warned that full CUDA graph decode steps never reach the shim, and told the operator to unset
    DSPARK_DRAFT_CUDAGRAPHS=keep, on every engine with vLLM's default decode mode FULL: one with no sidecar
    configured at all (the plug-in is installed in every vLLM process) and one whose shim stays off for good
    (its graphs kept on purpose, the reason logged beside it). Neither set that variable, nor would forward."""
    if env:
        monkeypatch.setenv("DSPARK_SOCKET_DIR", str(short_socket_dir()))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    vllm_plugin.register()
    cfg = vllm_config()
    mode = SimpleNamespace(decode_mode=lambda: SimpleNamespace(name="FULL"))
    cfg.compilation_config = SimpleNamespace(cudagraph_mode=mode)
    model = fake_vllm.registry.models[ARCH](vllm_config=cfg)
    md = FlashAttentionMetadata(1)
    fake_vllm.fc.ctx = SimpleNamespace(attn_metadata=md)
    with caplog.at_level("WARNING", logger="dspark_sidecar"):
        model(torch.arange(7), md.positions)
    assert model.stock_calls == 1 and model.dspark_shim().enabled == warned  # kept: enabled, no sidecar there
    assert ("full CUDA graphs" in caplog.text) == warned and ("DSPARK_DRAFT_CUDAGRAPHS" in caplog.text) == warned


class PositionalEmbedsDrafter(StockDrafter):
    """A draft model with the DSpark/DFlash drafters' own forward signature: inputs_embeds is the third input."""

    def forward(self, input_ids, positions, inputs_embeds=None):
        self.stock_calls += 1
        return torch.full((positions.numel(), HIDDEN), -1.0)


def test_inputs_embeds_given_by_position_are_the_ones_sent(fake_vllm, monkeypatch):
    """The wrapper read inputs_embeds only as a keyword: a caller passing it by position, as the stock
    forward(input_ids, positions, inputs_embeds) allows, had it dropped, and the shim sent the embedding of
    input_ids instead, so the sidecar drafted from other inputs than the stock layers would have (and with
    input_ids None, every such step fell back on an embedding error)."""
    fake_vllm.registry.models = {ARCH: PositionalEmbedsDrafter}
    folder = short_socket_dir()
    server = FakeServer(FakeSidecar(0, 4), folder / "rank0.sock").start()
    try:
        monkeypatch.setenv("DSPARK_SOCKET_DIR", str(folder))
        assert vllm_plugin.register() == [ARCH]
        model = fake_vllm.registry.models[ARCH](vllm_config=vllm_config())
        md = FlashAttentionMetadata(3)
        fake_vllm.fc.ctx = SimpleNamespace(attn_metadata={"layers.0.attn": md})
        kv = shm_kv_cache()
        for layer, seg in zip(model.layers, kv):
            layer.kv_cache = seg.tensor
        ids = torch.arange(21) % 64
        emb = torch.ones(21, HIDDEN)
        assert torch.equal(model(ids, md.positions, emb), emb * 2)  # not model.table[ids] * 2
        assert torch.equal(model(None, md.positions, emb), emb * 2)
        assert torch.equal(model(ids, md.positions), model.table[ids] * 2)  # none given: embedded here
        assert model.stock_calls == 0
        model.dspark_shim().close()
        for seg in kv:
            seg.close()
    finally:
        server.stop()


@pytest.mark.parametrize("env, config", [(None, {}), ({"DSPARK_STEP_DEADLINE_MS": "soon"}, {}), ({}, dict(tp=8))],
                         ids=["no-sidecar", "bad-variable", "refused-deployment"])
def test_a_shim_off_for_good_runs_no_collective_over_the_tp_group(fake_vllm, monkeypatch, caplog, env, config):
    """The plug-in is loaded in every vLLM process: an engine serving a DSpark draft without a sidecar (or one the
    shim refuses for good, on every rank alike) never agrees on a step. Its first drafter forward still built the
    ranks' agreement (the shared page's broadcast and gather over vLLM's TP CPU group, and the page kept mapped),
    and a failure there raised out of the forward into the engine. The stock layers answer, with no collective."""
    calls = []

    def node_agreement(group, timeout_s):
        calls.append(group)
        raise RuntimeError("gloo: connection reset by peer")

    monkeypatch.setattr(vllm_plugin, "node_agreement", node_agreement)
    sys.modules["vllm.distributed.parallel_state"].get_tp_group = lambda: SimpleNamespace(
        rank_in_group=0, world_size=4, cpu_group="tp-cpu-group")  # vLLM's GroupCoordinator: no all_min of its own
    if env is not None:
        monkeypatch.setenv("DSPARK_SOCKET_DIR", str(short_socket_dir()))
        for k, v in env.items():
            monkeypatch.setenv(k, v)
    model = _first_forward_runs_the_stock_layers(fake_vllm, caplog, **config)
    assert calls == [] and not model.dspark_shim().enabled
    # A shim that may forward still agrees over the TP group (and a failure there is a peer gone: it is raised).
    monkeypatch.setenv("DSPARK_SOCKET_DIR", str(short_socket_dir()))
    monkeypatch.delenv("DSPARK_STEP_DEADLINE_MS", raising=False)
    with pytest.raises(RuntimeError, match="gloo"):
        vllm_plugin.build_shim(model, vllm_config())
    assert calls == ["tp-cpu-group"]


def _vllm_initialize_model(model_class, vllm_config, prefix: str = ""):
    """vLLM 0.34's initialize_model (model_executor/model_loader/utils.py:96-133) as far as it calls the class:
    with vllm_config and prefix only where the signature of its __init__ names both; else as an old-style class,
    with those of prefix, config, cache_config, ... it names (none a DSpark drafter takes but prefix)."""
    params = [p.name for p in inspect.signature(model_class.__init__).parameters.values()]
    if "vllm_config" in params and "prefix" in params:
        return model_class(vllm_config=vllm_config, prefix=prefix)
    return model_class(**({"prefix": prefix} if "prefix" in params else {}))


def test_vllm_builds_the_wrapped_draft_model_with_its_config(fake_vllm):
    """vLLM reads the model class's __init__ signature to decide how to build it. The wrapper's (*args, **kwargs)
    named neither vllm_config nor prefix, so vLLM took it for an old-style class and built it with no arguments:
    the stock __init__ (keyword-only vllm_config) raised TypeError, and no DSpark engine with the plug-in
    installed could load its draft model, a sidecar configured or not."""
    vllm_plugin.register()
    cls = fake_vllm.registry.models[ARCH]
    cfg = vllm_config()
    model = _vllm_initialize_model(cls, cfg, prefix="draft")
    assert isinstance(model, StockDrafter) and model._dspark_vllm_config is cfg
    assert list(inspect.signature(cls.__init__).parameters) == ["self", "vllm_config", "prefix"]


def test_the_deployment_is_read_from_the_configs_vllm_hands_the_draft_and_the_speculator():
    """vLLM 0.34 builds the DSpark draft with a parallel_config of its own (spec_decode/dspark/utils.py
    _get_dspark_parallel_config): the draft's TP, and PP forced to 1. Read from it alone, a PP-2 deployment
    was never refused (the seed's PP == 1); and the speculator's config (the target's TP) ran the draft steps
    eagerly, without their graphs, for a draft at TP 1 whose shim then refused it (TP 1 != 4)."""
    target = SimpleNamespace(tensor_parallel_size=4, data_parallel_size=1, pipeline_parallel_size=2)
    draft_pc = SimpleNamespace(tensor_parallel_size=4, data_parallel_size=1, pipeline_parallel_size=1)
    spec = SimpleNamespace(method="dspark", num_speculative_tokens=7, target_parallel_config=target,
                           draft_parallel_config=draft_pc)
    draft_side = SimpleNamespace(parallel_config=draft_pc, speculative_config=spec,
                                 device_config=SimpleNamespace(device="cpu"))
    cfg = vllm_plugin.engine_config_from_vllm(draft_side, 0, environ={"DSPARK_SOCKET_DIR": "/run/dspark"})
    assert (cfg.tp_size, cfg.pp_size) == (4, 2) and vllm_plugin.config_refusal(cfg) == "PP > 1"

    target = SimpleNamespace(tensor_parallel_size=4, data_parallel_size=1, pipeline_parallel_size=1)
    draft_pc = SimpleNamespace(tensor_parallel_size=1, data_parallel_size=1, pipeline_parallel_size=1)
    spec = SimpleNamespace(method="dspark", num_speculative_tokens=7, target_parallel_config=target,
                           draft_parallel_config=draft_pc)
    for pc in (target, draft_pc):  # the speculator's (init_cudagraph_manager) and the draft model's
        seen = SimpleNamespace(parallel_config=pc, speculative_config=spec, device_config=SimpleNamespace(device="cpu"))
        cfg = vllm_plugin.engine_config_from_vllm(seen, 0, environ={"DSPARK_SOCKET_DIR": "/run/dspark"})
        assert vllm_plugin.config_refusal(cfg) == "TP 1 != 4"


@pytest.mark.parametrize("config", [dict(anchor=True), dict(draft_dcp=1), dict()])
def test_a_draft_layout_the_sidecar_serves_is_not_refused(config):
    assert vllm_refusals.draft_layout_refusal(vllm_config(**config)) is None


@pytest.mark.parametrize("anchor", [0, None, False])
def test_sample_from_anchor_is_read_as_vllm_reads_it(anchor):
    """vLLM tests the checkpoint's value for truth (dspark/speculator.py): a 0 or null there drafts 8 rows too."""
    cfg = vllm_config()
    cfg.speculative_config.draft_model_config.hf_config.sample_from_anchor = anchor
    assert "sample_from_anchor" in vllm_refusals.draft_layout_refusal(cfg)


def test_a_draft_spanning_several_kv_cache_groups_keeps_its_graphs_and_says_why(fake_speculator, monkeypatch, caplog):
    """vLLM 0.34 sets the speculator's attention (draft_kv_cache_group_ids) before init_cudagraph_manager. A draft
    whose layers span several KV cache groups falls back on every step (a step carries one table:
    metadata.spans_kv_groups), so running it eagerly would give the draft's graphs away for nothing."""
    monkeypatch.setenv("DSPARK_SOCKET_DIR", str(short_socket_dir()))
    assert "draft steps run eagerly" in vllm_plugin.eager_draft_steps()
    spec = fake_speculator()
    spec.vllm_config, spec.draft_kv_cache_group_ids = vllm_config(), [1, 3]
    with caplog.at_level("WARNING", logger="dspark_sidecar.client"):
        spec.init_cudagraph_manager("FULL")
    assert spec.mode == "FULL" and "span 2 KV cache groups" in caplog.text
    one = fake_speculator()
    one.vllm_config, one.draft_kv_cache_group_ids = vllm_config(), [2]
    one.init_cudagraph_manager("FULL")
    assert one.mode == "NONE"


M = TypeVar("M")


class _MetadataBuilder(Generic[M]):
    """vLLM's AttentionMetadataBuilder[M] (v1/attention/backend.py): the metadata class is its type argument."""


@dataclass
class _RecordsMetadata:  # FlashAttentionMetadata / TritonAttentionMetadata / RocmAttentionMetadata's fields read
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


@dataclass
class _FlashInferMetadata:  # v1/attention/backends/flashinfer.py FlashInferMetadata: tables inside prefill / decode
    slot_mapping: torch.Tensor
    prefill: object
    decode: object


class _RecordsBuilder(_MetadataBuilder[_RecordsMetadata]):
    pass


class _SubclassedBuilder(_RecordsBuilder):  # as RocmAiterUnifiedAttentionMetadataBuilder(RocmAttentionMetadataBuilder)
    pass


class _FlashInferBuilder(_MetadataBuilder[_FlashInferMetadata]):
    pass


_BUILDERS = {"FLASHINFER": _FlashInferBuilder, "ROCM_AITER_UNIFIED_ATTN": _SubclassedBuilder}


def _draft_attention(model, causal=False, window=4096, rotary_dim=64, backend=None):
    """The attention vLLM 0.34 resolved for the draft's layers, on the fake draft model: DFlashQwen3Attention's
    causal and sliding_window (models/qwen3_dflash.py, from _resolve_layer_attention) and its rotary_emb's
    rotary_dim (get_rope: head_dim x rope_parameters' partial_rotary_factor, 0.5 unset)."""
    attn = SimpleNamespace(causal=causal, sliding_window=window, rotary_emb=SimpleNamespace(rotary_dim=rotary_dim))
    if backend is not None:  # vLLM's Attention layer (self_attn.attn) and the backend its selector picked
        builder = _BUILDERS.get(backend, _RecordsBuilder)
        attn.attn = SimpleNamespace(attn_backend=SimpleNamespace(get_name=lambda: backend,
                                                                 get_builder_cls=lambda: builder))
    model.model = SimpleNamespace(layers=[SimpleNamespace(self_attn=attn) for _ in range(5)])
    return model


def _draft_config(sliding_window=4096, rotary_dim=64):
    """vllm_config() whose draft hf_config names what the sidecar reads from the same config.json."""
    cfg = vllm_config()
    hf = cfg.speculative_config.draft_model_config.hf_config
    hf.sliding_window, hf.rotary_dim = sliding_window, rotary_dim
    return cfg


@pytest.mark.parametrize("attention, said", [
    # No layer_types in config.json: transformers' MiniMaxM3VLTextConfig fills "full_attention", and vLLM's
    # _resolve_layer_attention windows only "sliding_attention" layers (or dflash_config.use_swa).
    (dict(window=None), "vLLM serves draft layer 0 with full attention"),
    (dict(causal=True), "vLLM serves draft layer 0 causally"),  # dflash_config.causal / is_causal true
    (dict(window=2048), "vLLM serves draft layer 0 with a 2048-token window"),  # dflash_config.swa_window_size
    (dict(rotary_dim=32), "vLLM rotates 32 dims of each head in draft layer 0"),  # partial_rotary_factor 0.25
    # ROCm's default (platforms/rocm.py _get_backend_priorities: ROCM_ATTN first): K and V as two head groups
    # (customize_spec num_head_slots=2) with an x-packed key interior, which the records view misreads.
    (dict(backend="ROCM_ATTN"), "vLLM's ROCM_ATTN attention backend"),
    # Named by the user, or CUDA's pick where FlashAttention cannot serve (an fp8_e5m2 cache): its metadata keeps
    # the tables inside its prefill / decode plans, with no seq_lens, so every step fell back, the graphs given away.
    (dict(backend="FLASHINFER"), "vLLM's FLASHINFER attention backend keeps no seq_lens, block table"),
])
def test_a_draft_whose_attention_vllm_resolved_otherwise_keeps_the_sidecar_off(fake_vllm, fake_speculator,
                                                                               monkeypatch, caplog, attention, said):
    """The stock forward attends as vLLM resolved the checkpoint's config (per layer: causal or not, the window
    or full attention, the rotary dims); the sidecar always serves the spec's non-causal block over the config's
    sliding_window with its rotary_dim. Where vLLM resolved otherwise, every forwarded step returned other hidden
    states (and wrote the block K/V) than the stock layers it replaced, without a word."""
    monkeypatch.setenv("DSPARK_SOCKET_DIR", str(short_socket_dir()))
    assert vllm_plugin.register() == [ARCH]
    cfg = _draft_config()
    model = _draft_attention(fake_vllm.registry.models[ARCH](vllm_config=cfg), **attention)
    spec = fake_speculator()
    spec.vllm_config, spec.model = cfg, model
    with caplog.at_level("WARNING", logger="dspark_sidecar"):
        spec.init_cudagraph_manager("FULL")
        assert spec.mode == "FULL" and said in caplog.text  # the graphs kept: no step would be forwarded
        md = FlashAttentionMetadata(1)
        fake_vllm.fc.ctx = SimpleNamespace(attn_metadata=md)
        model(torch.arange(7), md.positions)
    assert model.stock_calls == 1 and said in (model.dspark_shim().refusal or "")


@pytest.mark.parametrize("attention, said", [
    (dict(window=2048), "vLLM serves draft layer 0 with a 2048-token window"),
    (dict(rotary_dim=32), "vLLM rotates 32 dims of each head in draft layer 0"),
])
def test_the_window_and_rotary_dims_of_a_nested_text_config_are_judged(attention, said):
    """The DSpark config.json holds its layers' fields under text_config (draft-step.md), where the sidecar reads
    them; vLLM gives that part as draft_model_config.hf_text_config. Read from hf_config alone, the window and the
    rotary dims were unsaid there, and a draft vLLM windowed or rotated otherwise than the sidecar was forwarded."""
    cfg = vllm_config()
    model_config = cfg.speculative_config.draft_model_config
    model_config.hf_text_config = SimpleNamespace(sliding_window=4096, rotary_dim=64)
    model = _draft_attention(SimpleNamespace(), **attention)
    assert said in (vllm_refusals.draft_attention_refusal(model, cfg) or "")
    assert vllm_refusals.draft_attention_refusal(_draft_attention(model), cfg) is None  # as the sidecar serves


@pytest.mark.parametrize("backend", ["FLASH_ATTN", "TRITON_ATTN", "ROCM_AITER_UNIFIED_ATTN"])
def test_the_attention_the_sidecar_serves_is_not_refused(fake_vllm, fake_speculator, monkeypatch, backend):
    """Non-causal, the config's window and rotary dims on every layer: eager draft steps, a shim that may forward."""
    monkeypatch.setenv("DSPARK_SOCKET_DIR", str(short_socket_dir()))
    assert vllm_plugin.register() == [ARCH]
    cfg = _draft_config()
    model = _draft_attention(fake_vllm.registry.models[ARCH](vllm_config=cfg), backend=backend)
    spec = fake_speculator()
    spec.vllm_config, spec.model = cfg, model
    spec.init_cudagraph_manager("FULL")
    assert spec.mode == "NONE" and vllm_plugin.build_shim(model, cfg).enabled
    assert vllm_refusals.draft_attention_refusal(model, cfg) is None
    # A model whose layers say nothing of their attention (another build of the class) is not judged by it.
    assert vllm_refusals.draft_attention_refusal(SimpleNamespace(), cfg) is None


@pytest.mark.parametrize("unsaid, attention, said", [
    # vLLM's qwen3_dflash resolves `causal` per layer, but a build where it is still unused keeps only
    # sliding_window on the attention module ("causal is currently unused here"): every other check was skipped.
    ("causal", dict(backend="ROCM_ATTN"), "vLLM's ROCM_ATTN attention backend"),
    ("causal", dict(backend="FLASHINFER"), "keeps no seq_lens, block table"),
    ("causal", dict(window=None), "vLLM serves draft layer 0 with full attention"),
    ("causal", dict(window=2048), "vLLM serves draft layer 0 with a 2048-token window"),
    ("causal", dict(rotary_dim=32), "vLLM rotates 32 dims of each head in draft layer 0"),
    ("sliding_window", dict(causal=True), "vLLM serves draft layer 0 causally"),
    ("sliding_window", dict(backend="ROCM_ATTN"), "vLLM's ROCM_ATTN attention backend"),
])
def test_what_a_draft_layer_says_of_its_attention_is_judged_though_it_leaves_out_another_part(unsaid, attention, said):
    """An attention module that does not say whether it is causal (or what its window is) is not refused for that,
    but still for what it does say. Both had to be there for any check to run: a vLLM that keeps no `causal` on the
    layer had its draft forwarded on ROCm's default backend (the cache misread), or with full attention."""
    cfg = _draft_config()
    model = _draft_attention(SimpleNamespace(), **attention)
    delattr(model.model.layers[0].self_attn, unsaid)  # one attention object on every layer (_draft_attention)
    assert said in (vllm_refusals.draft_attention_refusal(model, cfg) or "")
    # Saying neither, and using a backend the sidecar reads, such a layer is not refused.
    served = _draft_attention(SimpleNamespace(), backend="FLASH_ATTN")
    for name in ("causal", "sliding_window"):
        delattr(served.model.layers[0].self_attn, name)
    assert vllm_refusals.draft_attention_refusal(served, cfg) is None


@pytest.mark.parametrize("attention, said", [
    (dict(window=None), "vLLM serves draft layer 3 with full attention"),
    (dict(causal=True), "vLLM serves draft layer 3 causally"),
    (dict(rotary_dim=32), "vLLM rotates 32 dims of each head in draft layer 3"),
    (dict(backend="ROCM_ATTN"), "holds draft layer 3's KV cache"),
])
def test_every_draft_layer_is_judged_not_the_first_alone(attention, said):
    """vLLM resolves the attention per layer (layer_types, per-layer windows): one layer of five built otherwise
    than the sidecar serves is enough, and the reason names it."""
    cfg = _draft_config()
    model = _draft_attention(SimpleNamespace(), backend="FLASH_ATTN")
    assert vllm_refusals.draft_attention_refusal(model, cfg) is None
    other = _draft_attention(SimpleNamespace(), **({"backend": "FLASH_ATTN"} | attention))
    model.model.layers[3] = other.model.layers[3]
    assert said in (vllm_refusals.draft_attention_refusal(model, cfg) or "")


def test_a_draft_layer_that_says_nothing_of_its_attention_does_not_end_the_judging_of_the_others():
    """A layer with no self_attn says nothing, and is not refused for it; but the check returned None there for the
    whole model, and a later layer built causal (or with another window) was forwarded unchecked."""
    cfg = _draft_config()
    model = _draft_attention(SimpleNamespace(), backend="FLASH_ATTN")
    causal = _draft_attention(SimpleNamespace(), backend="FLASH_ATTN", causal=True)
    model.model.layers[0] = SimpleNamespace()  # no self_attn
    assert vllm_refusals.draft_attention_refusal(model, cfg) is None
    model.model.layers[3] = causal.model.layers[3]
    assert "vLLM serves draft layer 3 causally" in (vllm_refusals.draft_attention_refusal(model, cfg) or "")


class _GenericFlashInferBuilder(_FlashInferBuilder, Generic[M]):  # its own __orig_bases__ name no metadata class
    pass


def test_the_metadata_class_is_found_on_a_base_of_a_builder_that_is_generic_itself():
    """The builder's own type arguments need not name the metadata class (a subclass that is generic again): the
    bases are read in turn, and a FlashInfer-like metadata class found there keeps the shim off all the same."""
    cfg = _draft_config()
    model = _draft_attention(SimpleNamespace(), backend="FLASH_ATTN")
    attn = model.model.layers[0].self_attn
    attn.attn.attn_backend.get_builder_cls = lambda: _GenericFlashInferBuilder
    assert "keeps no seq_lens, block table" in (vllm_refusals.draft_attention_refusal(model, cfg) or "")


def test_a_config_that_does_not_say_whether_sleep_mode_is_on_is_not_refused_for_it():
    """An object that does not say (another vLLM, a fake) is not refused for what it leaves out (module docstring)."""
    assert vllm_refusals.sleep_mode_refusal(SimpleNamespace()) is None
    assert vllm_refusals.sleep_mode_refusal(SimpleNamespace(model_config=SimpleNamespace())) is None
    assert "sleep mode" in vllm_refusals.sleep_mode_refusal(vllm_config(sleep_mode=True))


@pytest.mark.parametrize("extensible", [False, None])
def test_a_kv_cache_of_plain_device_memory_or_a_setting_not_yet_resolved_is_not_refused(extensible):
    assert vllm_refusals.kv_memory_refusal(vllm_config(extensible=extensible)) is None
    assert vllm_refusals.kv_memory_refusal(SimpleNamespace()) is None  # a config without cache_config says nothing


def test_sleep_mode_without_a_sidecar_configured_is_the_plain_unsaid_case(fake_vllm, caplog):
    """The plug-in is loaded in every vLLM process, sleep mode common among them (RL trainers): one with no
    sidecar configured logged an ERROR on every rank telling the operator the sidecar stays off and to run
    without sleep mode "to use the sidecar", which it never asked for. Sleep mode is a reason only where a
    sidecar is configured; without one the shim is off for the plain reason, unsaid."""
    vllm_plugin.register()
    cfg = vllm_config(sleep_mode=True)
    model = fake_vllm.registry.models[ARCH](vllm_config=cfg)
    md = FlashAttentionMetadata(1)
    fake_vllm.fc.ctx = SimpleNamespace(attn_metadata=md)
    with caplog.at_level("WARNING", logger="dspark_sidecar"):
        out = model(torch.arange(7), md.positions)
    assert torch.equal(out, torch.full((7, HIDDEN), -1.0)) and model.stock_calls == 1
    assert model.dspark_shim().refusal == "no sidecar endpoint configured"
    assert vllm_plugin.shim_off_reason(cfg, model) is None
    assert caplog.records == []


_SPECULATOR = "vllm.v1.worker.gpu.spec_decode.dspark.speculator"


class _FailingSpeculatorModule:
    """A meta-path finder whose import of vLLM's DSpark speculator module raises as that module runs (a kernel
    library of another version, a driver the host lacks): not an ImportError."""

    def find_spec(self, name, path, target=None):
        import importlib.util

        return importlib.util.spec_from_loader(name, self) if name == _SPECULATOR else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise AttributeError("module 'triton.language' has no attribute 'fancy_op'")


def _first_forward_under_full_decode_graphs(fake_vllm, caplog) -> None:
    """The draft model's first forward where vLLM's decode mode reads FULL: the stock layers (no KV cache yet),
    the shim built and on; what the shim logged at WARNING is in caplog."""
    cfg = vllm_config()
    cfg.compilation_config = SimpleNamespace(cudagraph_mode=SimpleNamespace(
        decode_mode=lambda: SimpleNamespace(name="FULL")))
    model = fake_vllm.registry.models[ARCH](vllm_config=cfg)
    md = FlashAttentionMetadata(1)
    fake_vllm.fc.ctx = SimpleNamespace(attn_metadata=md)
    with caplog.at_level("WARNING", logger="dspark_sidecar"):
        model(torch.arange(7), md.positions)
    assert model.stock_calls == 1 and model.dspark_shim().enabled


def test_a_speculator_module_that_fails_to_import_leaves_vllm_starting_and_the_drafter_forwarding(fake_vllm,
                                                                                               monkeypatch, caplog):
    """register() imports vLLM's DSpark speculator module in every vLLM process with a sidecar configured (a DSpark
    arch is registered in every vLLM, whatever model it serves), and caught only ImportError there: any other
    exception raised as that module ran went out of register() and stopped vLLM from starting, as a draft class
    failing to load did before (vLLM does not catch what a plug-in raises). The graphs are left as vLLM sets them,
    and the reason said; the drafter's first forward, which asks again, runs too."""
    compilation = types.ModuleType("vllm.config.compilation")
    compilation.CUDAGraphMode = SimpleNamespace(NONE="NONE", FULL="FULL")
    names = ["vllm.config", "vllm.v1", "vllm.v1.worker", "vllm.v1.worker.gpu", "vllm.v1.worker.gpu.spec_decode",
             "vllm.v1.worker.gpu.spec_decode.dspark"]
    for name in names:
        package = types.ModuleType(name)
        package.__path__ = []  # a package: the speculator module below is looked up on sys.meta_path
        monkeypatch.setitem(sys.modules, name, package)
    monkeypatch.setitem(sys.modules, "vllm.config.compilation", compilation)
    monkeypatch.delitem(sys.modules, _SPECULATOR, raising=False)
    monkeypatch.setattr(sys, "meta_path", [_FailingSpeculatorModule(), *sys.meta_path])
    monkeypatch.setenv("DSPARK_SOCKET_DIR", str(short_socket_dir()))
    with caplog.at_level("INFO", logger="dspark_sidecar.client"):
        assert vllm_plugin.register() == [ARCH]
    assert "no DSparkSpeculator to adjust" in caplog.text and "fancy_op" in caplog.text
    assert not vllm_plugin.draft_steps_eager()
    _first_forward_under_full_decode_graphs(fake_vllm, caplog)
    assert "full CUDA graphs" in caplog.text


def test_a_dp_deployment_is_refused_though_the_drafts_own_config_says_dp_1():
    """vLLM 0.34's draft parallel config is the draft's own; DP is the target's (speculative_config's
    target_parallel_config, or the speculator's parallel_config). Read from the draft's alone, a DP-2 engine
    would be taken for DP 1 and served, the ranks of both replicas dialling the one sidecar's sockets."""
    target = SimpleNamespace(tensor_parallel_size=4, data_parallel_size=2, pipeline_parallel_size=1)
    draft_pc = SimpleNamespace(tensor_parallel_size=4, data_parallel_size=1, pipeline_parallel_size=1)
    spec = SimpleNamespace(method="dspark", num_speculative_tokens=7, target_parallel_config=target,
                           draft_parallel_config=draft_pc)
    for pc in (draft_pc, target):  # the draft model's config, and the speculator's
        seen = SimpleNamespace(parallel_config=pc, speculative_config=spec, device_config=SimpleNamespace(device="cpu"))
        cfg = vllm_plugin.engine_config_from_vllm(seen, 0, environ={"DSPARK_SOCKET_DIR": "/run/dspark"})
        assert cfg.dp_size == 2 and vllm_plugin.config_refusal(cfg) == "DP > 1"


def test_engine_rank_r_dials_sidecar_rank_r(fake_vllm, monkeypatch):
    """Engine rank r talks only to sidecar rank r, on its GPU (architecture.md): the rank is vLLM's TP rank
    (rank_in_group), and its endpoint that rank's socket. Dialled at rank 0's, every engine rank bound its KV cache
    to one sidecar rank on another GPU."""
    folder = short_socket_dir()
    monkeypatch.setenv("DSPARK_SOCKET_DIR", str(folder))
    sys.modules["vllm.distributed.parallel_state"].get_tp_group = lambda: SimpleNamespace(
        rank_in_group=2, world_size=4, all_min=lambda v: v)
    cfg = vllm_config()
    vllm_plugin.register()
    model = fake_vllm.registry.models[ARCH](vllm_config=cfg)
    shim = model.dspark_shim()
    assert shim.enabled and shim.rank == 2
    assert shim.config.endpoint == f"unix:{folder}/rank2.sock"
    assert vllm_plugin.engine_config_from_vllm(cfg, 3, environ={"DSPARK_SOCKET_DIR": "/run/dspark"}).endpoint == (
        "unix:/run/dspark/rank3.sock")
    # Read without the space around it, as `serve` reads the same variable: both sides name one folder.
    assert vllm_plugin.engine_config_from_vllm(cfg, 3, environ={"DSPARK_SOCKET_DIR": " /run/dspark\n"}).endpoint == (
        "unix:/run/dspark/rank3.sock")


def test_a_kv_cache_list_is_read_at_its_first_virtual_engine(fake_vllm):
    """Older vLLM binds layer.kv_cache as a list indexed by virtual engine; the draft runs on virtual engine 0."""
    model = nn.Module()
    model.attn = FakeAttention()
    first, second = torch.zeros(2, 4, 16, 1, 8), torch.ones(2, 4, 16, 1, 8)
    model.attn.kv_cache = [first, second]
    (t,) = vllm_plugin.kv_cache_provider(model)()
    assert t is first


def test_an_fp8_e4m3_named_cache_at_scale_one_is_passed_as_e4m3_codes(fake_vllm, monkeypatch):
    """kv_cache_dtype "fp8_e4m3" is vLLM's explicit name for the platform fp8 that "fp8" means on NVIDIA and
    gfx950: its uint8 cache at scale 1 holds the values' e4m3fn codes just the same, and goes on as them."""
    plat = types.ModuleType("vllm.platforms")
    plat.current_platform = SimpleNamespace(fp8_dtype=lambda: torch.float8_e4m3fn)
    monkeypatch.setitem(sys.modules, "vllm.platforms", plat)
    model = nn.Module()
    model.attn = FakeAttention()
    model.attn.kv_cache = torch.tensor([[0x38, 0x40]], dtype=torch.uint8)  # e4m3fn codes of 1.0, 2.0
    model.attn.kv_cache_dtype, model.attn._k_scale_float, model.attn._v_scale_float = "fp8_e4m3", 1.0, 1.0
    (t,) = vllm_plugin.kv_cache_provider(model)()
    assert t.dtype == torch.float8_e4m3fn and t.float().tolist() == [[1.0, 2.0]]


def test_draft_steps_made_eager_are_not_reported_as_full_graph_replays(fake_vllm, fake_speculator, monkeypatch,
                                                                       caplog):
    """With the plug-in's eager draft steps in place, vLLM's decode mode still reads FULL (the target keeps its
    graphs): the shim must not tell the operator its steps are replayed and to unset DSPARK_DRAFT_CUDAGRAPHS=keep,
    which was never set."""
    monkeypatch.setenv("DSPARK_SOCKET_DIR", str(short_socket_dir()))
    assert vllm_plugin.register() == [ARCH] and vllm_plugin.draft_steps_eager()
    _first_forward_under_full_decode_graphs(fake_vllm, caplog)
    assert "full CUDA graphs" not in caplog.text and "DSPARK_DRAFT_CUDAGRAPHS" not in caplog.text


def _speculator_module(monkeypatch, speculator_class, graph_modes) -> None:
    """vLLM's DSpark speculator module holding `speculator_class`, and CUDAGraphMode as `graph_modes`."""
    compilation = types.ModuleType("vllm.config.compilation")
    compilation.CUDAGraphMode = graph_modes
    module = types.ModuleType(_SPECULATOR)
    module.DSparkSpeculator = speculator_class
    for name in ["vllm.config", "vllm.v1", "vllm.v1.worker", "vllm.v1.worker.gpu", "vllm.v1.worker.gpu.spec_decode",
                 "vllm.v1.worker.gpu.spec_decode.dspark"]:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.config.compilation", compilation)
    monkeypatch.setitem(sys.modules, _SPECULATOR, module)


class _NoManager:  # a DSparkSpeculator with no init_cudagraph_manager at all
    pass


class _ManagerWithoutMode:  # one that picks its mode itself: init_cudagraph_manager(self)
    def init_cudagraph_manager(self):
        self.mode = "FULL"


class _Plain:  # vLLM 0.34's shape, under a CUDAGraphMode without NONE
    def init_cudagraph_manager(self, cudagraph_mode):
        self.mode = cudagraph_mode


_MODES = SimpleNamespace(NONE="NONE", FULL="FULL")


@pytest.mark.parametrize("speculator, modes, init", [
    (_NoManager, _MODES, lambda s: None),
    (_ManagerWithoutMode, _MODES, lambda s: s.init_cudagraph_manager()),
    (_Plain, SimpleNamespace(FULL="FULL"), lambda s: s.init_cudagraph_manager("FULL")),
], ids=["no-init_cudagraph_manager", "no-mode-parameter", "no-CUDAGraphMode.NONE"])
def test_a_speculator_of_another_shape_is_left_as_vllm_made_it_and_vllm_starts(fake_vllm, monkeypatch, caplog,
                                                                               speculator, modes, init):
    """register() patches DSparkSpeculator.init_cudagraph_manager(self, cudagraph_mode) to pass CUDAGraphMode.NONE.
    A vLLM whose speculator has no such method raised AttributeError out of register() (vLLM does not catch what a
    plug-in raises: no vLLM process started), one whose method takes no mode raised TypeError from the patch as the
    engine set up its speculator, and one without CUDAGraphMode.NONE raised AttributeError there. The speculator is
    left as vLLM made it, the reason said, and the draft model still wrapped."""
    monkeypatch.setenv("DSPARK_SOCKET_DIR", str(short_socket_dir()))
    _speculator_module(monkeypatch, speculator, modes)
    stock = speculator.__dict__.get("init_cudagraph_manager")
    with caplog.at_level("INFO", logger="dspark_sidecar.client"):
        assert vllm_plugin.register() == [ARCH]
    assert "draft CUDA graphs left as vLLM sets them" in caplog.text and "DSparkSpeculator" in caplog.text
    assert speculator.__dict__.get("init_cudagraph_manager") is stock and not vllm_plugin.draft_steps_eager()
    spec = speculator()
    init(spec)
    assert getattr(spec, "mode", "FULL") == "FULL"


def test_a_keyword_only_mode_is_replaced_too(fake_speculator, monkeypatch):
    class DSparkSpeculator:
        def init_cudagraph_manager(self, *, cudagraph_mode):
            self.mode = cudagraph_mode

    _speculator_module(monkeypatch, DSparkSpeculator, _MODES)
    monkeypatch.setenv("DSPARK_SOCKET_DIR", str(short_socket_dir()))
    assert "draft steps run eagerly" in vllm_plugin.eager_draft_steps()
    spec = DSparkSpeculator()
    spec.init_cudagraph_manager(cudagraph_mode="FULL")
    assert spec.mode == "NONE"


def test_the_speculator_s_other_arguments_pass_through_and_the_mode_is_replaced_however_given(fake_speculator,
                                                                                               monkeypatch):
    """The patch took (self, cudagraph_mode) alone: a vLLM passing the mode by keyword under its own name worked, but
    one passing another argument beside it raised TypeError in the engine's set-up. The stock signature is kept, the
    other arguments reach the stock method as given, and the mode is NONE whichever way it came."""
    class DSparkSpeculator:
        def init_cudagraph_manager(self, cudagraph_mode, capture_sizes=None, *, pool=None):
            self.mode, self.sizes, self.pool = cudagraph_mode, capture_sizes, pool

    _speculator_module(monkeypatch, DSparkSpeculator, _MODES)
    monkeypatch.setenv("DSPARK_SOCKET_DIR", str(short_socket_dir()))
    assert "draft steps run eagerly" in vllm_plugin.eager_draft_steps()
    assert list(inspect.signature(DSparkSpeculator.init_cudagraph_manager).parameters) == [
        "self", "cudagraph_mode", "capture_sizes", "pool"]
    for call in (lambda s: s.init_cudagraph_manager("FULL", [1, 2], pool="p"),
                 lambda s: s.init_cudagraph_manager(cudagraph_mode="FULL", capture_sizes=[1, 2], pool="p")):
        spec = DSparkSpeculator()
        call(spec)
        assert (spec.mode, spec.sizes, spec.pool) == ("NONE", [1, 2], "p")
    spec = DSparkSpeculator()
    spec.vllm_config = vllm_config(sleep_mode=True)  # off for good: vLLM's own mode, the arguments as given
    spec.init_cudagraph_manager("FULL", [3], pool="q")
    assert (spec.mode, spec.sizes, spec.pool) == ("FULL", [3], "q")
    with pytest.raises(TypeError, match="unexpected keyword argument 'stream'"):  # the stock's own error, as without
        DSparkSpeculator().init_cudagraph_manager("FULL", stream=1)


class _RenamedPositionsDrafter(StockDrafter):
    def forward(self, input_ids, position_ids, inputs_embeds=None):
        self.stock_calls += 1
        return torch.full((position_ids.numel(), HIDDEN), -1.0)


class _KeywordOnlyDrafter(StockDrafter):
    def forward(self, *, input_ids, positions, inputs_embeds=None):
        self.stock_calls += 1
        return torch.full((positions.numel(), HIDDEN), -1.0)


class _PositionsByKeywordDrafter(StockDrafter):  # positions among the keywords: the wrapper handed them by position
    def forward(self, input_ids, **kwargs):
        self.stock_calls += 1
        return torch.full((kwargs["positions"].numel(), HIDDEN), -1.0)


@pytest.mark.parametrize("stock, call", [
    (_RenamedPositionsDrafter, lambda m, pos: m(input_ids=torch.arange(7), position_ids=pos)),
    (_KeywordOnlyDrafter, lambda m, pos: m(input_ids=torch.arange(7), positions=pos)),
    (_PositionsByKeywordDrafter, lambda m, pos: m(input_ids=torch.arange(7), positions=pos)),
], ids=["positions-named-otherwise", "keyword-only", "positions-in-kwargs"])
def test_a_draft_class_whose_forward_the_wrapper_cannot_stand_in_for_is_left_unwrapped(fake_vllm, monkeypatch, caplog,
                                                                                       stock, call):
    """The wrapper's forward(self, input_ids, positions, *args, **kwargs) passes both on to the stock forward by
    position. A stock forward that names positions otherwise (vLLM calls the draft by keyword) or takes them by
    keyword only raised TypeError from the wrapper on every draft step, in every vLLM process the plug-in is
    installed in, a sidecar configured or not. Such a class is left as vLLM registered it, by name in the log."""
    fake_vllm.registry.models = {ARCH: stock}
    with caplog.at_level("WARNING", logger="dspark_sidecar.client"):
        assert vllm_plugin.register() == []
        assert vllm_plugin.make_sidecar_class(stock) is stock
    assert fake_vllm.registry.models[ARCH] is stock
    assert f"{stock.__name__} not wrapped" in caplog.text and "input_ids and positions" in caplog.text
    model = stock(vllm_config=vllm_config())
    md = FlashAttentionMetadata(1)
    assert call(model, md.positions).shape == (7, HIDDEN) and model.stock_calls == 1


def test_a_positional_only_or_defaulted_forward_is_still_wrapped():
    class PositionalOnly(StockDrafter):
        def forward(self, ids, pos, /, inputs_embeds=None):
            return pos

    class Defaulted(StockDrafter):
        def forward(self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None):
            return positions

    class Variadic(StockDrafter):
        def forward(self, input_ids, *rest, **kwargs):
            return rest[0]

    def undecorated(forward):  # a decorator without functools.wraps: its signature says nothing of the stock's
        def run(*args, **kwargs):
            return forward(*args, **kwargs)
        return run

    class Decorated(StockDrafter):
        forward = undecorated(StockDrafter.forward)

    for stock in (PositionalOnly, Defaulted, Variadic, Decorated):
        assert vllm_plugin.make_sidecar_class(stock) is not stock

    class NoPositions(StockDrafter):  # nothing for the positions the wrapper hands on
        def forward(self, input_ids):
            return input_ids

    assert vllm_plugin.make_sidecar_class(NoPositions) is NoPositions


def test_a_forward_context_module_of_another_vllm_keeps_the_shim_off_instead_of_raising(fake_vllm, monkeypatch,
                                                                                        caplog):
    """build_shim read vllm.forward_context.is_forward_context_available unchecked, inside the drafter's first forward:
    a vLLM without it raised AttributeError into that forward (the engine's step failed), a sidecar configured or not.
    The stock layers answer instead; with a sidecar configured, the reason is said."""
    del fake_vllm.fc.is_forward_context_available
    model = _first_forward_runs_the_stock_layers(fake_vllm, caplog)
    assert model.dspark_shim().refusal == "no sidecar endpoint configured"
    monkeypatch.setenv("DSPARK_SOCKET_DIR", str(short_socket_dir()))
    model = _first_forward_runs_the_stock_layers(fake_vllm, caplog)
    refusal = model.dspark_shim().refusal
    assert "is_forward_context_available" in refusal and refusal in caplog.text and not model.dspark_shim().enabled


def test_a_forward_context_module_of_another_vllm_keeps_the_draft_graphs(fake_vllm, fake_speculator, monkeypatch,
                                                                          caplog):
    """The shim stays off there (above): the draft steps run eagerly for nothing unless the speculator's hook reads
    the same verdict."""
    monkeypatch.setenv("DSPARK_SOCKET_DIR", str(short_socket_dir()))
    assert "draft steps run eagerly" in vllm_plugin.eager_draft_steps()
    del fake_vllm.fc.get_forward_context
    spec = fake_speculator()
    spec.vllm_config = vllm_config()
    with caplog.at_level("WARNING", logger="dspark_sidecar.client"):
        spec.init_cudagraph_manager("FULL")
    assert spec.mode == "FULL" and "get_forward_context" in caplog.text


@pytest.mark.parametrize("value", ["-1", "0", "0.5", "1e-400", "3600001", "nan", "inf"])
def test_a_step_deadline_variable_out_of_range_is_said_in_its_own_unit(value):
    """The variable is milliseconds (README: 1 to 3600000); the refusal quoted EngineConfig's field in seconds:
    DSPARK_STEP_DEADLINE_MS='-1' read "step_deadline_s: must be above 0 and at most 3600 s, got -0.001", a value and
    a field the operator never set. Its range is said in the variable's own unit."""
    with pytest.raises(vllm_plugin.EngineConfigError) as err:
        vllm_plugin.engine_config_from_vllm(vllm_config(), 0, environ={"DSPARK_SOCKET_DIR": "/run/dspark",
                                                                       "DSPARK_STEP_DEADLINE_MS": value})
    assert str(err.value) == f"DSPARK_STEP_DEADLINE_MS={value!r}: expected a number of milliseconds from 1 to 3600000"
    for edge, seconds in (("1", 0.001), ("3600000", 3600.0)):
        cfg = vllm_plugin.engine_config_from_vllm(vllm_config(), 0, environ={"DSPARK_STEP_DEADLINE_MS": edge})
        assert cfg.step_deadline_s == seconds


def test_a_kv_cache_is_provided_only_once_every_layer_has_one(fake_vllm):
    """Until every attention layer holds its cache (vLLM allocates them in turn), none is handed on: a part of the
    layers would be bound as if it were the draft's whole cache (review 391's mutation pass)."""
    model = nn.Module()
    model.layers = nn.ModuleList(FakeAttention() for _ in range(3))
    caches = vllm_plugin.kv_cache_provider(model)
    model.layers[0].kv_cache = torch.zeros(2, 4, 16, 1, 8)
    model.layers[2].kv_cache = torch.zeros(2, 4, 16, 1, 8)
    assert caches() == []
    model.layers[1].kv_cache = torch.zeros(2, 4, 16, 1, 8)
    assert [t.data_ptr() for t in caches()] == [m.kv_cache.data_ptr() for m in model.layers]


def test_a_window_or_rotary_dims_the_config_or_the_layer_leaves_unsaid_are_not_judged():
    """A draft config.json naming no sliding_window (or rotary_dim), or a layer whose rotary embedding names no
    rotary_dim, is not refused for it (the module's rule: an object that does not say is not refused for it)."""
    model = _draft_attention(SimpleNamespace(), backend="FLASH_ATTN", window=2048, rotary_dim=32)
    unsaid = vllm_config()  # hf_config with neither field
    assert vllm_refusals.draft_attention_refusal(model, unsaid) is None
    for layer in model.model.layers:
        layer.self_attn.rotary_emb = SimpleNamespace()
    assert vllm_refusals.draft_attention_refusal(model, _draft_config(sliding_window=2048, rotary_dim=64)) is None


def test_a_vllm_config_error_is_not_laid_to_the_step_deadline_variable_set_beside_it():
    """Only the deadline's own refusal names DSPARK_STEP_DEADLINE_MS: another field EngineConfig refuses (the
    deployment's) is said as EngineConfig says it, the variable set or not."""
    with pytest.raises(vllm_plugin.EngineConfigError, match="^tp_size: must be a positive integer, got 0"):
        vllm_plugin.engine_config_from_vllm(vllm_config(tp=0), 0, environ={"DSPARK_STEP_DEADLINE_MS": "500"})


def test_a_registered_entry_holding_its_class_is_wrapped(fake_vllm):
    """vLLM's _RegisteredModel holds the class itself (model_cls)."""
    fake_vllm.registry.models = {ARCH: SimpleNamespace(model_cls=StockDrafter)}
    assert vllm_plugin.register() == [ARCH]
    assert issubclass(fake_vllm.registry.models[ARCH], StockDrafter)
