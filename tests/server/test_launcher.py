"""server/launcher.py with real rank processes: a rank that refuses to start stops the group with its own code."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dspark_sidecar.server.config import ServeConfig
from dspark_sidecar.server.launcher import EXIT_TEMPFAIL, EXIT_USAGE, launch
from helpers.engine_fakes import short_socket_dir
from helpers.waiting import wait_until


def _launch_and_stop_once_up(tmp_path: Path, caplog) -> int:
    """launch() of two fake ranks that each touch tmp_path/up-RANK, with this process sent SIGTERM (the stop)
    once both have: a stop during start-up, by state rather than by time. The launcher's exit code."""
    def stop_once_up() -> None:
        deadline = time.monotonic() + 30
        while len(list(tmp_path.glob("up-*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_once_up, daemon=True).start()
    with caplog.at_level(logging.INFO, logger="dspark_sidecar.launcher"):
        return launch(ServeConfig(tp=2, socket_dir=tmp_path), [], on_ready=lambda: False, poll_s=0.05)


def _fake_ranks(monkeypatch, script: str) -> None:
    """The launcher's rank processes run `script` (python -c) instead of `serve`."""
    from dspark_sidecar.server import launcher

    real_popen = subprocess.Popen
    monkeypatch.setattr(launcher.subprocess, "Popen",
                        lambda argv, **kw: real_popen([sys.executable, "-c", script], **kw))


def _serving_rank(tmp_path, on_sigterm: str) -> str:
    """A serving rank's script: `on_sigterm` is its SIGTERM handler (an expression), it marks
    tmp_path/ready-RANK once the handler is set, then idles."""
    return ("import os, signal, sys, time, pathlib\n"
            f"signal.signal(signal.SIGTERM, {on_sigterm})\n"
            f"pathlib.Path({str(tmp_path)!r}, 'ready-' + os.environ['RANK']).touch()\n"
            "while True: time.sleep(0.05)\n")


def _ready_when_both_marked(tmp_path, serving: threading.Event):
    """An on_ready probe: True (and `serving` set) once both ranks marked themselves ready."""
    def on_ready() -> bool:
        if len(list(tmp_path.glob("ready-*"))) < 2:
            return False
        serving.set()
        return True

    return on_ready


def _sigterm_once_serving(serving: threading.Event, after_s: float = 0.0) -> None:
    """Stop the launcher (SIGTERM to this process, as a supervisor would) once `serving` is set, after_s later."""
    def stop() -> None:
        serving.wait(30)
        time.sleep(after_s)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop, daemon=True).start()


def _stop_once_serving(tmp_path, monkeypatch, caplog, on_sigterm: str) -> int:
    """launch() of two fake ranks (_serving_rank with `on_sigterm`), SIGTERMed once both serve; its exit code, its
    lines in caplog."""
    _fake_ranks(monkeypatch, _serving_rank(tmp_path, on_sigterm))
    serving = threading.Event()
    _sigterm_once_serving(serving)
    with caplog.at_level(logging.INFO, logger="dspark_sidecar.launcher"):
        return launch(ServeConfig(tp=2, socket_dir=tmp_path, drain_s=0.0), [],
                      on_ready=_ready_when_both_marked(tmp_path, serving), poll_s=0.05)


@pytest.mark.parametrize("poll_s", [0.2, 4.0])
def test_a_rank_that_refuses_to_start_stops_the_group_with_exit_2_and_no_second_line(caplog, capfd, poll_s):
    # The parent checks flags, sockets and ports before launch; a rank can still refuse (a port taken
    # in between). Its one line is enough: the launcher used to add "rank N exited with code 2" and
    # exit 1, as for a crash. Here every rank refuses --seed -5 (range-checked when a rank parses).
    # With a slow poll both ranks have exited before the launcher looks again: that case returned 1
    # (the group's "all exited" branch came before the refusal's), as it did on a loaded CI box.
    sock = short_socket_dir()
    argv = ["serve", "--tp", "2", "--device", "cpu", "--socket-dir", str(sock), "--seed", "-5"]
    with caplog.at_level(logging.INFO, logger="dspark_sidecar.launcher"):
        code = launch(ServeConfig(tp=2, socket_dir=sock), argv, on_ready=lambda: False, poll_s=poll_s)  # never serving
    assert code == EXIT_USAGE == 2
    assert "exited with code" not in caplog.text and "refused to start" in caplog.text
    err = capfd.readouterr().err
    assert "--seed" in err and "Traceback" not in err
    assert not list(sock.glob("*.sock"))


def test_a_port_taken_between_the_parent_s_check_and_the_rank_s_bind_exits_75(caplog, capfd):
    """The race the parent's check cannot close: a rank meets its gRPC port taken. That may pass (a
    previous instance still letting go), so the group exits 75 (EX_TEMPFAIL), which systemd restarts,
    not 2, which its unit never restarts; still with the rank's one line and none from the launcher."""
    import socket

    sock = short_socket_dir()
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        argv = ["serve", "--tp", "1", "--device", "cpu", "--socket-dir", str(sock), "--tcp-base-port", str(port)]
        with caplog.at_level(logging.INFO, logger="dspark_sidecar.launcher"):
            code = launch(ServeConfig(tp=1, socket_dir=sock, tcp_base_port=port), argv, on_ready=lambda: False)
    assert code == EXIT_TEMPFAIL == 75
    assert "exited with code" not in caplog.text and "refused to start" in caplog.text
    err = capfd.readouterr().err
    assert "--tcp-base-port: " in err and str(port) in err and "Traceback" not in err, err


def test_a_stop_during_the_probe_that_finds_the_group_serving_drains_it_and_exits_0(tmp_path, monkeypatch):
    """SIGTERM while on_ready() runs, and on_ready then reports the group serving: the ranks drain
    (serving ranks take drain_s and the teardown). The launcher used to keep the start-up stop bound
    it set when the signal came (STARTUP_STOP_S), kill the draining ranks when it passed, and exit 1
    ("ranks still running 60 s after SIGTERM")."""
    from dspark_sidecar.server import launcher

    monkeypatch.setattr(launcher, "STARTUP_STOP_S", 0.5)
    # A serving rank: it marks its SIGTERM handler installed, then drains for 1.5 s and exits 0.
    _fake_ranks(monkeypatch, _serving_rank(tmp_path, "lambda *a: (time.sleep(1.5), sys.exit(0))"))

    def on_ready() -> bool:
        if len(list(tmp_path.glob("ready-*"))) < 2:
            return False
        os.kill(os.getpid(), signal.SIGTERM)  # handled here, inside the probe, before it returns
        return True

    code = launch(ServeConfig(tp=2, socket_dir=tmp_path), [], on_ready=on_ready, poll_s=0.05)
    assert code == 0, "the draining ranks were killed as if still starting"


def test_a_stop_before_the_ranks_set_their_handlers_exits_0(tmp_path, monkeypatch, caplog):
    """SIGTERM (or Ctrl-C) within the first seconds of `serve`: the ranks are still importing torch, before
    serve_rank sets their handlers, so the launcher's SIGTERM ends them by the default action (-15).
    README: during start-up `serve` ends the ranks "also with exit 0"; the launcher counted -15 as a
    failed rank and exited 1, silently (about 2-6 s into a start on a loaded 2-core host)."""
    # A rank still importing: no handler of its own, it only marks that it runs. Not ended by the stop, it
    # exits 3 by itself, which the launcher counts as a failure (the test says so by state, not by time).
    rank = ("import os, pathlib, sys, time\n"
            f"pathlib.Path({str(tmp_path)!r}, 'up-' + os.environ['RANK']).touch()\n"
            "time.sleep(60)\n"
            "sys.exit(3)\n")
    _fake_ranks(monkeypatch, rank)

    code = _launch_and_stop_once_up(tmp_path, caplog)
    assert code == 0, "ranks ended by the stop's own SIGTERM were counted as failures"
    # Ended by the stop's SIGTERM, not by the start-up stop's kill (STARTUP_STOP_S later).
    assert "killing them" not in caplog.text, caplog.text


def test_a_serving_group_s_stop_waits_out_a_long_drain(tmp_path, monkeypatch):
    """--drain-s accepts up to 300 s, and a serving rank's stop takes --drain-s plus its teardown. The
    launcher's kill came a fixed DRAIN_GRACE_S after SIGTERM, whatever the drain: a drain longer than
    that was cut short and `serve` exited 1. Here the grace past the drain is 0.5 s, the ranks drain for 2 s."""

    from dspark_sidecar.server import launcher

    monkeypatch.setattr(launcher, "DRAIN_GRACE_S", 0.5)
    # Shorter than the drain: a serving group stopped under the start-up bound is killed inside it.
    monkeypatch.setattr(launcher, "STARTUP_STOP_S", 0.5)
    # A serving rank: handler set, drains for 2 s (inside its --drain-s of 30 s), then exits 0. A drain as long as
    # --drain-s left the rank's exit half a second (the grace) before the kill: a loaded box's late handler ran past.
    _fake_ranks(monkeypatch, _serving_rank(tmp_path, "lambda *a: (time.sleep(2.0), sys.exit(0))"))
    serving = threading.Event()
    on_ready = _ready_when_both_marked(tmp_path, serving)

    _sigterm_once_serving(serving, after_s=0.2)
    code = launch(ServeConfig(tp=2, socket_dir=tmp_path, drain_s=30.0), [], on_ready=on_ready, poll_s=0.05)
    assert code == 0, "the ranks were killed inside their drain"


def test_a_second_stop_signal_does_not_push_back_the_kill_of_wedged_ranks(tmp_path, monkeypatch):
    """Ranks that do not end on SIGTERM (wedged in their teardown) are killed --drain-s + DRAIN_GRACE_S
    after the stop. Every further SIGTERM or Ctrl-C to the launcher restarted that wait: a user pressing
    Ctrl-C again because the stop seemed stuck (or a supervisor repeating its SIGTERM) got a later kill,
    and one repeating it often enough none. Here the grace is 1 s and a SIGTERM comes every 0.4 s until the
    launcher returns (at most SIGNALS of them): it must return while they still come, not once they stop."""

    from dspark_sidecar.server import launcher

    monkeypatch.setattr(launcher, "DRAIN_GRACE_S", 1.0)
    _fake_ranks(monkeypatch, _serving_rank(tmp_path, "signal.SIG_IGN"))  # wedged: never ends by itself
    serving, returned = threading.Event(), threading.Event()
    sent = []
    on_ready = _ready_when_both_marked(tmp_path, serving)
    SIGNALS = 25  # 10 s of them: far past the 1 s grace, so only a kill pushed back by each one waits them out

    def stop_again_and_again() -> None:
        serving.wait(30)
        for _ in range(SIGNALS):
            if returned.is_set():
                return
            os.kill(os.getpid(), signal.SIGTERM)
            sent.append(1)
            time.sleep(0.4)

    # The launcher puts back the handler it found: the signals still coming after it returned land here.
    late = []
    before = signal.signal(signal.SIGTERM, lambda *a: late.append(1))
    try:
        th = threading.Thread(target=stop_again_and_again, daemon=True)
        th.start()
        code = launch(ServeConfig(tp=2, socket_dir=tmp_path, drain_s=0.0), [], on_ready=on_ready, poll_s=0.05)
        sent_by_then = len(sent)
        returned.set()
        th.join(timeout=10)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert code == 1  # the ranks had to be killed
    assert 1 <= sent_by_then < SIGNALS, f"killed only after the last of {sent_by_then} SIGTERMs: each pushed it back"


def test_the_process_to_exit_with_going_stops_a_serving_group_as_sigterm_does(tmp_path, monkeypatch, caplog):
    """--exit-with-pid: once that process has gone (here a stand-in for processes.ExitWith, gone once the
    group serves), the ranks get SIGTERM and drain, the launcher says why in one line and exits 0.
    tests/client/test_launcher_parent_death.py runs the same with a real starter SIGKILLed."""
    from dspark_sidecar.server import launcher

    serving = threading.Event()

    class GoneOnceServing:
        def __init__(self, pid: int) -> None:
            self.pid = pid

        def gone(self) -> bool:
            return serving.is_set()

    monkeypatch.setattr(launcher, "ExitWith", GoneOnceServing)
    stopped = f"pathlib.Path({str(tmp_path)!r}, 'stopped-' + os.environ['RANK']).touch()"
    _fake_ranks(monkeypatch, _serving_rank(tmp_path, f"lambda *a: ({stopped}, sys.exit(0))"))
    with caplog.at_level(logging.INFO, logger="dspark_sidecar.launcher"):
        code = launch(ServeConfig(tp=2, socket_dir=tmp_path, exit_with_pid=4242), [],
                      on_ready=_ready_when_both_marked(tmp_path, serving), poll_s=0.05)
    assert code == 0
    assert sorted(p.name for p in tmp_path.glob("stopped-*")) == ["stopped-0", "stopped-1"]  # drained, not killed
    assert [r.getMessage() for r in caplog.records] == [
        "the process this sidecar exits with (--exit-with-pid 4242) has gone; stopping the ranks"]


def test_the_rendezvous_port_the_launcher_picks_is_none_of_the_ranks_own_ports(monkeypatch):
    """With --master-port 0 the launcher asks the kernel for a free port, and the ranks' gRPC and metrics
    ports are free too until they bind them: the kernel's pick could be one of them (ports in its
    ephemeral range, 50051 say), and then rank 0's store and that rank's listener met on it, the second
    refusing to start (exit 75, "--master-port ... choose another port" for a port nobody chose). Here
    the kernel offers rank 1's gRPC port, then rank 0's metrics port, then a port of nobody's."""
    import types

    from dspark_sidecar.server import launcher

    cfg = ServeConfig(tp=2, socket_dir=short_socket_dir(), tcp_base_port=50051, metrics_port=50061)
    picks = iter([50052, 50061, 50099])

    class Kernel:  # a socket whose bind to port 0 gets the next of `picks`
        def __init__(self, *a):
            self.port = None

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, addr):
            assert addr == ("127.0.0.1", 0)
            self.port = next(picks)

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(launcher, "socket", types.SimpleNamespace(socket=Kernel, AF_INET=2, SOCK_STREAM=1))
    ports = []
    real_popen = subprocess.Popen

    def rank(argv, env, **kw):
        ports.append(env["MASTER_PORT"])
        return real_popen([sys.executable, "-c", "pass"], env=env, **kw)  # exits at once: the launch ends

    monkeypatch.setattr(launcher.subprocess, "Popen", rank)
    launch(cfg, ["serve"], on_ready=lambda: False)
    assert ports == ["50099", "50099"]


def test_a_rank_that_cannot_be_spawned_takes_down_the_ranks_already_started(tmp_path, monkeypatch):
    """The ranks were spawned before the try whose finally terminates them: a Popen that raised for rank 1
    (fork's EAGAIN under a process limit, ENOMEM) left rank 0 running, waiting for a rendezvous that never
    came, and the launcher's caller got the exception with a child it could not reach."""
    from dspark_sidecar.server import launcher

    real_popen = subprocess.Popen
    started = []

    def popen(argv, **kw):
        if started:
            raise BlockingIOError(11, "Resource temporarily unavailable")
        started.append(real_popen([sys.executable, "-c", "import time; time.sleep(120)"], **kw))
        return started[-1]

    monkeypatch.setattr(launcher.subprocess, "Popen", popen)
    try:
        with pytest.raises(BlockingIOError):
            launch(ServeConfig(tp=2, socket_dir=tmp_path), [], on_ready=lambda: False)
        (rank0,) = started
        assert rank0.poll() is not None, "rank 0 was left running"
    finally:
        for p in started:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_stop_while_the_ranks_are_spawned_stops_the_spawning_and_exits_0(tmp_path, monkeypatch, caplog):
    """SIGTERM between two ranks' spawns (a supervisor's stop right after its start): the launcher set its
    handlers only once every rank was spawned, so the signal took the default action and killed it (exit
    -15, the ranks left to notice their parent's death). Now the stop is the launcher's: rank 1 is never
    spawned, rank 0 is stopped at once (not at the start-up stop's kill), exit 0. Here a handler of the
    test's stands for the default action, and rank 0 would exit 3 by itself after 60 s: ended by -SIGTERM with
    no start-up kill logged, it got the launcher's SIGTERM at once."""
    from dspark_sidecar.server import launcher

    monkeypatch.setattr(launcher, "STARTUP_STOP_S", 30.0)
    real_popen = subprocess.Popen
    started = []

    def popen(argv, **kw):
        started.append(real_popen([sys.executable, "-c", "import sys, time; time.sleep(60); sys.exit(3)"], **kw))
        os.kill(os.getpid(), signal.SIGTERM)  # the stop comes inside Popen, once rank 0 is spawned
        return started[-1]

    monkeypatch.setattr(launcher.subprocess, "Popen", popen)
    missed = []
    before = signal.signal(signal.SIGTERM, lambda *a: missed.append(1))
    try:
        with caplog.at_level(logging.INFO, logger="dspark_sidecar.launcher"):
            code = launch(ServeConfig(tp=2, socket_dir=tmp_path), [], on_ready=lambda: False, poll_s=0.05)
    finally:
        signal.signal(signal.SIGTERM, before)
        for p in started:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert not missed and code == 0 and len(started) == 1
    assert "killing them" not in caplog.text, "rank 0 never got the launcher's SIGTERM: the start-up stop killed it"
    assert started[0].returncode == -signal.SIGTERM, started[0].returncode


def test_a_rank_that_failed_during_a_start_up_stop_is_not_hidden_by_the_kill_of_a_wedged_peer(tmp_path, monkeypatch,
                                                                                               caplog):
    """A stop during start-up: rank 0 exits 1 by itself (a failure, its own traceback), rank 1 is blocked where no
    handler runs and is killed STARTUP_STOP_S later. With every rank exiting by itself the launcher said 1; with
    one killed it returned 0 whatever the others' codes, so the failed rank went unreported."""
    import types

    from dspark_sidecar.server import launcher

    monkeypatch.setattr(launcher, "STARTUP_STOP_S", 0.5)
    rank = ("import os, pathlib, signal, sys, time\n"
            "signal.signal(signal.SIGTERM, (lambda *a: sys.exit(1)) if os.environ['RANK'] == '0' else signal.SIG_IGN)\n"
            f"pathlib.Path({str(tmp_path)!r}, 'up-' + os.environ['RANK']).touch()\n"
            "time.sleep(60)\n")
    _fake_ranks(monkeypatch, rank)
    started: list[subprocess.Popen] = []
    spawn = launcher.subprocess.Popen
    monkeypatch.setattr(launcher.subprocess, "Popen",
                        lambda argv, **kw: started.append(spawn(argv, **kw)) or started[-1])
    # The launcher's clock stands still until its poll has seen rank 0's exit: the kill STARTUP_STOP_S into the stop
    # then comes after that exit however late a loaded box runs rank 0's handler. A kill first ended rank 0 as one of
    # the stop's, and the launcher rightly said 0: the case this test is about never came.
    frozen = time.monotonic()
    monkeypatch.setattr(launcher, "time", types.SimpleNamespace(
        monotonic=lambda: time.monotonic() if started and started[0].returncode is not None else frozen,
        sleep=time.sleep))

    code = _launch_and_stop_once_up(tmp_path, caplog)
    assert "killing them" in caplog.text, caplog.text  # rank 1 was killed, as a start-up stop does
    assert code == 1, "rank 0's exit 1 was reported as a clean stop"


def _ranks_with_a_slow_probe(monkeypatch, script: str):
    """The launcher's ranks run `script`; the on_ready probe returned only once every rank has exited (a probe
    that took its time: up to 1 s a rank on a loaded host), so the launcher's next look finds them all gone."""
    from dspark_sidecar.server import launcher

    real_popen = subprocess.Popen
    started: list[subprocess.Popen] = []

    def popen(argv, **kw):
        started.append(real_popen([sys.executable, "-c", script], **kw))
        return started[-1]

    monkeypatch.setattr(launcher.subprocess, "Popen", popen)

    def on_ready() -> bool:
        for p in started:
            p.wait(timeout=60)
        return False

    return on_ready


def test_the_rank_named_for_a_failed_start_is_the_one_that_failed_not_a_peer_it_took_down(tmp_path, monkeypatch,
                                                                                             caplog):
    """Rank 1 dies during start-up by a signal (the OOM killer's SIGKILL: it prints no line of its own); rank 0,
    its peer in a start-up collective, then exits 1 by itself (PeerLost: "a peer rank left during start-up").
    Seen gone in the same look, the launcher named the lowest rank, rank 0 with code 1, and the rank that failed
    appeared nowhere in the log."""
    rank = ("import os, pathlib, signal, sys, time\n"
            f"d = pathlib.Path({str(tmp_path)!r})\n"
            "if os.environ['RANK'] == '1':\n"
            "    (d / 'dying-1').touch()\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n"
            "deadline = time.monotonic() + 30\n"
            "while not (d / 'dying-1').exists() and time.monotonic() < deadline:\n"
            "    time.sleep(0.02)\n"
            "sys.exit(1)\n")
    on_ready = _ranks_with_a_slow_probe(monkeypatch, rank)
    with caplog.at_level(logging.INFO, logger="dspark_sidecar.launcher"):
        code = launch(ServeConfig(tp=2, socket_dir=tmp_path), [], on_ready=on_ready, poll_s=0.05)
    assert code == 1
    assert "sidecar rank 1 exited with code -9; stopping the group" in caplog.text, caplog.text


def test_a_rank_that_fails_during_the_stop_of_a_serving_group_is_named(tmp_path, monkeypatch, caplog):
    """A serving group stopped: rank 0 drains and exits 0, rank 1 dies in its drain (here it exits 3; the OOM
    killer's -9 alike). The launcher exited 1 with no line at all: nothing said which rank failed, or how."""
    rank1 = "sys.exit(3) if os.environ['RANK'] == '1' else sys.exit(0)"
    code = _stop_once_serving(tmp_path, monkeypatch, caplog, f"lambda *a: {rank1}")
    assert code == 1
    assert "sidecar rank 1 exited with code 3 during the stop" in caplog.text, caplog.text
    assert "rank 0" not in caplog.text, caplog.text


def test_a_serving_rank_that_dies_of_the_stop_s_own_signal_is_named(tmp_path, monkeypatch, caplog):
    """A serving rank handles SIGTERM (it drains), and ignores it past its teardown (cli._ignore_stop_signals): one
    that dies of it all the same (-15, or -2 of a Ctrl-C) had no handler where it must, and never drained. Only a
    rank still starting ends so as the stop asks; a serving one is a failed stop, named, exit 1."""
    code = _stop_once_serving(tmp_path, monkeypatch, caplog, "signal.SIG_DFL")
    assert code == 1
    assert ("sidecar rank 0 exited with code -15; sidecar rank 1 exited with code -15 during the stop"
            in caplog.text), caplog.text


def test_a_rank_blocked_during_a_start_up_stop_is_killed_at_the_bound_not_a_grace_later(tmp_path, monkeypatch,
                                                                                         caplog):
    """A rank blocked where no handler runs (torch's rendezvous connect) is killed once STARTUP_STOP_S has passed
    since the stop ("within about 3 s", README): at once, not sent SIGTERM again and given another grace."""
    from dspark_sidecar.server import launcher

    monkeypatch.setattr(launcher, "STARTUP_STOP_S", 0.5)
    rank = ("import os, pathlib, signal, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            f"pathlib.Path({str(tmp_path)!r}, 'up-' + os.environ['RANK']).touch()\n"
            "time.sleep(60)\n")
    _fake_ranks(monkeypatch, rank)
    graces: list[float] = []
    terminate = launcher._terminate
    monkeypatch.setattr(launcher, "_terminate", lambda procs, grace_s=10.0: (graces.append(grace_s),
                                                                            terminate(procs, grace_s))[1])
    code = _launch_and_stop_once_up(tmp_path, caplog)
    assert code == 0 and "killing them" in caplog.text, caplog.text
    assert graces[0] == 0.0, graces  # (then the finally's, which finds every rank gone)


@pytest.mark.parametrize("probe", [True, False], ids=["a-peer-dies", "no-probe"])
def test_a_serving_rank_stopped_by_the_launcher_drains_before_any_kill(tmp_path, monkeypatch, caplog, probe):
    """A serving rank that the launcher stops drains (here 0.5 s, then marks itself stopped) and is killed only past
    its grace: when a peer has died (10 s), and for launch() without an on_ready probe, which assumes the group
    serves (--drain-s + DRAIN_GRACE_S, not the start-up bound, patched to 0.1 s here)."""
    from dspark_sidecar.server import launcher

    monkeypatch.setattr(launcher, "STARTUP_STOP_S", 0.1)
    rank = ("import os, pathlib, signal, sys, time\n"
            f"d = pathlib.Path({str(tmp_path)!r})\n"
            "r = os.environ['RANK']\n"
            "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(0.5), (d / ('stopped-' + r)).touch(), sys.exit(0)))\n"
            + _RANK_1_ENDS_ONCE_SERVING.format(end="sys.exit(3)" if probe else "pass"))
    _fake_ranks(monkeypatch, rank)
    if probe:  # rank 1 dies once the group serves; the launcher stops rank 0
        assert _launch_until_a_rank_dies(tmp_path, caplog) == 1
        assert sorted(p.name for p in tmp_path.glob("stopped-*")) == ["stopped-0"]
        return

    def stop_once_up() -> None:  # both ranks up (their handlers set): SIGTERM to this process, as a supervisor's
        wait_until(lambda: len(list(tmp_path.glob("ready-*"))) == 2, 30, "both ranks up", interval_s=0.02)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_once_up, daemon=True).start()
    assert launch(ServeConfig(tp=2, socket_dir=tmp_path, drain_s=0.0), [], poll_s=0.05) == 0
    assert sorted(p.name for p in tmp_path.glob("stopped-*")) == ["stopped-0", "stopped-1"], "killed mid-drain"


def test_a_rank_that_dies_while_the_group_serves_is_named_and_takes_the_group_down(tmp_path, monkeypatch, caplog):
    """Rank 1 exits by itself while the group serves (here with code 2, which a start-up refusal also has):
    the launcher names it, stops rank 0 and exits 1, so a supervisor restarts the group. Passing the 2 on
    (a refusal's code, which systemd's unit never restarts) or not looking at the ranks once serving left a
    group that can never step again running, or stopped for good."""
    rank = ("import os, pathlib, signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
            f"d = pathlib.Path({str(tmp_path)!r})\n"
            "r = os.environ['RANK']\n"
            + _RANK_1_ENDS_ONCE_SERVING.format(end="sys.exit(2)"))
    _fake_ranks(monkeypatch, rank)
    assert _launch_until_a_rank_dies(tmp_path, caplog) == 1
    assert [r.getMessage() for r in caplog.records] == [
        "sidecar rank 1 exited with code 2; stopping the group (2 ranks)"], caplog.text


# The tail of a fake rank's script for _launch_until_a_rank_dies (`d`: the folder, `r`: the RANK, os and time
# imported): marks itself ready; rank 1 then waits for the launcher to see the group serving and ends with `end`.
_RANK_1_ENDS_ONCE_SERVING = ("(d / ('ready-' + r)).touch()\n"
                             "if r == '1':\n"
                             "    deadline = time.monotonic() + 30\n"
                             "    while not (d / 'serving').exists() and time.monotonic() < deadline:\n"
                             "        time.sleep(0.02)\n"
                             "    {end}\n"
                             "while True: time.sleep(0.05)\n")


def _launch_until_a_rank_dies(folder, caplog) -> int:
    """launch() of two fake ranks in `folder` whose rank 1 ends once `folder/serving` exists, made here as soon as
    the launcher sees the group serving; the launcher's code. A launcher that never notices is SIGTERMed after
    30 s, so the test fails rather than hangs."""
    serving = threading.Event()
    ready = _ready_when_both_marked(folder, serving)

    def on_ready() -> bool:
        if ready():
            (folder / "serving").touch()  # rank 1 ends only once the launcher has seen the group serving
            return True
        return False

    returned = threading.Event()

    def hang_guard() -> None:
        if not returned.wait(30):
            os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=hang_guard, daemon=True).start()
    try:
        with caplog.at_level(logging.INFO, logger="dspark_sidecar.launcher"):
            return launch(ServeConfig(tp=2, socket_dir=folder, drain_s=0.0), [], on_ready=on_ready, poll_s=0.05)
    finally:
        returned.set()


def test_the_kill_of_a_wedged_serving_rank_names_it_and_a_rank_that_failed_in_its_drain(tmp_path, monkeypatch, caplog):
    """A serving group stopped: rank 0 fails in its drain (exits 3), rank 1 is wedged and killed --drain-s +
    DRAIN_GRACE_S later. The launcher's one line was "ranks still running 60 s after SIGTERM": neither the
    wedged rank nor the failed one was named (the docstring and a stop without the kill name both)."""
    from dspark_sidecar.server import launcher

    monkeypatch.setattr(launcher, "DRAIN_GRACE_S", 0.5)
    on_sigterm = "(lambda *a: sys.exit(3)) if os.environ['RANK'] == '0' else signal.SIG_IGN"
    code = _stop_once_serving(tmp_path, monkeypatch, caplog, on_sigterm)
    assert code == 1
    assert "rank(s) [1] still running" in caplog.text and "killing them" in caplog.text, caplog.text
    assert "sidecar rank 0 exited with code 3 during the stop" in caplog.text, caplog.text


def _rank_with_its_sockets(sock, end: str) -> str:
    """A fake rank that listens on its gRPC and engine-lease sockets in `sock`, removes both on SIGTERM (as the
    teardown's close of the server and the leases does) and, rank 1, ends once serving by `end`."""
    return ("import os, pathlib, signal, socket, sys, time\n"
            f"d = pathlib.Path({str(sock)!r})\n"
            "r = os.environ['RANK']\n"
            "held = []\n"
            "for name in ('rank%s.sock' % r, 'rank%s.lease' % r):\n"
            "    s = socket.socket(socket.AF_UNIX)\n"
            "    s.bind(str(d / name))\n"
            "    s.listen()\n"
            "    held.append(s)\n"
            "def stop(*a):\n"
            "    for n in ('rank%s.sock' % r, 'rank%s.lease' % r):\n"
            "        (d / n).unlink()\n"
            "    sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, stop)\n"
            + _RANK_1_ENDS_ONCE_SERVING.format(end=end))


@pytest.mark.parametrize("end, code", [("os._exit(3)", 3), ("os.kill(os.getpid(), signal.SIGKILL)", -9)])
def test_a_rank_that_ends_while_serving_is_named_and_leaves_no_socket_of_its_own(monkeypatch, caplog, end, code):
    """Rank 1 ends with os._exit(3) while the group serves (the gone-engine device check, servicer.py), or is
    SIGKILLed (the OOM killer): it removes nothing itself, so its gRPC socket and its engine-lease socket
    (DIR/rank1.lease) stay in the folder. The launcher names it with its code, stops rank 0, exits 1 for the
    supervisor's restart, and removed the gRPC socket only: the lease socket stayed, a socket nobody answers on,
    until a next start replaced it."""
    sock = short_socket_dir()
    rank = _rank_with_its_sockets(sock, end)
    _fake_ranks(monkeypatch, rank)
    assert _launch_until_a_rank_dies(sock, caplog) == 1
    assert [r.getMessage() for r in caplog.records] == [
        f"sidecar rank 1 exited with code {code}; stopping the group (2 ranks)"], caplog.text
    assert sorted(p.name for p in sock.iterdir() if p.is_socket()) == []


def test_a_stop_signal_during_the_launcher_s_clean_up_does_not_cut_it_short(monkeypatch, caplog):
    """launch() put the caller's handlers back first, then killed what was left of the group and removed a failed
    rank's socket files: a stop repeated meanwhile (a second Ctrl-C or SIGTERM, reaching `serve`'s defaults) ended
    the launcher there, its exit -SIGTERM and the killed rank's sockets left behind. Here the caller's handler
    raises (as SIG_DFL's kill ends the process), and a SIGTERM comes as the launcher removes rank 1's files."""
    from dspark_sidecar.server import launcher

    sock = short_socket_dir()
    rank = _rank_with_its_sockets(sock, "os.kill(os.getpid(), signal.SIGKILL)")
    _fake_ranks(monkeypatch, rank)
    real_remove = launcher.remove_stale_socket

    def remove_stopped(*paths):
        os.kill(os.getpid(), signal.SIGTERM)  # delivered here, on this (the main) thread, before the removal
        return real_remove(*paths)

    monkeypatch.setattr(launcher, "remove_stale_socket", remove_stopped)

    class Killed(Exception):
        pass

    def killed(*a):
        raise Killed

    before = signal.signal(signal.SIGTERM, killed)
    try:
        assert _launch_until_a_rank_dies(sock, caplog) == 1
    finally:
        signal.signal(signal.SIGTERM, before)
    assert sorted(p.name for p in sock.iterdir() if p.is_socket()) == []


def test_a_stale_socket_the_launcher_may_not_remove_keeps_the_group_s_exit_code(monkeypatch, caplog):
    """A rank refuses to start because the stale socket at its name is another user's in a sticky folder (a pod
    whose containers' uids differ: unlink is EPERM; preflight.claim_socket's one line, exit 2). The launcher's
    clean-up after the failed rank then tried the same unlink in its finally: the PermissionError replaced the
    group's exit 2 with a traceback (exit 1, which systemd restarts for ever). The socket is left, with a line."""
    sock = short_socket_dir()
    rank = ("import os, pathlib, socket, sys\n"
            f"d = pathlib.Path({str(sock)!r})\n"
            "if os.environ['RANK'] == '0':\n"  # a socket file nobody answers on, then the refusal
            "    socket.socket(socket.AF_UNIX).bind(str(d / 'rank0.sock'))\n"
            "    sys.exit(2)\n"
            "import time; time.sleep(60)\n")
    _fake_ranks(monkeypatch, rank)
    real_unlink = Path.unlink

    def eperm(self, missing_ok=False):
        if self.name == "rank0.sock":
            raise PermissionError(1, "Operation not permitted", str(self))
        return real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", eperm)
    with caplog.at_level(logging.INFO, logger="dspark_sidecar.launcher"):
        code = launch(ServeConfig(tp=2, socket_dir=sock), [], on_ready=lambda: False, poll_s=0.05)
    assert code == EXIT_USAGE
    assert (sock / "rank0.sock").is_socket()
    assert "cannot remove" in caplog.text and "rank0.sock" in caplog.text, caplog.text


def test_a_ctrl_c_to_the_whole_group_during_start_up_exits_0(tmp_path, monkeypatch, caplog):
    """A Ctrl-C in serve's terminal reaches every process of the foreground group: ranks still importing (no
    handler of their own yet) die of the SIGINT itself (-2), and the launcher stops. That is the stop asked for,
    exit 0, as the launcher's own SIGTERM's -15 is. Here the probe sends the SIGINT, to the ranks first (each has
    ended before the launcher hears of it: the order the launcher cannot count on) and then to this process."""
    from dspark_sidecar.server import launcher

    rank = ("import os, pathlib, sys, time\n"
            f"pathlib.Path({str(tmp_path)!r}, 'up-' + os.environ['RANK']).touch()\n"
            "time.sleep(60)\n"
            "sys.exit(3)\n")
    real_popen = subprocess.Popen
    started: list[subprocess.Popen] = []

    def popen(argv, **kw):
        started.append(real_popen([sys.executable, "-c", rank], **kw))
        return started[-1]

    monkeypatch.setattr(launcher.subprocess, "Popen", popen)

    def on_ready() -> bool:
        if len(list(tmp_path.glob("up-*"))) < 2:
            return False
        for p in started:
            p.send_signal(signal.SIGINT)
        for p in started:
            p.wait(timeout=30)
        os.kill(os.getpid(), signal.SIGINT)  # handled here, inside the probe, before it returns
        return False

    try:
        with caplog.at_level(logging.INFO, logger="dspark_sidecar.launcher"):
            code = launch(ServeConfig(tp=2, socket_dir=tmp_path), [], on_ready=on_ready, poll_s=0.05)
    except KeyboardInterrupt:
        pytest.fail("the launcher's SIGINT was not its stop: KeyboardInterrupt")
    assert [p.returncode for p in started] == [-signal.SIGINT] * 2
    assert code == 0, caplog.text
    assert "exited with code" not in caplog.text, caplog.text


def test_each_rank_gets_its_rank_the_world_the_rendezvous_and_the_launcher_s_pid(tmp_path, monkeypatch):
    """What a rank reads from its environment (cli.cmd_serve, app._die_with_parent): RANK and LOCAL_RANK (its GPU),
    WORLD_SIZE, MASTER_ADDR/MASTER_PORT, and DSPARK_LAUNCHER_PID, without which a rank never set PR_SET_PDEATHSIG
    and outlived a SIGKILLed launcher, and checked the checkpoint again in every rank. The launcher puts back the
    signal handlers it found."""
    import json

    from dspark_sidecar.server import launcher

    seen = []
    real_popen = subprocess.Popen

    def rank(argv, env, **kw):
        seen.append({k: env.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                             "DSPARK_LAUNCHER_PID")})
        return real_popen([sys.executable, "-c", "pass"], env=env, **kw)  # exits at once: the launch ends

    monkeypatch.setattr(launcher.subprocess, "Popen", rank)
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    launch(ServeConfig(tp=2, socket_dir=tmp_path, master_port=29511), ["serve"], on_ready=lambda: False)
    assert {s: signal.getsignal(s) for s in before} == before
    cfg = ServeConfig(tp=2, socket_dir=tmp_path)
    want = [{"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": cfg.master_addr,
             "MASTER_PORT": "29511", "DSPARK_LAUNCHER_PID": str(os.getpid())} for r in range(2)]
    assert seen == want, json.dumps(seen)
