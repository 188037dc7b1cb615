"""The operator guide names the exact refusal reasons, every metric, every flag, and the caveats it owes."""

from __future__ import annotations

import re

import pytest

from deploy.deploy_files import DEPLOY, serve_flag_env
from dspark_sidecar.server.metrics import RESULTS

OPERATIONS = (DEPLOY / "OPERATIONS.md").read_text()
SECURITY = (DEPLOY / "SECURITY.md").read_text()

# Exact strings of the seed's deployment checks; operators alert on them verbatim.
REFUSAL_REASONS = [
    "not gfx950",
    "FlyDSL not installed",
    "TP n != 4",
    "DP > 1",
    "PP > 1",
    "no DSpark draft",
    "7 speculative tokens required",
]
METRICS = ["dspark_steps_total", "dspark_step_seconds", "dspark_kv_binds_total", "dspark_serving"]


@pytest.mark.parametrize("reason", REFUSAL_REASONS)
def test_guide_lists_refusal_reason_verbatim(reason):
    assert f"`{reason}`" in OPERATIONS


def test_guide_documents_metrics_with_their_labels():
    for name in METRICS:
        assert f"`{name}" in OPERATIONS, name
    for result in RESULTS:
        assert f'dspark_steps_total{{result="{result}"}}' in OPERATIONS, result
    for phase in ("queue", "rendezvous", "compute", "total"):
        assert f'dspark_step_seconds{{phase="{phase}"}}' in OPERATIONS, phase


def test_guide_flag_table_covers_every_serve_flag():
    documented = set(re.findall(r"`(DSPARK_[A-Z_]+)`", OPERATIONS))
    assert serve_flag_env() <= documented, serve_flag_env() - documented


def test_guide_and_security_cover_the_required_caveats():
    assert "expandable_segments" in OPERATIONS and "MPS" in OPERATIONS
    assert "returns `None`" in OPERATIONS or "return `None`" in OPERATIONS
    assert "Circuit breaker" in OPERATIONS or "circuit breaker" in OPERATIONS
    for point in ("0660", "loopback", "--allow-remote", "IPC handle"):
        assert point in SECURITY, point


def test_deploy_readme_names_every_file_in_deploy():
    """deploy/README.md's table is the index of the folder; gpu-check.sh and the .dockerignore files
    were missing from it."""
    readme = (DEPLOY / "README.md").read_text()
    for entry in sorted(DEPLOY.iterdir()):
        if entry.name == "README.md" or entry.name.startswith((".", "__")):
            continue
        assert (f"`{entry.name}/" if entry.is_dir() else f"`{entry.name}`") in readme, entry.name


def test_every_dspark_variable_the_deploy_files_name_is_one_serve_knows():
    """serve warns of a DSPARK_* variable nothing reads: the deploy files' own (the launch recipe's
    DSPARK_LAUNCHER, DSPARK_PYTHON, DSPARK_SOCKET_GROUP, exported around serve) must not be among them."""
    from dspark_sidecar import cli

    names = {m for f in DEPLOY.rglob("*") if f.is_file() for m in re.findall(r"DSPARK_[A-Z_]*[A-Z]", f.read_text())}
    dests = [n.removeprefix("DSPARK_").lower() for n in serve_flag_env()]
    assert "DSPARK_LAUNCHER" in names and "DSPARK_SOCKET_DIR" in names
    assert cli.unknown_env(dict.fromkeys(names, "1"), dests) == []
