"""deploy/launch-tp4.sh: the command and environment it hands to the server (a recording stand-in for python)."""

from __future__ import annotations

import grp
import os
import stat
import subprocess

import pytest

from deploy.deploy_files import DEPLOY, serve_parser

RECIPE = DEPLOY / "launch-tp4.sh"
OTHER_UID = 54321  # owns the links of another user's
# Prints its argv (one per line) and then its environment, in place of the real interpreter.
RECORDER = '#!/bin/sh\nprintf "%s\\n" "$@" > "$RECORD_DIR/argv"\nenv > "$RECORD_DIR/env"\n'


@pytest.fixture
def launch(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(RECORDER)
    fake.chmod(0o755)

    def run(*args, **env):
        base = {k: v for k, v in os.environ.items() if not k.startswith(("DSPARK_", "OMP_", "NCCL_", "GLOO_"))}
        base.update(DSPARK_PYTHON=str(fake), RECORD_DIR=str(tmp_path), DSPARK_DEVICE="cpu", **env)
        res = subprocess.run(["bash", str(RECIPE), *args], env=base, capture_output=True, text=True, timeout=60)
        argv_file = tmp_path / "argv"
        if not argv_file.exists():
            return res, None, None
        argv = argv_file.read_text().splitlines()
        environ = dict(line.split("=", 1) for line in (tmp_path / "env").read_text().splitlines() if "=" in line)
        argv_file.unlink()
        return res, argv, environ

    return run


def test_builtin_launcher_serves_tp4_on_the_socket_dir(launch, tmp_path):
    sockets = tmp_path / "socks"
    res, argv, env = launch("--backend", "reference", DSPARK_SOCKET_DIR=str(sockets))
    assert res.returncode == 0, res.stderr
    assert argv == ["-m", "dspark_sidecar", "serve", "--tp", "4", "--socket-dir", str(sockets), "--backend", "reference"]
    assert env["DSPARK_SOCKET_DIR"] == str(sockets) and env["DSPARK_TP"] == "4"
    assert env["OMP_NUM_THREADS"] == "2" and env["NCCL_SOCKET_IFNAME"] == "lo" and env["GLOO_SOCKET_IFNAME"] == "lo"
    assert stat.S_IMODE(sockets.stat().st_mode) == 0o770


def test_torchrun_launcher_runs_one_process_per_rank(launch, tmp_path):
    res, argv, _ = launch(DSPARK_LAUNCHER="torchrun", DSPARK_TP="2", DSPARK_SOCKET_DIR=str(tmp_path / "s"))
    assert res.returncode == 0, res.stderr
    assert argv[:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    assert argv[5:] == ["-m", "dspark_sidecar", "serve", "--tp", "2", "--socket-dir", str(tmp_path / "s")]


def test_operator_environment_is_kept(launch, tmp_path):
    _, _, env = launch(DSPARK_SOCKET_DIR=str(tmp_path / "s"), OMP_NUM_THREADS="6", NCCL_SOCKET_IFNAME="eth9")
    assert env["OMP_NUM_THREADS"] == "6" and env["NCCL_SOCKET_IFNAME"] == "eth9"


@pytest.mark.parametrize("env", [{"DSPARK_TP": "four"}, {"DSPARK_TP": "0"}, {"DSPARK_LAUNCHER": "mpirun"}])
def test_bad_settings_stop_before_launching(launch, tmp_path, env):
    res, argv, _ = launch(DSPARK_SOCKET_DIR=str(tmp_path / "s"), **env)
    assert res.returncode == 2 and argv is None
    assert "error" in res.stderr


@pytest.mark.parametrize("launcher", ["builtin", "torchrun"])
@pytest.mark.parametrize("flags, variable", [(["--tp", "2"], "DSPARK_TP"), (["--tp=2"], "DSPARK_TP"),
                                             (["--socket-dir", "/elsewhere"], "DSPARK_SOCKET_DIR"),
                                             (["--socket-dir=/elsewhere"], "DSPARK_SOCKET_DIR"),
                                             (["--socket-d", "/elsewhere"], "DSPARK_SOCKET_DIR"),
                                             (["--sock=/elsewhere"], "DSPARK_SOCKET_DIR"),
                                             (["--so", "/elsewhere"], "DSPARK_SOCKET_DIR")])
def test_tp_and_socket_dir_given_as_flags_are_refused(launch, tmp_path, launcher, flags, variable):
    """The recipe sizes torchrun (--nproc-per-node) and prepares the socket folder (mode, setgid group)
    from DSPARK_TP and DSPARK_SOCKET_DIR, then appended the flags: `--tp 2` under torchrun started 4
    processes serving --tp 2 (each rank: WORLD_SIZE 4 != --tp 2), and `--socket-dir D` served in a
    folder the recipe had not prepared while the one it had stayed empty. serve's parser takes any unique
    prefix of a flag (`--so D`, `--sock=D` and `--socket-d D` are --socket-dir), which the recipe let through."""
    res, argv, _ = launch(*flags, DSPARK_LAUNCHER=launcher, DSPARK_SOCKET_DIR=str(tmp_path / "s"))
    assert res.returncode == 2 and argv is None, argv
    assert f"set {variable}" in res.stderr
    assert serve_parser().parse_args(flags).__dict__[variable.removeprefix("DSPARK_").lower()] is not None


def test_missing_parents_of_the_socket_dir_let_the_engine_group_through(launch, tmp_path):
    """The recipe made missing parents under its umask 007: 0770 in this user's own group, so an engine
    admitted only through DSPARK_SOCKET_GROUP could not reach the sockets (EACCES on connect). They are
    made as `serve` makes them (server/sockdir.py PARENT_MODE 0755, narrowed by the caller's umask)."""
    sockets = tmp_path / "srv" / "dspark" / "socks"
    # 002, not 022: under a caller's 022 a plain `mkdir -p` makes the same 0755 parents, and the narrowing
    # to serve's mode went untested.
    old = os.umask(0o002)
    try:
        res, argv, _ = launch(DSPARK_SOCKET_DIR=str(sockets), DSPARK_SOCKET_GROUP=grp.getgrgid(os.getgid()).gr_name)
    finally:
        os.umask(old)
    assert res.returncode == 0 and argv is not None, res.stderr
    for parent in (tmp_path / "srv", tmp_path / "srv" / "dspark"):
        assert stat.S_IMODE(parent.stat().st_mode) == 0o755, (parent, oct(parent.stat().st_mode))
    assert stat.S_IMODE(sockets.stat().st_mode) == 0o2770


def test_a_socket_group_that_cannot_be_given_stops_before_launching(launch, tmp_path):
    """The folder could not be handed to DSPARK_SOCKET_GROUP (no such group): serving on regardless, in a folder
    the engine's group cannot open, would turn every connect of the engine into EACCES."""
    res, argv, _ = launch(DSPARK_SOCKET_DIR=str(tmp_path / "s"), DSPARK_SOCKET_GROUP="no-such-group-dspark")
    assert res.returncode == 2 and argv is None, res.stderr
    assert "error: DSPARK_SOCKET_GROUP" in res.stderr, res.stderr


@pytest.mark.parametrize("where", ["leaf", "parent"])
def test_a_socket_dir_that_cannot_be_made_is_a_setting_error(launch, tmp_path, where):
    """A file where the folder or one of its parents should be: exit 2 and a line naming the setting, as serve's
    refusal of the same folder (not set -e's exit 1, which a unit's Restart= takes for a crash and retries)."""
    (tmp_path / "f").write_text("")
    target = tmp_path / "f" if where == "leaf" else tmp_path / "f" / "s"
    res, argv, _ = launch(DSPARK_SOCKET_DIR=str(target))
    assert res.returncode == 2 and argv is None, res.stderr
    assert "error: DSPARK_SOCKET_DIR" in res.stderr, res.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="a link of another user's needs lchown (root)")
@pytest.mark.parametrize("group", [False, True])
def test_a_socket_dir_that_is_another_users_link_is_refused_before_any_chmod(launch, tmp_path, group):
    """serve refuses a DSPARK_SOCKET_DIR that is a link of another user's (sockdir.foreign_link), but the recipe's
    chmod 0770 (and chgrp, chmod 2770) had already followed it: a member of a group-writable parent's group (which
    serve accepts) made DIR a link to a folder of this user's, and that folder was opened to the group."""
    shared, victim = tmp_path / "shared", tmp_path / "victim"
    shared.mkdir(mode=0o775)
    victim.mkdir(mode=0o700)
    link = shared / "dspark"
    link.symlink_to(victim)
    os.lchown(link, OTHER_UID, -1)
    env = {"DSPARK_SOCKET_GROUP": grp.getgrgid(os.getgid()).gr_name} if group else {}
    res, argv, _ = launch(DSPARK_SOCKET_DIR=str(link), **env)
    assert res.returncode == 2 and argv is None, res.stderr
    assert f"{link} is a symbolic link owned by another user (uid {OTHER_UID})" in res.stderr
    assert stat.S_IMODE(victim.stat().st_mode) == 0o700, oct(victim.stat().st_mode)


@pytest.mark.parametrize("variable", ["DSPARK_TP", "DSPARK_SOCKET_DIR"])
def test_empty_tp_or_socket_dir_is_refused_as_serve_refuses_it(launch, variable):
    """serve refuses a DSPARK_* variable that is set but empty (`DSPARK_SOCKET_DIR=$UNSET_VAR`, cli._env):
    the recipe took it for unset, passed the default on as a flag, and served TP 4 in /tmp/dspark-sidecar
    while the engine, given the same empty variable, looked elsewhere."""
    res, argv, _ = launch(**{variable: ""})
    assert res.returncode == 2 and argv is None, argv
    assert f"{variable} is set but empty" in res.stderr


def test_empty_cuda_visible_devices_on_an_nvidia_node_is_refused(tmp_path):
    """CUDA_VISIBLE_DEVICES set but empty (`=$GPUS`, GPUS unset) hides every GPU: under DSPARK_DEVICE auto
    the ranks then served on the CPU, and the recipe's warning said the opposite (unset: rank r takes the
    node's GPU r). Run on a copy whose NVIDIA device node is a file here."""
    node = tmp_path / "nvidiactl"
    node.touch()
    recipe = tmp_path / "launch-tp4.sh"
    recipe.write_text(RECIPE.read_text().replace("/dev/nvidiactl", str(node)).replace("/dev/kfd", str(tmp_path / "kfd")))
    fake = tmp_path / "python"
    fake.write_text(RECORDER)
    fake.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DSPARK_", "CUDA_"))}

    def run(**env):
        return subprocess.run(["bash", str(recipe)], capture_output=True, text=True, timeout=60,
                              env={**base, "DSPARK_PYTHON": str(fake), "RECORD_DIR": str(tmp_path),
                                   "DSPARK_SOCKET_DIR": str(tmp_path / "s"), **env})

    res = run(CUDA_VISIBLE_DEVICES="")
    assert res.returncode == 2 and not (tmp_path / "argv").exists(), res.stderr
    assert "CUDA_VISIBLE_DEVICES is set but empty" in res.stderr
    res = run()  # unset: every GPU of the node, in order; a warning only
    assert res.returncode == 0 and "CUDA_VISIBLE_DEVICES unset" in res.stderr, res.stderr
    # The header's NVIDIA defaults: cuda:r is the engine's GPU r only if both number the GPUs by bus id.
    env = dict(line.split("=", 1) for line in (tmp_path / "env").read_text().splitlines() if "=" in line)
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" and env["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps", env
    res = run(CUDA_VISIBLE_DEVICES="", DSPARK_DEVICE="cpu")  # on the CPU by choice: no GPU set-up at all
    assert res.returncode == 0, res.stderr
