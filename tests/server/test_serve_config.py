"""ServeConfig: --launch-streams (how many streams a step's launch groups run on) and --prelaunch-behind-ms, and what is refused."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import pytest

from dspark_sidecar import cli
from dspark_sidecar.server.config import DEFAULT_LAUNCH_STREAMS, ServeConfig, ServeConfigError


def _parse(argv: list[str]) -> ServeConfig:
    p = argparse.ArgumentParser()
    cli._add_serve_flags(p)
    return cli.serve_config(p.parse_args(argv))


def test_default_is_side_by_side_at_tp1_and_in_order_above():
    assert _parse(["--tp", "1"]).step_streams == DEFAULT_LAUNCH_STREAMS > 1
    assert _parse(["--tp", "4"]).step_streams == 1
    assert _parse(["--tp", "2"]).step_streams == 1  # every TP above 1, not only the deployment's 4
    assert _parse(["--tp", "1", "--launch-streams", "2"]).step_streams == 2
    assert _parse(["--tp", "4", "--launch-streams", "1"]).step_streams == 1


def test_side_by_side_at_tp_above_1_is_opt_in():
    """At TP > 1 each extra stream needs a communicator of its own (made at start-up): asked for
    explicitly, never by default."""
    assert _parse(["--tp", "4", "--launch-streams", "4"]).step_streams == 4
    assert ServeConfig(tp=2, launch_streams=2).step_streams == 2


@pytest.mark.parametrize("n", [-1, 9])
def test_out_of_range_is_refused(n):
    with pytest.raises(ServeConfigError, match="--launch-streams: must be 0..8"):
        ServeConfig(tp=1, launch_streams=n)


def test_prelaunch_cooldown_threshold_from_flag_or_environment(monkeypatch):
    """--prelaunch-behind-ms (or DSPARK_PRELAUNCH_BEHIND_MS) sets when pre-launch stops for an engine
    that runs ahead; the default is prelaunch.BEHIND_S, and a threshold of 0 or less is refused."""
    from dspark_sidecar.server import prelaunch

    assert _parse([]).prelaunch_behind_ms / 1e3 == prelaunch.BEHIND_S
    assert _parse(["--prelaunch-behind-ms", "1"]).prelaunch_behind_ms == 1.0
    monkeypatch.setenv("DSPARK_PRELAUNCH_BEHIND_MS", "0.5")
    assert _parse([]).prelaunch_behind_ms == 0.5
    for bad in ("0", "-2"):
        with pytest.raises(ServeConfigError, match="--prelaunch-behind-ms"):
            _parse(["--prelaunch-behind-ms", bad])


def test_exchange_lanes_at_tp_above_one_warn_of_nccls_concurrent_communicators(monkeypatch, caplog):
    """Each extra launch stream gets a communicator of its own, used at the same time as the others,
    which NCCL does not promise to make progress: the operator is told at start-up."""
    import torch

    from dspark_sidecar.server import app

    monkeypatch.setattr(app.dist, "new_group", lambda timeout=None: "group")
    monkeypatch.setattr(app.dist, "all_reduce", lambda t, group=None: t.fill_(2))
    with caplog.at_level("WARNING", logger="dspark_sidecar.server"):
        lanes = app.exchange_lanes(3, 2, torch.device("cpu"))
    assert [lane.group for lane in lanes] == ["group", "group"]
    assert "NCCL does not promise" in caplog.text and "--launch-streams 1" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="dspark_sidecar.server"):
        assert app.exchange_lanes(1, 2, torch.device("cpu")) == ()
    assert caplog.text == ""


def test_exchange_lanes_wait_for_a_dead_peer_as_long_as_the_world_group_does(monkeypatch):
    """The lanes' communicators get --dist-timeout-s, as init_process_group gave the world group: new_group
    without one took torch's default (10 min for NCCL), so a step's collective on a lane waited that long."""
    import datetime

    import torch

    from dspark_sidecar.server import app

    made = []
    monkeypatch.setattr(app.dist, "new_group", lambda timeout=None: made.append(timeout) or "group")
    monkeypatch.setattr(app.dist, "all_reduce", lambda t, group=None: t.fill_(2))
    app.exchange_lanes(3, 2, torch.device("cpu"), datetime.timedelta(seconds=7))
    assert made == [datetime.timedelta(seconds=7)] * 2


@pytest.mark.parametrize("seed", [-1, 1 << 32, 2 ** 70])
def test_a_seed_the_synthetic_writer_cannot_use_is_refused_by_flag(seed):
    # Before, 2**70 reached torch.Generator.manual_seed in every rank: a traceback each.
    with pytest.raises(ServeConfigError, match=r"--seed: must be 0\.\.4294967295"):
        ServeConfig(seed=seed)


@pytest.mark.parametrize("kw, message", [
    ({"backend": "cutlass"}, "--backend: must be one of"),
    ({"dtype": "fp16"}, "--dtype: must be one of"),
    ({"device": "tpu"}, "--device: must be auto, cpu or cuda, got 'tpu'"),
    ({"dist_backend": "mpi"}, "--dist-backend: must be auto, gloo or nccl, got 'mpi'"),
    ({"dist_backend": "nccl", "device": "cpu"}, "--dist-backend nccl: the ranks compute on the CPU (--device cpu)"),
    ({"max_reqs": 0}, "--max-reqs: must be 1..256, got 0"),
    ({"max_reqs": 257}, "--max-reqs: must be 1..256, got 257"),
    ({"tp": 4, "tcp_base_port": 65533}, "--tcp-base-port: must be 0..65532, got 65533"),
    ({"tp": 1, "metrics_port": -1}, "--metrics-port: must be 0..65535, got -1"),
    ({"tp": 4, "master_port": 65536}, "--master-port: must be 0..65535, got 65536"),
    ({"tp": 2, "shard_of": 4}, "--shard-of: needs --tp 1 and N >= 2, got --tp 2 --shard-of 4"),
    ({"tp": 1, "shard_of": 1}, "--shard-of: needs --tp 1 and N >= 2, got --tp 1 --shard-of 1"),
    ({"drain_s": -1}, "--drain-s: must be 0..300, got -1"),
    ({"drain_s": 301}, "--drain-s: must be 0..300, got 301"),
    ({"checkpoint": "/ckpt/dspark"}, "--target-checkpoint: required with --checkpoint"),
    ({"target_checkpoint": "/ckpt"}, "--target-checkpoint: given without --checkpoint"),
    ({"exit_with_pid": -1}, "--exit-with-pid: must be 0 (off) or a process id 1..4194304, got -1"),
    ({"exit_with_pid": (1 << 22) + 1}, "--exit-with-pid: must be 0 (off) or a process id 1..4194304, got 4194305"),
    ({"tp": 65}, "--tp: must be 1..64, got 65"),
    ({"startup_timeout_s": 0}, "--startup-timeout-s: must be 1..86400, got 0"),  # new_group's 0: every wait fails
    ({"startup_timeout_s": 86_401}, "--startup-timeout-s: must be 1..86400, got 86401"),
    # Rank 0's store and rank 1's gRPC listener would meet on it: the second to bind refused to start.
    ({"tp": 2, "tcp_base_port": 50051, "master_port": 50052}, "--master-port: port 50052 is also --tcp-base-port's"),
    # Each rank serves metrics on port + rank: at --tp 4 a base of 65533 put rank 3 on 65536, which the HTTP
    # server refuses with an OverflowError (not the OSError the rank turns into one line): a traceback.
    ({"tp": 4, "metrics_port": 65533}, "--metrics-port: must be 0..65532, got 65533"),
    # gRPC takes its message limits as a C int: 2^31 raised OverflowError from grpc.server() in every rank.
    ({"max_message_bytes": 1 << 31}, "--max-message-bytes: must be 1 MiB..2^31 - 1 (gRPC's limit), got 2147483648"),
    ({"max_message_bytes": (1 << 20) - 1}, "--max-message-bytes: must be 1 MiB..2^31 - 1 (gRPC's limit), got 1048575"),
    ({"rendezvous_ms": 60_001}, "--rendezvous-ms: must be 1..60000, got 60001"),
    ({"prelaunch_behind_ms": 60_001}, "--prelaunch-behind-ms: must be above 0 and at most 60000, got 60001"),
    ({"dist_timeout_s": 86_401}, "--dist-timeout-s: must be 1..86400, got 86401"),
], ids=lambda v: v if isinstance(v, str) else ",".join(f"{k}={x}" for k, x in v.items()))
def test_each_setting_outside_its_range_is_refused_naming_its_flag(kw, message):
    """ServeConfig refuses in __post_init__ (flags, DSPARK_* variables, and programmatic use alike): each
    check here was dropped by a mutation without any test failing."""
    with pytest.raises(ServeConfigError, match=re.escape(message)):
        ServeConfig(**kw)


def test_settings_at_the_edges_of_their_ranges_are_accepted():
    for kw in ({"max_reqs": 1}, {"max_reqs": 256}, {"tp": 4, "tcp_base_port": 65532}, {"tp": 1, "metrics_port": 65535},
               {"tp": 4, "master_port": 65535},  # one port, not one per rank: any port, whatever --tp
               {"tp": 1, "shard_of": 2}, {"drain_s": 0}, {"drain_s": 300},
               {"tp": 4, "metrics_port": 65532}, {"launch_streams": 8}, {"rendezvous_ms": 60_000},
               {"prelaunch_behind_ms": 60_000}, {"dist_timeout_s": 86_400}, {"exit_with_pid": 1 << 22},
               {"max_message_bytes": 1 << 20}, {"max_message_bytes": (1 << 31) - 1},
               # --random-weights draws the weights: a --checkpoint gives only its config.json, no target needed
               {"checkpoint": Path("/ckpt/dspark"), "random_weights": True}):
        c = ServeConfig(**kw)
        assert all(getattr(c, k) == v for k, v in kw.items()), kw


@pytest.mark.parametrize("kw, flag", [
    ({"metrics_port": 9400, "metrics_host": ""}, "--metrics-host"),
    ({"metrics_port": 9400, "metrics_host": "  "}, "--metrics-host"),
    ({"tcp_base_port": 50000, "tcp_host": "", "allow_remote": True}, "--tcp-host"),
])
def test_an_empty_listen_host_is_refused(kw, flag):
    """An empty host binds every interface (getaddrinfo's AI_PASSIVE): `--metrics-host "$UNSET"` served metrics
    off-node while the docs say loopback. DSPARK_METRICS_HOST='' was already refused (cli._env); the flag was not."""
    with pytest.raises(ServeConfigError, match=f"^{flag}: empty"):
        ServeConfig(**kw)
    with pytest.raises(ServeConfigError, match=f"^{flag}: empty"):
        _parse([f"--{k.replace('_', '-')}={v}" for k, v in kw.items() if k != "allow_remote"]
               + (["--allow-remote"] if kw.get("allow_remote") else []))


def test_a_folder_given_as_text_is_a_path_and_an_empty_one_is_refused(tmp_path):
    """The demo, the bench and tests build ServeConfig themselves: a socket folder given as text stayed text,
    and the parent's folder check (sockdir.prepare: d.parent) and a rank's AttachDoorbell (run_dir / name) ended
    in a traceback; '' served in the working directory, which the CLI's --socket-dir refuses (layout.folder_flag)."""
    from pathlib import Path

    from dspark_sidecar.server import preflight

    cfg = ServeConfig(tp=1, socket_dir=str(tmp_path / "sock"), checkpoint=str(tmp_path / "d"),
                      target_checkpoint=str(tmp_path / "t"))
    paths = (cfg.socket_dir, cfg.checkpoint, cfg.target_checkpoint)
    assert paths == (tmp_path / "sock", tmp_path / "d", tmp_path / "t")
    assert all(isinstance(p, Path) for p in paths)
    preflight.check_socket_dir(cfg)
    for kw in ({"socket_dir": ""}, {"socket_dir": " "}, {"checkpoint": "", "target_checkpoint": str(tmp_path)},
               {"checkpoint": str(tmp_path), "target_checkpoint": ""}):
        flag = "--" + next(k for k, v in kw.items() if not v.strip()).replace("_", "-")
        with pytest.raises(ServeConfigError, match=f"^{flag}: empty"):
            ServeConfig(**kw)


@pytest.mark.parametrize("kw, message", [
    ({"tp": True}, "--tp: expected an integer, got True"),
    ({"tp": 2.0}, "--tp: expected an integer, got 2.0"),
    ({"max_reqs": 8.5}, "--max-reqs: expected an integer, got 8.5"),
    ({"tp": 1, "tcp_base_port": 50000.5}, "--tcp-base-port: expected an integer, got 50000.5"),
    ({"seed": 1.5}, "--seed: expected an integer, got 1.5"),
    ({"drain_s": True}, "--drain-s: expected a number, got True"),
    ({"strict_refusal": "no"}, "--strict-refusal: expected True or False, got 'no'"),
    ({"warmup": 0}, "--no-warmup: expected True or False, got 0"),
    ({"prelaunch": 0}, "--no-prelaunch: expected True or False, got 0"),  # each --no-X flag named as given
    ({"cuda_graphs": 1}, "--no-cuda-graphs: expected True or False, got 1"),
    ({"socket_dir": None}, "--socket-dir: expected a path, got None"),  # only the checkpoints may be None
    ({"preset": None}, "--preset: expected text, got None"),
], ids=lambda v: v if isinstance(v, str) else ",".join(f"{k}={x!r}" for k, x in v.items()))
def test_a_value_of_the_wrong_type_is_refused_naming_its_flag(kw, message):
    """A programmatic ServeConfig (the flags and DSPARK_* variables always give the field's type): --tp True
    reached the launcher's WORLD_SIZE=True, a rank's int() of it a traceback; a float port or --max-reqs
    ended in range()'s TypeError, a float seed in torch's generator; strict_refusal='no' was on."""
    with pytest.raises(ServeConfigError, match=re.escape(message)):
        ServeConfig(**kw)


def test_a_float_setting_takes_an_integer():
    assert ServeConfig(drain_s=2, prelaunch_behind_ms=3).drain_s == 2


@pytest.mark.parametrize("host", ["[127.0.0.1]", "[::1", "::1]", "[localhost]"])
def test_brackets_around_anything_but_an_ipv6_address_are_refused(host):
    """gRPC parses only [IPV6]:PORT: '[127.0.0.1]' passed ServeConfig and the parent's check (both strip the
    brackets), then every rank's bind failed, read as a port taken since the checks: exit 75, restarted for ever."""
    with pytest.raises(ServeConfigError, match=r"^--tcp-host: .*brackets"):
        ServeConfig(tp=1, tcp_base_port=50000, tcp_host=host, allow_remote=True)


@pytest.mark.parametrize("host", ["[::1]", "::1", "127.0.0.1", "localhost"])
def test_an_ipv6_address_bracketed_or_not_is_served(host):
    # gRPC parses [IPV6]:PORT only: "::1:50001" (a mutation's, the brackets dropped) is no address it binds.
    want = "[::1]:50001" if ":" in host else f"{host}:50001"
    assert ServeConfig(tp=2, tcp_base_port=50000, tcp_host=host).endpoints(1)[1] == want


def test_a_host_that_is_not_loopback_is_served_with_allow_remote_only():
    """--allow-remote is the switch that lets a non-loopback --tcp-host serve: a mutation that ignored it (refusing
    every remote host) passed every test, as did one that ignored the refusal's loopback check."""
    with pytest.raises(ServeConfigError, match=r"^--tcp-host: 10\.1\.2\.3 is not a loopback address.*--allow-remote"):
        ServeConfig(tp=1, tcp_base_port=50000, tcp_host="10.1.2.3")
    assert ServeConfig(tp=1, tcp_base_port=50000, tcp_host="10.1.2.3", allow_remote=True).endpoints(0)[1] == "10.1.2.3:50000"
    assert ServeConfig(tp=1, tcp_host="10.1.2.3").tcp_base_port == 0  # no TCP listener: the host is not used


@pytest.mark.parametrize("tp", [1, 12])
def test_a_socket_dir_whose_lease_socket_would_not_fit_a_unix_path_is_refused(tp):
    """Each rank binds DIR/rank{r}.lease (the engine's lease socket) beside DIR/rank{r}.sock, one byte longer: a
    folder whose rank socket filled sun_path exactly passed the check, and every rank bound its gRPC socket, loaded
    its shard (minutes for a full preset) and then failed in a traceback ("AF_UNIX path too long"), at each restart."""
    import socket

    from dspark_sidecar import layout
    from helpers.engine_fakes import short_socket_dir

    top = str(short_socket_dir())  # pytest's tmp_path may leave too little room below 107 bytes
    last = f"/rank{tp - 1}.sock"
    d = top + "/" + "d" * (layout.SUN_PATH_MAX - len(top) - 1 - len(last))
    assert len(d + last) == layout.SUN_PATH_MAX  # the gRPC socket alone fits
    lease = layout.rank_lease_socket(d, tp - 1)
    with socket.socket(socket.AF_UNIX) as s, pytest.raises(OSError, match="too long"):
        s.bind(str(lease))  # what the rank's LeaseKeeper does, after its shard is loaded
    with pytest.raises(ServeConfigError, match=rf"^--socket-dir: .*{re.escape(str(lease))} is 108 bytes"):
        ServeConfig(tp=tp, socket_dir=d)
    shorter = d[:-1]  # both of a rank's sockets fit
    assert ServeConfig(tp=tp, socket_dir=shorter).socket_dir == Path(shorter)
    with socket.socket(socket.AF_UNIX) as s:
        os.makedirs(shorter)
        s.bind(str(layout.rank_lease_socket(shorter, tp - 1)))


@pytest.mark.parametrize("kw, message", [
    ({"tcp_host": ""}, "--tcp-host: empty"),
    ({"tcp_host": "127.0.0.1 "}, "--tcp-host: '127.0.0.1 ' has white space around it"),
    ({"tcp_host": "localhost\n"}, "--tcp-host: 'localhost\\n' has white space around it"),
    ({"metrics_port": 9400, "metrics_host": " 0.0.0.0"}, "--metrics-host: ' 0.0.0.0' has white space around it"),
    ({"master_addr": "127.0.0.1\t"}, "--master-addr: '127.0.0.1\\t' has white space around it"),
], ids=lambda v: v if isinstance(v, str) else ",".join(f"{k}={x!r}" for k, x in v.items()))
def test_a_listen_host_with_white_space_or_none_is_refused_as_such_not_as_remote(kw, message):
    """No host name or address holds white space (a DSPARK_TCP_HOST copied from a file with its newline): an empty
    or padded loopback --tcp-host was refused as "not a loopback address ... needs --allow-remote", advice that
    opened the endpoint off-node and still failed (the parent's resolve of '127.0.0.1 '), and a padded
    --metrics-host passed to fail in the parent's check, or under torchrun only in each rank."""
    with pytest.raises(ServeConfigError, match=f"^{re.escape(message)}"):
        ServeConfig(tp=1, tcp_base_port=50000, **kw)
    assert "--allow-remote" not in message


@pytest.mark.parametrize("backend", ["triton", "flydsl"])
def test_a_gpu_backend_for_ranks_on_the_cpu_is_refused_by_the_config(backend):
    """Both backends' kernels run on the rank's GPU: with --device cpu every rank started, listened, joined the
    group and only then refused the flag in a line of its own (choose_backend), where README promises one line
    before any rank starts (as for --dist-backend nccl with --device cpu)."""
    with pytest.raises(ServeConfigError, match=f"^--backend {backend}: .*--device cpu"):
        ServeConfig(backend=backend, device="cpu")
    with pytest.raises(ServeConfigError, match=f"^--backend {backend}: "):
        _parse(["--backend", backend, "--device", "cpu"])
    for ok in ({"backend": backend}, {"backend": backend, "device": "cuda"}, {"backend": "reference", "device": "cpu"},
               {"backend": "auto", "device": "cpu"}):
        assert ServeConfig(**ok).backend == ok["backend"]


@pytest.mark.parametrize("value, on", [("1", True), ("TRUE", True), ("yes", True), ("On", True),
                                       ("0", False), ("false", False), ("No", False), ("off", False)])
def test_a_boolean_variable_sets_its_setting_either_way(value, on, monkeypatch):
    """DSPARK_<X> of a --x flag, and of a --no-x flag (README: DSPARK_WARMUP=0 turns the warm-up off), read as
    written: the words of each kind, in any case. Only a misspelt one was tested (refused)."""
    names = ("strict_refusal", "allow_remote", "random_weights", "warmup", "prelaunch", "cuda_graphs")
    for name in names:
        monkeypatch.setenv(cli.env_name(name), value)
    c = _parse([])
    assert {name: getattr(c, name) for name in names} == dict.fromkeys(names, on)
    assert _parse(["--no-warmup"]).warmup is False  # the flag, where given, over its variable
