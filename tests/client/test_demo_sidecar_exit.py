"""The demo's own sidecar, really started: a clean run exits 0; one whose sidecar dies mid-run exits 1."""

from __future__ import annotations

import dataclasses
import tempfile

import pytest

from dspark_sidecar import cli
from dspark_sidecar.client import demo
from dspark_sidecar.client.harness import Fault, run_engine
from dspark_sidecar.client.launcher import SidecarLauncher

DEMO = ["demo", "--rounds", "4", "--tp", "1", "--required-tp", "1"]


@pytest.fixture
def own_sidecar(tiny_ckpt, tmp_path, monkeypatch):
    """The demo as the command runs it, at TP 1, on the session's checkpoint; its $TMPDIR is returned, and the
    sidecars it started are in `started`."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    monkeypatch.setattr(demo, "ensure_synthetic_checkpoint", lambda cfg, seed: tiny_ckpt)
    started: list[SidecarLauncher] = []

    class Recording(SidecarLauncher):
        def start(self) -> SidecarLauncher:
            started.append(self)
            return super().start()

    monkeypatch.setattr(demo, "SidecarLauncher", Recording)
    return scratch, started


def test_a_clean_run_with_its_own_sidecar_exits_0_and_leaves_nothing(own_sidecar, capsys):
    scratch, started = own_sidecar
    assert cli.main(DEMO) == 0, capsys.readouterr().err
    assert "forwarded to the sidecar: 4" in capsys.readouterr().out
    assert started[0].proc.returncode == 0 and list(scratch.iterdir()) == []


def test_a_sidecar_that_dies_mid_run_fails_the_demo(own_sidecar, monkeypatch, capsys):
    """Its rank crashed after two compared rounds: the rest fell back ("sidecar unreachable"), the two compared
    rounds matched, and the demo exited 0, its sidecar gone (exit 1) without a word in the verdict."""
    scratch, started = own_sidecar

    def crash(_round: int) -> None:
        started[0].kill_rank(0)
        started[0].proc.wait(timeout=60)  # the group goes down with its rank (server/launcher.launch: exit 1)

    def engine(h, work_dir):
        return run_engine(dataclasses.replace(h, faults=(Fault(2, "pause"),)), work_dir, on_pause=crash)

    monkeypatch.setattr(demo, "run_engine", engine)
    assert cli.main(DEMO) == 1
    out, err = capsys.readouterr()
    assert err.startswith("dspark-sidecar demo: FAILED: the sidecar exited mid-run with status 1"), err
    assert "2 of 4 rounds forwarded" in err, err
    (kept,) = scratch.iterdir()  # the log, named in the line; the socket folder removed
    assert (kept / "sidecar.log").exists() and str(kept / "sidecar.log") in err, err


def test_a_sidecar_that_stops_by_itself_mid_run_fails_the_demo_though_it_exits_0(own_sidecar, monkeypatch, capsys):
    """Stopped mid-run by another's SIGTERM (an operator, a supervisor), the sidecar drains and exits 0: the later
    rounds fell back ("sidecar unreachable"), the earlier ones matched, and the demo read its own stop's 0 and passed."""
    import signal

    scratch, started = own_sidecar

    def stopped_elsewhere(_round: int) -> None:
        started[0].proc.send_signal(signal.SIGTERM)
        assert started[0].proc.wait(timeout=60) == 0  # a clean drain: its status alone says nothing

    def engine(h, work_dir):
        return run_engine(dataclasses.replace(h, faults=(Fault(2, "pause"),)), work_dir, on_pause=stopped_elsewhere)

    monkeypatch.setattr(demo, "run_engine", engine)
    assert cli.main(DEMO) == 1
    out, err = capsys.readouterr()
    assert err.startswith("dspark-sidecar demo: FAILED: the sidecar exited mid-run with status 0"), err
    assert "2 of 4 rounds forwarded" in err, err
    (kept,) = scratch.iterdir()
    assert str(kept / "sidecar.log") in err, err
