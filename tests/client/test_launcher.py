"""SidecarLauncher.start(): what it hands the `serve` process, and what it takes for its sidecar serving.
No sidecar is started here: Popen is replaced by a process that records how it was started."""

from __future__ import annotations

import pytest

from dspark_sidecar.client import launcher as L
from dspark_sidecar.client.launcher import SidecarLauncher
from helpers.engine_fakes import FakeServer, FakeSidecar, short_socket_dir


class _Started:
    """A `serve` process as Popen returns it: records its argv and env; exited with `code` (None: running)."""

    calls: list[dict] = []

    # A pid no process can have (Linux's pid_max is at most 2**22): pid 0 equalled os.getsid() of a process whose
    # session leader is outside its pid namespace (a container's `exec`, CI), which getsid reports as 0, so a
    # sidecar listening from the test process was taken for this fake serve's own.
    NO_PID = 2**22 + 1

    def __init__(self, argv, env=None, code=None, **_kw) -> None:
        _Started.calls.append({"argv": argv, "env": env})
        self.pid, self.returncode = _Started.NO_PID, code

    def poll(self):
        return self.returncode

    def send_signal(self, sig):  # stop(): it exits on the signal
        self.returncode = -sig

    def wait(self, timeout=None):
        return self.returncode


@pytest.fixture
def started(monkeypatch):
    _Started.calls = []
    return _Started


def test_a_sidecar_started_from_a_torchrun_worker_keeps_none_of_its_rendezvous(monkeypatch, started):
    """torchrun puts TORCHELASTIC_USE_AGENT_STORE=True in every worker's environment. start() took out
    RANK/WORLD_SIZE/LOCAL_RANK but passed that on: `serve`'s own ranks then joined the group as clients of
    the agent's store (cli.py, process_group.rendezvous_store), rank 0 included, on the port serve's launcher
    had picked and nobody listened on; rank 0 timed out after 60 s and the start failed (checked with a real
    TP-2 sidecar). None of torchrun's variables reach the sidecar now."""
    for k, v in {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "TORCHELASTIC_USE_AGENT_STORE": "True",
                 "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_RUN_ID": "none"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(L.subprocess, "Popen", lambda argv, **kw: started(argv, code=2, **kw))
    with pytest.raises(RuntimeError, match="sidecar exited with 2"):
        SidecarLauncher(short_socket_dir(), tp=1).start()
    (call,) = started.calls
    leaked = sorted(k for k in call["env"] if k in ("RANK", "WORLD_SIZE", "LOCAL_RANK") or k.startswith("TORCHELASTIC_"))
    assert leaked == [], leaked


def test_the_starter_s_serve_flag_variables_do_not_configure_the_sidecar_behind_its_argv(monkeypatch, started):
    """A serve flag's DSPARK_<FLAG> is the default of every flag argv leaves out: an operator's
    DSPARK_STRICT_REFUSAL=1 or DSPARK_WEIGHTS=mxfp8 reached the demo's sidecar, which then served another
    drafter than the one the demo compares it with (or refused on NVIDIA), and its metrics port took the
    production sidecar's. Only argv configures it; the log level and names serve does not read pass."""
    for k, v in {"DSPARK_STRICT_REFUSAL": "1", "DSPARK_WEIGHTS": "mxfp8", "DSPARK_BACKEND": "flydsl",
                 "DSPARK_METRICS_PORT": "9400", "DSPARK_CHECKPOINT": "/srv/prod", "DSPARK_LOG_LEVEL": "DEBUG",
                 "DSPARK_STEP_DEADLINE_MS": "500"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(L.subprocess, "Popen", lambda argv, **kw: started(argv, code=2, **kw))
    with pytest.raises(RuntimeError, match="sidecar exited with 2"):
        SidecarLauncher(short_socket_dir(), tp=1).start()
    (call,) = started.calls
    passed = sorted(k for k in call["env"] if k.startswith("DSPARK_"))
    assert passed == ["DSPARK_LOG_LEVEL", "DSPARK_STEP_DEADLINE_MS"], passed


def test_start_refuses_a_folder_another_sidecar_serves_instead_of_returning_that_one(monkeypatch, started):
    """With a sidecar already serving in the folder, the new `serve` refuses its sockets (exit 75) only after
    its imports, while the old sidecar's health passed start()'s wait at once: start() returned at once, the
    caller then drove the other sidecar (another preset or dtype; checked with two real ones: an fp32 sidecar's
    status for a bf16 start) and stop() stopped nothing of it. start() now refuses before it starts anything."""
    folder = short_socket_dir()
    other = FakeServer(FakeSidecar(0, 1), folder / "rank0.sock").start()
    monkeypatch.setattr(L.subprocess, "Popen", lambda argv, **kw: started(argv, **kw))  # running, for ever
    try:
        with pytest.raises(RuntimeError, match=r"a sidecar already answers on .* \(ranks \[0\]\)"):
            SidecarLauncher(folder, tp=1, ready_timeout_s=1.0).start()
    finally:
        other.stop()
    assert started.calls == [], "a second serve was started on a folder another sidecar serves"


def test_start_refuses_a_folder_whose_socket_paths_are_too_long_in_words_that_say_so(monkeypatch, started):
    """A folder whose rank{r}.sock paths pass sun_path's 107 bytes: start()'s probe for a sidecar already there
    could not connect ("AF_UNIX path too long", an OSError it counts as someone serving), so start() said "a
    sidecar already answers on ... stop it first" for a folder nobody serves in, or ever could. It now gives
    serve's own refusal, before it makes the folder or starts anything."""
    folder = short_socket_dir() / ("x" * 100)
    monkeypatch.setattr(L.subprocess, "Popen", lambda argv, **kw: started(argv, **kw))
    with pytest.raises(ValueError, match=r"--socket-dir: .*rank3\.lease is \d+ bytes, a unix socket path holds at most 107"):
        SidecarLauncher(folder, tp=4, ready_timeout_s=1.0).start()
    assert started.calls == [] and not folder.exists()


def test_start_does_not_return_a_sidecar_whose_own_serve_has_exited(monkeypatch, started):
    """The folder free at the check but served by another sidecar by the time every rank's health passes
    (one started meanwhile): its health is not this launcher's sidecar, whose serve has exited (75)."""
    folder = short_socket_dir()
    servers: list[FakeServer] = []

    def popen(argv, **kw):  # the other sidecar comes up just as this serve loses the race and exits
        servers.append(FakeServer(FakeSidecar(0, 1), folder / "rank0.sock").start())
        return started(argv, code=75, **kw)

    monkeypatch.setattr(L.subprocess, "Popen", popen)
    monkeypatch.setattr(SidecarLauncher, "log_tail", lambda self, n=30: "a sidecar is already serving")
    try:
        with pytest.raises(RuntimeError, match="sidecar exited with 75"):
            SidecarLauncher(folder, tp=1, ready_timeout_s=1.0).start()
    finally:
        for s in servers:
            s.stop()


def test_start_does_not_return_another_sidecar_that_serves_while_its_own_serve_still_starts(monkeypatch, started):
    """The folder free at start()'s check, another sidecar serving there at the first look at health, and this
    launcher's serve still running: it refuses the folder only after its imports (exit 75, seconds later), so the
    check of its exit after the wait passed and start() returned the other sidecar (two real starters 2.5 s apart:
    the second's start() returned at once, its serve exited 75 a second later; started together, one's rank lost
    the socket's lock and its serve exited 1 after start() had returned). A rank is this launcher's only where the
    process listening on its socket is in the session its serve leads; here the other one listens in this one's."""
    folder = short_socket_dir()
    servers: list[FakeServer] = []
    procs: list[_Started] = []

    def popen(argv, **kw):  # the other sidecar comes up as this serve starts, which runs on (importing)
        servers.append(FakeServer(FakeSidecar(0, 1), folder / "rank0.sock").start())
        procs.append(started(argv, **kw))
        return procs[-1]

    monkeypatch.setattr(L.subprocess, "Popen", popen)
    try:
        with pytest.raises(RuntimeError, match=r"another sidecar serves on .* \(ranks \[0\]\)"):
            # A bound on a hang, not a timing: at 1 s a loaded box's first health probe (a fresh channel, its own
            # 1 s deadline) ran past it, and start() raised its TimeoutError before it looked at the listener.
            SidecarLauncher(folder, tp=1, ready_timeout_s=60.0).start()
    finally:
        for s in servers:
            s.stop()
    assert procs[0].returncode == -15, "the serve of a start that returned no sidecar of its own was not stopped"


# A `serve` with one rank (its child) listening on the folder's rank0.sock, as serve's ranks do.
_LISTENING_SERVE = """
import subprocess, sys
rank = "import socket, sys, time; s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(8); " \\
       "print('listening', flush=True); time.sleep(120)"
subprocess.run([sys.executable, "-c", rank, sys.argv[1]])
"""


def test_start_returns_its_own_sidecar_whose_ranks_are_children_of_its_serve(monkeypatch):
    """The other side of the check above: a rank listening from a process of this launcher's serve (its child,
    in its session) is this launcher's sidecar, and start() returns it."""
    import os
    import signal
    import subprocess
    import sys

    from helpers.waiting import wait_until

    folder = short_socket_dir()
    real_popen, procs = subprocess.Popen, []

    def popen(argv, **kw):
        procs.append(real_popen([sys.executable, "-c", _LISTENING_SERVE, str(folder / "rank0.sock")], **kw))
        return procs[-1]

    monkeypatch.setattr(L.subprocess, "Popen", popen)

    def healthy(self, deadline_s=1.0):  # serving once its rank listens
        wait_until(lambda: "listening" in self.log_tail(), 30, "the rank's first line", watch=procs[0])
        return [True] * self.tp

    monkeypatch.setattr(SidecarLauncher, "healthy", healthy)
    sc = SidecarLauncher(folder, tp=1, exit_with_starter=False)
    try:
        assert sc.start() is sc and not sc.exited
    finally:
        for p in procs:  # the serve and its rank: the whole group (the serve, not reaped yet, keeps it)
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def test_a_start_interrupted_while_waiting_for_serving_stops_the_sidecar_it_started(monkeypatch):
    """The sidecar runs in a session of its own, out of reach of the starter's Ctrl-C, and `with` calls
    __exit__ (stop) only once __enter__ (start) has returned: a Ctrl-C (or any exception) during start()'s
    wait for SERVING left it running, its sockets held, until the starter process itself ended (or for ever
    with exit_with_starter=False). Here `serve` is a real process that never serves, and the wait is
    interrupted at its second look."""
    import subprocess
    import sys

    real_popen = subprocess.Popen
    procs = []

    def popen(argv, **kw):
        procs.append(real_popen([sys.executable, "-c", "import time; time.sleep(120)"], **kw))
        return procs[-1]

    monkeypatch.setattr(L.subprocess, "Popen", popen)
    looks = []

    def healthy(self, deadline_s=1.0):
        looks.append(1)
        if len(looks) == 2:
            raise KeyboardInterrupt
        return [False] * self.tp

    monkeypatch.setattr(SidecarLauncher, "healthy", healthy)
    try:
        with pytest.raises(KeyboardInterrupt):
            with SidecarLauncher(short_socket_dir(), tp=1, exit_with_starter=False):
                pass
        (proc,) = procs
        assert proc.poll() is not None, "the interrupted start left its sidecar running"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


# A `serve` that ignores SIGTERM (SIG_IGN is inherited across exec: its rank ignores it too), with one rank in its
# process group; prints the rank's pid once both ignore the signal.
_DEAF_SERVE = """
import signal, subprocess, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
rank = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(120)"],
                        stdout=subprocess.PIPE, text=True)
rank.stdout.readline()
print(rank.pid, flush=True)
rank.wait()
"""


def test_stop_kills_the_whole_group_of_a_sidecar_that_ignores_sigterm():
    """stop() sends SIGTERM and, when the sidecar has not exited within its timeout (a wedged launcher, ranks
    blocked in native code), SIGKILLs the whole process group: the launcher and its ranks. Without the kill it
    waited on the launcher for ever, and the ranks kept their GPU memory and sockets."""
    import os
    import subprocess
    import sys
    import threading

    from helpers.sidecar_proc import alive
    from helpers.waiting import wait_until

    sc = SidecarLauncher(short_socket_dir(), tp=1, exit_with_starter=False)
    sc.proc = subprocess.Popen([sys.executable, "-c", _DEAF_SERVE], stdout=subprocess.PIPE, text=True,
                               start_new_session=True)
    rank_pid = 0
    try:
        rank_pid = int(sc.proc.stdout.readline())
        codes: list[int | None] = []
        stopper = threading.Thread(target=lambda: codes.append(sc.stop(timeout_s=0.5)), daemon=True)
        stopper.start()
        stopper.join(30.0)  # a bound on a hang, not a timing: the kill comes 0.5 s in
        assert codes == [-9], "stop() did not end a sidecar that ignores SIGTERM"
        wait_until(lambda: not alive(rank_pid), 10.0, lambda: f"rank {rank_pid} of the stopped sidecar still runs")
    finally:
        if sc.proc.poll() is None:
            sc.proc.kill()
            sc.proc.wait()
        if rank_pid and alive(rank_pid):
            os.kill(rank_pid, 9)
        sc.proc.stdout.close()


# A `serve` with three children: a helper that is no rank (no RANK in its environment), then rank 1, then rank 0;
# prints their pids in that order once each runs (/proc/PID/environ is empty for a moment after Popen returns).
_RANKED_SERVE = """
import os, subprocess, sys
child = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(120)"]
env = {k: v for k, v in os.environ.items() if k != "RANK"}
procs = [subprocess.Popen(child, env=e, stdout=subprocess.PIPE, text=True)
         for e in (env, dict(env, RANK="1"), dict(env, RANK="0"))]
for p in procs:
    p.stdout.readline()
print(*(p.pid for p in procs), flush=True)
procs[0].wait()
"""


def test_rank_pids_are_the_serve_s_children_carrying_rank_in_rank_order():
    """rank_pids() (kill_rank's victim, the tests' crash of rank r) reads RANK from each child's environment: in rank
    order whatever order serve spawned them in, and a child of serve's that is no rank left out."""
    import os
    import signal
    import subprocess
    import sys

    sc = SidecarLauncher(short_socket_dir(), tp=2, exit_with_starter=False)
    sc.proc = subprocess.Popen([sys.executable, "-c", _RANKED_SERVE], stdout=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        _helper, rank1, rank0 = map(int, sc.proc.stdout.readline().split())
        assert sc.rank_pids() == [rank0, rank1]
    finally:
        os.killpg(sc.proc.pid, signal.SIGKILL)  # serve and its children: its group
        sc.proc.wait()
        sc.proc.stdout.close()


def test_a_failed_start_quotes_its_own_sidecar_s_lines_not_an_earlier_start_s(monkeypatch, started):
    """The log is appended to (a socket folder or --work-dir used again): a sidecar that died without a word (SIGKILL,
    the OOM killer) was reported with the tail of the previous start's log, "sidecar exited with -9" over another
    start's traceback, which then read as this one's cause. The tail is of what this start's sidecar wrote."""
    folder = short_socket_dir()
    (folder / "sidecar.log").write_text("ModuleNotFoundError: an earlier start's cause\n")

    def popen(argv, stdout=None, **kw):  # says one line, or nothing, and has exited
        if says:
            stdout.write(says.encode())
        return started(argv, code=code, **kw)

    monkeypatch.setattr(L.subprocess, "Popen", popen)
    for says, code in (("", -9), ("dspark-sidecar: this start's refusal\n", 2)):
        with pytest.raises(RuntimeError) as err:
            SidecarLauncher(folder, tp=1).start()
        assert str(err.value) == f"sidecar exited with {code}:\n{says.strip()}", str(err.value)
    says, code = "".join(f"line {i}\n" for i in range(40)), 1  # the last 30 lines, where the cause is
    with pytest.raises(RuntimeError) as err:
        SidecarLauncher(folder, tp=1).start()
    assert str(err.value).splitlines()[1:] == [f"line {i}" for i in range(10, 40)], str(err.value)
    assert "an earlier start's cause" in (folder / "sidecar.log").read_text()  # appended to, not replaced


def test_start_returns_only_once_every_rank_is_serving(monkeypatch, started):
    """Rank 0 SERVING with rank 1 still loading is not a serving TP-2 sidecar: its first step would fail."""
    monkeypatch.setattr(L.subprocess, "Popen", lambda argv, **kw: started(argv, **kw))  # running
    looks: list[list[bool]] = []

    def healthy(self, deadline_s=1.0):
        looks.append([True, len(looks) >= 2])  # rank 1 serves from the third look on
        return looks[-1]

    monkeypatch.setattr(SidecarLauncher, "healthy", healthy)
    SidecarLauncher(short_socket_dir(), tp=2).start()
    assert looks == [[True, False], [True, False], [True, True]]


# A `serve` that never serves: says so, and one line more on SIGTERM before it exits (as serve's drain does).
_NEVER_SERVES = """
import signal, sys, time
def stop(*_):
    print("stopping on SIGTERM", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("loading", flush=True)
time.sleep(120)
"""


def _real_serve(monkeypatch, script: str) -> list:
    """Popen replaced by a real process running `script`, started as start() starts serve (its log, its session)."""
    import subprocess
    import sys

    real_popen, procs = subprocess.Popen, []

    def popen(argv, **kw):
        procs.append(real_popen([sys.executable, "-c", script], **kw))
        return procs[-1]

    monkeypatch.setattr(L.subprocess, "Popen", popen)
    return procs


def test_a_sidecar_never_serving_is_stopped_at_the_bound_and_its_stop_s_lines_are_quoted(monkeypatch):
    """Past ready_timeout_s start() stops the sidecar before it raises, so the tail it quotes ends with what the
    sidecar said while it stopped (where a wedged start-up shows itself), and nothing of it runs on."""
    from helpers.waiting import wait_until

    procs = _real_serve(monkeypatch, _NEVER_SERVES)

    def healthy(self, deadline_s=1.0):  # not serving, looked at once its handler is set (a loaded host's start)
        wait_until(lambda: "loading" in self.log_tail(), 30, "the sidecar's first line", watch=procs[0])
        return [False] * self.tp

    monkeypatch.setattr(SidecarLauncher, "healthy", healthy)
    sc = SidecarLauncher(short_socket_dir(), tp=1, ready_timeout_s=0.5, exit_with_starter=False)
    try:
        with pytest.raises(TimeoutError, match=r"sidecar not SERVING within 0\.5 s:\nloading\nstopping on SIGTERM$"):
            sc.start()
        (proc,) = procs
        assert proc.returncode == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_the_sidecar_runs_in_a_session_of_its_own(monkeypatch):
    """Its own session and process group: the starter's Ctrl-C (sent to the terminal's foreground group) does not
    reach it, and stop()'s SIGKILL to its group reaches its ranks (which share its group) and nothing else."""
    import os

    procs = _real_serve(monkeypatch, _NEVER_SERVES)
    monkeypatch.setattr(SidecarLauncher, "healthy", lambda self, deadline_s=1.0: [True] * self.tp)
    sc = SidecarLauncher(short_socket_dir(), tp=1, exit_with_starter=False).start()
    try:
        pid = sc.proc.pid
        assert os.getsid(pid) == pid and os.getpgid(pid) == pid and os.getsid(pid) != os.getsid(0)
    finally:
        sc.stop(timeout_s=10)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_health_is_each_rank_s_own():
    """healthy() looks at every rank's socket: a folder where rank 0 serves and rank 1 nothing yet is not serving."""
    folder = short_socket_dir()
    rank0 = FakeServer(FakeSidecar(0, 2), folder / "rank0.sock").start()
    try:
        assert SidecarLauncher(folder, tp=2).healthy() == [True, False]
    finally:
        rank0.stop()


def test_stop_before_start_twice_and_after_the_sidecar_exited_by_itself(monkeypatch):
    """stop() is safe to call whatever came before (a `finally` after a start that raised, a second __exit__): None
    before any start; the sidecar's exit code, the same each time, once it has ended by itself, which `exited`
    tells without anyone having waited for it (the demo reads it to fail a run whose sidecar died mid-way)."""
    from helpers.waiting import wait_until

    sc = SidecarLauncher(short_socket_dir(), tp=1, exit_with_starter=False)
    assert sc.stop() is None and not sc.exited
    procs = _real_serve(monkeypatch, "import sys; sys.exit(3)")
    monkeypatch.setattr(SidecarLauncher, "_wait_serving", lambda self: None)  # returned as serving, then it exits
    sc.start()
    wait_until(lambda: sc.exited, 30, "the sidecar's exit, seen through `exited`")
    assert sc.stop() == 3 and sc.stop() == 3 and procs[0].returncode == 3
