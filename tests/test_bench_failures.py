"""The bench's figures when a mode fails: the run goes on, the note says why, no mode prints a figure it did not measure."""

from __future__ import annotations

import json
import shutil
import sys
import types

import pytest
import torch

from dspark_sidecar import bench as B
from dspark_sidecar.bench import BenchConfig, BenchConfigError
from dspark_sidecar.proto import sidecar_pb2 as pb


def _fake_bench(monkeypatch, measure, kv_dtype=torch.float32):
    """run_bench over a Bench whose measure() is `measure` (no model, no sidecar, no timing)."""

    class FakeBench:
        def __init__(self, bc, device):
            self.model = self.cfg = self.embed = None
            self.pages, self.kv = 1, [torch.zeros(1, dtype=kv_dtype)]

        def measure(self, mode, case):
            return measure(mode)

        def phase_fields(self, mode):
            return {}

        def close(self):
            pass

    monkeypatch.setattr(B, "Bench", FakeBench)
    monkeypatch.setattr(B, "Case", lambda *a, **k: None)
    monkeypatch.setattr(B, "copy_bandwidth", lambda device: 1e12)
    monkeypatch.setattr(B, "floor_bytes", lambda *a: 1e8)


def test_a_mode_failing_without_a_message_is_a_note_not_the_end_of_the_run(tmp_path, monkeypatch):
    """An exception whose str() is empty (a bare assert, queue.Empty, TimeoutError()) made the note's
    `str(exc).splitlines()[0]` raise IndexError inside the handler: the run ended, no JSON written."""
    def measure(mode):
        if mode == "d":
            raise AssertionError()
        return [1.0, 2.0]

    _fake_bench(monkeypatch, measure)
    report = B.run_bench(BenchConfig(preset="tiny", reqs=(1,), contexts=(40,), modes=("a", "d", "e"), repeats=2,
                                     out_dir=tmp_path), torch.device("cpu"))
    rows = {r["mode"]: r for r in report["rows"]}
    assert rows["d"]["note"] == "error: AssertionError" and "note" not in rows["e"]
    assert json.loads((tmp_path / "bench.json").read_text())["rows"] == report["rows"]


def test_a_grpc_failure_s_note_keeps_its_status_and_details(tmp_path, monkeypatch):
    """grpc's RpcError str() opens with a line that says nothing ("<_InactiveRpcError of RPC that
    terminated with:"): the note must carry the status code and details that follow it."""
    import grpc

    class Inactive(grpc.RpcError):
        def __str__(self):
            return ("<_InactiveRpcError of RPC that terminated with:\n\tstatus = StatusCode.UNAVAILABLE\n"
                    '\tdetails = "failed to connect to all addresses"\n>')

        def code(self):
            return grpc.StatusCode.UNAVAILABLE

        def details(self):
            return "failed to connect to all addresses"

    def measure(mode):
        raise Inactive()

    _fake_bench(monkeypatch, measure)
    report = B.run_bench(BenchConfig(preset="tiny", reqs=(1,), contexts=(40,), modes=("e",), repeats=2,
                                     out_dir=tmp_path), torch.device("cpu"))
    (row,) = report["rows"]
    assert "UNAVAILABLE" in row["note"] and "failed to connect to all addresses" in row["note"], row


def test_an_inline_step_s_error_is_reported_as_the_sidecar_s(monkeypatch):
    """Mode e decoded the hidden states before looking at the answer's error, so a refused step read
    as "hidden: unsupported dtype DTYPE_UNSPECIFIED" instead of the sidecar's own reason."""
    bench = object.__new__(B.Bench)
    bench.device, bench.step_id, bench.sidecar_ns = torch.device("cpu"), 0, []
    bench.binding = types.SimpleNamespace(binding_id=1, generation=1)

    class Stub:
        def DraftStep(self, req, timeout):
            return pb.DraftStepResponse(step_id=req.step_id, error=pb.StepError(code=11, message="seq_lens: too long"))

    bench.stub = Stub()
    case = types.SimpleNamespace(R=1, embeds=torch.zeros(7, 4), host=types.SimpleNamespace(
        positions=torch.zeros(7, dtype=torch.int64),
        meta=types.SimpleNamespace(seq_lens=torch.zeros(1, dtype=torch.int32),
                                   block_tables=torch.zeros(1, 1, dtype=torch.int32),
                                   slot_mapping=torch.zeros(7, dtype=torch.int64))))
    with pytest.raises(RuntimeError, match="sidecar step failed: .*seq_lens: too long") as err:
        bench._remote("e", case)
    assert "seq_lens: too long" in B._error_note(err.value)  # the row's note: the reason, on its first line


@pytest.mark.parametrize("shard_of", [0, -4])
def test_shard_of_below_one_is_refused_by_its_flag(shard_of):
    """--shard-of 0 reached ParallelContext: a traceback ("rank 0 outside world size 0"), not the flag."""
    with pytest.raises(BenchConfigError, match="--shard-of"):
        BenchConfig(shard_of=shard_of)


@pytest.mark.parametrize("field,values,flag", [("reqs", (1, 8, 1), "--reqs: 1 given"),
                                               ("contexts", (512, 4096, 4096), "--contexts: 4096 given"),
                                               ("modes", ("a", "d", "a"), "--modes: a given")])
def test_a_value_given_twice_is_refused_by_its_flag(field, values, flag):
    """--reqs 1,8,1 ran R = 1 twice: two rows for one case in the table and the JSON, and a plot line through both."""
    with pytest.raises(BenchConfigError, match=flag):
        BenchConfig(**{field: values})


def test_the_shim_s_rows_are_refused_once_it_left_the_bench_s_data_plane(tmp_path):
    """h and i time the shim against the doorbell the bench set up (its ring time stamps). A shim that
    dropped that link (a failed step: _drop_link) answers the next step over a new doorbell, or the gRPC
    stream: the row then carried the old doorbell's stamps (a negative "before ring") under the data
    plane's name. Such a step must fail the mode."""
    from dspark_sidecar.bench import Bench, Case

    dev = torch.device("cpu")
    bench = Bench(BenchConfig(preset="tiny", reqs=(1,), contexts=(40,), modes=("h",), out_dir=tmp_path), dev)
    try:
        case = Case(bench.cfg, 1, 40, 16, bench.pages, bench.embed, dev, seed=3)
        bench._inputs = bench.bufs.input_view(case.embeds.shape[0])
        bench._inputs.copy_(case.embeds)
        with bench._forward_context(case):
            bench._shimmed(case)  # over the bench's data plane
            assert bench.shim_ns[-1][0] > 0
            bench.shim._drop_link()  # as after a failed step
            with pytest.raises(RuntimeError, match="data plane"):
                bench._shimmed(case)
        assert all(before > 0 for before, _ in bench.shim_ns)
    finally:
        bench.close()


def test_the_plot_draws_each_mode_in_order_of_r(tmp_path, monkeypatch):
    """--reqs 8,1,2 gave rows in that order, and each mode's line went 8 -> 1 -> 2 (back over itself)."""
    drawn = []

    class Ax:
        def plot(self, xs, ys, *a, **k):
            drawn.append((k.get("label") or a[0], list(xs)))

        def set(self, **k):
            pass

        def legend(self, **k):
            pass

    class Fig:
        def tight_layout(self):
            pass

        def savefig(self, path, dpi=None):
            path.write_bytes(b"png")

    plt = types.ModuleType("matplotlib.pyplot")
    plt.subplots = lambda *a, **k: (Fig(), [[Ax()]])
    mpl = types.ModuleType("matplotlib")
    mpl.use, mpl.pyplot = (lambda name: None), plt
    monkeypatch.setitem(sys.modules, "matplotlib", mpl)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", plt)
    rows = [{"mode": "a", "R": r, "context": 40, "floor_ms": 0.1 * r, "p50_ms": float(r)} for r in (8, 1, 2)]
    B._plot({"rows": rows, "device": "cpu"}, tmp_path / "bench.png")
    assert drawn and all(xs == [1, 2, 8] for _, xs in drawn), drawn
    assert (tmp_path / "bench.png").exists()


def test_a_sidecar_that_cannot_be_set_up_fails_its_modes_not_the_run(tmp_path, monkeypatch):
    """The sidecar (or its data plane) not set up raised out of Bench(): no row and no JSON at all, the
    reference figures that need no sidecar lost with the rest. d-i now carry the reason as a note."""
    from dspark_sidecar.client.shim import DrafterShim

    monkeypatch.setattr(DrafterShim, "connect", lambda self: "refused for the test")
    report = B.run_bench(BenchConfig(preset="tiny", reqs=(1,), contexts=(40,), modes=("a", "d", "h"), repeats=2,
                                     out_dir=tmp_path), torch.device("cpu"))
    rows = {r["mode"]: r for r in report["rows"]}
    assert rows["a"]["p50_ms"] > 0 and "note" not in rows["a"]
    for m in ("d", "h"):
        assert rows[m]["note"].startswith("error: RuntimeError") and "refused for the test" in rows[m]["note"], rows[m]
        assert "p50_ms" not in rows[m]
    assert json.loads((tmp_path / "bench.json").read_text())["rows"] == report["rows"]


def test_a_mode_that_cannot_run_here_keeps_its_reason(tmp_path):
    """On CPU g is "n/a: needs a GPU"; its phases were read all the same, from no samples, and the
    row said "error: StatisticsError: no median for empty data" instead."""
    report = B.run_bench(BenchConfig(preset="tiny", reqs=(1,), contexts=(40,), modes=("a", "g"), repeats=2,
                                     out_dir=tmp_path), torch.device("cpu"))
    rows = {r["mode"]: r for r in report["rows"]}
    assert rows["g"]["note"] == "n/a: needs a GPU", rows["g"]


def test_the_bench_s_sidecar_folder_goes_with_a_clean_stop_and_stays_with_a_failed_one(tmp_path, bench_sidecars):
    """Each bench run with a sidecar left its mkdtemp folder (the sidecar's log and socket folder) in the temp
    dir (fifty after two hours of test runs here). It goes now once the sidecar stopped cleanly; a sidecar
    that failed keeps its log for a person to read."""
    B.run_bench(BenchConfig(preset="tiny", reqs=(1,), contexts=(40,), modes=("d",), repeats=2, out_dir=tmp_path),
                torch.device("cpu"))
    (side,) = bench_sidecars
    assert side.proc.returncode == 0 and not side.work.exists()

    failed = type(side).__new__(type(side))
    failed.work, failed.proc = tmp_path / "failed", types.SimpleNamespace(returncode=1)
    failed.work.mkdir()
    (failed.work / "sidecar.log").write_text("rank 0: CUDA out of memory")
    failed.discard()
    assert (failed.work / "sidecar.log").exists()


def test_a_run_stopped_while_it_measures_the_bandwidth_stops_its_sidecar(tmp_path, bench_sidecars, monkeypatch):
    """The copy bandwidth was measured after Bench() started the sidecar but outside the try whose finally
    closes it: a SIGTERM there (cli's _sigterm_unwinds: SystemExit), Ctrl-C or a failed copy left the sidecar
    serving until the bench's process exited, and its folder (log, sockets) in the temp dir."""
    def stopped(device):
        raise SystemExit(143)

    monkeypatch.setattr(B, "copy_bandwidth", stopped)
    with pytest.raises(SystemExit):
        B.run_bench(BenchConfig(preset="tiny", reqs=(1,), contexts=(40,), modes=("d",), repeats=2, out_dir=tmp_path),
                    torch.device("cpu"))
    (side,) = bench_sidecars
    assert side.proc.poll() is not None and not side.work.exists()


def test_the_shim_s_rows_are_refused_when_its_step_went_over_the_grpc_stream(tmp_path):
    """A step too large for the registered buffers (a block table wider than the data plane's 8192 pages:
    a context past 131k at pages of 16) is sent by the shim over the gRPC stream, its doorbell kept. The
    row was timed and printed as "sidecar via the shim" (the data plane) anyway, with the doorbell's time
    stamps of no step of this mode (a "before ring" of -40,000 s), while (d) failed the same case with the
    data plane's error. Such a step must fail the mode: it is the inline gRPC path, not h's."""
    from dspark_sidecar.bench import Bench, Case

    dev, ctx = torch.device("cpu"), 140_000
    bench = Bench(BenchConfig(preset="tiny", reqs=(1,), contexts=(ctx,), modes=("h",), out_dir=tmp_path), dev)
    try:
        case = Case(bench.cfg, 1, ctx, 16, bench.pages, bench.embed, dev, seed=3)
        assert not bench.shim.doorbell.fits(1, case.host.meta, bench.cfg.hidden_size)  # the case the test is about
        bench._inputs = case.embeds
        with bench._forward_context(case), pytest.raises(RuntimeError, match="gRPC stream"):
            bench._shimmed(case)
        assert bench.shim.stats.forwarded == 1 and bench.shim.stats.via_doorbell == 0  # it did forward, inline
        assert not bench.shim_ns
    finally:
        bench.close()


def test_mode_f_s_batch_means_never_give_a_p99(tmp_path, monkeypatch, capsys):
    """f's samples are means of PIPELINE steps: at --repeats 1000 there are 100 of them, and the row gave a
    "p99" of batch means (a step's tail averaged with nine others) beside the other modes' per-step p99s.
    README: "mode f's batch means always do" give max_ms and the sample count instead."""
    _fake_bench(monkeypatch, lambda mode: [float(i) for i in range(1, 101)])
    report = B.run_bench(BenchConfig(preset="tiny", reqs=(1,), contexts=(40,), modes=("a", "f"), repeats=1000,
                                     out_dir=tmp_path), torch.device("cpu"))
    rows = {r["mode"]: r for r in report["rows"]}
    assert rows["a"]["p99_ms"] == 99.0  # 100 steps: a p99
    assert "p99_ms" not in rows["f"] and rows["f"]["max_ms"] == 100.0 and rows["f"]["samples"] == 100
    f_line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(B.NAMES["f"]))
    assert "p99" not in f_line and "max of 100" in f_line


def test_a_row_s_p50_is_the_median_of_its_samples_not_their_mean(tmp_path, monkeypatch, capsys):
    """The rows say p50: one slow step in five (a GC pause, a preemption) must not move it, where a mean
    would (1, 1, 1, 1, 11: a median of 1, a mean of 3). Batch means (f) are medianed the same way."""
    _fake_bench(monkeypatch, lambda mode: [1.0, 1.0, 11.0, 1.0, 1.0])
    report = B.run_bench(BenchConfig(preset="tiny", reqs=(1,), contexts=(40,), modes=("a", "f"), repeats=5,
                                     out_dir=tmp_path), torch.device("cpu"))
    for row in report["rows"]:
        # The floor is 0.1 ms (1e8 bytes at 1e12 B/s): ten times under the median.
        assert row["p50_ms"] == 1.0 and row["max_ms"] == 11.0 and row["x_floor"] == pytest.approx(10.0), row
    assert "p50    1.000 ms" in capsys.readouterr().out


def test_the_floor_counts_the_cache_s_own_element_size(tmp_path, monkeypatch):
    """An fp8 cache (--kv-dtype fp8) is read at 1 byte a K/V value: run_bench must hand floor_bytes the
    cache's element size, or the floor counts the compute dtype's 2 bytes and the x_floor ratio drops."""
    _fake_bench(monkeypatch, lambda mode: [1.0, 1.0], kv_dtype=torch.float8_e4m3fn)
    seen = []
    monkeypatch.setattr(B, "floor_bytes", lambda model, cfg, R, ctx, kv_itemsize=None: seen.append(kv_itemsize) or 1e8)
    B.run_bench(BenchConfig(preset="tiny", reqs=(1,), contexts=(40,), modes=("a",), repeats=2, kv_dtype="fp8",
                            out_dir=tmp_path), torch.device("cpu"))
    assert seen == [1]


def test_a_kv_cache_that_cannot_be_allocated_is_one_line_and_leaves_no_segment(tmp_path, monkeypatch, capsys):
    """A --contexts (or --reqs) whose cache does not fit /dev/shm failed at a later layer's segment with OSError
    ENOSPC: a traceback, and the layers already made stayed in /dev/shm (GBs of them) until the process exited."""
    import errno

    from dspark_sidecar import cli
    from dspark_sidecar.proto import memory

    made, real = [], memory.shm_empty

    def shm_empty(shape, dtype, group=None):
        if len(made) == 2:  # the third layer's does not fit
            raise OSError(errno.ENOSPC, "No space left on device")
        made.append(real(shape, dtype, group))
        return made[-1]

    monkeypatch.setattr(memory, "shm_empty", shm_empty)
    with pytest.raises(BenchConfigError, match="--contexts") as err:
        B.Bench(BenchConfig(preset="tiny", reqs=(1,), contexts=(40,), modes=("a",), out_dir=tmp_path),
                torch.device("cpu"))
    assert "No space left on device" in str(err.value)
    assert len(made) == 2 and all(m.unlinked for m in made)
    made.clear()
    assert cli.main(["bench", "--device", "cpu", "--preset", "tiny", "--reqs", "1", "--contexts", "40", "--modes", "a",
                     "--repeats", "1", "--out-dir", str(tmp_path / "out")]) == 2
    out = capsys.readouterr().err
    assert out.startswith("dspark-sidecar: --reqs/--contexts:") and out.count("\n") == 1, out
    assert all(m.unlinked for m in made)


def test_a_sidecar_that_dies_mid_bench_is_named_in_the_later_rows(tmp_path, monkeypatch, bench_sidecars):
    """A sidecar killed between cases (the OOM killer, a crash) left every later remote row with gRPC's
    "UNAVAILABLE: failed to connect to all addresses" and no word of the sidecar's exit or its log, which stays."""
    import signal

    real, cases = B.Case, []

    def case(*a, **k):
        cases.append(1)
        if len(cases) == 2:  # after the first case's rows
            bench_sidecars[0].proc.send_signal(signal.SIGKILL)
            bench_sidecars[0].proc.wait()
        return real(*a, **k)

    monkeypatch.setattr(B, "Case", case)
    try:
        report = B.run_bench(BenchConfig(preset="tiny", reqs=(1,), contexts=(40, 48), modes=("a", "d", "e"),
                                         repeats=2, out_dir=tmp_path), torch.device("cpu"))
        rows = {(r["mode"], r["context"]): r for r in report["rows"]}
        assert all("p50_ms" in rows[m, 40] for m in "ade") and "p50_ms" in rows["a", 48]
        log = bench_sidecars[0].work / "sidecar.log"
        for m in "de":
            assert rows[m, 48]["note"] == f"error: the sidecar exited (status -9) during the bench; see {log}", \
                rows[m, 48]
        assert log.exists()  # kept for the operator
    finally:
        if bench_sidecars and bench_sidecars[0].work.exists():  # kept by the bench for its log: this test's to remove
            shutil.rmtree(bench_sidecars[0].work)


def test_a_note_is_the_first_line_that_says_something():
    """A row's note is one line: a message opening with a blank line and going on for several kept only its first
    line with text, never the lines after it (they broke the printed table) nor an empty first line."""
    assert B._error_note(RuntimeError("\n  sidecar step failed: timeout\nsee the log\n")) == \
        "error: RuntimeError: sidecar step failed: timeout"


def test_the_percentile_of_no_samples_is_nan_not_a_figure():
    import math

    from dspark_sidecar.percentiles import percentile

    assert math.isnan(percentile([], 99))
    assert percentile([3.0], 99) == 3.0 and percentile([2.0, 1.0], 99) == 2.0 and percentile([2.0, 1.0], 50) == 1.0
    assert percentile([3.0, 1.0, 2.0], 0) == 1.0 and percentile([3.0, 1.0, 2.0], 100) == 3.0  # the ends: q in 0..100


@pytest.mark.parametrize("n, tail", [(1, {"max_ms": 1.0}), (2, {"max_ms": 2.0}), (99, {"max_ms": 99.0}),
                                     (100, {"p99_ms": 99.0}), (101, {"p99_ms": 100.0})])
def test_a_row_s_p99_is_from_100_samples_up_and_the_maximum_below(n, tail):
    """At 99 samples a nearest-rank p99 is the slowest (ceil(98.01) = 99th of 99): the row gives it as max_ms. From
    100 it is the 99th smallest (ceil(99.0)), never the maximum; at 101 the 100th (ceil(99.99)). Samples unordered."""
    ms = [float(i) for i in range(n, 0, -1)]
    assert B._latency_fields(ms) == {"samples": n, "p50_ms": (n + 1) / 2, **tail}
