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


def _troubleshooting_rows() -> dict[str, str]:
    """symptom -> likely cause, from the guide's troubleshooting table."""
    section = OPERATIONS.split("## Troubleshooting", 1)[1]
    rows = [line.split("|")[1:-1] for line in section.splitlines() if line.startswith("| ") and "---" not in line]
    return {symptom.strip(): cause.strip() for symptom, cause in rows[1:]}


def test_troubleshooting_gives_mps_under_two_users_its_real_symptom():
    """The MPS control daemon serves one user at a time: a client of another user is queued until every
    client of the running server has exited (nvidia-cuda-mps-control(1)). With the sidecar started first
    (the engine's unit and pod start after it), an engine of another user does not run slower, it waits at
    its first CUDA call for as long as the sidecar serves. The table listed that cause under "forwarded steps
    slower", sending an operator whose engine never came up to look at step latencies."""
    rows = _troubleshooting_rows()
    slower = [cause for symptom, cause in rows.items() if "slower" in symptom]
    assert slower and not any("user" in cause for cause in slower), slower
    hang = [symptom for symptom, cause in rows.items() if "different users" in cause]
    assert hang and all("engine" in s and ("hangs" in s or "waits" in s) for s in hang), hang


def test_install_steps_name_this_checkout_not_the_package_name_on_an_index():
    """The images install the wheel built from the checkout by its file: `pip install "dspark-sidecar[...]"`
    also asks the package index for that name and takes the highest version found, anyone's
    (test_deploy_dockerfiles). The bare-metal guide, its troubleshooting row and the engine image's comments
    still said `pip install "dspark-sidecar[flydsl]"` / `pip install dspark-sidecar`: an operator following them
    installed whatever the index holds under that name, or nothing."""
    texts = {f.relative_to(DEPLOY): f.read_text() for f in DEPLOY.rglob("*") if f.is_file() and f.suffix in (".md", ".yaml")}
    bare = re.compile(r"""pip install[^\n`]*?["'\s]dspark[-_]sidecar(?=[\["'`\s]|$)""", re.M)
    found = {str(path): bare.findall(text) for path, text in texts.items() if bare.search(text)}
    assert not found, found
    assert 'pip install "<this checkout>[flydsl]"' in OPERATIONS


def test_guide_lists_the_sidecars_own_reasons_verbatim():
    """The guide says alert on the reasons verbatim, and listed only the seed's seven: on the very host the path
    is for, `status` showed "no engine bound yet (...)" before any engine (no refusal at all: an alert on it
    paged for every start), "--backend triton selected" (README's tested choice there), and on a CPU rank or
    another drafter/dtype words the guide never named."""
    import torch

    from dspark_sidecar.drafter.config import load_config
    from dspark_sidecar.server.backend import choose_backend
    from dspark_sidecar.server.config import ServeConfig
    from dspark_sidecar.server.fast_path import kernel_mismatch
    from dspark_sidecar.server.refusal import AWAITING_BIND, HostFacts

    host = HostFacts(on_gfx950=True, flydsl_available=True, tp_size=4)
    chosen = choose_backend(ServeConfig(backend="reference"), host, torch.device("cuda")).flydsl_refusal
    assert chosen == "--backend reference selected" and "`--backend B selected`" in OPERATIONS, chosen
    assert "`--backend triton selected`" in OPERATIONS
    on_cpu = choose_backend(ServeConfig(), host, torch.device("cpu")).flydsl_refusal
    dtype = kernel_mismatch(load_config("minimax-m3.1"), torch.float32)
    for reason in (AWAITING_BIND, on_cpu, dtype):
        assert f"`{reason}`" in OPERATIONS, reason


def _flag_row(flag: str) -> str:
    """The guide's flag table row of `flag`."""
    (row,) = [line for line in OPERATIONS.splitlines() if line.startswith(f"| `{flag}")]
    return row


def test_the_tcp_row_says_what_serve_listens_on():
    """The guide's row said "TCP instead of, or besides, sockets": no flag turns the unix sockets off, every
    rank listens on its socket and, with --tcp-base-port, on a TCP port as well."""
    from dspark_sidecar.server.config import ServeConfig

    eps = ServeConfig(tp=2, tcp_base_port=19000).endpoints(1)
    assert eps[0].startswith("unix:") and eps[1].endswith(":19001"), eps
    row = _flag_row("--tcp-host")
    assert "instead" not in row and "besides" in row, row


def test_the_target_checkpoint_row_names_only_what_serve_reads_of_it(tmp_path):
    """The guide's row called the target folder the "embed_tokens / lm_head source": the sidecar reads (and
    checks) only embed_tokens there; lm_head is the engine's."""
    from safetensors.torch import load_file, save_file

    from dspark_sidecar.drafter.checkpoint import EMBED_KEY, check_checkpoint, ensure_synthetic_checkpoint
    from dspark_sidecar.drafter.config import load_config

    cfg = load_config("tiny")
    dspark_dir, target_dir = ensure_synthetic_checkpoint(cfg)
    embed_only = tmp_path / "target"
    embed_only.mkdir()
    tensors = {}
    for f in target_dir.glob("*.safetensors"):
        tensors |= {k: v for k, v in load_file(f).items() if k == EMBED_KEY}
    assert set(tensors) == {EMBED_KEY}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(embed_only / "model.safetensors"))
    check_checkpoint(cfg, dspark_dir, embed_only)  # no lm_head: nothing missing for the sidecar
    row = _flag_row("--target-checkpoint")
    assert "embed_tokens" in row and "lm_head" not in row, row
