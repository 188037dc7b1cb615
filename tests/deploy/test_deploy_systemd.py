"""systemd units: `systemd-analyze verify` clean, sysusers valid, sockets 0770/0660 in a group shared with the engine."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deploy.deploy_files import (
    HEALTHCHECK_MODULE,
    SYSTEMD,
    env_file,
    parse_unit,
    serve_config_from_env,
    serve_flag_env,
    unit_environment,
    unit_values,
)
from dspark_sidecar.drafter.config import PRESETS

SIDECAR = SYSTEMD / "dspark-sidecar.service"
MPS = SYSTEMD / "nvidia-mps.service"
SIDECAR_MPS_DROPIN = SYSTEMD / "dspark-sidecar.service.d" / "nvidia-mps.conf"
ENGINE_DROPIN = SYSTEMD / "engine.service.d" / "dspark-sidecar.conf"
SYSUSERS = SYSTEMD / "dspark-sidecar.sysusers.conf"
# A stand-in for the operator's engine unit, to verify the engine drop-in on something.
STUB_ENGINE = "[Unit]\nDescription=stub engine\n[Service]\nExecStart=/usr/bin/sleep infinity\n"

needs_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed (apt-get install systemd)"
)


def _system_unit_dir() -> Path | None:
    for d in ("/usr/lib/systemd/system", "/lib/systemd/system"):
        if Path(d, "sysinit.target").exists():
            return Path(d)
    return None


def _executables(unit: Path) -> set[str]:
    """Absolute program paths of the Exec*= lines (after systemd's -@:+! prefixes)."""
    progs = set()
    for _, key, value in parse_unit(unit):
        if key.startswith("Exec") and value:
            progs.add(value.lstrip("-@:+!").split()[0])
    return progs


def _verify_root(tmp_path: Path, units: dict[str, str], dropins: dict[str, dict[str, str]]) -> Path:
    """A throw-away root holding the distribution's units, ours, and stubs for our programs.

    verify checks that every ExecStart program exists; the real ones (dspark-sidecar,
    nvidia-cuda-mps-control) are not installed on a CI machine, so stubs stand in for them.
    """
    system_dir = _system_unit_dir()
    if system_dir is None:
        pytest.skip("no systemd unit directory with sysinit.target on this machine")
    root = tmp_path / "root"
    shutil.copytree(system_dir, root / "usr/lib/systemd/system", symlinks=True)
    etc = root / "etc/systemd/system"
    etc.mkdir(parents=True)
    for name, text in units.items():
        (etc / name).write_text(text)
    for unit, files in dropins.items():
        (etc / f"{unit}.d").mkdir()
        for name, text in files.items():
            (etc / f"{unit}.d" / name).write_text(text)
    for unit in etc.rglob("*"):
        if unit.is_file():
            for prog in _executables(unit):
                stub = root / prog.lstrip("/")
                stub.parent.mkdir(parents=True, exist_ok=True)
                stub.write_text("#!/bin/sh\n")
                stub.chmod(0o755)
    return root


def _verify(root: Path, *units: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["systemd-analyze", "verify", f"--root={root}", "--man=no", *units],
        capture_output=True, text=True, timeout=120,
    )


@needs_analyze
def test_units_and_dropins_verify_clean(tmp_path):
    root = _verify_root(
        tmp_path,
        {SIDECAR.name: SIDECAR.read_text(), MPS.name: MPS.read_text(), "engine.service": STUB_ENGINE},
        {
            SIDECAR.name: {SIDECAR_MPS_DROPIN.name: SIDECAR_MPS_DROPIN.read_text()},
            "engine.service": {ENGINE_DROPIN.name: ENGINE_DROPIN.read_text()},
        },
    )
    res = _verify(root, SIDECAR.name, MPS.name, "engine.service")
    # verify exits 0 on unknown keys and unparsable values (it only warns): demand silence.
    assert res.returncode == 0 and res.stderr.strip() == "", res.stderr


@needs_analyze
def test_verify_harness_reports_a_broken_unit(tmp_path):
    broken = SIDECAR.read_text().replace("KillMode=mixed", "KillMode=sometimes") + "BogusKey=1\n"
    root = _verify_root(tmp_path, {SIDECAR.name: broken}, {})
    res = _verify(root, SIDECAR.name)
    assert "sometimes" in res.stderr and "BogusKey" in res.stderr, res.stderr


@pytest.mark.skipif(shutil.which("systemd-sysusers") is None, reason="systemd-sysusers not installed")
def test_sysusers_file_creates_the_unit_accounts(tmp_path):
    (tmp_path / "etc").mkdir()
    for f in ("passwd", "group"):
        (tmp_path / "etc" / f).touch()
    res = subprocess.run(
        ["systemd-sysusers", f"--root={tmp_path}", "--dry-run", str(SYSUSERS)],
        capture_output=True, text=True, timeout=60,
    )
    assert res.returncode == 0, res.stderr
    # Diagnostics name the file and line; the normal "Creating ..." lines do not.
    assert str(SYSUSERS) not in res.stderr, res.stderr
    (user,) = unit_values(SIDECAR, "User")
    (group,) = unit_values(SIDECAR, "Group")
    assert f"Creating user '{user}'" in res.stderr + res.stdout
    assert f"Creating group '{group}'" in res.stderr + res.stdout


def test_socket_dir_is_the_runtime_directory_shared_with_the_engine_group():
    (runtime_dir,) = unit_values(SIDECAR, "RuntimeDirectory")
    assert unit_values(SIDECAR, "RuntimeDirectoryMode") == ["0770"]
    assert unit_values(SIDECAR, "UMask") == ["0007"]
    assert unit_environment(SIDECAR)["DSPARK_SOCKET_DIR"] == f"%t/{runtime_dir}"
    (group,) = unit_values(SIDECAR, "Group")
    assert unit_values(ENGINE_DROPIN, "SupplementaryGroups") == [group]
    assert unit_environment(ENGINE_DROPIN)["DSPARK_SOCKET_DIR"] == f"/run/{runtime_dir}"
    (user,) = unit_values(SIDECAR, "User")
    # A line, not a substring of the file: the commented engine example `#m vllm ...` must not count.
    entries = [line.split()[:3] for line in SYSUSERS.read_text().splitlines() if line.strip() and line[0] != "#"]
    assert ["m", user, group] in entries, entries


def test_sidecar_unit_waits_for_serving_and_drains_on_sigterm():
    (post,) = unit_values(SIDECAR, "ExecStartPost")
    assert HEALTHCHECK_MODULE in post and "--all-ranks" in post and "--socket-dir" in post
    assert unit_values(SIDECAR, "ExecStart")[0].endswith("dspark-sidecar serve")
    assert unit_values(SIDECAR, "KillSignal") == ["SIGTERM"]
    # The engine must survive a sidecar failure: Wants=, never Requires=/BindsTo=.
    assert "dspark-sidecar.service" in " ".join(unit_values(ENGINE_DROPIN, "Wants"))
    assert not unit_values(ENGINE_DROPIN, "Requires") and not unit_values(ENGINE_DROPIN, "BindsTo")


def test_nvidia_dropin_makes_the_sidecar_an_mps_client_of_the_mps_unit():
    assert unit_values(SIDECAR_MPS_DROPIN, "Requires") == [MPS.name]
    pipe = unit_environment(MPS)["CUDA_MPS_PIPE_DIRECTORY"]
    assert unit_environment(SIDECAR_MPS_DROPIN)["CUDA_MPS_PIPE_DIRECTORY"] == pipe
    assert unit_environment(ENGINE_DROPIN)["CUDA_MPS_PIPE_DIRECTORY"] == pipe
    assert unit_values(MPS, "RuntimeDirectory") == [pipe.removeprefix("/run/")]
    # cuda:r is the same physical GPU in both processes only if both number the GPUs by bus id.
    for dropin in (SIDECAR_MPS_DROPIN, ENGINE_DROPIN):
        assert unit_environment(dropin)["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID", dropin.name


def test_environment_file_example_is_a_valid_serve_configuration():
    env = env_file(SYSTEMD / "sidecar.env.example")
    flags = {k: v for k, v in env.items() if k.startswith("DSPARK_")}
    assert set(flags) <= serve_flag_env(), set(flags) - serve_flag_env()
    # The unit pins the socket dir to its RuntimeDirectory; the file would override it.
    assert "DSPARK_SOCKET_DIR" not in flags
    serve = serve_config_from_env(flags)
    assert serve.tp == 4 and serve.preset in PRESETS and not serve.strict_refusal


def test_stop_timeout_outlasts_the_drain_and_the_launchers_own_grace():
    """TimeoutStopSec equalled the launcher's DRAIN_GRACE_S (60 s): a rank that hangs in its teardown
    met systemd's SIGKILL of the whole group at the same moment as the launcher's own kill, its log
    line and its clean-up. systemd's must come after the launcher's, which covers a default drain."""
    from dspark_sidecar.server.config import ServeConfig
    from dspark_sidecar.server.launcher import DRAIN_GRACE_S

    (timeout,) = unit_values(SIDECAR, "TimeoutStopSec")
    assert timeout.endswith("s") and timeout[:-1].isdigit(), timeout
    # A rank's worst stop: --drain-s, then the teardown watchdog (teardown.TEARDOWN_LIMIT_S + rank.STOP_STEPS_S
    # + teardown.SERVER_GRACE_S = 30 s); spelled out here so the test does not import torch.
    # The launcher kills a rank still running --drain-s + DRAIN_GRACE_S after SIGTERM.
    drain = ServeConfig().drain_s
    assert drain + 30 < drain + DRAIN_GRACE_S < int(timeout[:-1])
    assert unit_values(SIDECAR, "KillMode") == ["mixed"]  # SIGTERM to the launcher only; it signals the ranks


def test_a_refused_configuration_is_not_restarted_forever():
    """`serve` exits EXIT_USAGE (2) for a flag, variable, checkpoint or socket folder that cannot be used,
    after one line naming it. Restart=on-failure alone restarted that every RestartSec for ever (5 s apart,
    under the start limit's 5 starts in 10 s), burying the line in a loop of weight loads; a restart cannot
    fix a configuration, so the unit stays failed with the line as its last words."""
    from dspark_sidecar.server.launcher import EXIT_USAGE

    assert unit_values(SIDECAR, "Restart") == ["on-failure"]
    assert unit_values(SIDECAR, "RestartPreventExitStatus") == [str(EXIT_USAGE)]


def test_the_mps_unit_is_started_only_once_its_daemon_answers():
    """With Type=exec alone the unit counted as started when the daemon was exec'd, and the sidecar
    (After= it) could create its CUDA context before the daemon answered: CUDA then runs without MPS,
    silently, and every step pays the context switch. The unit waits for the daemon's own probe, the
    one the Kubernetes startup probe and launch-tp4.sh use."""
    assert unit_values(MPS, "Type") == ["exec"]
    (post,) = unit_values(MPS, "ExecStartPost")
    assert "echo get_server_list | /usr/bin/nvidia-cuda-mps-control" in post and post.startswith("/bin/sh -c 'until ")
    assert unit_values(SIDECAR_MPS_DROPIN, "After") == [MPS.name]


def test_the_jit_caches_are_in_the_units_cache_directory():
    """Triton and FlyDSL read TRITON_CACHE_DIR and FLYDSL_RUNTIME_CACHE_DIR, not XDG_CACHE_HOME; named,
    so that the caches do not depend on HOME pointing into the CacheDirectory too."""
    env = unit_environment(SIDECAR)
    (cache,) = unit_values(SIDECAR, "CacheDirectory")
    for name in ("TRITON_CACHE_DIR", "FLYDSL_RUNTIME_CACHE_DIR"):
        assert env[name].startswith(f"%C/{cache}/"), (name, env.get(name))


def _start_post(unit: Path, program: str, stand_in: str) -> list[str]:
    """The unit's ExecStartPost as the argv systemd runs: `$$` unescaped to the `$` the shell expands, and
    `program` (not installed here) replaced by `stand_in`."""
    (post,) = unit_values(unit, "ExecStartPost")
    return [arg.replace(program, stand_in) for arg in shlex.split(post.replace("$$", "$"))]


def _exited_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _polls_until_main_exits(argv: list[str], env: dict[str, str]) -> None:
    """`argv` keeps polling while $MAINPID runs, and ends non-zero within seconds once it has exited."""
    live = subprocess.Popen(["sleep", "60"])
    try:
        post = subprocess.Popen(argv, env=dict(env, MAINPID=str(live.pid)), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            time.sleep(5)
            assert post.poll() is None, "ExecStartPost gave up while the main process was still starting"
        finally:
            post.kill()
            post.wait()
    finally:
        live.kill()
        live.wait()
    try:
        res = subprocess.run(argv, env=dict(env, MAINPID=str(_exited_pid())), capture_output=True, text=True,
                             timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("ExecStartPost polled on after the main process had exited: systemd waits for it, so the "
                    "unit stays activating until TimeoutStartSec")
    assert res.returncode != 0 and "exited before" in res.stderr, (res.returncode, res.stderr)


def test_sidecar_start_post_gives_up_once_the_launcher_has_exited(tmp_path):
    """systemd waits for ExecStartPost even after the main process has exited (service.c: in START_POST
    the main process's exit only ends the unit when no control process runs). The health loop polled
    until it saw SERVING, which a launcher that exited 2 (a refused flag or checkpoint) or 75 (a socket
    or port held) never gives: the unit sat "activating" for TimeoutStartSec (15 min), the engine's start
    (After= it) waited as long, and a 75 was retried every 15 min instead of every RestartSec. The loop
    now ends, non-zero, once $MAINPID is gone, and keeps polling while the launcher loads."""
    argv = _start_post(SIDECAR, "/opt/dspark-sidecar/bin/python", sys.executable)
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
           "DSPARK_SOCKET_DIR": str(tmp_path), "DSPARK_TP": "4"}
    _polls_until_main_exits(argv, env)


def test_mps_start_post_gives_up_once_the_daemon_has_exited(tmp_path):
    """The same for nvidia-mps.service: a control daemon that exited at start (another instance on the
    pipe directory, no GPU) held the unit, and the sidecar that Requires= it, for its TimeoutStartSec."""
    stub = tmp_path / "nvidia-cuda-mps-control"
    stub.write_text("#!/bin/sh\ncat >/dev/null\necho 'Cannot find MPS control daemon process' >&2\nexit 1\n")
    stub.chmod(0o755)
    argv = _start_post(MPS, "/usr/bin/nvidia-cuda-mps-control", str(stub))
    _polls_until_main_exits(argv, {"PATH": os.environ["PATH"]})


def test_sidecar_start_post_probes_the_ranks_and_folder_the_sidecar_serves(tmp_path):
    """The health loop must ask DSPARK_TP ranks in DSPARK_SOCKET_DIR, as serve reads them (sidecar.env sets
    DSPARK_TP): a probe of 4 ranks beside a `DSPARK_TP=2` sidecar never saw rank2 SERVING, and the unit, and the
    engine's start behind it, sat "activating" until TimeoutStartSec failed it. Unset, it asks serve's default."""
    from dspark_sidecar.server.config import ServeConfig

    recorder = tmp_path / "python"
    recorder.write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$RECORD"\n')
    recorder.chmod(0o755)
    argv = _start_post(SIDECAR, "/opt/dspark-sidecar/bin/python", str(recorder))
    record = tmp_path / "argv"
    base = {"PATH": os.environ["PATH"], "RECORD": str(record), "DSPARK_SOCKET_DIR": str(tmp_path / "s"),
            "MAINPID": str(os.getpid())}
    for env, tp in (({"DSPARK_TP": "2"}, "2"), ({}, str(ServeConfig().tp))):
        subprocess.run(argv, env={**base, **env}, check=True, timeout=30)
        assert record.read_text().splitlines() == ["-m", HEALTHCHECK_MODULE, "--all-ranks",
                                                   "--socket-dir", str(tmp_path / "s"), "--tp", tp]


def test_sidecar_start_post_keeps_the_journal_to_the_refusal_line(tmp_path):
    """OPERATIONS.md: a refused configuration (exit 2) leaves the unit failed "with the one line naming it last
    in `journalctl -u dspark-sidecar`". The health loop's stdout goes to that journal too: each poll, every 2 s
    of a start that may load for 15 minutes, wrote one "rankN.sock: UNREACHABLE: UNAVAILABLE" line per rank,
    and after a refusal those lines, not serve's, were the journal's last. Only the loop's own line may follow."""
    argv = _start_post(SIDECAR, "/opt/dspark-sidecar/bin/python", sys.executable)
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
           "DSPARK_SOCKET_DIR": str(tmp_path), "DSPARK_TP": "4", "MAINPID": str(_exited_pid())}
    res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode != 0
    assert res.stdout == "" and res.stderr == "dspark-sidecar exited before every rank was SERVING\n", res


# systemd's truth words; a unit's boolean is on for any of them.
_ON = ("1", "yes", "true", "on")


def test_no_hardening_option_shuts_the_ranks_out_of_the_gpu_device_nodes():
    """ProtectClock=yes implies DeviceAllow=char-rtc r before systemd 252 (systemd PR 25075: "allow-listing a
    device implicitly blocks everything else"), and under DevicePolicy=auto one DeviceAllow= entry admits no
    other device: on Ubuntu 22.04 (systemd 249) and Debian 11 the ranks could not open /dev/kfd, /dev/dri/renderD*
    or /dev/nvidia*, found no GPU, and `serve` refused --device cuda (exit 2; under auto it served on the CPU).
    The unit leaves PrivateDevices off for that reason already; no setting that makes a device list may be on,
    in the unit or its NVIDIA drop-in."""
    for unit in (SIDECAR, SIDECAR_MPS_DROPIN):
        for _, key, value in parse_unit(unit):
            assert not (key in ("ProtectClock", "PrivateDevices") and value.lower() in _ON), (unit.name, key, value)
            assert key != "DeviceAllow" or not value, (unit.name, key, value)
            assert not (key == "DevicePolicy" and value in ("closed", "strict")), (unit.name, key, value)
