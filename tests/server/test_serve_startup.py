"""`serve` start-up as a user meets it, with real launcher and rank processes (CPU, tiny preset).

- A second `serve` on the socket folder of a running one unlinked the live socket, reported "serving"
  from the first one's socket (cli.py `ready`), and left the first one unreachable for good.
- SIGTERM / Ctrl-C during start-up was ignored until the rank was SERVING (its handler only set an
  event read by the serving loop) and the launcher waited DRAIN_GRACE_S (60 s) before killing.
- A peer lost inside the warm-up step reached the others as gloo's traceback, not PeerLost's one line.
- SIGTERM while rank 0 wrote the embedded synthetic checkpoint (under torchrun) left its partial folder.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from dspark_sidecar.server.healthcheck import check
from helpers.waiting import wait_until


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}


def _rank0_env() -> dict[str, str]:
    """The environment of rank 0 of a TP-1 group as torchrun gives it (no launcher of ours), on a free port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return dict(_env(), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def _serve(sock_dir: Path, ckpt, *extra, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dspark_sidecar", "serve", "--tp", "1", "--device", "cpu",
                             "--socket-dir", str(sock_dir), "--checkpoint", str(ckpt[0]),
                             "--target-checkpoint", str(ckpt[1]), "--drain-s", "0", *extra],
                            env=dict(_env(), **(env or {})), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _group_alive(pgid: int) -> bool:
    out = subprocess.run(["ps", "-o", "stat=", "-g", str(pgid)], capture_output=True, text=True).stdout
    return any(stat[:1] != "Z" for stat in out.split())


def _board_mappings(launcher_pid: int) -> list[str]:
    """The rendezvous board's lines in /proc/PID/maps of the launcher's ranks."""
    ranks = subprocess.run(["ps", "-o", "pid=", "--ppid", str(launcher_pid)], capture_output=True, text=True).stdout
    return [line for pid in ranks.split() for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
            if "/dev/shm/dspark-rdv-" in line]


def _kill(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the group already ended
    p.communicate(timeout=10)


def test_a_second_serve_on_a_live_socket_dir_is_refused_and_the_first_keeps_serving(tiny_ckpt, tmp_path):
    sock = tmp_path / "sock"
    first = _serve(sock, tiny_ckpt)
    second = None
    try:
        wait_until(lambda: check(f"unix:{sock / 'rank0.sock'}", 0.5) == "SERVING", 60, "the first serve SERVING",
                   watch=first, interval_s=0.1)
        # Rank 0 removes the rendezvous board's name once every rank has it mapped: a serving group leaves
        # nothing in /dev/shm that a kill -9 would leave behind (rendezvous.Board).
        boards = _board_mappings(first.pid)
        assert boards and all(m.endswith("(deleted)") for m in boards), boards
        ino = (sock / "rank0.sock").stat().st_ino
        second = _serve(sock, tiny_ckpt)
        out, err = second.communicate(timeout=30)
        assert second.returncode == 75, err  # EX_TEMPFAIL: a socket held now (config.AddressInUse)
        assert "serving" not in out, out
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert f"--socket-dir: a sidecar is already serving on {sock / 'rank0.sock'}" in err
        assert (sock / "rank0.sock").stat().st_ino == ino and first.poll() is None
        assert check(f"unix:{sock / 'rank0.sock'}", 30.0) == "SERVING"  # a bound on a hang, not a timing
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=30)
        assert first.returncode == 0 and "Traceback" not in err, err
    finally:
        if second is not None:
            _kill(second)
        _kill(first)


def test_sigterm_while_the_ranks_wait_in_the_rendezvous_ends_the_group_promptly(tiny_ckpt, tmp_path):
    """A rank told to join torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE) when no store listens:
    it sits in torch's store connect (native code, no Python signal handler runs) for --dist-timeout-s.
    The launcher kills it STARTUP_STOP_S after the stop. (Before rank 0 hosted the store on the
    rendezvous address itself, an unroutable --master-addr put it there; that is now refused at once.)"""
    sock = tmp_path / "sock"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # The agent's store, listening once serve's check of the port is behind (a rank's connect retries until then):
    # it takes the rank's connection and never answers, so the rank's store (its ping) waits in native code for
    # good; the group can end before the hang guard only by the launcher's kill.
    store = socket.socket()
    connected: list[socket.socket] = []

    def in_the_store() -> list[socket.socket]:
        try:
            connected.append(store.accept()[0])
        except BlockingIOError:
            pass
        return connected

    p = _serve(sock, tiny_ckpt, "--master-port", str(port), "--dist-timeout-s", "3600",
               env={"TORCHELASTIC_USE_AGENT_STORE": "True"})
    try:
        # By state, not by a nap: a second after its socket, a rank on a loaded box was still in Python code on its
        # way there, where its handler ends it by itself (exit 0, "SIGTERM during start-up"), and nothing is killed.
        wait_until((sock / "rank0.sock").exists, 30, "rank 0's socket", watch=p, interval_s=0.1)
        store.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        store.bind(("127.0.0.1", port))
        store.listen()
        store.setblocking(False)
        wait_until(in_the_store, 60, "rank 0's connect to the store", watch=p, interval_s=0.05)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)  # a hang guard only
        assert p.returncode == 0 and "Traceback" not in err, err
        # Killed by the start-up stop (STARTUP_STOP_S), not the serving drain's grace (DRAIN_GRACE_S, exit 1).
        assert "still starting 3 s after the stop request" in err and "killing them" in err, err
        assert "ranks still running" not in err, err
        assert not _group_alive(p.pid), "a rank outlived the launcher"
        assert not list(sock.glob("*.sock")), "a killed rank's socket file was left behind"
    finally:
        _kill(p)
        for c in connected:
            c.close()
        store.close()


RANK_BLOCKED_IN_LOAD = """
import sys, time
from dspark_sidecar.server import app
app._load = lambda *a, **k: time.sleep(3600)  # a load that takes long (a slow disk, a hung NFS read)
from dspark_sidecar import cli
sys.exit(cli.main(sys.argv[1:]))
"""


def test_sigterm_while_a_rank_loads_ends_it_at_once_without_traceback(tmp_path):
    """A rank in Python code when the stop comes (a load of minutes) ends itself: exit 0, its socket
    removed; no launcher needed (under torchrun the rank gets the signal directly)."""
    sock = tmp_path / "sock"
    env = _rank0_env()
    p = subprocess.Popen([sys.executable, "-c", RANK_BLOCKED_IN_LOAD, "serve", "--tp", "1", "--device", "cpu",
                          "--socket-dir", str(sock)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        wait_until((sock / "rank0.sock").exists, 30, "rank 0's socket", watch=p, interval_s=0.1)
        time.sleep(1.0)  # past init_process_group (world 1: immediate), into the load
        p.send_signal(signal.SIGTERM)
        # A hang guard only: a rank that let its load (an hour) run on before it ended is still running here.
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0 and "Traceback" not in err, err
        assert "SIGTERM during start-up" in err, err
        assert not (sock / "rank0.sock").exists()
    finally:
        _kill(p)


def test_a_rank_that_fails_to_start_removes_its_socket_file(tmp_path):
    """A start-up refusal past the bind (here the metrics port, held by another process) under torchrun,
    where no launcher of ours removes a failed rank's socket: the rank removed it only on a signal or a
    lost peer, and left a socket file nobody answers on for every other failure."""
    sock = tmp_path / "sock"
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        env = _rank0_env()
        p = subprocess.run([sys.executable, "-m", "dspark_sidecar", "serve", "--tp", "1", "--device", "cpu",
                            "--socket-dir", str(sock), "--metrics-port", str(held.getsockname()[1])],
                           env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 75 and "--metrics-port: rank 0 cannot listen on" in p.stderr, p.stderr
    assert not list(sock.glob("*.sock")), "a rank that failed to start left its socket file"


RANK_SLOW_LAST_COLLECT = """
import gc, sys, time, types
from pathlib import Path
from dspark_sidecar.server import app
def collect(*a):  # the start-up heap's last collection, long (a large drafter on a loaded host): here it lasts
    # until the test has sent its SIGTERM (then it touches MARKER.sent), not a fixed 2 s that a loaded box's test
    # could overrun before its signal; the handler runs here, in the main thread, before this returns.
    marker = Path(sys.argv[-1])
    marker.touch()
    deadline = time.monotonic() + 60
    while not marker.with_name(marker.name + ".sent").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return gc.collect(*a)
app.gc = types.SimpleNamespace(collect=collect, freeze=gc.freeze, unfreeze=gc.unfreeze)
from dspark_sidecar import cli
sys.exit(cli.main(sys.argv[1:-1]))
"""


def test_sigterm_in_the_last_moments_of_start_up_never_shows_serving(tmp_path):
    """A stop that came after the rank stopped ending at once on a signal (start_up.active) but before it
    went SERVING: it published SERVING (and logged it) anyway, then drained. A probe or engine saw a rank
    that was told to stop report SERVING."""
    sock, marker = tmp_path / "sock", tmp_path / "collecting"
    env = _rank0_env()
    p = subprocess.Popen([sys.executable, "-c", RANK_SLOW_LAST_COLLECT, "serve", "--tp", "1", "--device", "cpu",
                          "--socket-dir", str(sock), "--drain-s", "1", str(marker)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_until(marker.exists, 60, f"the rank's marker {marker.name}", watch=p, interval_s=0.1)
        p.send_signal(signal.SIGTERM)
        marker.with_name(marker.name + ".sent").touch()  # the collection ends only now
        seen = set()
        while p.poll() is None:
            seen.add(check(f"unix:{sock / 'rank0.sock'}", 0.5))
            time.sleep(0.05)
        _, err = p.communicate(timeout=10)
        assert p.returncode == 0 and "Traceback" not in err, err
        assert "SERVING" not in seen and "rank 0: SERVING" not in err, (seen, err)
    finally:
        _kill(p)


RANK_DIES_IN_WARM_UP = """
import os, sys
from dspark_sidecar.server import startup
real = startup.warm_up
def warm_up(ctx, **kw):
    if ctx.rank == 1:  # a peer that fails inside the warm-up step (out of device memory, say): its line, then gone
        print("rank 1: failed in its warm-up", file=sys.stderr, flush=True)
        os._exit(1)
    return real(ctx, **kw)
startup.warm_up = warm_up
from dspark_sidecar import cli
sys.exit(cli.main(sys.argv[1:]))
"""


def test_a_peer_lost_in_the_warm_up_step_is_one_line_not_gloo_s_traceback(tmp_path):
    """The warm-up step exchanges partial sums with the peers. A peer that failed inside it reached the
    others as gloo's error from deep in the step, a traceback that reads as a second failure; every other
    start-up collective says it in one line (PeerLost), as OPERATIONS.md promises for start-up."""
    sock = tmp_path / "sock"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-c", RANK_DIES_IN_WARM_UP, "serve", "--tp", "2", "--device", "cpu",
                               "--socket-dir", str(sock)],
                              env=dict(_env(), RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=str(port)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
             for r in (0, 1)]
    try:
        _, err = procs[0].communicate(timeout=120)  # a hang guard only
        assert procs[0].returncode == 1, err
        assert "Traceback" not in err, err
        assert "dspark-sidecar: rank 0: a peer rank left during the warm-up step (" in err, err
        assert not (sock / "rank0.sock").exists()
    finally:
        for p in procs:
            _kill(p)


def test_a_failure_of_the_rank_s_own_warm_up_is_not_blamed_on_a_peer(monkeypatch):
    """Only an error out of a collective is a peer lost: this rank's own (out of memory, a kernel that fails)
    is raised as it is, with its traceback; as PeerLost it would send the reader to a peer that printed nothing."""
    import threading

    import pytest

    from dspark_sidecar.server import startup
    from dspark_sidecar.server.process_group import PeerLost

    def oom(ctx):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(startup, "warm_up", oom)
    with pytest.raises(RuntimeError, match="out of memory") as info:
        startup.StartUp(0, threading.Event()).warm_up(None)
    assert not isinstance(info.value, PeerLost)


def test_a_second_signal_during_the_unwinding_does_not_cut_its_cleanup_short(monkeypatch):
    """A stop while rank 0 writes the synthetic checkpoint raises SystemExit(0) for the writer's cleanup (its
    partial folder goes). A second signal meanwhile (a supervisor repeating SIGTERM, a Ctrl-C on top) must let
    that cleanup run on: raised again, it cut the cleanup short; as a plain start-up stop, os._exit skipped it."""
    import threading

    import pytest

    from dspark_sidecar.server import startup

    start_up = startup.StartUp(0, threading.Event())
    ended: list[object] = []
    monkeypatch.setattr(startup.os, "_exit", ended.append)
    monkeypatch.setattr(start_up, "release", lambda: ended.append("release"))
    cleaned = []
    with pytest.raises(SystemExit) as info:
        with start_up.unwinding():
            try:
                start_up.on_signal(signal.SIGTERM, None)
            finally:  # the writer's cleanup, which a second signal reaches
                start_up.on_signal(signal.SIGINT, None)
                cleaned.append("inside")
    start_up.on_signal(signal.SIGTERM, None)  # and one more once the unwinding has left the writer
    assert info.value.code == 0 and cleaned == ["inside"] and start_up.stop.is_set()
    assert ended == [], "a later signal ended the process past the unwinding's cleanup"


def test_a_signal_after_the_unwinding_ends_the_rank_as_any_stop_during_start_up(monkeypatch):
    """Past the synthetic checkpoint's write, a stop ends the rank at once again (its files released, os._exit):
    left raising SystemExit, it unwound from wherever the main thread was, a half-made collective included."""
    import threading

    from dspark_sidecar.server import startup

    start_up = startup.StartUp(0, threading.Event())
    ended: list[object] = []
    monkeypatch.setattr(startup.os, "_exit", ended.append)
    monkeypatch.setattr(start_up, "release", lambda: ended.append("release"))
    with start_up.unwinding():
        pass  # the write, done
    start_up.on_signal(signal.SIGTERM, None)  # raised SystemExit(0) with `unwind` left set
    assert ended == ["release", 0] and start_up.stop.is_set()


RANK_STOPPED_WRITING_THE_CHECKPOINT = """
import sys, time
from pathlib import Path
from dspark_sidecar.drafter import checkpoint
def write(cfg, out, seed=0):  # the embedded checkpoint's write, long (a full preset: gigabytes)
    Path(out).mkdir(parents=True)
    (Path(out) / "model.safetensors").write_bytes(bytes(4096))
    Path(sys.argv[-1]).touch()
    time.sleep(3600)
checkpoint.write_synthetic_checkpoint = write
from dspark_sidecar import cli
sys.exit(cli.main(sys.argv[1:-1]))
"""


def test_sigterm_while_rank_0_writes_the_synthetic_checkpoint_leaves_no_partial_folder(tmp_path):
    """Under torchrun rank 0 writes the embedded synthetic checkpoint itself (serve's parent does not run).
    A stop then ended it with os._exit, which skipped the writer's cleanup: its partial folder stayed in
    the cache, one more at each stop."""
    sock, cache, marker = tmp_path / "sock", tmp_path / "cache", tmp_path / "writing"
    env = dict(_rank0_env(), XDG_CACHE_HOME=str(cache))
    p = subprocess.Popen([sys.executable, "-c", RANK_STOPPED_WRITING_THE_CHECKPOINT, "serve", "--tp", "1", "--device",
                          "cpu", "--socket-dir", str(sock), str(marker)], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_until(marker.exists, 60, f"the rank's marker {marker.name}", watch=p, interval_s=0.1)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)  # a hang guard only
        assert p.returncode == 0 and "Traceback" not in err, err
        assert "SIGTERM during start-up" in err, err
        assert not list((cache / "dspark-sidecar").iterdir()), "a partial synthetic checkpoint was left behind"
        assert not (sock / "rank0.sock").exists()
    finally:
        _kill(p)


RANK_IN_ITS_WARM_UP = """
import sys, time
from pathlib import Path
from dspark_sidecar.server import startup
def warm_up(ctx, **kw):  # past the servicer (its lease socket bound), in the warm-up: a stop, or a failure
    Path(sys.argv[-1]).touch()
    if sys.argv[-2] == "fail":
        raise MemoryError("the warm-up ran out of memory")
    time.sleep(3600)
startup.warm_up = warm_up
from dspark_sidecar import cli
sys.exit(cli.main(sys.argv[1:-2]))
"""


def _rank_in_its_warm_up(sock: Path, marker: Path, how: str) -> subprocess.Popen:
    """Rank 0 of a TP-1 group (as under torchrun, no launcher of ours) that stops in its warm-up (`how`: "wait"
    for a signal, or "fail"), its marker touched once the warm-up began."""
    env = _rank0_env()
    return subprocess.Popen([sys.executable, "-c", RANK_IN_ITS_WARM_UP, "serve", "--tp", "1", "--device", "cpu",
                             "--socket-dir", str(sock), how, str(marker)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def test_a_rank_stopped_in_its_warm_up_leaves_no_lease_socket(tmp_path):
    """The lease socket (DIR/rank{r}.lease) is bound with the servicer, before the warm-up and the last barrier.
    A stop there ended the rank (exit 0, its gRPC socket removed) with the lease socket left in the folder, a
    socket nobody answers on until the next start; SECURITY.md says it is removed at shutdown."""
    sock, marker = tmp_path / "sock", tmp_path / "warming"
    p = _rank_in_its_warm_up(sock, marker, "wait")
    try:
        wait_until(marker.exists, 60, f"the rank's marker {marker.name}", watch=p, interval_s=0.1)
        assert (sock / "rank0.lease").is_socket()  # bound before the warm-up: the case this test is about
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)  # a hang guard only
        assert p.returncode == 0 and "SIGTERM during start-up" in err, err
        assert sorted(f.name for f in sock.iterdir() if f.is_socket()) == [], err
    finally:
        _kill(p)


def test_a_rank_that_fails_in_its_warm_up_leaves_no_lease_socket(tmp_path):
    """The same for a failure in the warm-up (out of memory, say): serve_rank removes "what start-up made" on its
    way out, which was the gRPC socket and rank 0's board, not the lease socket beside them."""
    sock, marker = tmp_path / "sock", tmp_path / "warming"
    p = _rank_in_its_warm_up(sock, marker, "fail")
    try:
        _, err = p.communicate(timeout=120)  # a hang guard only
        assert marker.exists() and p.returncode == 1 and "the warm-up ran out of memory" in err, err
        assert sorted(f.name for f in sock.iterdir() if f.is_socket()) == [], err
    finally:
        _kill(p)


PEER_LOST_WITH_A_THREAD_IN_THE_COLLECTIVE = """
import sys, threading
from dspark_sidecar.server import app
from dspark_sidecar.server.process_group import PeerLost
def serve_rank(*a, **k):
    # A thread of the group still inside the collective the peer left (gloo's own are C++ threads, which the
    # interpreter's exit destroyed while they ran: SIGABRT, "terminate called without an active exception").
    threading.Thread(target=threading.Event().wait, name="in-the-lost-collective").start()
    raise PeerLost("rank 0: a peer rank left during the warm-up step (Connection closed by peer)")
app.serve_rank = serve_rank
from dspark_sidecar import cli
sys.exit(cli.main(sys.argv[1:]))
"""


def test_a_rank_that_lost_a_peer_exits_1_without_the_interpreter_s_teardown(tmp_path):
    """After PeerLost the rank's group is broken mid-collective: CI (session 58) saw rank 0 print its one line
    and then die of SIGABRT ("terminate called without an active exception") in the interpreter's exit, which
    destroyed gloo's threads still waiting in the lost collective, so the launcher saw -6, not 1. The line is
    printed and the process ends with exit 1 at once (StartUp.release has removed its files already); a thread
    still in the collective neither aborts nor holds the exit."""
    p = subprocess.Popen([sys.executable, "-c", PEER_LOST_WITH_A_THREAD_IN_THE_COLLECTIVE, "serve", "--tp", "2",
                          "--device", "cpu", "--socket-dir", str(tmp_path / "sock")],
                         env=dict(_env(), RANK="0", WORLD_SIZE="2", LOCAL_RANK="0"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = p.communicate(timeout=60)  # before: the interpreter's exit waited on the thread for good
        assert p.returncode == 1, err
        assert err.strip().splitlines()[-1] == ("dspark-sidecar: rank 0: a peer rank left during the warm-up step "
                                                "(Connection closed by peer)"), err
    finally:
        _kill(p)


RANK_WHOSE_LEASE_KEEPER_FAILS = """
import errno, sys, types
from dspark_sidecar.server import lease
def no_selector():  # past the lease socket's bind, inside the servicer's making: out of descriptors (epoll_create1)
    raise OSError(errno.EMFILE, "Too many open files")
lease.selectors = types.SimpleNamespace(DefaultSelector=no_selector, EVENT_READ=lease.selectors.EVENT_READ)
from dspark_sidecar import cli
sys.exit(cli.main(sys.argv[1:]))
"""


def test_a_rank_that_fails_while_its_servicer_is_made_leaves_no_lease_socket(tmp_path):
    """The servicer binds the lease socket in its constructor; the rank took it for its own (StartUp.lease) only
    once the constructor had returned. A failure of the rest of the constructor (here out of descriptors), or a
    stop meanwhile, left the lease socket in the folder, nobody answering on it until the next start."""
    sock = tmp_path / "sock"
    env = _rank0_env()
    p = subprocess.run([sys.executable, "-c", RANK_WHOSE_LEASE_KEEPER_FAILS, "serve", "--tp", "1", "--device", "cpu",
                        "--socket-dir", str(sock)], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "Too many open files" in p.stderr, p.stderr
    assert sorted(f.name for f in sock.iterdir() if f.is_socket()) == [], p.stderr[-2000:]


def test_a_rank_whose_world_size_is_not_its_tp_is_refused_as_a_flag_before_it_listens(tmp_path):
    """torchrun --nproc-per-node 2 with --tp 1: each rank would take a shard of a TP it is not in. Refused as a flag
    (exit 2, one line, nothing in the socket folder), which no restart changes, before any socket is bound."""
    sock = tmp_path / "sock"
    env = dict(_env(), RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    p = subprocess.run([sys.executable, "-m", "dspark_sidecar", "serve", "--tp", "1", "--device", "cpu",
                        "--socket-dir", str(sock)], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stderr == ("dspark-sidecar: --tp 1: 2 ranks were started (WORLD_SIZE 2); start as many as --tp says "
                        "(torchrun --nproc-per-node)\n")
    assert not sock.exists() or not list(sock.iterdir())


_SIGNAL_AT_EVERY_LINE = """
import signal, sys, threading
from dspark_sidecar.server import startup

def stop_at_line(k):
    # "event": the threading.Event the rank's stop was (a signal at one of its lines hangs: how the test failed)
    start_up = startup.StartUp(0, threading.Event()) if sys.argv[1] == "event" else startup.StartUp(0)
    made = start_up.stop
    start_up.active = False  # serving: a signal drains through `stop`, the main thread in its beat's wait
    seen = [0]

    def trace(frame, event, arg):
        # A signal's handler runs on the main thread between two of its lines, wherever it is: here, at the k-th
        # line the wait runs (the handler's own lines not counted).
        if event == "line" and frame.f_code.co_name != "on_signal":
            seen[0] += 1
            if seen[0] == k:
                start_up.on_signal(signal.SIGTERM, None)
        return trace

    sys.settrace(trace)
    try:
        woke = made.wait(2)
    finally:
        sys.settrace(None)
    signalled = seen[0] >= k
    assert woke == signalled, (k, woke)  # woken by the signal at once; never signalled: its timeout (ends the run)
    return signalled

k = 1
while stop_at_line(k):  # every line of the wait in turn, until the wait ended before its k-th line
    k += 1
print("ok", k - 1)
"""


def test_a_stop_signalled_at_any_line_of_the_serving_loop_s_wait_ends_it(tmp_path):
    """The serving loop waits on `stop` (a beat's timed wait) and SIGTERM's handler sets it, on the same (main)
    thread. With a threading.Event a signal that landed while the wait held the event's lock (its Condition's,
    not re-entrant) had set() wait for that lock for good: a rank that never drained, killed by the launcher 60 s
    later (2 hangs in 75 SIGTERMs of a served TP-1 rank). Here the handler runs at every line of the wait in
    turn; each wait must end at once."""
    script = tmp_path / "signal_at_every_line.py"
    script.write_text(_SIGNAL_AT_EVERY_LINE)
    env = dict(_env(), PYTHONPATH=os.environ.get("PYTHONPATH", ""))
    try:
        out = subprocess.run([sys.executable, str(script), "stop"], capture_output=True, text=True, timeout=60, env=env)
    except subprocess.TimeoutExpired:
        raise AssertionError("a signal at some line of the wait hung it") from None
    assert out.returncode == 0 and out.stdout.startswith("ok "), (out.stdout, out.stderr[-2000:])


def test_a_stop_landing_inside_a_write_to_stderr_still_ends_the_rank(monkeypatch):
    """The start-up stop logs a line, from the signal handler, to the stream the rank logs to (stderr). A signal
    landing while the main thread is inside that stream's write (a slow journal, a full pipe) has the handler's
    write re-enter the same buffered writer: Python raises RuntimeError("reentrant call"), logging's handleError
    raises it again writing its report to the same stderr, and it came out of the handler: the rank's files were
    not released and os._exit never ran. The line is lost, the stop is not. Reproduced with a real BufferedWriter
    whose raw write runs the handler, as a signal between two bytecodes of that write would."""
    import io
    import logging
    import threading

    from dspark_sidecar.server import startup

    start_up = startup.StartUp(0, threading.Event())
    ended: list[object] = []
    monkeypatch.setattr(startup.os, "_exit", ended.append)
    monkeypatch.setattr(start_up, "release", lambda: ended.append("release"))
    landed: list[BaseException | None] = []

    class Raw(io.RawIOBase):
        def writable(self) -> bool:
            return True

        def write(self, b) -> int:
            if not landed:  # the signal, delivered inside the buffered writer's write (its lock held)
                landed.append(None)
                start_up.on_signal(signal.SIGTERM, None)
            return len(b)

    stderr = io.TextIOWrapper(io.BufferedWriter(Raw(), buffer_size=8), write_through=True)
    monkeypatch.setattr(sys, "stderr", stderr)  # where logging's handleError reports a failed emit
    handler = logging.StreamHandler(stderr)
    logger = logging.getLogger("dspark_sidecar.server")
    # Enabled whatever an earlier test's logging set-up left (a level, a dictConfig's disabling); setLevel, not the
    # attribute, so the logger's cache of isEnabledFor answers is cleared both ways.
    monkeypatch.setattr(logger, "disabled", False)
    monkeypatch.setattr(logging.root.manager, "disable", logging.NOTSET)
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        logger.info("rank 0: loading the checkpoint")  # the main thread's own line, longer than the buffer
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert landed and ended == ["release", 0] and start_up.stop.is_set()
