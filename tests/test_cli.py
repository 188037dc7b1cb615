"""The command line: a flag or environment value that cannot be used is one line naming it, exit status 2."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from dspark_sidecar import cli


@pytest.mark.parametrize("env, value, words, argv", [
    ("DSPARK_TP", "four", "DSPARK_TP='four': expected an integer", ["status"]),
    ("DSPARK_WARMUP", "ture", "DSPARK_WARMUP='ture': expected one of 1, true", ["serve"]),
    ("DSPARK_LOG_LEVEL", "verbose", "DSPARK_LOG_LEVEL='VERBOSE': expected DEBUG", ["step"]),
    # '' as a path is the working directory: serve listened on ./rank0.sock, saying nothing
    ("DSPARK_SOCKET_DIR", "", "DSPARK_SOCKET_DIR (--socket-dir) is set but empty", ["status", "--tp", "1"]),
    # blanks only (`DSPARK_SOCKET_DIR=" $X"`): a folder named '  ' in the working directory, as silently
    ("DSPARK_SOCKET_DIR", "  ", "DSPARK_SOCKET_DIR (--socket-dir) is set but empty", ["status", "--tp", "1"]),
    # the demo's variable: it named a --demo-rounds flag that no command has
    ("DSPARK_DEMO_ROUNDS", "", "DSPARK_DEMO_ROUNDS (demo --rounds) is set but empty", ["demo"]),
])
def test_a_bad_environment_value_is_one_line_naming_it(env, value, words, argv, monkeypatch, capsys):
    """These used to end in a raw traceback (int('four'), logging's own ValueError), and a misspelt
    boolean silently read as false (DSPARK_WARMUP=ture turned warm-up off). Each is refused by a command
    that reads it, before anything starts."""
    monkeypatch.setenv(env, value)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("dspark-sidecar: ") and words in err and "Traceback" not in err


@pytest.mark.parametrize("env, value, readers", [
    ("DSPARK_WARMUP", "ture", {"serve"}),
    ("DSPARK_MAX_REQS", "64x", {"serve"}),
    ("DSPARK_CHECKPOINT", "", {"serve"}),
    ("DSPARK_DEMO_ROUNDS", "", {"demo"}),
    ("DSPARK_TP", "four", {"serve", "status", "demo"}),
    ("DSPARK_SOCKET_DIR", "", {"serve", "status"}),
])
@pytest.mark.parametrize("cmd", ["serve", "status", "step", "demo", "bench"])
def test_a_command_is_not_refused_for_a_variable_only_another_command_reads(env, value, readers, cmd, monkeypatch,
                                                                             capsys):
    """Every command built every command's flags, and with them their DSPARK_* defaults: `step --help`, the
    bench or the demo (whose sidecar gets none of serve's variables: README) exited 2 for a DSPARK_WARMUP=ture
    or an empty DSPARK_CHECKPOINT that only serve reads, and serve for the demo's DSPARK_DEMO_ROUNDS."""
    monkeypatch.setenv(env, value)
    with pytest.raises(SystemExit) as exc:
        cli.main([cmd, "--help"])
    assert exc.value.code == 0, capsys.readouterr().err
    # Its readers' help too: a bad value is refused where it is used, in a run without the flag
    # (test_a_bad_environment_value_is_one_line_naming_it); the help says which flag overrides it.


@pytest.mark.parametrize("argv, env, value, words", [
    (["status", "--tp", "0"], "DSPARK_TP", "four", "--tp: must be at least 1, got 0"),
    (["serve", "--max-reqs", "0"], "DSPARK_MAX_REQS", "64x", "--max-reqs: must be 1..256, got 0"),
    (["serve", "--no-warmup", "--tp", "0"], "DSPARK_WARMUP", "ture", "--tp: must be 1..64, got 0"),
    (["demo", "--rounds", "0"], "DSPARK_DEMO_ROUNDS", "", "--rounds: must be >= 1, got 0"),
])
def test_a_flag_given_overrides_a_malformed_variable_unread(argv, env, value, words, monkeypatch, capsys):
    """The variable was converted when the parser was built: `DSPARK_TP=four status --tp 1` exited 2 for the
    variable the flag overrides, so a bad ConfigMap value could not be mended from the command line. Each run here
    is stopped by its flag's own check instead (before anything starts), naming the flag, not the variable."""
    monkeypatch.setenv(env, value)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and env not in err, err


def test_a_variable_s_value_is_read_without_the_space_around_it(monkeypatch):
    """int() and float() strip their text; a path or a word did not: DSPARK_SOCKET_DIR="/run/dspark " (a YAML
    value quoted with its space, a $(cat file)'s newline) named a folder whose name ends in a blank."""
    import argparse

    monkeypatch.setenv("DSPARK_SOCKET_DIR", " /run/dspark\n")
    monkeypatch.setenv("DSPARK_PRESET", "minimax-m3.1 ")
    p = argparse.ArgumentParser()
    cli._add_serve_flags(p)
    a = cli.resolve_env_defaults(p.parse_args([]))
    assert a.socket_dir == Path("/run/dspark") and a.preset == "minimax-m3.1"


@pytest.mark.parametrize("value, on", [("TRUE", True), ("Yes", True), ("On", True), ("OFF", False), ("No", False),
                                       (" 1", True), ("off\n", False)])
def test_a_boolean_variable_is_read_whatever_its_case(value, on, monkeypatch):
    """Booleans take 1/true/yes/on or 0/false/no/off (README); the word is checked lower-cased, so an upper-case
    TRUE that passes the check must also read as true, not turn the flag off in silence. Space around the word
    is dropped, as int() drops it from DSPARK_TP=" 2 "."""
    import argparse

    monkeypatch.setenv("DSPARK_ALLOW_REMOTE", value)
    monkeypatch.setenv("DSPARK_WARMUP", value)
    p = argparse.ArgumentParser()
    cli._add_serve_flags(p)
    a = cli.resolve_env_defaults(p.parse_args([]))
    assert a.allow_remote is on and a.warmup is on


def test_a_step_over_no_context_runs(capsys):
    """--context 0 (requests with no committed row) is a step the sidecar serves; only a negative one is refused.
    Also a step that fits the host's memory is not refused by the size check."""
    assert cli.main(["step", "--reqs", "1", "--context", "0", "--repeat", "1", "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("preset tiny: 1 requests x 7 rows, context 0, fp32") and "median" in out, out


@pytest.mark.parametrize("value, level", [("debug", "DEBUG"), ("warn", "WARN"), ("FATAL", "FATAL"), (" info ", "INFO")])
def test_the_log_level_is_read_on_the_oldest_python_pyproject_admits(value, level, monkeypatch):
    """logging.getLevelNamesMapping is Python 3.11's, and pyproject's requires-python admits 3.10 (Ubuntu 22.04's
    python3, in which OPERATIONS.md's bare-metal venv is made): there every command, `serve` included, ended in
    an AttributeError before it read a flag. Removed here, as 3.10 lacks it; logging's names still pass."""
    monkeypatch.delattr(logging, "getLevelNamesMapping", raising=False)
    monkeypatch.setenv("DSPARK_LOG_LEVEL", value)
    assert cli._log_level() == level
    monkeypatch.setenv("DSPARK_LOG_LEVEL", "verbose")
    with pytest.raises(cli.UsageError, match="DSPARK_LOG_LEVEL='VERBOSE': expected DEBUG"):
        cli._log_level()


_TINY_BENCH = ["--device", "cpu", "--preset", "tiny", "--reqs", "1", "--contexts", "40", "--repeats", "1"]


@pytest.mark.parametrize("argv, words", [
    (["serve", "--tp", "0"], "--tp: must be 1..64, got 0"),
    (["serve", "--target-checkpoint", "/nonexistent/target"], "--target-checkpoint: given without --checkpoint"),
    (["serve", "--max-message-bytes", str(1 << 32)], "--max-message-bytes: must be 1 MiB..2^31 - 1"),
    (["serve", "--dist-timeout-s", "0"], "--dist-timeout-s: must be 1..86400"),
    (["serve", "--exit-with-pid", "-1"], "--exit-with-pid: must be 0 (off) or a process id 1..4194304, got -1"),
    (["serve", "--tcp-base-port", "19000", "--metrics-port", "19002"], "--metrics-port: port 19002 is also --tcp-base-port's"),
    (["serve", "--preset", "minimax"], "unknown 'minimax'"),
    (["serve", "--tp", "3"], "not divisible by TP size 3"),
    (["status", "--tp", "0"], "--tp: must be at least 1, got 0"),
    # 0 or nan: every live rank printed UNREACHABLE DEADLINE_EXCEEDED, exit 1, naming no flag
    (["status", "--tp", "1", "--timeout", "0"], "--timeout: must be a number of seconds above 0, got 0.0"),
    (["status", "--tp", "1", "--timeout", "nan"], "--timeout: must be a number of seconds above 0, got nan"),
    # above serve's 64 (a DSPARK_TP of 4000, a typo): it probed every rank one by one, --timeout each when hung
    (["status", "--tp", "65"], "--tp: must be 1..64 (serve's), got 65"),
    # step: each of these loaded the drafter and then ended in a traceback (max() of an empty sequence,
    # torch.arange's bounds, an UnboundLocalError with no step timed)
    (["step", "--reqs", "0"], "--reqs: must be 1..256, got 0"),
    (["step", "--context", "-5"], "--context: must be 0 or more, got -5"),
    (["step", "--repeat", "0"], "--repeat: must be at least 1, got 0"),
    # above the most requests a sidecar serves in a step (serve's --max-reqs, bench's --reqs): it ran on for minutes
    (["step", "--reqs", "257", "--context", "0", "--repeat", "1"], "--reqs: must be 1..256, got 257"),
    # demo: DemoConfig's and the harness's ValueError ended in a traceback naming a field, not the flag
    (["demo", "--rounds", "0"], "--rounds: must be >= 1, got 0"),
    (["demo", "--max-reqs", "0"], "--max-reqs: must be 1..256, got 0"),
    (["demo", "--tp", "0"], "--tp: must be at least 1, got 0"),
    (["demo", "--required-tp", "0"], "--required-tp: must be at least 1, got 0"),
    (["demo", "--use-running-sidecar"], "--use-running-sidecar: needs --socket-dir"),
    # ... and the demo's own sidecar exited 2 after it had been started (a RuntimeError traceback)
    (["demo", "--rendezvous-ms", "0"], "--rendezvous-ms: must be 1..60000, got 0"),
    (["demo", "--tp", "65"], "--tp: must be 1..64, got 65"),
    # a verifying demo at a TP the shim does not forward at compared nothing: exit 1 after eight processes
    (["demo", "--tp", "2"], "--tp 2: the shim forwards only at --required-tp 4, so no round would be compared"),
    (["bench", "--reqs", "1,x"], "--reqs: comma-separated integers, got '1,x'"),
    (["bench", "--reqs", "0", "--device", "cpu"], "--reqs: request counts in 1.."),
    (["bench", "--repeats", "0", "--device", "cpu"], "--repeats: at least 1, got 0"),
    (["bench", "--sidecar-backend", "cuda", "--device", "cpu"], "--sidecar-backend: one of"),
    # --shard-of 0 reached ParallelContext (a traceback); --tp 0 ran the one-process bench as if not given
    (["bench", "--shard-of", "0", "--device", "cpu"], "--shard-of: a TP size of at least 1, got 0"),
    (["bench", "--tp", "0", "--device", "cpu"], "--tp: at least 1, got 0"),
    # bench_tp times TP N's shard whatever --shard-of said: the flag was ignored without a word
    (["bench", "--tp", "2", "--shard-of", "4", *_TINY_BENCH], "--shard-of 4: with --tp 2 the shard timed is TP 2's"),
    # a shard of a TP the preset does not split over: the drafter's words alone, naming no flag, once the
    # bench had made its --out-dir and drawn the weights
    (["bench", "--shard-of", "3", *_TINY_BENCH], "--shard-of 3: num_attention_heads: 8 is not divisible by TP size 3"),
    # --shim-phases split nothing, silently, where no mode h runs: without h in --modes, or at --tp N (a tiny
    # bench, so that a regression that runs it fails soon)
    (["bench", "--modes", "acd", "--shim-phases", *_TINY_BENCH], "--shim-phases: splits mode h's time, and --modes acd"),
    (["bench", "--tp", "2", "--shim-phases", *_TINY_BENCH], "--shim-phases: the one-process bench's mode h only"),
    # a GPU backend for a sidecar on the CPU, which serve refuses: every mode d-i failed after the run (exit 1, each
    # row naming the sidecar's log), or at --tp N the run ended in "the bench's sidecar did not start"
    (["bench", "--modes", "ad", "--sidecar-backend", "triton", *_TINY_BENCH], "--sidecar-backend triton: its kernels"),
    (["bench", "--tp", "2", "--modes", "a", "--sidecar-backend", "flydsl", *_TINY_BENCH],  # --tp N: a sidecar always
     "--sidecar-backend flydsl: its kernels"),
])
def test_a_flag_that_cannot_be_used_is_refused_before_anything_starts(argv, words, capsys, no_launch):
    """Checked in the parent, before a rank, a socket or a sidecar exists (each rank used to print its
    own traceback, some after loading the weights, or a flag was ignored: --target-checkpoint alone). no_launch:
    a check lost (a mutation of ServeConfig's) started a real TP-4 sidecar in the default /tmp/dspark-sidecar,
    shared by every run on the host, and the test hung in it."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1, err


def test_a_gpu_sidecar_backend_on_the_cpu_is_refused_only_where_the_bench_starts_a_sidecar(tmp_path, monkeypatch):
    """--sidecar-backend names the bench's sidecar's backend: modes a-c on the CPU start none, so it is no reason to
    refuse them (d-i and --tp N start one, which serve would refuse: the list above)."""
    from dspark_sidecar import bench

    ran = []
    monkeypatch.setattr(bench, "run_bench", lambda bc, device: ran.append(bc.modes) or {
        "device": "cpu", "copy_bandwidth_GBps": 1.0, "rows": []})
    assert cli.main(["bench", "--modes", "abc", "--sidecar-backend", "triton", "--device", "cpu", "--preset", "tiny",
                     "--out-dir", str(tmp_path)]) == 0
    assert ran == [("a", "b", "c")]


def test_a_bench_out_dir_that_cannot_be_a_folder_is_refused_before_the_run(tmp_path, monkeypatch, capsys):
    """run_bench made --out-dir after every mode had run: a file there ended the bench in a traceback."""
    from dspark_sidecar import bench

    monkeypatch.setattr(bench, "run_bench", lambda *a: pytest.fail("the bench ran"))
    taken = tmp_path / "taken"
    taken.write_text("")
    for out in (taken, taken / "sub"):
        assert cli.main(["bench", "--device", "cpu", "--out-dir", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"--out-dir: cannot make '{out}' a folder" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("argv, taken, kind", [
    ([], "bench.json", "a folder"),
    ([], "bench.png", "a folder"),
    (["--tp", "2", "--preset", "tiny"], "bench-tp2.json", "a folder"),
    (["--tp", "2", "--preset", "tiny"], "single-gpu/bench.png", "a folder"),
    (["--tp", "2", "--preset", "tiny"], "single-gpu", "not a folder"),
])
def test_a_bench_output_whose_name_is_taken_is_refused_before_the_run(tmp_path, monkeypatch, capsys, argv, taken, kind):
    """A folder named bench.json (or bench.png, or a file named single-gpu) in --out-dir passed the folder checks:
    every mode ran, then writing the report ended the bench in a traceback (IsADirectoryError), its figures lost."""
    from dspark_sidecar import bench, bench_tp

    monkeypatch.setattr(bench, "run_bench", lambda *a: pytest.fail("the bench ran"))
    monkeypatch.setattr(bench_tp, "run_tp_bench", lambda *a: pytest.fail("the bench ran"))
    if kind == "a folder":
        (tmp_path / taken).mkdir(parents=True)
    else:
        (tmp_path / taken).write_text("")
    assert cli.main(["bench", "--device", "cpu", "--out-dir", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert f"--out-dir: '{tmp_path / taken}' is {kind}, where the bench writes its" in err and err.count("\n") == 1, err


def test_a_socket_folder_too_long_for_a_unix_socket_is_named(capsys):
    """gRPC's own bind error ("Failed to bind") named no flag."""
    assert cli.main(["serve", "--socket-dir", "/tmp/" + "d" * 120]) == 2
    assert "--socket-dir: " in capsys.readouterr().err


@pytest.mark.parametrize("flags, refused", [
    ({"tp": 2}, True),
    ({"tp": 2, "device": "cuda"}, True),
    ({"tp": 2, "dist_backend": "gloo"}, False),  # asked for: may share
    ({"tp": 2, "device": "cpu"}, False),
    ({"tp": 1}, False),
])
def test_more_ranks_than_gpus_under_nccl_is_refused_before_any_rank_starts(flags, refused, monkeypatch, capsys):
    """NCCL refuses two ranks of one group on one GPU at the first collective ("Duplicate GPU detected",
    run 207 on one H200): each rank printed a traceback after loading its shard."""
    import torch

    from dspark_sidecar.server import backend
    from dspark_sidecar.server.config import ServeConfig, ServeConfigError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    cfg = ServeConfig(**flags)
    if refused:
        with pytest.raises(ServeConfigError, match="--tp 2: 1 GPU\\(s\\) visible, and NCCL/RCCL cannot"):
            backend.check_gpu_placement(cfg)
        argv = ["serve"] + [w for k, v in flags.items() for w in (f"--{k.replace('_', '-')}", str(v))]
        # 75, restarted by systemd's unit: GPUs the host does not show yet (a driver still loading at boot) may
        # be there at the next start (review 321); a too-narrow CUDA_VISIBLE_DEVICES repeats the line every 5 s.
        assert cli.main(argv) == 75 and "1 GPU(s) visible" in capsys.readouterr().err
    else:
        backend.check_gpu_placement(cfg)
    backend.check_gpu_placement(cfg, visible=2)  # enough GPUs: never refused


@pytest.mark.parametrize("flags, gpu", [
    (["--device", "cpu"], True),  # GPUs there, but the ranks asked to compute on the CPU
    (["--device", "cpu"], False),
    ([], False),  # --device auto with no GPU visible: the ranks run on the CPU
])
def test_nccl_for_ranks_on_the_cpu_is_refused_before_any_rank_starts(flags, gpu, monkeypatch, capsys, tmp_path,
                                                                      no_launch):
    """NCCL moves GPU tensors only: each rank ended in torch's RuntimeError traceback from init_process_group
    ("Distributed package doesn't have NCCL built in" on a CPU build), and serve exited 1, naming no flag."""
    import torch

    from helpers.refusals import refused

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2 if gpu else 0)
    refused(["serve", "--tp", "2", "--dist-backend", "nccl", "--socket-dir", str(tmp_path / "s"), *flags], capsys,
            "--dist-backend nccl: ", "the CPU", sock_dir=tmp_path / "s")


def test_nccl_with_the_ranks_on_gpus_is_not_refused(monkeypatch):
    import torch

    from dspark_sidecar.server import backend
    from dspark_sidecar.server.config import ServeConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for device in ("auto", "cuda"):
        backend.check_gpu_placement(ServeConfig(tp=2, dist_backend="nccl", device=device), visible=2)


def test_the_readme_s_demo_rounds_default_is_the_parser_s(monkeypatch):
    """README said `--rounds N` (default 60); the command runs 100 rounds."""
    import re

    seen = []
    monkeypatch.delenv("DSPARK_DEMO_ROUNDS", raising=False)
    monkeypatch.setattr(cli, "cmd_demo", lambda a: seen.append(a.rounds) or 0)
    assert cli.main(["demo"]) == 0
    readme = (Path(cli.__file__).parent / "README.md").read_text()
    (documented,) = re.findall(r"`--rounds N` \(default (\d+)\)", readme)
    assert int(documented) == seen[0]


def test_status_says_a_loading_rank_answered_not_that_it_is_unreachable(tmp_path, capsys):
    """A half-up group: rank 0 listens but still loads (GetStatus answers UNAVAILABLE, "still loading"),
    rank 1's socket is not there. Both printed "UNREACHABLE UNAVAILABLE", so an operator could not tell a
    rank that is coming up from one that is gone. Exit 1 either way: no full report."""
    from concurrent import futures

    import grpc

    from dspark_sidecar.proto import sidecar_pb2_grpc as pb_grpc
    from dspark_sidecar.server.app import LateServicer
    from dspark_sidecar.server.errors import StatusInterceptor

    server = grpc.server(futures.ThreadPoolExecutor(2), interceptors=[StatusInterceptor()])
    pb_grpc.add_DrafterSidecarServicer_to_server(LateServicer(), server)  # no inner yet: loading
    assert server.add_insecure_port(f"unix:{tmp_path / 'rank0.sock'}")
    server.start()
    try:
        assert cli.main(["status", "--socket-dir", str(tmp_path), "--tp", "2", "--timeout", "5"]) == 1
    finally:
        server.stop(None)
    lines = capsys.readouterr().out.splitlines()
    rank0 = next(line for line in lines if line.startswith("== rank 0"))
    rank1 = next(line for line in lines if line.startswith("== rank 1"))
    assert "UNREACHABLE" not in rank0 and "LOADING" in rank0 and "still loading" in rank0, rank0
    assert "UNREACHABLE UNAVAILABLE" in rank1, rank1


def test_serve_help_shows_the_defaults_the_environment_sets(monkeypatch, capsys):
    """`serve --help` said "(default 4)" and "(default tiny)" whatever DSPARK_TP and DSPARK_PRESET set."""
    monkeypatch.setenv("DSPARK_TP", "2")
    monkeypatch.setenv("DSPARK_PRESET", "minimax-m3.1")
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text
    assert "tensor-parallel ranks (default 2)" in out
    assert "tiny | minimax-m3.1 (default minimax-m3.1)" in out


def test_status_into_a_reader_that_goes_away_ends_without_a_traceback(tmp_path):
    """`status | head -1` printed a BrokenPipeError traceback (two, chained to the rank's RpcError) once
    head had exited: the command's output is meant for pipes."""
    import os
    import subprocess
    import sys

    sock = tmp_path / "sock"
    sock.mkdir(mode=0o700)
    # Unbuffered, so that each rank's line is written as it is printed: the first reaches the reader while
    # the other 63 ranks are still asked, and those are written after the reader has gone (EPIPE).
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "dspark_sidecar", "status", "--socket-dir", str(sock), "--tp", "64",
                             "--timeout", "0.5"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first = proc.stdout.readline()
    proc.stdout.close()  # as head does after its line
    _, err = proc.communicate(timeout=120)
    assert first.startswith(b"== rank 0 "), first
    assert b"Traceback" not in err and b"BrokenPipeError" not in err, err.decode()[-2000:]
    assert proc.returncode == 1


def test_a_dspark_variable_nothing_reads_is_named_with_the_one_meant():
    """DSPARK_NO_WARMUP=1 (the variable of --no-warmup is DSPARK_WARMUP=0) and typos were ignored in silence."""
    dests = ["help", "tp", "socket_dir", "warmup", "prelaunch", "cuda_graphs"]
    env = {"DSPARK_NO_WARMUP": "1", "DSPARK_SOCKETDIR": "/run/x", "DSPARK_FROBNICATE": "1", "DSPARK_TP": "4",
           "DSPARK_STEP_DEADLINE_MS": "50", "DSPARK_LOG_LEVEL": "INFO", "HOME": "/root", "XDSPARK_TP": "2"}
    assert cli.unknown_env(env, dests) == [
        "DSPARK_FROBNICATE is not read by dspark-sidecar; ignored",
        "DSPARK_NO_WARMUP is not read by dspark-sidecar; ignored (did you mean DSPARK_WARMUP?)",
        "DSPARK_SOCKETDIR is not read by dspark-sidecar; ignored (did you mean DSPARK_SOCKET_DIR?)",
    ]


def test_serve_warns_of_an_unread_dspark_variable_before_it_starts(monkeypatch, capsys, caplog):
    """Named by the parent before anything starts (here: before the TP check refuses --tp 3)."""
    monkeypatch.setenv("DSPARK_NO_WARMUP", "1")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("DSPARK_LAUNCHER_PID", raising=False)
    with caplog.at_level("WARNING", logger="dspark_sidecar.cli"):
        assert cli.main(["serve", "--tp", "3"]) == 2
    assert [r.getMessage() for r in caplog.records if r.name == "dspark_sidecar.cli"] == [
        "DSPARK_NO_WARMUP is not read by dspark-sidecar; ignored (did you mean DSPARK_WARMUP?)"]
    assert "not divisible by TP size 3" in capsys.readouterr().err


def test_a_broken_pipe_that_is_not_stdout_s_is_not_silenced():
    """Only a reader of stdout that has gone is ended quietly (exit 1, no traceback). Any other
    BrokenPipeError (a pipe to a child process that died: the demo's and bench's spawned ranks) was
    swallowed the same way: exit 1 with no word at all, and stdout pointed at /dev/null."""
    import subprocess
    import sys

    code = ("import sys; from dspark_sidecar import cli\n"
            "def boom(argv): raise BrokenPipeError(32, 'Broken pipe (a child process)')\n"
            "cli._main = boom\n"
            "sys.exit(cli.main([]))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "BrokenPipeError" in proc.stderr and "a child process" in proc.stderr, proc.stderr[-2000:]


def _a_gone_pid() -> int:
    """The pid of a process that has exited and been reaped (no process has it, barring a reuse)."""
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", ""])
    p.wait()
    return p.pid


def test_serve_reads_dspark_exit_with_pid_and_refuses_a_process_already_gone(monkeypatch, capsys, caplog, no_launch):
    """--exit-with-pid's variable is read (no "not read" warning), and a pid that names no running process
    is one line and exit 2 before any rank: the launcher would stop the sidecar as soon as it started."""
    from helpers.refusals import refused

    pid = _a_gone_pid()
    monkeypatch.setenv("DSPARK_EXIT_WITH_PID", str(pid))
    with caplog.at_level("WARNING", logger="dspark_sidecar.cli"):
        refused(["serve", "--tp", "1", "--device", "cpu"], capsys, f"--exit-with-pid: process {pid} is not running")
    assert not [r for r in caplog.records if r.name == "dspark_sidecar.cli"]


def test_exit_with_pid_under_torchrun_is_said_to_be_ignored(monkeypatch, caplog):
    """Under torchrun there is no serve launcher to watch the process: rank 0 says so rather than ignore it
    in silence (here before the TP check refuses --tp 3, so nothing starts)."""
    import os

    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("DSPARK_LAUNCHER_PID", raising=False)
    with caplog.at_level("WARNING", logger="dspark_sidecar.cli"):
        assert cli.main(["serve", "--tp", "3", "--exit-with-pid", str(os.getpid())]) == 2
    assert [r.getMessage() for r in caplog.records if r.name == "dspark_sidecar.cli"] == [
        "--exit-with-pid is ignored under torchrun: its agent, not serve, starts and stops the ranks"]


def test_bench_repeats_default_is_written_once_and_is_bench_config_s(monkeypatch):
    """--repeats' default was written twice, as a literal in cli.py and in bench.BenchConfig (100 in both, free
    to drift apart): now both read bench_defaults.REPEATS, and cli.py writes no literal for it."""
    import ast
    from pathlib import Path

    from dspark_sidecar import bench_defaults
    from dspark_sidecar.bench import BenchConfig

    tree = ast.parse(Path(cli.__file__).read_text())
    (call,) = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and n.args
               and isinstance(n.args[0], ast.Constant) and n.args[0].value == "--repeats"]
    (default,) = [k.value for k in call.keywords if k.arg == "default"]
    assert not isinstance(default, ast.Constant), "cli.py writes --repeats' default itself"
    seen = []
    monkeypatch.setattr(cli, "cmd_bench", lambda a: seen.append(a.repeats) or 0)
    assert cli.main(["bench"]) == 0
    assert seen == [BenchConfig().repeats] == [bench_defaults.REPEATS]


def test_the_command_line_builds_its_parsers_without_torch():
    """bench_defaults exists so that cli.py need not import bench.py (torch) for a default: `--help` stays fast."""
    import subprocess
    import sys

    code = ("import sys\nfrom dspark_sidecar import cli\n"
            "try:\n    cli.main(['bench', '--help'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "--repeats" in out and out.splitlines()[-1] == "False", out


@pytest.mark.parametrize("argv, gpus, words", [
    # the tiny preset's 8 heads over 3 ranks: the sidecar exited 2 after it was started (a RuntimeError traceback)
    (["demo", "--tp", "3"], 0, "--tp 3: num_attention_heads: 8 is not divisible by TP size 3"),
    (["demo", "--tp", "3", "--use-running-sidecar", "--socket-dir", "/tmp/x"], 0, "--tp 3: num_attention_heads"),
    # serve's rules were checked on its default folder, not the demo's: a folder too long for a unix socket
    # ended in the launcher's traceback saying "a sidecar already answers" there (connect() fails, ENAMETOOLONG)
    (["demo", "--socket-dir", "/tmp/" + "d" * 110], 0, "--socket-dir: /tmp/ddd"),
    (["demo", "--socket-dir", "/tmp/a?b"], 0, "--socket-dir: /tmp/a?b holds '?'"),
    (["demo", "--use-running-sidecar", "--socket-dir", "/tmp/" + "d" * 110], 0, "--socket-dir: /tmp/ddd"),
    # the synthetic checkpoint's seed: 2^62 overflowed torch's generator (a traceback, two folders left in
    # $TMPDIR); -1 ran, though no `serve --seed` takes it for --use-running-sidecar
    (["demo", "--seed", str(1 << 62)], 0, "--seed: must be 0..4294967295, got 4611686018427387904"),
    (["demo", "--seed", "-1"], 0, "--seed: must be 0..4294967295, got -1"),
    # sidecar rank r and engine rank r on GPU r: the sidecar's ranks failed in a traceback after it was started
    (["demo", "--device", "cuda"], 0, "--device cuda: 0 GPU(s) visible, --tp 4 needs 4"),
    (["demo", "--device", "cuda", "--tp", "2", "--required-tp", "2"], 1,
     "--device cuda: 1 GPU(s) visible, --tp 2 needs 2"),
])
def test_a_demo_flag_the_sidecar_or_harness_would_refuse_is_refused_before_anything_starts(
        argv, gpus, words, monkeypatch, capsys):
    """Each of these started the demo (a checkpoint written, a sidecar launched) and ended in a traceback."""
    import torch

    from dspark_sidecar.client import demo

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)

    def started(cfg):
        raise AssertionError(f"the demo started with {argv}")

    monkeypatch.setattr(demo, "run_demo", started)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("dspark-sidecar: ") and words in err and err.count("\n") == 1, err


def test_a_demo_that_does_not_verify_runs_at_a_tp_the_shim_does_not_forward_at(monkeypatch, capsys):
    """The refusal of --tp != --required-tp is for a verifying demo (nothing would be compared): --no-verify is the
    documented way to watch every round fall back, and a mutation that refused it too passed every test."""
    from dspark_sidecar.client import demo

    ran = []

    class Ran(Exception):
        pass

    def run_demo(cfg):
        ran.append(cfg)
        raise Ran  # stop here: the checks before the run are what is tested

    monkeypatch.setattr(demo, "run_demo", run_demo)
    with pytest.raises(Ran):
        cli.main(["demo", "--tp", "2", "--no-verify", "--rounds", "1"])
    assert [(c.tp, c.required_tp, c.verify) for c in ran] == [(2, 4, False)]
    assert capsys.readouterr().err == ""


def test_the_demo_on_a_socket_folder_where_nothing_serves_fails_in_one_line(capsys):
    """--use-running-sidecar where no sidecar answers ended in gRPC's own traceback (_InactiveRpcError, exit 1
    by accident): README promises a one-line reason on stderr."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="dsp-") as empty:
        assert cli.main(["demo", "--rounds", "2", "--use-running-sidecar", "--socket-dir", empty]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"dspark-sidecar demo: FAILED: no sidecar status from {empty} (rank 0: UNAVAILABLE"), err
    assert err.count("\n") == 1 and "Traceback" not in err, err


def test_sigterm_unwinds_the_one_process_bench(monkeypatch):
    """`bench` under SIGTERM died at once: its sidecar's folder (dspark-bench-*) stayed in $TMPDIR and, on CPU,
    the KV cache's shared memory with it. Now run_bench's finally (Bench.close) runs, and the exit is 143."""
    import os
    import signal
    import time

    from dspark_sidecar import bench

    unwound = []

    def run(bc, device):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(3)  # a step: a SIGTERM ends it
        finally:
            unwound.append("closed")
        raise AssertionError("SIGTERM did not stop the bench")

    monkeypatch.setattr(bench, "run_bench", run)
    def caller_s(signum, frame):  # stands for the default action, which would end pytest too
        pass

    before = signal.signal(signal.SIGTERM, caller_s)
    try:
        with pytest.raises(SystemExit) as stopped:
            cli.main(["bench", "--device", "cpu", "--preset", "tiny"])
        assert signal.getsignal(signal.SIGTERM) is caller_s  # the command's handler ends with the bench
    finally:
        signal.signal(signal.SIGTERM, before)
    assert stopped.value.code == 128 + signal.SIGTERM and unwound == ["closed"]


@pytest.mark.parametrize("name", ["x" * 120, "a%41b", "a?b"])
def test_status_refuses_a_folder_no_client_can_reach_saying_why(name, tmp_path, capsys):
    """A folder serve refuses (past sun_path, or URI syntax gRPC reads in a unix: target): every rank printed
    "UNREACHABLE UNKNOWN" (or UNAVAILABLE) under gRPC's own log lines, naming nothing ('%41' even asked
    another folder's ranks). One line naming --socket-dir, exit 2, as serve and demo say it."""
    assert cli.main(["status", "--socket-dir", str(tmp_path / name), "--tp", "1", "--timeout", "0.5"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("dspark-sidecar: --socket-dir: "), (out, err)


def test_a_step_bigger_than_the_host_s_memory_is_refused_before_it_allocates(monkeypatch, capsys):
    """`step --context 10000000` (tiny preset, one request) allocated the KV cache and the context's taps until the
    kernel's OOM killer ended it (SIGKILL, no line; on a shared host it may end another process instead). Sized
    first, against the host's memory (made small here, so the test allocates nothing big either way)."""
    monkeypatch.setattr(cli, "_host_memory_bytes", lambda: 1 << 20, raising=False)
    assert cli.main(["step", "--reqs", "2", "--context", "4096", "--repeat", "1"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("dspark-sidecar: --reqs/--context: 2 requests of 4096 tokens need ") \
        and "more than this host's 0.0 GiB" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("short", [1, 0])
def test_a_step_is_refused_from_one_byte_more_than_the_host_s_memory(short, monkeypatch, capsys):
    """The bound is the host's memory itself: the test above refuses with room to spare, and a mutation that
    allowed twice the host's memory passed it. Sized as cmd_step sizes it: the KV cache and the context's taps."""
    import math

    import torch

    from dspark_sidecar.drafter import scenario
    from dspark_sidecar.drafter.config import load_config
    from dspark_sidecar.drafter.kv_cache import kv_storage_shape

    cfg, reqs, context = load_config("tiny"), 1, 64
    pages = scenario.pages_needed(context + 7, 16) * reqs
    itemsize = torch.bfloat16.itemsize
    need = (cfg.num_hidden_layers * math.prod(kv_storage_shape(cfg, 1, pages, 16)) * itemsize
            + reqs * context * cfg.tap_size * (4 + itemsize))
    monkeypatch.setattr(cli, "_host_memory_bytes", lambda: need - short)
    rc = cli.main(["step", "--reqs", str(reqs), "--context", str(context), "--repeat", "1"])
    out, err = capsys.readouterr()
    if short:
        assert rc == 2 and out == "" and "--reqs/--context: 1 requests of 64 tokens need" in err, err
    else:
        assert rc == 0 and "median" in out, (out, err)


def test_status_says_why_a_rank_is_unreachable(tmp_path, capsys):
    """"UNREACHABLE UNAVAILABLE" alone for a socket that is not there: the OS's words name it (no such file,
    connection refused, permission denied: OPERATIONS.md's first troubleshooting line)."""
    assert cli.main(["status", "--socket-dir", str(tmp_path), "--tp", "1", "--timeout", "2"]) == 1
    line = capsys.readouterr().out.strip()
    assert line.startswith("== rank 0") and "UNREACHABLE UNAVAILABLE: " in line and "No such file" in line, line



def test_sigterm_while_serve_writes_the_synthetic_checkpoint_unwinds_its_cleanup():
    """serve's parent writes the embedded synthetic checkpoint before any rank (and so any handler) exists: a
    SIGTERM there (a systemd stop during a first start) killed it at once, skipping the writer's removal of its
    partial folder, gigabytes for a full preset. It now unwinds as Ctrl-C does, and exits 0 as a stopped
    start-up. (In a child process: before the fix the signal killed whatever process ran it.)"""
    import os
    import subprocess
    import sys

    code = (
        "import os, signal, sys\n"
        "from dspark_sidecar import cli\n"
        "from dspark_sidecar.drafter import checkpoint\n"
        "def writing(cfg, seed):\n"
        "    try:\n"
        "        os.kill(os.getpid(), signal.SIGTERM)  # delivered here, in the main thread, mid-write\n"
        "        print('the write went on after SIGTERM')\n"
        "    finally:\n"
        "        print('partial folder removed', flush=True)  # the writer's own clean-up\n"
        "checkpoint.ensure_synthetic_checkpoint = writing\n"
        "try:\n"
        "    cli.main(['serve', '--tp', '1', '--device', 'cpu', '--preset', 'tiny'])\n"
        "finally:\n"
        "    print('handler restored', signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, flush=True)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "DSPARK_LAUNCHER_PID")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert proc.stdout.splitlines() == ["partial folder removed", "handler restored True"], proc.stdout


def test_bench_on_cuda_with_no_gpu_visible_is_one_line_before_the_run(monkeypatch, capsys):
    """`bench --device cuda` at --tp 1 (the default) on a host with no GPU went on into Bench(): the weights'
    first CUDA allocation ended it in torch's traceback ("Torch not compiled with CUDA enabled"), exit 1.
    --tp N > 1 and the demo already said it in one line (_check_gpus)."""
    import torch

    from dspark_sidecar import bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(bench, "run_bench", lambda *a: pytest.fail("the bench ran"))
    assert cli.main(["bench", "--device", "cuda", "--preset", "tiny"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dspark-sidecar: --device cuda: 0 GPU(s) visible") and err.count("\n") == 1, err


def _interrupted(patch: str, *argv: str):
    """Run `dspark-sidecar ARGV` in a child whose `patch` (Python lines) makes a Ctrl-C land mid-command."""
    import os
    import subprocess
    import sys

    code = f"import sys\nfrom dspark_sidecar import cli\n{patch}\nsys.exit(cli.main({list(argv)!r}))\n"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "DSPARK_LAUNCHER_PID")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)


def test_ctrl_c_ends_a_command_in_one_line_not_a_traceback():
    """Ctrl-C in `demo` (or status, step, bench) printed Python's KeyboardInterrupt traceback through
    run_demo, the harness and torch's spawn. The unwinding still runs; the command then says so in one line
    and ends by SIGINT as before (a shell, and serve's launcher for a rank still starting, see an interrupt),
    with what it had printed to a pipe still delivered."""
    import signal

    proc = _interrupted("def demo(a):\n    print('round 10/100')\n    raise KeyboardInterrupt\n"
                        "cli.cmd_demo = demo", "demo")
    assert proc.returncode == -signal.SIGINT, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout == "round 10/100\n"
    assert proc.stderr == "dspark-sidecar: interrupted\n", proc.stderr[-2000:]


def test_ctrl_c_while_serve_writes_the_synthetic_checkpoint_is_a_stopped_start_up():
    """README: Ctrl-C or SIGTERM during serve's start-up exits 0. SIGTERM while the parent wrote the embedded
    checkpoint did (its unwind test above); Ctrl-C there printed a KeyboardInterrupt traceback instead."""
    proc = _interrupted("from dspark_sidecar.drafter import checkpoint\n"
                        "def writing(cfg, seed):\n    try:\n        raise KeyboardInterrupt\n"
                        "    finally:\n        print('partial folder removed', flush=True)\n"
                        "checkpoint.ensure_synthetic_checkpoint = writing",
                        "serve", "--tp", "1", "--device", "cpu", "--preset", "tiny")
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout == "partial folder removed\n" and "Traceback" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("how", ["sigterm-to-serve", "ctrl-c-to-the-group", "sigterm-to-a-torchrun-rank"])
def test_a_stop_repeated_until_serve_has_gone_leaves_its_exit_0(how, tmp_path):
    """README: Ctrl-C or SIGTERM drains every rank, and serve exits 0. A stop repeated until serve has gone (a second
    Ctrl-C, a supervisor repeating SIGTERM; the launcher forwards each to the ranks) landed in an interpreter's exit,
    where every handler set from Python is SIG_DFL again: a rank that had logged "stopped" died of it (the launcher's
    "sidecar rank 0 exited with code -15 during the stop", exit 1; under torchrun the rank's own -15), or the
    launcher did (-15, -2, or a KeyboardInterrupt traceback from an atexit hook). Here SIGTERM to serve, SIGINT to
    its whole process group (a terminal's Ctrl-C), or SIGTERM to a rank started as torchrun starts it, every 2 ms
    from SERVING until the process has exited (each failed 3 runs in 3)."""
    import contextlib
    import signal
    import socket
    import subprocess
    import sys
    import time

    from dspark_sidecar.server.healthcheck import check
    from helpers.waiting import wait_until

    sock = tmp_path / "sock"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "DSPARK_LAUNCHER_PID")}
    if how == "sigterm-to-a-torchrun-rank":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    p = subprocess.Popen([sys.executable, "-m", "dspark_sidecar", "serve", "--tp", "1", "--device", "cpu", "--preset",
                          "tiny", "--socket-dir", str(sock), "--drain-s", "0"], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_until(lambda: check(f"unix:{sock / 'rank0.sock'}", 1.0) == "SERVING", 120, "rank 0 SERVING", watch=p,
                   interval_s=0.1)
        while p.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # (all gone, serve not reaped yet)
                if how == "ctrl-c-to-the-group":
                    os.killpg(p.pid, signal.SIGINT)
                else:
                    os.kill(p.pid, signal.SIGTERM)
            time.sleep(0.002)
        _, err = p.communicate(timeout=60)
        assert "rank 0: stopped" in err, err[-3000:]
        assert p.returncode == 0 and "exited with code" not in err and "Traceback" not in err, (p.returncode,
                                                                                                err[-3000:])
    finally:
        if p.returncode is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate(timeout=10)


@pytest.mark.parametrize("launcher_pid, checked", [(True, False), (False, True)])
def test_a_rank_of_serve_s_own_launcher_does_not_read_the_whole_checkpoint_again(
        launcher_pid, checked, tiny_ckpt, tmp_path, monkeypatch):
    """README and OPERATIONS.md: serve reads every tensor of dspark/ once before it starts the ranks, which
    then check their own slices as they load. Each rank of the built-in launcher (RANK, WORLD_SIZE and
    DSPARK_LAUNCHER_PID set) read the whole checkpoint again too: TP + 1 full reads at every start. Under
    torchrun no parent has checked it, so each rank still does."""
    import os

    from dspark_sidecar.drafter import checkpoint
    from dspark_sidecar.server import app

    seen = []
    monkeypatch.setattr(checkpoint, "check_checkpoint", lambda *a: seen.append(a))
    monkeypatch.setattr(app, "serve_rank", lambda *a, **k: 0)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    if launcher_pid:
        monkeypatch.setenv("DSPARK_LAUNCHER_PID", str(os.getppid()))
    else:
        monkeypatch.delenv("DSPARK_LAUNCHER_PID", raising=False)
    assert cli.main(["serve", "--tp", "1", "--device", "cpu", "--socket-dir", str(tmp_path / "s"),
                     "--checkpoint", str(tiny_ckpt[0]), "--target-checkpoint", str(tiny_ckpt[1])]) == 0
    assert bool(seen) == checked


@pytest.mark.parametrize("value", ["", "  "])  # blank: what `"$A $B"` of two unset variables gives
@pytest.mark.parametrize("argv", [["serve", "--tp", "1", "--device", "cpu"], ["status", "--tp", "1"], ["demo"]])
def test_an_empty_socket_dir_flag_is_refused_as_its_variable_is(argv, value, monkeypatch, capsys, no_launch):
    """`--socket-dir "$UNSET_VAR"` is Path(''), the working directory: serve's ranks listened on ./rank0.sock (and
    status and the demo looked there), saying nothing, where an empty DSPARK_SOCKET_DIR is refused."""
    from dspark_sidecar.client import demo

    monkeypatch.setattr(demo, "run_demo", lambda cfg: pytest.fail("the demo started"))
    with pytest.raises(SystemExit) as exc:
        cli.main([*argv, "--socket-dir", value])
    assert exc.value.code == 2
    assert "argument --socket-dir: empty" in capsys.readouterr().err


def test_a_rank_that_finds_no_gpu_exits_75_as_the_launcher_does(monkeypatch):
    """Under torchrun the launcher's check is skipped, and the rank's own resolve_device finds the missing GPU:
    it must exit 75 too (cli.main returns the error's exit_status), or a unit started before the driver loaded
    stays failed under RestartPreventExitStatus=2 (review 321)."""
    import torch

    from dspark_sidecar.server import backend
    from dspark_sidecar.server.config import ServeConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(backend.BackendUnavailable, match="--device cuda: no CUDA/ROCm device is visible") as err:
        backend.resolve_device(ServeConfig(device="cuda"), 0)
    assert err.value.exit_status == 75
    # An explicit backend this host cannot run is still a flag to change: 2, never restarted.
    assert backend.BackendUnavailable("--backend triton: x").exit_status == 2


@pytest.mark.parametrize("flag, at", [("--checkpoint", 0), ("--target-checkpoint", 1)])
def test_an_empty_checkpoint_flag_is_refused_not_read_as_the_working_directory(flag, at, tiny_ckpt, tmp_path,
                                                                              monkeypatch, capsys, no_launch):
    """`--checkpoint "$UNSET_VAR"` is Path(''), the working directory: serve read (and its ranks would have served)
    whatever checkpoint lay where it was started, or failed naming config.json alone, where an empty
    DSPARK_CHECKPOINT is refused (cli._env), and an empty --socket-dir too."""
    monkeypatch.chdir(tiny_ckpt[at])  # a checkpoint there: the empty flag was served from it, in silence
    paths = {"--checkpoint": str(tiny_ckpt[0]), "--target-checkpoint": str(tiny_ckpt[1]), flag: ""}
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "--tp", "1", "--device", "cpu", "--socket-dir", str(tmp_path / "s"),
                  *(w for kv in paths.items() for w in kv)])
    assert exc.value.code == 2
    assert f"argument {flag}: empty" in capsys.readouterr().err


def test_an_empty_bench_out_dir_is_refused_not_read_as_the_working_directory(monkeypatch, capsys):
    """`bench --out-dir ""` wrote bench.json (and its figures) into the working directory, saying nothing."""
    from dspark_sidecar import bench

    monkeypatch.setattr(bench, "run_bench", lambda *a: pytest.fail("the bench ran"))
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--device", "cpu", "--out-dir", ""])
    assert exc.value.code == 2
    assert "argument --out-dir: empty" in capsys.readouterr().err


def test_random_weights_with_a_checkpoint_read_only_its_config(tmp_path, tiny_ckpt, monkeypatch):
    """--random-weights draws every weight on the device (app._load): a --checkpoint gives its config.json alone,
    and ServeConfig takes it without --target-checkpoint. The parent still read every tensor of the folder, so a
    folder of config.json alone (a real drafter's shape, its weights elsewhere) was refused ("no safetensors
    files"), and a full one was read for nothing (minutes for the real shape) before any rank started."""
    import shutil

    from dspark_sidecar.drafter import checkpoint
    from dspark_sidecar.server import launcher

    only = tmp_path / "dspark"
    only.mkdir()
    shutil.copy(tiny_ckpt[0] / "config.json", only)
    started = []
    monkeypatch.setattr(launcher, "launch", lambda cfg, argv, on_ready=None: started.append(cfg) or 0)
    monkeypatch.delenv("RANK", raising=False)
    assert cli.main(["serve", "--tp", "1", "--device", "cpu", "--socket-dir", str(tmp_path / "s"),
                     "--random-weights", "--checkpoint", str(only)]) == 0
    assert [c.checkpoint for c in started] == [only]
    # Without --random-weights the folder's tensors are still checked, before any rank.
    monkeypatch.setattr(checkpoint, "check_checkpoint", lambda *a: pytest.fail("checked"))
    with pytest.raises(pytest.fail.Exception, match="checked"):
        cli.main(["serve", "--tp", "1", "--device", "cpu", "--socket-dir", str(tmp_path / "s"),
                  "--checkpoint", str(tiny_ckpt[0]), "--target-checkpoint", str(tiny_ckpt[1])])


@pytest.mark.parametrize("argv, words", [
    (["--tp", "3"], "--tp 3: num_attention_heads: 8 is not divisible by TP size 3"),
    # --shard-of's N is the TP size the preset must split over: the line said "TP size 3" for a --tp 1
    (["--tp", "1", "--shard-of", "3"], "--shard-of 3: num_attention_heads: 8 is not divisible by TP size 3"),
])
def test_a_tp_the_drafter_cannot_split_over_names_its_flag(argv, words, capsys, no_launch):
    """The demo's and the bench's refusal named --tp; serve's gave the drafter's words alone, naming no flag
    (with --shard-of, a TP size the command line never gave as --tp)."""
    from helpers.refusals import refused

    refused(["serve", "--device", "cpu", *argv], capsys, words)


def test_a_rank_meets_its_peers_where_its_launcher_says_not_where_the_flags_say(tmp_path, monkeypatch):
    """Serve's launcher picks a free rendezvous port for --master-port 0 (torchrun brings its own) and hands it to
    every rank as MASTER_ADDR/MASTER_PORT, while the rank's argv still says 0: the rank must take the environment's,
    or rank 0 would host the store on a port of its own choosing that no peer knows."""
    import os

    from dspark_sidecar.server import app

    seen = []
    monkeypatch.setattr(app, "serve_rank", lambda cfg, *a, **k: seen.append(cfg) or 0)
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "localhost", "MASTER_PORT": "29517",
                 "DSPARK_LAUNCHER_PID": str(os.getppid())}.items():
        monkeypatch.setenv(k, v)
    assert cli.main(["serve", "--tp", "1", "--device", "cpu", "--socket-dir", str(tmp_path / "s"), "--random-weights",
                     "--master-addr", "127.0.0.1", "--master-port", "0"]) == 0
    assert [(c.master_addr, c.master_port) for c in seen] == [("localhost", 29517)]


def test_a_bench_out_dir_that_cannot_be_written_into_is_refused_before_the_run(monkeypatch, capsys):
    """A folder that exists but takes no files (a read-only mount, another user's folder; /proc/self here, which
    refuses even root) passed the mkdir check: every mode ran, then writing bench.json ended it in a traceback."""
    from dspark_sidecar import bench

    monkeypatch.setattr(bench, "run_bench", lambda *a: pytest.fail("the bench ran"))
    assert os.path.isdir("/proc/self")
    assert cli.main(["bench", "--device", "cpu", "--out-dir", "/proc/self"]) == 2
    err = capsys.readouterr().err
    assert "--out-dir: cannot write into '/proc/self'" in err and err.count("\n") == 1, err


def test_a_bench_with_a_failed_mode_exits_1_naming_it_and_one_that_cannot_run_here_does_not(tmp_path, monkeypatch,
                                                                                               capsys):
    """A failed mode is a row with a note, and the other modes run on; but the command exited 0 whatever failed,
    so a script (gpu-check.sh) or CI job took a table with its sidecar modes all broken for a measured one.
    Mode b cannot run on a CPU ("n/a"): that is not a failure."""
    from dspark_sidecar import bench

    real = bench.Bench.measure

    def measure(self, mode, case):
        if mode == "d":
            raise RuntimeError("the data plane broke")
        return real(self, mode, case)

    argv = ["bench", *_TINY_BENCH, "--modes", "ab", "--out-dir", str(tmp_path / "ok")]
    assert cli.main(argv) == 0
    assert "failed" not in capsys.readouterr().err
    monkeypatch.setattr(bench.Bench, "measure", measure)
    monkeypatch.setattr(bench.Bench, "_connect", lambda self: None)  # mode d's sidecar is not what this is about
    argv = ["bench", *_TINY_BENCH, "--modes", "abd", "--out-dir", str(tmp_path / "bad")]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "dspark-sidecar: 1 of 3 rows failed: d (R=1, context 40)" in err, err
    assert (tmp_path / "bad" / "bench.json").exists()  # the table is still written


def test_a_bench_whose_sidecar_did_not_start_exits_1_naming_its_rows(tmp_path, monkeypatch, capsys):
    """The sidecar that did not start is caught into every d-i row's note (a, b and c still run): those rows
    are failures, not modes that cannot run here."""
    from dspark_sidecar import bench

    def no_sidecar(self):
        raise bench.BenchFailed("the bench's sidecar did not start; see /x/sidecar.log")

    monkeypatch.setattr(bench.Bench, "_connect", no_sidecar)
    argv = ["bench", *_TINY_BENCH, "--modes", "ad", "--out-dir", str(tmp_path / "out")]
    assert cli.main(argv) == 1
    assert "dspark-sidecar: 1 of 2 rows failed: d (R=1, context 40)" in capsys.readouterr().err
    (row,) = [r for r in json.loads((tmp_path / "out" / "bench.json").read_text())["rows"] if r["mode"] == "d"]
    assert row["note"] == ("error: BenchFailed: the bench's sidecar did not start; see /x/sidecar.log "
                           "(setting up the sidecar)")
