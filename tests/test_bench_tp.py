"""`bench --tp N` on CPU: N sidecar ranks (gloo) driven by N engine rank processes, checked against the reference."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from dspark_sidecar import bench_tp, cli
from dspark_sidecar.bench import BenchConfig, SidecarUnderTest
from dspark_sidecar.bench_tp import PARITY_RTOL, _median, _parity, _report, _timed_steps, run_tp_bench


def test_tp4_sidecar_from_four_engine_ranks_equals_the_reference_at_tp4(tmp_path):
    # R = 9: two launches per step; fp32 on CPU runs the reference ops on both sides, so bit-identical.
    bc = BenchConfig(preset="tiny", reqs=(1, 9), contexts=(40,), dtype="fp32", repeats=2, out_dir=tmp_path)
    report = run_tp_bench(bc, 4, single_gpu=True, device_type="cpu")
    assert json.loads((tmp_path / "bench-tp4.json").read_text()) == report
    assert [r["R"] for r in report["rows"]] == [1, 9]
    for row in report["rows"]:
        assert row["errors"] == 0 and row["ranks_agree"] and row["parity_ok"]
        assert row["hidden_rel_l2"] == 0.0 and row["kv_rel_l2"] == 0.0
        assert row["tp_step_p50_ms"] > 0 and row["single_gpu_shard_p50_ms"] > 0 and row["x_floor"] > 0
        assert 0 < row["exchange_share"]
        # the same step through each rank's shim, its agreements included: the same bits on every rank
        assert row["tp_shim_step_p50_ms"] > 0 and row["shim_matches"]


def _rank_row(**kw) -> dict:
    return {"R": 8, "context": 4096, "p50_ms": 1.0, "errors": 0, "exchange_p50_ms": 0.1,
            "hidden_rel_l2": 0.01, "kv_rel_l2": 0.01, "ranks_agree": True, "shim_p50_ms": 1.1,
            "shim_matches": True, **kw}


def test_a_failed_single_gpu_comparison_row_fails_the_run_by_name(tmp_path, monkeypatch, capsys):
    """The single-GPU comparison's rows (its own bench.json): a failed one (its sidecar did not start, say) left
    only a figure missing from the TP rows, and `bench --tp` exited 0 with parity ok, as the one-process bench did
    before it exited 1 on a failed row. A mode that cannot run here (n/a) is no failure."""
    bc = BenchConfig(out_dir=tmp_path)
    single = {"rows": [{"mode": "d", "R": 8, "context": 4096, "note": "error: BenchFailed: did not start"},
                       {"mode": "c", "R": 8, "context": 4096, "note": "n/a: needs a GPU"}]}
    report = _report(bc, 2, [[_rank_row()], [_rank_row()]], single, "cpu", 1.0)
    assert report["single_gpu_failed"] == ["d (R=8, context 4096)"]
    assert json.loads((tmp_path / "bench-tp2.json").read_text())["single_gpu_failed"] == ["d (R=8, context 4096)"]
    monkeypatch.setattr(bench_tp, "run_tp_bench", lambda *a, **kw: report)
    assert cli.main(["bench", "--tp", "2", "--device", "cpu", "--preset", "tiny", "--out-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "the single-GPU comparison's rows failed: d (R=8, context 4096)" in err, err
    report["single_gpu_failed"] = []
    assert cli.main(["bench", "--tp", "2", "--device", "cpu", "--preset", "tiny", "--out-dir", str(tmp_path)]) == 0


def test_the_report_fails_a_case_on_any_rank_s_error_disagreement_or_drift(tmp_path):
    bc = BenchConfig(out_dir=tmp_path)
    single = {"rows": [{"mode": "d", "R": 8, "context": 4096, "p50_ms": 0.6, "floor_ms": 0.25},
                       {"mode": "c", "R": 8, "context": 4096, "p50_ms": 0.5, "floor_ms": 0.25}]}
    cases = {
        "ok": ([[_rank_row()], [_rank_row(p50_ms=1.5)]], True),
        "drift": ([[_rank_row()], [_rank_row(hidden_rel_l2=2 * PARITY_RTOL)]], False),
        "kv": ([[_rank_row(kv_rel_l2=0.5)], [_rank_row()]], False),
        "disagree": ([[_rank_row()], [_rank_row(ranks_agree=False)]], False),
        "error": ([[_rank_row(errors=1)], [_rank_row()]], False),
        "shim": ([[_rank_row()], [_rank_row(shim_matches=False)]], False),
    }
    for name, (per_rank, ok) in cases.items():
        row = _report(bc, 2, per_rank, single, "H200", PARITY_RTOL)["rows"][0]
        assert row["parity_ok"] is ok, name
    row = _report(bc, 2, cases["ok"][0], single, "H200", PARITY_RTOL)["rows"][0]
    # The slowest rank is the step; the floor and baselines are rank 0's shard on one GPU.
    assert row["tp_step_p50_ms"] == 1.5 and row["x_floor"] == 1.5 / 0.25 and row["tp_shim_step_p50_ms"] == 1.1
    assert row["single_gpu_shard_p50_ms"] == 0.6 and row["single_gpu_backend_inprocess_p50_ms"] == 0.5
    # On CPU (reference ops on both sides) any difference at all fails.
    assert not _report(bc, 2, cases["ok"][0], single, "cpu", 0.0)["rows"][0]["parity_ok"]


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_kv_layout_records_is_what_the_engine_ranks_allocate_and_bind(tmp_path, kv_dtype):
    # --kv-layout (and --kv-dtype) reach the TP engine ranks too: each allocates vLLM 0.34's records
    # cache, its shim binds it, and the reference runs over the same views; the rows say what they measured.
    bc = BenchConfig(preset="tiny", reqs=(2,), contexts=(40,), dtype="fp32", repeats=1, out_dir=tmp_path,
                     kv_layout="records", kv_dtype=kv_dtype)
    (row,) = run_tp_bench(bc, 2, single_gpu=False, device_type="cpu")["rows"]
    assert row["kv_layout"] == ("records fp8" if kv_dtype == "fp8" else "records")
    assert row["errors"] == 0 and row["parity_ok"] and row["kv_rel_l2"] == 0.0
    assert row["parity_rtol"] == 0.0  # on CPU both sides run the reference ops: bit-identical or a failure


class _Answer:
    """A DraftStepResponse's part _timed_steps reads: an error, or timings.prelaunched."""

    def __init__(self, error: bool = False, prelaunched: bool = False) -> None:
        self.error, self.timings = error, SimpleNamespace(prelaunched=prelaunched)

    def HasField(self, name: str) -> bool:  # noqa: N802  (protobuf's name)
        return name == "error" and self.error


def test_a_step_answered_with_an_error_is_not_a_timing():
    """The engine ranks put every timed step's ms into the median, error answers too: those come back
    before any layer ran, so a case whose steps failed reported a fast p50 (beside its FAIL)."""
    answers = iter([(9.0, _Answer()), (9.0, _Answer(error=True)), (9.0, _Answer()),  # warm-up
                    (5.0, _Answer(prelaunched=True)), (0.01, _Answer(error=True)), (0.01, _Answer(error=True)),
                    (7.0, _Answer())])
    times, errors, early = _timed_steps(lambda: next(answers), repeats=4)
    assert times == [5.0, 7.0] and errors == 3 and early == 1
    assert _median(times) == 6.0
    # every step failed: no figure (NaN), not a StatisticsError that took the whole run down with it
    times, errors, _ = _timed_steps(lambda: (0.01, _Answer(error=True)), repeats=2)
    assert times == [] and errors == 5 and math.isnan(_median(times))


@pytest.mark.parametrize("argv, words", [
    (["--tp", "3", "--preset", "tiny"], "--tp 3: num_attention_heads: 8 is not divisible by TP size 3"),
    (["--tp", "2", "--preset", "no-such-preset"], "no-such-preset"),
])
def test_a_preset_or_tp_that_cannot_run_is_one_line_before_any_process(argv, words, tmp_path, monkeypatch, capsys):
    """With --no-single-gpu nothing checked --tp or --preset before the sidecar started: it failed to
    start (a traceback naming its log) and its folder stayed in $TMPDIR, for a flag's value."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def started(*_a, **_kw):
        raise AssertionError("a sidecar was started for an unusable flag")

    monkeypatch.setattr(bench_tp, "SidecarUnderTest", started)
    assert cli.main(["bench", *argv, "--device", "cpu", "--no-single-gpu", "--out-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dspark-sidecar: ") and words in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


class _QuietSidecar(SidecarUnderTest):
    """SidecarUnderTest's close and discard over a process that stops cleanly on SIGTERM, as serve does."""

    def __init__(self, bc, device, work, tp=1) -> None:
        self.work, self.sock = work, work / "sock"
        self.log = open(work / "sidecar.log", "wb")
        code = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); time.sleep(600)"
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=self.log, stderr=subprocess.STDOUT)


def _post_pid(rank: int) -> Path:
    """Writes this engine rank's pid as $BENCH_TP_TEST_PIDS/rank<rank>, whole or absent to a reader (a rank may be
    ended mid-write); returns that folder."""
    pids = Path(os.environ["BENCH_TP_TEST_PIDS"])
    (pids / f".tmp{rank}").write_text(str(os.getpid()))
    (pids / f".tmp{rank}").rename(pids / f"rank{rank}")
    return pids


def _rank_that_sigterms_the_bench(rank, world, bc, device_type, target_dir, store, out) -> None:
    """An engine rank: says it runs, rank 0 sends the bench SIGTERM, then each waits as for a step."""
    pids = _post_pid(rank)
    if rank == 0:
        deadline = time.monotonic() + 60
        while len(list(pids.glob("rank?"))) < world and time.monotonic() < deadline:  # every rank running
            time.sleep(0.05)
        os.kill(os.getppid(), signal.SIGTERM)
    time.sleep(120)  # a step's wait (60 s in the real ranks); left running, it outlives the bench
    (pids / f"rank{rank}.slept").write_text("")  # only a rank waited for, not ended, gets here


def test_sigterm_stops_the_engine_ranks_and_the_sidecar_and_removes_the_folder(tmp_path, tmp_path_factory,
                                                                               monkeypatch):
    """`bench --tp N` under SIGTERM (`timeout`, a cancelled CI job) died at once: its work folder (the
    sidecar's log and sockets) stayed in $TMPDIR. Now it unwinds as the demo does: the engine ranks are
    ended, the sidecar stopped, the folder removed, exit status 143."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(bench_tp, "_engine_rank", _rank_that_sigterms_the_bench)
    pids = tmp_path_factory.mktemp("pids")
    monkeypatch.setenv("BENCH_TP_TEST_PIDS", str(pids))  # the spawned ranks inherit it
    sidecars = []
    monkeypatch.setattr(bench_tp, "SidecarUnderTest", lambda *a, **kw: sidecars.append(_QuietSidecar(*a, **kw))
                        or sidecars[-1])
    before = signal.signal(signal.SIGTERM, lambda signum, frame: None)  # stands for the default action
    try:
        with pytest.raises(SystemExit) as stopped:
            cli.main(["bench", "--tp", "2", "--device", "cpu", "--preset", "tiny", "--no-single-gpu",
                      "--out-dir", str(tmp_path / "out")])
    finally:
        signal.signal(signal.SIGTERM, before)
    assert stopped.value.code == 128 + signal.SIGTERM
    # The ranks were ended, not waited for: none slept out its step's wait (no wall-clock bound: house rule).
    assert sorted(p.name for p in pids.iterdir()) == ["rank0", "rank1"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # the work folder gone
    assert sidecars[0].proc.returncode == 0
    ranks = [int((pids / f"rank{r}").read_text()) for r in range(2)]
    for pid in ranks:  # ended, not left waiting (the bench's exit would have waited for them)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_rank_that_answered_no_step_leaves_the_case_without_a_step_time(tmp_path):
    """The step is the slowest rank's p50; a rank whose every step was answered with an error has none (NaN).
    max() over the ranks kept or dropped that NaN by rank order: with rank 0 answered and rank 1 not, the row
    printed rank 0's p50 as the step's time, its ratio to the floor and the exchange's share of it."""
    bc = BenchConfig(out_dir=tmp_path)
    single = {"rows": [{"mode": "d", "R": 8, "context": 4096, "p50_ms": 0.6, "floor_ms": 0.25}]}
    for per_rank in ([[_rank_row()], [_rank_row(p50_ms=math.nan, errors=5)]],
                     [[_rank_row(p50_ms=math.nan, errors=5)], [_rank_row()]]):
        row = _report(bc, 2, per_rank, single, "H200", PARITY_RTOL)["rows"][0]
        assert math.isnan(row["tp_step_p50_ms"]) and not row["parity_ok"], row
        assert row["x_floor"] is None or math.isnan(row["x_floor"])


def test_a_direct_step_counts_the_engine_s_fill_as_the_one_gpu_d_beside_it_does(monkeypatch):
    """The TP row is read against the one-GPU shard's (d), whose time runs from the engine's fill of the regions
    to the hidden states. The TP step started its clock after the fill (and the barrier that follows it): the
    exchange's cost read off the two lacked the fill's 22-85 us. The barrier stays out. Clock faked."""
    now = [0.0]

    def takes(s, out=None):
        def fn():
            now[0] += s
            return out
        return fn

    monkeypatch.setattr(bench_tp.time, "perf_counter", lambda: now[0])
    ms, resp = bench_tp._step_ms(takes(0.002), takes(0.5), takes(0.003, "answer"))
    assert ms == pytest.approx(5.0) and resp == "answer"  # fill 2 + ring 3; the barrier's 500 left out


def test_a_nan_drift_on_any_rank_fails_the_case(tmp_path):
    """The case's drift is the worst rank's; max() keeps a NaN only in first place, so a rank past 0 whose block
    K/V (or hidden states) came back NaN (garbage codes in an fp8 cache read as NaN) left rank 0's figure as the
    case's: parity ok."""
    bc = BenchConfig(out_dir=tmp_path)
    single = {"rows": [{"mode": "d", "R": 8, "context": 4096, "p50_ms": 0.6, "floor_ms": 0.25}]}
    for field in ("kv_rel_l2", "hidden_rel_l2"):
        for per_rank in ([[_rank_row()], [_rank_row(**{field: math.nan})]],
                         [[_rank_row(**{field: math.nan})], [_rank_row()]]):
            row = _report(bc, 2, per_rank, single, "H200", PARITY_RTOL)["rows"][0]
            assert math.isnan(row[field]) and not row["parity_ok"], (field, row)


def test_fewer_gpus_than_tp_is_one_line_and_exit_2_before_any_process(tmp_path, monkeypatch, capsys):
    """`bench --tp 2` where one GPU is visible raised SystemExit from run_tp_bench: exit 1 (a parity failure's
    status) and a bare line without the command's prefix. Now a usage error, as the demo's, before anything runs."""
    import torch

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)

    def started(*_a, **_kw):
        raise AssertionError("something was started with too few GPUs")

    monkeypatch.setattr(bench_tp, "SidecarUnderTest", started)
    assert cli.main(["bench", "--tp", "2", "--device", "cuda", "--preset", "tiny",
                     "--out-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dspark-sidecar: ") and "1 GPU(s) visible" in err and "--tp 2" in err
    assert list(tmp_path.iterdir()) == []


class _Stop(Exception):
    """Raised by a stand-in once it has seen what it was given."""


@pytest.mark.parametrize("asked, runs", [(0, 1), (2, 2)])
def test_the_one_gpu_shard_runs_its_launch_groups_as_the_tp_sidecar_does(tmp_path, monkeypatch, asked, runs):
    """The one-GPU shard beside a TP row is that row's step less the exchange. --launch-streams 0 is serve's
    default, 4 streams side by side at --tp 1 and 1 (in order) above: at R = 16 and 32 the shard ran its launch
    groups side by side while the TP-N sidecar ran them in order, and the gap read as the exchange's."""
    from dspark_sidecar import bench

    seen = []

    def single(bc, device):
        seen.append(bc)
        raise _Stop

    monkeypatch.setattr(bench, "run_bench", single)
    with pytest.raises(_Stop):
        run_tp_bench(BenchConfig(preset="tiny", out_dir=tmp_path, launch_streams=asked), 2, device_type="cpu")
    assert seen[0].shard_of == 2 and seen[0].launch_streams == runs


def _rank_that_dies_before_its_peer_s_barrier(rank, world, bc, device_type, target_dir, store, out) -> None:
    """An engine rank: rank 1 fails at once; rank 0 waits for it in the ranks' gloo barrier (300 s timeout)."""
    import datetime

    import torch.distributed as dist

    pids = _post_pid(rank)
    if rank == 1:
        # Fail only once rank 0 has written its pid: raising earlier lets spawn end rank 0 before it does (as on
        # CI's loaded box), and the test could not check that rank 0 is gone.
        deadline = time.monotonic() + 60
        while not (pids / "rank0").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        raise RuntimeError("engine rank 1 failed")
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    dist.barrier()


def test_a_failed_engine_rank_ends_the_run_and_its_waiting_peer(tmp_path, tmp_path_factory, monkeypatch, capsys):
    """Real spawned ranks over gloo: one that raises is the run's error, its peer (waiting for it in a collective)
    is ended, not left to its 300 s timeout, and the sidecar is stopped. The command says which rank failed and
    why in one line, exit 1 (it was torch's ProcessRaisedException: a traceback through the spawn machinery)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(bench_tp, "_engine_rank", _rank_that_dies_before_its_peer_s_barrier)
    pids = tmp_path_factory.mktemp("pids")
    monkeypatch.setenv("BENCH_TP_TEST_PIDS", str(pids))
    sidecars = []
    monkeypatch.setattr(bench_tp, "SidecarUnderTest", lambda *a, **kw: sidecars.append(_QuietSidecar(*a, **kw))
                        or sidecars[-1])
    assert cli.main(["bench", "--tp", "2", "--device", "cpu", "--preset", "tiny", "--no-single-gpu",
                     "--out-dir", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("dspark-sidecar: bench --tp 2: engine rank 1 failed: RuntimeError: engine rank 1 failed "
                          "(the sidecar's folder: ") and err.count("\n") == 1, err
    assert sidecars[0].proc.returncode == 0
    for pid in (int((pids / f"rank{r}").read_text()) for r in range(2)):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _rank_that_exits(rank, world, bc, device_type, target, store, out):
    """An engine rank that ends without raising (as one killed would): rank 1 exits 3, rank 0 returns."""
    if rank == 1:
        os._exit(3)


def test_an_engine_rank_that_exited_is_one_line_too(tmp_path, monkeypatch):
    """torch raises ProcessExitedException, not ProcessRaisedException, for a rank that exited: the same BenchFailed."""
    from dspark_sidecar.bench import BenchFailed

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(bench_tp, "_engine_rank", _rank_that_exits)
    monkeypatch.setattr(bench_tp, "SidecarUnderTest", _QuietSidecar)
    with pytest.raises(BenchFailed, match=r"^engine rank 1 failed: exited with status 3 \(the sidecar's folder: "):
        run_tp_bench(BenchConfig(preset="tiny", out_dir=tmp_path / "out"), 2, single_gpu=False, device_type="cpu")


def _raised_in_rank(exc: Exception, rank: int = 2):
    """torch's ProcessRaisedException for a rank that raised exc: its traceback as spawn's _wrap sends it."""
    import traceback

    import torch.multiprocessing as mp

    try:
        raise exc
    except Exception:  # noqa: BLE001
        trace = traceback.format_exc()
    return mp.ProcessRaisedException(f"\n\n-- Process {rank} terminated with the following error:\n{trace}", rank, 1)


@pytest.mark.parametrize("exc, line", [
    (RuntimeError("engine rank 1 failed"), "RuntimeError: engine rank 1 failed"),
    # a CUDA error's message: its last line was the line given ("Compile with `TORCH_USE_CUDA_DSA` ...")
    (RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported\n"
                  "For debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
                  "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n"),
     "RuntimeError: CUDA error: out of memory"),
    # a gRPC error's str() ends with ">" alone
    (ValueError("<_InactiveRpcError of RPC that terminated with:\n\tstatus = StatusCode.UNAVAILABLE\n>"),
     "ValueError: <_InactiveRpcError of RPC that terminated with:"),
])
def test_a_raising_engine_rank_is_named_by_its_exception_s_first_line(exc, line):
    assert bench_tp._rank_failure(_raised_in_rank(exc)) == line


def test_an_engine_rank_that_exited_is_named_by_its_signal_or_status():
    import torch.multiprocessing as mp

    killed = mp.ProcessExitedException("process 1 terminated with signal SIGKILL", 1, 1, -9, "SIGKILL")
    assert bench_tp._rank_failure(killed) == "exited with SIGKILL"
    assert bench_tp._rank_failure(mp.ProcessExitedException("process 1 terminated with exit code 3", 1, 1, 3)) \
        == "exited with status 3"


def test_a_nan_block_k_v_in_any_layer_fails_the_case(monkeypatch):
    """A rank's K/V drift is its worst layer's. max() over the layers keeps a NaN only in first place: a layer past
    the first whose block K/V came back NaN (garbage codes in an fp8 cache read as NaN, the hidden states fine)
    left layer 0's drift as the rank's: parity ok."""
    import torch

    from dspark_sidecar.drafter.kv_cache import StepMetadata

    monkeypatch.setattr(bench_tp.dist, "broadcast", lambda *a, **k: None)  # one rank: rank 0's answer is its own
    slots = torch.tensor([3, 4], dtype=torch.int64)
    meta = StepMetadata(torch.tensor([9], dtype=torch.int32), torch.tensor([[0]], dtype=torch.int32), slots)
    want = torch.ones(2, 4)

    class Ref:  # the reference layers: writes the block K/V into the copy it is given, returns the hidden states
        def draft_step(self, embeds, positions, meta, kv):
            for t in kv:
                t[:, 0, 3:5] = 1.0
            return want

    for bad in (0, 1):
        kv = [torch.zeros(2, 1, 16, 1, 4) for _ in range(2)]
        for t in kv:
            t[:, 0, 3:5] = 1.0
        kv[bad][:, 0, 3:5] = math.nan  # what the sidecar wrote in layer `bad`
        got = _parity(Ref(), None, None, None, meta, [torch.zeros_like(t) for t in kv], kv, want.clone())
        assert math.isnan(got["kv_rel_l2"]) and got["hidden_rel_l2"] == 0.0, (bad, got)


def test_mxfp8_weights_are_the_reference_s_too(tmp_path):
    """--weights mxfp8: the sidecar computes with its layer weights quantized to MXFP8; the engine ranks' reference
    kept the dense weights it drew, so every case failed parity on CPU (drift 3e-2, against a bound of 0) and on
    GPUs drifted by the quantization's error besides the kernels'. The reference must hold the same weights."""
    bc = BenchConfig(preset="tiny", reqs=(2,), contexts=(40,), dtype="fp32", repeats=1, out_dir=tmp_path,
                     weights="mxfp8")
    (row,) = run_tp_bench(bc, 2, single_gpu=False, device_type="cpu")["rows"]
    assert row["errors"] == 0 and row["parity_ok"], row
    assert row["hidden_rel_l2"] == 0.0 and row["kv_rel_l2"] == 0.0


def test_the_report_s_exchange_share_and_counts_are_over_every_rank(tmp_path):
    """The exchange is the slowest rank's (the step waits for it), its share is of the step's time; the errors
    are every rank's together, and the pre-launched share is the least any rank got (a step is early only
    where every rank's was)."""
    bc = BenchConfig(out_dir=tmp_path)
    single = {"rows": [{"mode": "d", "R": 8, "context": 4096, "p50_ms": 0.6, "floor_ms": 0.25}]}
    per_rank = [[_rank_row(exchange_p50_ms=0.3, errors=1, prelaunched_share=0.9)],
                [_rank_row(p50_ms=1.5, exchange_p50_ms=0.1, errors=2, prelaunched_share=0.5)]]
    row = _report(bc, 2, per_rank, single, "H200", PARITY_RTOL)["rows"][0]
    assert row["exchange_ms"] == 0.3 and row["exchange_share"] == pytest.approx(0.2), row
    assert row["errors"] == 3 and row["prelaunched_share"] == 0.5, row
    row = _report(bc, 2, per_rank[::-1], single, "H200", PARITY_RTOL)["rows"][0]  # the slowest exchange on rank 1
    assert row["exchange_ms"] == 0.3 and row["exchange_share"] == pytest.approx(0.2), row


def test_a_case_that_fails_parity_exits_1(tmp_path, monkeypatch, capsys):
    """`bench --tp N` is run by CI as a parity check: a failed case must be its exit status, not a line alone."""
    for ok, code in ((True, 0), (False, 1)):
        monkeypatch.setattr(bench_tp, "run_tp_bench", lambda bc, tp, single, dev: {
            "rows": [{"parity_ok": True}, {"parity_ok": ok}], "single_gpu_failed": []})
        assert cli.main(["bench", "--tp", "2", "--device", "cpu", "--preset", "tiny",
                         "--out-dir", str(tmp_path / "out")]) == code
        assert ("FAILED in 1 of 2 cases" in capsys.readouterr().out) is not ok


def test_a_case_without_a_step_time_is_written_as_strict_json(tmp_path):
    """A rank that answered no step leaves the row's step time NaN (and its ratios with it); json.dumps wrote that
    as a bare NaN, which strict JSON readers (JavaScript, Go, serde, jq --strict) refuse: the whole file unreadable
    for the failed case it was meant to report. The file carries null there; the row in memory keeps its NaN."""
    bc = BenchConfig(out_dir=tmp_path)
    single = {"rows": [{"mode": "d", "R": 8, "context": 4096, "p50_ms": 0.6, "floor_ms": 0.25}]}
    report = _report(bc, 2, [[_rank_row()], [_rank_row(p50_ms=math.nan, errors=5, hidden_rel_l2=math.nan)]],
                     single, "H200", PARITY_RTOL)

    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    written = json.loads((tmp_path / "bench-tp2.json").read_text(), parse_constant=refuse)["rows"][0]
    assert written["tp_step_p50_ms"] is None and written["hidden_rel_l2"] is None and written["exchange_share"] is None
    assert written["R"] == 8 and written["parity_ok"] is False
    assert math.isnan(report["rows"][0]["tp_step_p50_ms"])


def test_the_exchange_is_timed_as_ten_all_reduces_of_each_launch_group_s_rows(tmp_path, monkeypatch):
    """The partial-sum share: per launch group of up to 8 requests, two all-reduces per layer (o_proj's and
    down_proj's partials: 10 for 5 layers), each of the group's [7r, hidden] rows. An engine rank run here, in this
    process, at TP 1 against a one-rank sidecar, its exchange timer a stand-in that records what it was given."""
    import torch
    import torch.distributed as dist

    from dspark_sidecar.drafter.config import load_config

    seen = []

    def timer(xs, exchange, count, repeats):
        seen.append(([tuple(x.shape) for x in xs], count, repeats))
        return [0.25]

    monkeypatch.setattr(bench_tp, "_time_exchange", timer)
    bc = BenchConfig(preset="tiny", shard_of=1, reqs=(9,), contexts=(40,), dtype="fp32", repeats=1, out_dir=tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    side = SidecarUnderTest(bc, torch.device("cpu"), work)
    try:
        bench_tp._engine_rank(0, 1, bc, "cpu", str(side.sock), str(work / "store"), str(work))
    finally:
        if dist.is_initialized():  # the rank failed before it destroyed its group: not left to the next test
            dist.destroy_process_group()
        side.close()
    hidden = load_config("tiny").hidden_size
    assert seen == [([(7 * 8, hidden), (7 * 1, hidden)], 10, 1)]
    (row,) = torch.load(work / "rank0.pt")
    assert row["exchange_p50_ms"] == 0.25 and row["errors"] == 0 and row["hidden_rel_l2"] == 0.0
    side.discard()
