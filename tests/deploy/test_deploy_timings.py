"""Start-up, probe and stop timings of the deploy files: against serve's own bounds and as OPERATIONS.md says."""

from __future__ import annotations

import re

import pytest

from deploy.deploy_files import (
    DEPLOY,
    SYSTEMD,
    VARIANTS,
    env_file,
    load_variant,
    serve_config_from_env,
    unit_values,
)

OPERATIONS = " ".join((DEPLOY / "OPERATIONS.md").read_text().split())  # one line: claims wrap across lines
SIDECAR = SYSTEMD / "dspark-sidecar.service"
DOCKERFILES = (DEPLOY / "Dockerfile.rocm", DEPLOY / "Dockerfile.cuda")
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


def _seconds(text: str) -> float:
    """A systemd or Docker time span with one unit ("15min", "15m", "75s", "5s") in seconds."""
    m = re.fullmatch(r"(\d+)\s*(min|m|s)", text.strip())
    assert m, text
    return int(m[1]) * (60 if m[2] in ("min", "m") else 1)


def _claim(pattern: str) -> list[str]:
    """The groups of the guide's one sentence matching `pattern` (exactly one must)."""
    found = re.findall(pattern, OPERATIONS)
    assert len(found) == 1, (pattern, found)
    return [found[0]] if isinstance(found[0], str) else list(found[0])


def _probe_timeout_s(*flags: str) -> float:
    """The per-rank deadline the health check uses (with no --timeout, as the deploy files run it: its default),
    read by running its main() with the one call it makes per rank replaced by a recorder."""
    from unittest import mock

    from dspark_sidecar.server import healthcheck

    seen = []
    with mock.patch.object(healthcheck, "check", lambda target, timeout_s: seen.append(timeout_s) or "SERVING"):
        assert healthcheck.main(["--all-ranks", "--socket-dir", "/run/x", "--tp", "1", *flags]) == 0
    (timeout,) = seen
    return timeout


def test_probe_timeout_reader_sees_the_deadline_the_check_uses():
    assert _probe_timeout_s("--timeout", "7.5") == 7.5
    assert 0 < _probe_timeout_s() < float("inf")


@pytest.mark.parametrize("name", VARIANTS)
def test_startup_probe_outlasts_the_ranks_own_start_up_bound(name):
    """A peer hung at start-up ends the others after --startup-timeout-s with one line naming the flag (README:
    "below the 15 minutes deploy/ gives start-up, so the line comes before the pod or unit is killed"). The
    startup probe's budget was checked against a hard-coded 600, not the bound the ConfigMap gives serve."""
    v = load_variant(name)
    serve = serve_config_from_env(v.config)
    startup = v.container("dspark-sidecar")["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] > serve.startup_timeout_s


def test_unit_and_image_start_budgets_outlast_the_ranks_own_start_up_bound():
    """The same for the systemd unit (ExecStartPost holds it "activating" for TimeoutStartSec, then it fails)
    with the sidecar.env it ships, and for the images' health check start period (no DSPARK_STARTUP_TIMEOUT_S)."""
    from dspark_sidecar.server.config import ServeConfig

    env = {k: v for k, v in env_file(SYSTEMD / "sidecar.env.example").items() if k.startswith("DSPARK_")}
    (start,) = unit_values(SIDECAR, "TimeoutStartSec")
    assert _seconds(start) > serve_config_from_env(env).startup_timeout_s
    for dockerfile in DOCKERFILES:
        (period,) = re.findall(r"--start-period=(\S+)", dockerfile.read_text())
        assert _seconds(period) > ServeConfig().startup_timeout_s, dockerfile.name


@pytest.mark.parametrize("name", VARIANTS)
def test_a_serving_groups_probe_ends_within_its_timeout(name):
    """Every probe asks the ranks one after the other, each within the health check's own deadline: a group
    whose ranks all answer SERVING, however slowly, must not be failed by kubelet's timeout before the
    check has heard them all (a timed-out probe's event shows none of the check's lines either)."""
    v = load_variant(name)
    tp = int(v.config["DSPARK_TP"])
    for probe in PROBES:
        command = v.container("dspark-sidecar")[probe]["exec"]["command"]
        given = command[command.index("--timeout"):][:2] if "--timeout" in command else []
        assert tp * _probe_timeout_s(*given) < v.container("dspark-sidecar")[probe]["timeoutSeconds"], probe
    for dockerfile in DOCKERFILES:  # the images' HEALTHCHECK, at the images' DSPARK_TP
        text = dockerfile.read_text()
        (timeout,) = re.findall(r"HEALTHCHECK [^\n]*--timeout=(\S+)", text)
        (image_tp,) = re.findall(r"DSPARK_TP=(\d+)", text)
        given = re.findall(r"healthcheck [^\n]*?(--timeout) (\S+)", text)
        assert int(image_tp) * _probe_timeout_s(*(given[0] if given else ())) < _seconds(timeout), dockerfile.name


@pytest.mark.parametrize("name", VARIANTS)
def test_the_guide_states_the_probes_as_the_manifests_set_them(name):
    """OPERATIONS.md "Start, stop and probes" gives the startup and liveness probes' period and count."""
    sidecar = load_variant(name).container("dspark-sidecar")
    for probe in ("startupProbe", "livenessProbe"):
        period, count = _claim(rf"\*\*{probe}\*\* \((\d+) s x (\d+)\)")
        assert (int(period), int(count)) == (sidecar[probe]["periodSeconds"], sidecar[probe]["failureThreshold"]), probe


def test_the_guide_states_the_units_and_launchers_timings():
    """The bare-metal and stopping paragraphs: the start budget, the restart delay, systemd's SIGKILL, the
    launcher's own kill of a wedged rank, and the --drain-s above which TimeoutStopSec must be raised."""
    from dspark_sidecar.server.launcher import DRAIN_GRACE_S

    (start,) = unit_values(SIDECAR, "TimeoutStartSec")
    (restart,) = unit_values(SIDECAR, "RestartSec")
    (stop,) = unit_values(SIDECAR, "TimeoutStopSec")
    assert int(_claim(r"with a (\d+)-minute budget for weight loading")[0]) * 60 == _seconds(start)
    assert int(_claim(r"A launcher that fails is restarted after (\d+) s")[0]) == _seconds(restart)
    assert int(_claim(r"SIGTERM, then SIGKILL after (\d+) s")[0]) == _seconds(stop)
    assert int(_claim(r"still running `--drain-s` \+ (\d+) s after SIGTERM")[0]) == DRAIN_GRACE_S
    # Above this --drain-s the launcher's kill (--drain-s + DRAIN_GRACE_S) would come at or after systemd's.
    assert int(_claim(r"with a `--drain-s` above (\d+) s")[0]) == _seconds(stop) - DRAIN_GRACE_S - 1


def test_docker_stop_timeout_outlasts_the_launchers_own_kill():
    """`docker run --stop-timeout N`, as the guide and both images' headers give it: past the launcher's kill of
    a wedged rank at the default drain, so that Docker's SIGKILL does not cut a drain or teardown short."""
    from dspark_sidecar.server.config import ServeConfig
    from dspark_sidecar.server.launcher import DRAIN_GRACE_S

    given = set(re.findall(r"--stop-timeout (\d+)", OPERATIONS))
    for dockerfile in DOCKERFILES:
        given |= set(re.findall(r"--stop-timeout (\d+)", dockerfile.read_text()))
    assert given and all(int(n) > ServeConfig().drain_s + DRAIN_GRACE_S for n in given), given
