"""What a demo leaves behind: no temporary folder (a failed run's log aside), no engine rank after SIGTERM."""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from dspark_sidecar import cli
from dspark_sidecar.client import demo
from dspark_sidecar.client.demo import DemoConfig, DemoError, run_demo
from dspark_sidecar.drafter.checkpoint import CheckpointError


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """The demo's $TMPDIR (what is left in it, a run left behind), and no checkpoint to write."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(demo, "ensure_synthetic_checkpoint", lambda cfg, seed: (Path("/nonexistent/dspark"),
                                                                                 Path("/nonexistent/target")))
    return tmp_path


class FakeLauncher:
    """SidecarLauncher's part the demo uses; `fail` makes start() write a log line and raise."""

    made: list[FakeLauncher] = []
    fail = False
    exited = False  # no process: none that could have ended before stop()

    def __init__(self, socket_dir, tp=4, log_path=None, **_kw) -> None:
        self.log_path, self.stopped = Path(log_path) if log_path else None, False
        FakeLauncher.made.append(self)

    def start(self) -> FakeLauncher:
        if self.fail:
            self.log_path.write_text("rank 0: Traceback ...\n")
            raise RuntimeError("sidecar exited with 1")
        return self

    def status(self, rank: int = 0):
        return SimpleNamespace(backend="reference", fast_path_refusal="")

    def stop(self) -> int:
        self.stopped = True
        return 0


@pytest.fixture
def fake_launcher(monkeypatch):
    monkeypatch.setattr(demo, "SidecarLauncher", FakeLauncher)
    FakeLauncher.made, FakeLauncher.fail = [], False
    return FakeLauncher


def test_no_sidecar_at_use_running_sidecar_s_folder_leaves_no_folder(scratch):
    """Each such run left an empty dspark-demo-* folder in $TMPDIR (kept "for its log", which it never held)."""
    with tempfile.TemporaryDirectory(prefix="dsp-", dir="/tmp") as empty:
        with pytest.raises(DemoError, match="no sidecar status"):
            run_demo(DemoConfig(rounds=1, tp=1, required_tp=1, socket_dir=empty, start_sidecar=False), out=lambda _: None)
    assert list(scratch.iterdir()) == []


def test_a_checkpoint_that_cannot_be_written_leaves_no_folder(scratch, monkeypatch):
    """Both folders were made before the checkpoint was written, outside the clean-up."""
    def full(cfg, seed):
        raise CheckpointError("/tmp/dspark-sidecar/tiny-seed0: cannot write the synthetic checkpoint (No space left)")

    monkeypatch.setattr(demo, "ensure_synthetic_checkpoint", full)
    with pytest.raises(CheckpointError):
        run_demo(DemoConfig(rounds=1, tp=1, required_tp=1), out=lambda _: None)
    assert list(scratch.iterdir()) == []


def test_a_sidecar_that_did_not_start_keeps_its_log_and_no_socket_folder(scratch, fake_launcher):
    """Its log stays, named in the error; the socket folder (no log in it) stayed too, for nothing."""
    fake_launcher.fail = True
    with pytest.raises(DemoError) as err:
        run_demo(DemoConfig(rounds=1, tp=1, required_tp=1), out=lambda _: None)
    (kept,) = scratch.iterdir()
    assert kept.name.startswith("dspark-demo-") and [p.name for p in kept.iterdir()] == ["sidecar.log"]
    assert str(kept / "sidecar.log") in str(err.value)
    assert fake_launcher.made[0].stopped


def test_sigterm_stops_the_engine_ranks_and_the_sidecar_and_removes_the_folders(scratch, fake_launcher, monkeypatch):
    """SIGTERM (`timeout`, a cancelled CI job) killed the demo at once: its engine ranks went on drafting every
    round locally, orphaned, and both temporary folders stayed. Now it unwinds: run_engine's finally kills
    the ranks, the sidecar is stopped, the folders go, and the exit status is 143 (128 + SIGTERM)."""
    unwound = []

    def engine(h, work_dir):
        Path(work_dir).mkdir(parents=True)
        (Path(work_dir) / "rank0.json").write_text("{}")
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(3)  # the ranks' join: a SIGTERM ends it
        finally:
            unwound.append("ranks killed")
        raise AssertionError("SIGTERM did not stop the demo")

    def caller_s(signum, frame):  # stands for the default action, which would end pytest too
        pass

    monkeypatch.setattr(demo, "run_engine", engine)
    before = signal.signal(signal.SIGTERM, caller_s)
    try:
        with pytest.raises(SystemExit) as stopped:
            cli.main(["demo", "--rounds", "1", "--tp", "1", "--required-tp", "1"])
        assert signal.getsignal(signal.SIGTERM) is caller_s  # the command's handler ends with the demo
    finally:
        signal.signal(signal.SIGTERM, before)
    assert stopped.value.code == 128 + signal.SIGTERM
    assert unwound == ["ranks killed"] and fake_launcher.made[0].stopped
    assert list(scratch.iterdir()) == []


def test_an_interrupted_demo_removes_its_folders(scratch, fake_launcher, monkeypatch):
    """Ctrl-C: the folders stayed "for the log" of a run that did not fail, and nothing said where."""
    def engine(h, work_dir):
        Path(work_dir).mkdir(parents=True)
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "run_engine", engine)
    with pytest.raises(KeyboardInterrupt):
        run_demo(DemoConfig(rounds=1, tp=1, required_tp=1), out=lambda _: None)
    assert fake_launcher.made[0].stopped and list(scratch.iterdir()) == []


def test_a_socket_folder_another_sidecar_serves_names_no_log_it_never_wrote(scratch):
    """The launcher refuses a folder where a sidecar already answers before it starts anything (no log written),
    yet the line said "its log: .../sidecar.log", a file that never was, in a folder then removed as empty."""
    from helpers.engine_fakes import FakeServer, FakeSidecar

    with tempfile.TemporaryDirectory(prefix="dsp-", dir="/tmp") as folder:  # not in $TMPDIR (scratch)
        other = FakeServer(FakeSidecar(0, 1), Path(folder) / "rank0.sock").start()
        try:
            with pytest.raises(DemoError, match="a sidecar already answers") as err:
                run_demo(DemoConfig(rounds=1, tp=1, required_tp=1, socket_dir=folder), out=lambda _: None)
        finally:
            other.stop()
    assert "its log" not in str(err.value), err.value
    assert list(scratch.iterdir()) == []


@pytest.mark.parametrize("over", [dict(dtype="fp16"), dict(tp=0)])
def test_a_config_the_harness_refuses_leaves_no_folder(scratch, fake_launcher, over):
    """The harness's own checks (DemoConfig leaves the dtype and the TP to them) raised after both folders were
    made and before the clean-up: two folders in $TMPDIR per call."""
    with pytest.raises(ValueError):
        run_demo(DemoConfig(rounds=1, required_tp=1, **over), out=lambda _: None)
    assert list(scratch.iterdir()) == [] and fake_launcher.made == []


def test_an_engine_failure_at_use_running_sidecar_s_folder_leaves_no_folder(scratch, fake_launcher, monkeypatch):
    """Kept "for its log" when the run ended in an error, but a --use-running-sidecar run writes no log: each
    engine failure (a rank that raised, the harness's timeout) left a dspark-demo-* folder in $TMPDIR holding only
    the ranks' rendezvous file and pause folder, named nowhere."""
    def engine(h, work_dir):
        (Path(work_dir) / "control").mkdir(parents=True)
        (Path(work_dir) / "store").write_text("")
        raise RuntimeError("engine rank 1 raised")

    monkeypatch.setattr(demo, "run_engine", engine)
    with tempfile.TemporaryDirectory(prefix="dsp-", dir="/tmp") as running:
        with pytest.raises(RuntimeError, match="engine rank 1 raised"):
            run_demo(DemoConfig(rounds=1, tp=1, required_tp=1, socket_dir=running, start_sidecar=False),
                     out=lambda _: None)
    assert list(scratch.iterdir()) == []
    # Its own sidecar's run still keeps the folder, for the log in it (the real launcher's start writes one).
    monkeypatch.setattr(FakeLauncher, "start", lambda self: self.log_path.write_text("rank 0: SERVING\n") and self)
    with pytest.raises(RuntimeError, match="engine rank 1 raised"):
        run_demo(DemoConfig(rounds=1, tp=1, required_tp=1), out=lambda _: None)
    (kept,) = scratch.iterdir()
    assert kept.name.startswith("dspark-demo-") and (kept / "sidecar.log").exists()
