"""The bench command runs end to end on CPU (figures are printed, never asserted)."""

from __future__ import annotations

import json

import pytest
import torch

from dspark_sidecar.bench import BenchConfig, run_bench


def test_bench_writes_rows_for_each_mode_it_can_run(tmp_path):
    bc = BenchConfig(preset="tiny", reqs=(1, 2), contexts=(40,), modes=("a", "b", "d", "e", "f", "g", "h", "i"), repeats=2,
                     out_dir=tmp_path)
    report = run_bench(bc, torch.device("cpu"))
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["rows"] == report["rows"] and data["copy_bandwidth_GBps"] > 0
    for mode in ("a", "d", "e", "f", "h"):
        rows = [r for r in data["rows"] if r["mode"] == mode]
        assert [r["R"] for r in rows] == [1, 2]
        assert all(r["p50_ms"] > 0 and r["max_ms"] >= r["p50_ms"] and r["floor_ms"] > 0 for r in rows)
    assert all(r["note"] == "n/a: needs a GPU" for r in data["rows"] if r["mode"] in ("b", "g", "i"))
    assert sum(r["mode"] == "g" for r in data["rows"]) == 2 and sum(r["mode"] == "i" for r in data["rows"]) == 2
    for r in data["rows"]:
        if r["mode"] in ("d", "e"):  # the sidecar's own phases come back with every remote row
            assert r["sidecar_host_p50_us"] > 0 and len(r["sidecar_queue_rendezvous_launch_p50_us"]) == 3
            # ... and inside them: validate and output ran, and with nothing queued (a CPU) no GPU waits.
            v, word, started, out = r["sidecar_validate_word_start_output_p50_us"]
            assert v > 0 and out > 0 and word == started == 0
        if r["mode"] == "d":
            assert r["engine_fill_p50_us"] > 0 and r["ring_to_answer_p50_us"] > 0
            # ring -> answer in its parts, from one clock in both processes: each part ran, and they
            # cover it (the ring's own time stamp comes just after the page write that t1 follows).
            parts = r["ring_seen_sidecar_published_engine_p50_us"]
            assert all(p > 0 for p in parts) and sum(parts) <= 1.5 * r["ring_to_answer_p50_us"] + 50, parts
        if r["mode"] in ("d", "f"):  # the sidecar's counter, read around the mode (no pre-launch on a CPU)
            assert r["prelaunch_misses"] == 0 and r["prelaunched_share"] == 0
        if r["mode"] == "h":  # the shim's own host time on both sides of the data plane's ring -> answer
            before, after = r["shim_before_ring_after_answer_p50_us"]
            assert before > 0 and after > 0 and before + after < 1e3 * r["p50_ms"]


_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("device,inputs,kv_layout,kv_dtype", [
    ("cpu", "host", "planes", "auto"), ("cpu", "host", "records", "fp8"),
    pytest.param("cuda", "host", "planes", "auto", marks=_CUDA), pytest.param("cuda", "device", "planes", "auto", marks=_CUDA),
    pytest.param("cuda", "host", "records", "auto", marks=_CUDA), pytest.param("cuda", "host", "records", "fp8", marks=_CUDA)])
def test_the_shim_s_step_is_the_data_plane_s_step(tmp_path, device, inputs, kv_layout, kv_dtype):
    """h goes through DrafterShim.maybe_forward, d drives the same data plane directly: one step, the
    same hidden states to the bit (the same sidecar computes both; the shim returns its own copy).
    With `device` inputs the shim reads the positions and metadata back from the GPU, as in vLLM;
    with `records` the engine's cache is vLLM 0.34's [pages, heads, page_size, 2 * head_dim], with
    `fp8` its values float8 e4m3 codes (kv_cache_dtype fp8)."""
    from dspark_sidecar.bench import Bench, Case

    dev = torch.device(device)
    bench = Bench(BenchConfig(preset="tiny", reqs=(2,), contexts=(40,), modes=("d", "h"), out_dir=tmp_path,
                              shim_inputs=inputs, kv_layout=kv_layout, kv_dtype=kv_dtype), dev)
    assert bench.kv_raw[0].dim() == (4 if kv_layout == "records" else 5)
    assert (bench.kv_raw[0].dtype == torch.float8_e4m3fn) == (kv_dtype == "fp8")
    try:
        case = Case(bench.cfg, 2, 40, 16, bench.pages, bench.embed, dev, seed=3)
        bench._inputs = bench.bufs.input_view(case.embeds.shape[0])
        bench._inputs.copy_(case.embeds)
        direct = bench._remote("d", case).clone()
        with bench._forward_context(case):
            shimmed = bench._shimmed(case)
        assert shimmed.data_ptr() != bench._inputs.data_ptr() and shimmed.shape == direct.shape
        assert torch.equal(shimmed, direct)
        # The engine's own copy (on a GPU, the driver's copy into a tensor made while the step ran): the next
        # step rewrites the output region, not what the engine was handed.
        assert shimmed.data_ptr() != bench.bufs.hidden.data_ptr()
        kept = shimmed.clone()
        # A second step from rows of the engine's own (not the input region's view): copied in by the data plane,
        # and answered as the data plane driven directly answers them.
        other = Case(bench.cfg, 2, 40, 16, bench.pages, bench.embed, dev, seed=4)
        bench._inputs = other.embeds.clone()
        with bench._forward_context(other):
            second = bench._shimmed(other)
        again = bench._remote("d", other).clone()
        assert torch.equal(second, again) and not torch.equal(second, kept) and torch.equal(shimmed, kept)
        assert bench.shim.stats.forwarded == 2 and bench.shim.stats.via_doorbell == 2
        assert not bench.shim.stats.fallbacks
    finally:
        bench.close()


def test_a_bench_that_cannot_set_up_leaves_no_sidecar_running(tmp_path, monkeypatch, bench_sidecars):
    from dspark_sidecar import bench as B
    from dspark_sidecar.client.shim import DrafterShim

    started = bench_sidecars
    monkeypatch.setattr(DrafterShim, "connect", lambda self: "refused for the test")
    bench = B.Bench(BenchConfig(preset="tiny", reqs=(1,), contexts=(40,), modes=("d",), out_dir=tmp_path),
                    torch.device("cpu"))
    try:
        assert len(started) == 1 and started[0].proc.poll() is not None  # the sidecar it started has exited
        assert "refused for the test" in bench.measure("d", None)  # d-i say why; a-c are not stopped by it
    finally:
        bench.close()


def _exited_at_once(monkeypatch) -> list[list[str]]:
    """bench's Popen replaced by a sidecar process that has ended at once (SidecarUnderTest gives up and closes it);
    returns the argvs it was started with."""
    from dspark_sidecar import bench as B

    argvs: list[list[str]] = []

    class Exited:
        def __init__(self, argv, **_kw):
            argvs.append(argv)

        def poll(self):
            return 1

        def terminate(self):
            return None

        def wait(self, timeout=None):
            return 1

    monkeypatch.setattr(B.subprocess, "Popen", Exited)
    return argvs


def test_the_bench_s_sidecar_exits_with_the_bench(tmp_path, monkeypatch):
    """A bench that is SIGKILLed left its sidecar (modes d-i) serving for ever: it is started with the bench's
    pid as --exit-with-pid (serve's launcher stops once that process has gone, as for client/launcher.py)."""
    import os

    from dspark_sidecar import bench as B

    argvs = _exited_at_once(monkeypatch)
    with pytest.raises(B.BenchFailed, match="the bench's sidecar did not start"):  # cli: one line, exit 1
        B.SidecarUnderTest(BenchConfig(preset="tiny", reqs=(1,), contexts=(40,), out_dir=tmp_path),
                           torch.device("cpu"), tmp_path)
    (argv,) = argvs
    assert argv[argv.index("--exit-with-pid") + 1] == str(os.getpid())


@pytest.mark.parametrize("shard_of", [1, 2, 4])
def test_the_bench_s_sidecar_is_started_with_flags_serve_accepts(shard_of, tmp_path, monkeypatch):
    """BenchConfig takes --shard-of 1 (a TP-1 drafter, whole), and the sidecar was started with `--tp 1 --shard-of 1`,
    which serve refuses (exit 2, "needs --tp 1 and N >= 2"): every sidecar mode (d-i) a failed row, exit 1."""
    import argparse

    from dspark_sidecar import bench as B
    from dspark_sidecar import cli

    argvs = _exited_at_once(monkeypatch)
    with pytest.raises(B.BenchFailed):
        B.SidecarUnderTest(BenchConfig(preset="tiny", shard_of=shard_of, reqs=(1,), contexts=(40,), out_dir=tmp_path),
                           torch.device("cpu"), tmp_path)
    (argv,) = argvs
    assert argv[3] == "serve"
    parser = argparse.ArgumentParser()
    cli._add_serve_flags(parser, cli._builtin)
    cfg = cli.serve_config(parser.parse_args(argv[4:]))  # serve's own parsing and checks: ServeConfigError here
    assert (cfg.tp, cfg.shard_of) == (1, shard_of if shard_of > 1 else 0)


def test_a_bench_stopped_while_its_sidecar_starts_stops_that_sidecar(tmp_path, monkeypatch):
    """A SIGTERM (cli's _sigterm_unwinds: SystemExit) or Ctrl-C while the bench waited for its sidecar to serve (on
    a GPU its weights drawn and graphs captured: the longest wait of a run) left that sidecar running until
    --exit-with-pid noticed, and its folder in the temp dir: Bench had no SidecarUnderTest yet to close."""
    from dspark_sidecar import bench as B
    from dspark_sidecar.server import healthcheck

    procs = []

    class Starting:  # a sidecar still loading: running until it is stopped, then a clean exit
        def __init__(self, argv, **_kw):
            self.returncode = None
            procs.append(self)

        def poll(self):
            return self.returncode

        def terminate(self):
            self.returncode = 0

        def wait(self, timeout=None):
            return self.returncode

    def stopped(target, timeout_s):
        raise SystemExit(143)

    monkeypatch.setattr(B.subprocess, "Popen", Starting)
    monkeypatch.setattr(healthcheck, "check", stopped)
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(SystemExit):
        B.SidecarUnderTest(BenchConfig(preset="tiny", reqs=(1,), contexts=(40,), out_dir=tmp_path),
                           torch.device("cpu"), work)
    (proc,) = procs
    assert proc.returncode == 0 and not work.exists()


def test_mxfp8_weights_count_their_stored_bytes_in_the_floor(tmp_path):
    dense = run_bench(BenchConfig(preset="tiny", reqs=(1,), contexts=(40,), modes=("a",), repeats=2,
                                  out_dir=tmp_path / "dense"), torch.device("cpu"))
    quant = run_bench(BenchConfig(preset="tiny", reqs=(1,), contexts=(40,), modes=("a",), repeats=2, weights="mxfp8",
                                  out_dir=tmp_path / "mxfp8"), torch.device("cpu"))
    # bf16 (2 bytes per weight) -> 1 + 1/32: the weight term about halves, the K/V window and the
    # final norm stay. Each run measures its own bandwidth, so compare bytes: floor x bandwidth.
    d, q = (r["rows"][0]["floor_ms"] * r["copy_bandwidth_GBps"] for r in (dense, quant))
    assert 0.3 * d < q < 0.6 * d


def test_floor_counts_the_weights_once_per_launch_group():
    """Spec section 5: weights read once per launch group of up to 8 requests. From 8 to 9 requests
    the floor grows by one more pass over the weights; from 1 to 8 only by K/V windows."""
    from dspark_sidecar.bench import floor_bytes
    from dspark_sidecar.drafter.config import load_config
    from dspark_sidecar.drafter.model import DSparkDrafter
    from dspark_sidecar.drafter.parallel import ParallelContext
    from dspark_sidecar.kernels.ops import REFERENCE_OPS

    cfg = load_config("tiny")
    model = DSparkDrafter(cfg, ParallelContext(0, 1), REFERENCE_OPS, torch.float32)
    weights = sum(p.numel() * 4 for n, p in model.named_parameters() if n.startswith(("layers.", "final_norm")))
    per_req = floor_bytes(model, cfg, 2, 40) - floor_bytes(model, cfg, 1, 40)  # one K/V window
    assert per_req > 0
    assert floor_bytes(model, cfg, 8, 40) == floor_bytes(model, cfg, 1, 40) + 7 * per_req
    assert floor_bytes(model, cfg, 9, 40) == floor_bytes(model, cfg, 8, 40) + per_req + weights
    assert floor_bytes(model, cfg, 32, 40) == 4 * weights + 32 * per_req
    # An fp8 cache: 1 byte a K/V value instead of fp32's 4.
    assert floor_bytes(model, cfg, 1, 40) - floor_bytes(model, cfg, 1, 40, kv_itemsize=1) == per_req * 3 // 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graphed_modes_report_gpu_time_beside_wall_clock(tmp_path):
    """b and c also report GPU time (events behind a spin: no host launch or sync latency in it),
    which is below the wall-clock figure that includes both, where those are more than the drift."""
    report = run_bench(BenchConfig(preset="tiny", reqs=(1, 8), contexts=(40,), modes=("b", "c"), repeats=5,
                                   out_dir=tmp_path), torch.device("cuda"))
    rows = [r for r in report["rows"] if r["mode"] in ("b", "c")]
    assert len(rows) == 4 and all("note" not in r for r in rows), rows
    for r in rows:
        # The two medians come from separate replays. The reference's graph (b) is GPU-bound for
        # about 1 ms, so the host's 10-20 us of launch and sync lie within the drift between the
        # two sets (run 133 on an H200: GPU 1.073 ms against wall 1.067 at R=8): there, GPU time may
        # not exceed wall by more than that drift. The GPU backend's graph (c) lasts about 0.1 ms,
        # where launch and sync are a tenth of the figure: its GPU time must be below wall.
        assert 0 < r["gpu_p50_ms"] < r["p50_ms"] * (1.03 if r["mode"] == "b" else 1.0)
        assert r["gpu_x_floor"] == pytest.approx(r["gpu_p50_ms"] / r["floor_ms"])


def test_bench_options_outside_their_range_are_refused():
    for lead in (0.0, -1.0, 5000.0):
        with pytest.raises(ValueError, match="--lead-ms"):
            BenchConfig(lead_ms=lead)
    with pytest.raises(ValueError, match="--shim-inputs: host or device"):
        BenchConfig(shim_inputs="gpu")
    with pytest.raises(ValueError, match="--kv-layout: one of planes, records"):
        BenchConfig(kv_layout="vllm")
    for contexts in ((), (0,), (512, 0)):  # a context of 0 tokens has no step to draft
        with pytest.raises(ValueError, match="--contexts"):
            BenchConfig(contexts=contexts)


def test_a_context_past_the_int32_sequence_lengths_is_refused_by_its_flag(tmp_path, monkeypatch, capsys):
    """A step's seq_lens (context + 7) are int32. A --contexts of 10^20 passed the check (at least 1), and the
    cache's element count overflowed int64 in shm_empty: a RuntimeError traceback about viewing bytes as bf16,
    where README promises one line and exit 2 for a cache that cannot be allocated."""
    from dspark_sidecar import bench as B
    from dspark_sidecar import cli

    longest = 2**31 - 1 - 7
    assert BenchConfig(contexts=(512, longest)).contexts == (512, longest)
    for contexts in ((longest + 1,), (512, 10**20)):
        with pytest.raises(ValueError, match=rf"--contexts: context lengths in 1\.\.{longest}, got"):
            BenchConfig(contexts=contexts)
    monkeypatch.setattr(B.Bench, "__init__", lambda *a: pytest.fail("the bench drew its weights and cache"))
    assert cli.main(["bench", "--device", "cpu", "--preset", "tiny", "--modes", "a", "--reqs", "1",
                     "--contexts", str(10**20), "--out-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--contexts: context lengths in 1..{longest}, got [{10**20}]" in err and err.count("\n") == 1, err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_engine_ahead_mode_times_the_step_on_the_engine_s_stream(tmp_path):
    """g (and i, g through the shim): behind the engine's own GPU work, the step's GPU time as the
    engine's stream sees it. It includes the graph itself, so it cannot undercut (c)'s GPU time by
    more than noise; and it excludes the lead (a timing that started before the spin ended would
    exceed lead_ms)."""
    report = run_bench(BenchConfig(preset="tiny", reqs=(1,), contexts=(40,), modes=("c", "g", "i"), repeats=5,
                                   lead_ms=2.0, out_dir=tmp_path), torch.device("cuda"))
    g, i = (next(r for r in report["rows"] if r["mode"] == m) for m in ("g", "i"))
    assert "note" not in g and "note" not in i, (g, i)
    assert g["lead_ms"] == i["lead_ms"] == 2.0 and 0 < g["p50_ms"] < 2.0 and 0 < i["p50_ms"] < 2.0
    assert g["x_c"] > 0.8 and g["ring_to_answer_p50_us"] > 0
    assert i["x_c"] > 0.8 and min(i["shim_before_ring_after_answer_p50_us"]) > 0  # i: g through the shim


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_data_plane_steps_are_pre_launched_again_after_the_engine_was_far_ahead(tmp_path):
    """g at an 8 ms lead puts the sidecar in its cooldown (server/prelaunch.py BEHIND_S). A synchronized
    engine right after it gets pre-launched steps back within (d)'s settling steps: run 134's full
    bench had (d) at 0% pre-launched for every case after the first g."""
    report = run_bench(BenchConfig(preset="tiny", reqs=(1,), contexts=(40,), modes=("g", "d"), repeats=5,
                                   lead_ms=8.0, out_dir=tmp_path), torch.device("cuda"))
    g, d = (next(r for r in report["rows"] if r["mode"] == m) for m in ("g", "d"))
    assert "note" not in g and "note" not in d, (g, d)
    assert g["prelaunched_share"] < 0.5, g  # the cooldown was entered (run 134: 0%)
    assert d["prelaunched_share"] == 1.0, d


def test_copy_bandwidth_on_a_gpu_is_timed_in_gpu_time(monkeypatch):
    """The floor is GPU time (README), so its bandwidth must be too: a wall-clock copy with a sync
    around it carries the host's launch and sync (run on an H200: 0.540 ms wall against 0.507 ms of
    GPU time for 1 GiB, a 6% lower bandwidth and a 6% higher floor). Timers faked: no GPU needed."""
    from dspark_sidecar import bench as B

    monkeypatch.setattr(B, "gpu_times", lambda fn, device, repeats, *a: [1.0] * repeats)
    monkeypatch.setattr(B, "timeit", lambda fn, device, repeats, *a, **k: [1.06] * repeats)
    monkeypatch.setattr(B.torch, "empty", lambda n, dtype=None, device=None: torch.zeros(0, dtype=dtype))
    assert B.copy_bandwidth(torch.device("cuda"), 1 << 30) == pytest.approx(2 * (1 << 30) / 1e-3)


def test_a_p99_is_only_called_so_with_at_least_100_samples(tmp_path, capsys):
    """Nearest-rank p99 of fewer than 100 samples is their maximum (30 repeats: the slowest of 30).
    Such a row says so: the maximum and its sample count, not a p99, in the JSON and the printed line."""
    from dspark_sidecar.bench import _fmt, _latency_fields

    report = run_bench(BenchConfig(preset="tiny", reqs=(1,), contexts=(40,), modes=("a",), repeats=5,
                                   out_dir=tmp_path), torch.device("cpu"))
    (row,) = report["rows"]
    assert row["samples"] == 5 and "p99_ms" not in row and row["max_ms"] >= row["p50_ms"]
    line = capsys.readouterr().out.splitlines()[0]
    assert "p99" not in line and "max of 5" in line
    ms = [float(i) for i in range(1, 201)]  # 200 samples: the 198th smallest is the nearest-rank p99
    assert _latency_fields(ms) == {"samples": 200, "p50_ms": 100.5, "p99_ms": 198.0}
    assert "p99  198.000 ms (200 samples)" in _fmt({"name": "x", "R": 1, "context": 40, "floor_ms": 1.0, "x_floor": 1.0,
                                                    "x_b": None, **_latency_fields(ms)})


def test_gpu_time_rows_are_compared_with_the_baselines_gpu_time(tmp_path, monkeypatch):
    """g and i are GPU time (events on the engine's stream): their ratio to (b), like their ratio to
    (c), must be against that baseline's GPU time, not its wall-clock median (which adds the host's
    launch and sync). The wall-clock rows stay against the wall-clock baselines. Measurements faked."""
    from dspark_sidecar import bench as B

    wall = {"b": 2.0, "c": 0.5, "d": 0.6, "e": 0.8, "f": 0.3, "g": 0.55, "h": 0.65, "i": 0.56}
    gpu = {"b": 1.6, "c": 0.4}

    class FakeBench:
        def __init__(self, bc, device):
            self.model = self.cfg = self.embed = None
            self.pages, self.kv = 1, [torch.zeros(1)]

        def measure(self, mode, case):
            return [wall[mode]] * 3

        def phase_fields(self, mode):
            return {"gpu_p50_ms": gpu[mode]} if mode in gpu else {}

        def close(self):
            pass

    monkeypatch.setattr(B, "Bench", FakeBench)
    monkeypatch.setattr(B, "Case", lambda *a, **k: None)
    monkeypatch.setattr(B, "copy_bandwidth", lambda device: 1e12)
    monkeypatch.setattr(B, "floor_bytes", lambda *a: 1e8)  # 0.1 ms
    report = B.run_bench(BenchConfig(preset="tiny", reqs=(1,), contexts=(40,), modes=tuple(wall), repeats=3,
                                     out_dir=tmp_path), torch.device("cpu"))
    rows = {r["mode"]: r for r in report["rows"]}
    for m in ("g", "i"):
        assert rows[m]["x_b"] == pytest.approx(wall[m] / gpu["b"]) and rows[m]["x_c"] == pytest.approx(wall[m] / gpu["c"])
    for m in ("c", "d", "e", "f", "h"):
        assert rows[m]["x_b"] == pytest.approx(wall[m] / wall["b"])
    for m in ("d", "e", "f", "h"):
        assert rows[m]["x_c"] == pytest.approx(wall[m] / wall["c"])
        assert rows[m]["over_c_us"] == pytest.approx((wall[m] - wall["c"]) * 1e3)  # us this mode adds over (c)
    assert rows["f"]["over_c_us"] < 0 and rows["g"]["over_c_us"] == pytest.approx((wall["g"] - gpu["c"]) * 1e3)
    assert rows["c"]["x_floor"] == pytest.approx(5.0) and rows["c"]["gpu_x_floor"] == pytest.approx(4.0)
    assert not {"x_c", "over_c_us"} & (rows["b"].keys() | rows["c"].keys())  # "modes d-i also as a ratio to (c)"


def test_floor_byte_counts_are_spec_section_5_s():
    """Spec section 5 at TP 4, per rank: the layer weights 0.83 GB in bf16, and a request's draft K/V
    2560 B a token (K and V, 1 KV head of 128, 5 layers, bf16). A step reads the K/V its rows see: the
    context and the 7 block rows, at most a full window (the first row's 4095 keys to the left and the
    7 block rows: 4102 tokens, as the attention kernels read them; the spec rounds it to 4103).
    The model is built on the meta device: byte counts alone, nothing allocated."""
    from dspark_sidecar.bench import floor_bytes
    from dspark_sidecar.drafter.config import load_config
    from dspark_sidecar.drafter.model import DSparkDrafter
    from dspark_sidecar.drafter.parallel import ParallelContext
    from dspark_sidecar.kernels.ops import REFERENCE_OPS

    cfg = load_config("minimax-m3.1")
    model = DSparkDrafter(cfg, ParallelContext(0, 4), REFERENCE_OPS, torch.bfloat16, torch.device("meta"))

    def per_request(ctx: int) -> int:
        return floor_bytes(model, cfg, 2, ctx) - floor_bytes(model, cfg, 1, ctx)

    assert per_request(100) == (100 + 7) * 2560
    assert per_request(4096) == per_request(100_000) == (4095 + 7) * 2560  # ~10.5 MB: the window caps it
    weights = floor_bytes(model, cfg, 1, 100) - per_request(100)
    assert abs(weights / 1e9 - 0.83) < 0.01, weights
    assert floor_bytes(model, cfg, 32, 100) == 4 * weights + 32 * per_request(100)  # 4 launch groups


def test_a_mode_faster_than_c_prints_its_difference_with_its_own_sign():
    """over_c_us is negative where a mode beats (c): g's GPU time or f's per-step mean (runs 100, 136 and 150
    wrote -3.5 to -8.1 us). The printed line put a '+' before it: "0.98x c (+-7 us)"."""
    from dspark_sidecar.bench import _fmt

    row = {"name": "data plane, engine ahead", "R": 1, "context": 4096, "floor_ms": 0.2, "x_floor": 2.0, "x_b": None,
           "samples": 5, "p50_ms": 0.4, "max_ms": 0.5, "x_c": 0.98, "over_c_us": -6.65}
    line = _fmt(row)
    assert "0.98x c (-7 us)" in line and "+-" not in line, line
    assert "1.10x c (+40 us)" in _fmt({**row, "x_c": 1.1, "over_c_us": 40.2})
