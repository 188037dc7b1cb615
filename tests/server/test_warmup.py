"""A GPU rank's warm-up launches every shape its steps launch, so that no served step compiles kernels inside its deadline.

The kernels are compiled per launch shape: Triton specializes the GEMMs on their row tile and split from a
launch's 7r rows, and the attention on its split count, from the launch's requests, its block tables' width
and the launch groups running side by side. The warm-up ran one eager step of 8 requests with short block
tables, so every other launch size, and the step graphs' fixed-width window tables even at 8 requests,
compiled inside the first served step of that shape. Compiled for sm_90 on this CPU, the attention's split
kernel at another request count took 1.8 s and each GEMM 0.5 s (review 220): with a cold compile cache such a
step passes the shim's 2 s step deadline, falls back, and its K/V writes land behind the engine's.

These record every launch (model.forward) the start-up plan makes and every launch the step graphs make
(StepGraphs._step, the call a capture and a replay run) for 1..max_reqs requests, on the CPU.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dspark_sidecar import layout
from dspark_sidecar.drafter.checkpoint import CheckpointReader
from dspark_sidecar.drafter.kv_cache import allocate_kv_cache, window_width
from dspark_sidecar.drafter.model import DSparkDrafter
from dspark_sidecar.drafter.parallel import ParallelContext
from dspark_sidecar.kernels.ops import REFERENCE_OPS
from dspark_sidecar.server import app, startup, warmup
from dspark_sidecar.server.graphs import StepGraphs, _Packed
from dspark_sidecar.server.metrics import Metrics
from dspark_sidecar.server.rank import RankContext

ENGINE_PAGE = 16  # an engine cache of vLLM's default block size (warmup.WARM_PAGE_SIZE)


@pytest.fixture
def model(tiny_cfg, tiny_ckpt):
    cpu = torch.device("cpu")
    return DSparkDrafter(tiny_cfg, ParallelContext(0, 1), REFERENCE_OPS, torch.float32, cpu).load(
        CheckpointReader(tiny_ckpt[0], torch.float32))


def _record_launches(model, monkeypatch) -> set:
    """Each launch's (rows, groups side by side, attention table width, cache page size); launches compute nothing."""
    seen: set = set()

    def forward(inputs_embeds, positions, meta, kv_caches, attn=None, lane=0, concurrent=1):
        a_meta = attn[1] if attn is not None else meta
        seen.add((inputs_embeds.shape[0], concurrent, a_meta.block_tables.shape[1], kv_caches[0].shape[2]))
        return torch.zeros(inputs_embeds.shape[0], model.cfg.hidden_size, dtype=model.dtype)

    monkeypatch.setattr(model, "forward", forward)
    return seen


def _graph_launches(model, cfg, max_reqs: int) -> None:
    """What the step graphs launch for every request count served, through their own call (StepGraphs._step)."""
    graphs = object.__new__(StepGraphs)  # the CUDA parts (streams, events, pinned staging) are not needed here
    graphs.model, graphs.streams = model, []
    kv = allocate_kv_cache(cfg, 1, 64, ENGINE_PAGE, model.dtype, model.device)
    for R in range(1, max_reqs + 1):
        packed = _Packed(R, window_width(ENGINE_PAGE, cfg.sliding_window))
        g = SimpleNamespace(views=packed.views(torch.zeros(packed.nbytes, dtype=torch.uint8)),
                            embeds=torch.zeros(packed.n, cfg.hidden_size, dtype=model.dtype))
        graphs._step(g, kv)


@pytest.mark.parametrize("max_reqs", [32, 5])
def test_the_gpu_warm_up_launches_every_shape_the_step_graphs_launch(model, tiny_cfg, tiny_embed, monkeypatch,
                                                                      max_reqs):
    seen = _record_launches(model, monkeypatch)
    ctx = RankContext(0, 1, tiny_cfg, model, tiny_embed, None, Metrics(0), max_reqs)
    graphs = SimpleNamespace(streams=[])  # TP > 1's default: launch groups in order
    sizes = app.warm_plan(SimpleNamespace(max_reqs=max_reqs), torch.device("cuda", 0), graphs)
    startup.StartUp(0, None).warm_up(ctx, sizes=sizes, graphs=graphs)
    warmed = set(seen)
    seen.clear()
    _graph_launches(model, tiny_cfg, max_reqs)
    assert seen, "no launch recorded"
    assert seen <= warmed, f"launch shapes first met in a served step: {sorted(seen - warmed)}"


@pytest.mark.parametrize("streams", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("max_reqs", [1, 7, 8, 9, 17, 40, layout.MAX_REQS_LIMIT])
def test_warm_sizes_cover_every_launch_group_of_every_request_count(streams, max_reqs):
    """Every (group size, groups side by side) a step of 1..max_reqs requests launches (model.draft_step: at most
    LAUNCH_REQS per group, min(groups, streams) side by side from two streams), and no request count over max_reqs."""
    def launched(R: int) -> set:
        groups = [min(layout.LAUNCH_REQS, R - s) for s in range(0, R, layout.LAUNCH_REQS)]
        side = min(len(groups), streams) if len(groups) > 1 and streams >= 2 else 1
        return {(size, side) for size in groups}

    sizes = warmup.warm_sizes(max_reqs, streams)
    assert sizes and max(sizes) <= max_reqs and sizes == sorted(set(sizes)), sizes
    want = set().union(*(launched(R) for R in range(1, max_reqs + 1)))
    assert set().union(*(launched(R) for R in sizes)) == want
    # And no step more: each is a full step of start-up time (collectives included), so each launches a shape
    # that no smaller size did (every R up to 256 at 4 streams: 256 steps for the 29 that cover them).
    for i, R in enumerate(sizes):
        assert launched(R) - set().union(set(), *(launched(r) for r in sizes[:i])), (R, sizes)


def test_a_cpu_rank_warms_up_with_one_step_as_before():
    """A CPU rank's kernels compile nothing per shape: one step of LAUNCH_REQS, the TP group's proof, costs
    no more start-up time than before (every test that serves starts ranks)."""
    assert app.warm_plan(SimpleNamespace(max_reqs=32), torch.device("cpu"), None) == [layout.LAUNCH_REQS]


def test_the_warm_up_steps_run_with_the_graphs_window_metadata(model, tiny_cfg, tiny_embed):
    """The steps themselves, computed (reference ops): the window-relative metadata of a short scratch cache
    and request counts past LAUNCH_REQS run as the step graphs' do, and give finite hidden states."""
    outs = []
    real = model.draft_step

    def draft_step(*a, **kw):
        outs.append(real(*a, **kw))
        return outs[-1]

    model.draft_step = draft_step
    ctx = RankContext(0, 1, tiny_cfg, model, tiny_embed, None, Metrics(0), 9)
    secs = warmup.warm_up(ctx, sizes=[1, 9], graphs=SimpleNamespace(streams=[]))
    assert secs > 0
    assert [o.shape[0] for o in outs] == [layout.QPR, 9 * layout.QPR]
    assert all(bool(torch.isfinite(o).all()) for o in outs)


def _stub_steps(model, monkeypatch) -> list:
    """model.draft_step recording each call's (rows, table width, cache page size, attn given, streams)."""
    calls = []

    def draft_step(embeds, positions, meta, kv, attn=None, streams=()):
        a_meta = attn[1] if attn is not None else meta
        calls.append((embeds.shape[0], a_meta.block_tables.shape[1], kv[0].shape[2], attn is not None, streams))
        return torch.zeros(embeds.shape[0], model.cfg.hidden_size)

    monkeypatch.setattr(model, "draft_step", draft_step)
    return calls


def test_the_warm_up_steps_launch_on_the_graphs_streams_as_theirs_do(model, tiny_cfg, tiny_embed, monkeypatch):
    """With graphs, each step runs its launch groups side by side on the graphs' streams (StepGraphs._step):
    a step launched in order compiles the attention for one group on the whole GPU, not the graphs' share."""
    calls = _stub_steps(model, monkeypatch)
    ctx = RankContext(0, 1, tiny_cfg, model, tiny_embed, None, Metrics(0), 17)
    streams = ["stream 0", "stream 1"]
    warmup.warm_up(ctx, sizes=[1, 17], graphs=SimpleNamespace(streams=streams))
    width = window_width(warmup.WARM_PAGE_SIZE, tiny_cfg.sliding_window)
    assert calls == [(7, width, 16, True, streams), (17 * 7, width, 16, True, streams)]
    calls.clear()
    warmup.warm_up(ctx, sizes=[1], graphs=None)  # no graphs: the absolute metadata, in order
    assert [c[3:] for c in calls] == [(False, ())]


def test_a_warm_up_of_another_page_size_addresses_its_steps_by_that_page_size(model, tiny_cfg, tiny_embed,
                                                                             monkeypatch):
    """page_size: the scratch cache's pages and the window tables' width both follow it (warm_up's argument)."""
    calls = _stub_steps(model, monkeypatch)
    ctx = RankContext(0, 1, tiny_cfg, model, tiny_embed, None, Metrics(0), 8)
    warmup.warm_up(ctx, page_size=8, sizes=[3], graphs=SimpleNamespace(streams=[]))
    assert calls == [(21, window_width(8, tiny_cfg.sliding_window), 8, True, [])]


def _fake_gpu_rank(monkeypatch, log: list) -> SimpleNamespace:
    """A RankContext stand-in on "cuda:0" with no GPU: steps, the scratch cache and the device sync go to `log`."""
    class OnHost:  # a stand-in for a host tensor: .to(the GPU) is itself here
        def to(self, *a):
            return self

    model = SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.bfloat16, par=SimpleNamespace(world_size=1),
                            draft_step=lambda *a, **kw: log.append("step"))
    step = SimpleNamespace(inputs_embeds=OnHost(), positions=OnHost(), meta=OnHost())
    monkeypatch.setattr(warmup, "allocate_kv_cache", lambda cfg, world, pages, *a: log.append(("cache", pages)))
    monkeypatch.setattr(warmup.scenario, "random_step", lambda *a, **kw: step)
    monkeypatch.setattr(warmup.torch.cuda, "synchronize", lambda device=None: log.append(("synchronize", device)))
    return SimpleNamespace(cfg=SimpleNamespace(sliding_window=64), model=model, embed=None)


def test_a_gpu_warm_up_reports_its_time_once_the_device_has_run_its_steps(monkeypatch):
    """Launches are asynchronous: the seconds logged (and the start-up barrier after them) count the steps'
    device time only when the warm-up waits for the device before it reads the clock."""
    log = []
    ctx = _fake_gpu_rank(monkeypatch, log)
    monkeypatch.setattr(warmup, "time", SimpleNamespace(perf_counter=lambda: log.append("clock") or float(len(log))))
    secs = warmup.warm_up(ctx, sizes=[1, 2], graphs=None)
    assert log[1:] == ["clock", "step", "step", ("synchronize", torch.device("cuda", 0)), "clock"] and secs == 4.0


def test_the_scratch_cache_stays_small_at_any_max_reqs(monkeypatch):
    """Past LAUNCH_REQS requests the warm contexts repeat: a step of MAX_REQS_LIMIT requests needs at most as
    many pages as that many of the longest (1 + 37 * 7 rows, its 7 block rows, at pages of 16: 17 pages)."""
    log = []
    ctx = _fake_gpu_rank(monkeypatch, log)
    warmup.warm_up(ctx, sizes=[layout.MAX_REQS_LIMIT], graphs=None)
    (what, pages), *_ = log
    assert what == "cache" and pages <= layout.MAX_REQS_LIMIT * 17
