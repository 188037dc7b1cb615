"""The operator guide names the exact refusal reasons, every metric, every flag, and the caveats it owes."""

from __future__ import annotations

import re
from pathlib import Path

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
    # The ConfigMap's comment on the two variables said the same ("the target model (embed_tokens / lm_head)").
    lines = (DEPLOY / "k8s" / "base" / "configmap.yaml").read_text().split("  DSPARK_CHECKPOINT:", 1)[0].splitlines()
    comment = []
    while lines and lines[-1].strip().startswith("#"):  # the comment block just above DSPARK_CHECKPOINT
        comment.insert(0, lines.pop())
    assert any("embed_tokens" in c for c in comment) and not any("lm_head" in c for c in comment), comment


def _default_matches(text: str, default) -> bool:
    """Whether a flag table's default cell (one value, its parenthetical dropped) reads as the parser's default."""
    words = text.replace("`", "").strip()
    if words in ("", "synthetic"):  # no value: the preset's synthetic checkpoint
        return default is None
    if words.split()[-1] in ("on", "off"):  # "off", "graphs on", "warm-up on": a switch (or 0 = off)
        return default == (words.split()[-1] == "on") and (isinstance(default, bool) or words.endswith("off"))
    if words.endswith(" MiB"):
        return default == int(words.removesuffix(" MiB")) << 20
    if isinstance(default, Path):
        return str(default) == words
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        return float(words) == default
    return words == default


def _table_defaults(text: str, default_col: int, sep: str) -> dict[str, str]:
    """flag -> its default cell's text, from a flag table whose rows start with "| `--"; a row naming two flags
    gives each its part of the cell (split on `sep`), or the whole cell when it has one part for both."""
    out = {}
    for line in text.splitlines():
        if not line.startswith("| `--"):
            continue
        cells = [c.strip() for c in line.split("|")[1:-1]]
        flags = re.findall(r"`(--[a-z-]+)", cells[0])
        values = [v.strip() for v in re.sub(r"\s*\([^)]*\)", "", cells[default_col]).split(sep)]
        for flag, value in zip(flags, values * len(flags) if len(values) == 1 else values, strict=True):
            out[flag] = value
    return out


@pytest.mark.parametrize("doc, heading, default_col, sep", [("deploy/OPERATIONS.md", "## Flags", 2, " / "),
                                                           ("README.md", "### `serve` flags", 1, ", ")])
def test_flag_tables_give_the_parsers_defaults(doc, heading, default_col, sep):
    """Both flag tables say each serve flag's default, which an operator leaves out of the ConfigMap or
    sidecar.env on its word; the table check above covered only the variable names, so a default changed in
    cli.py / ServeConfig could leave the guide stating the old one. Each cell is read against the parser."""
    from deploy.deploy_files import REPO, serve_parser

    section = (REPO / doc).read_text().split(f"\n{heading}\n", 1)[1].split("\n#", 1)[0]
    cells = _table_defaults(section, default_col, sep)
    actions = [a for a in serve_parser()._actions if a.option_strings and a.dest != "help"]
    assert {a.option_strings[0] for a in actions} <= set(cells), {a.option_strings[0] for a in actions} - set(cells)
    wrong = {a.option_strings[0]: (cells[a.option_strings[0]], a.default) for a in actions
             if not _default_matches(cells[a.option_strings[0]], a.default)}
    assert not wrong, wrong


def test_flag_default_reader_refuses_a_stale_default():
    """The reader above must fail a cell that no longer matches: a number, a switch, a size, a path."""
    assert not _default_matches("2.0", 1.0) and _default_matches("1.0", 1.0)
    assert not _default_matches("on", False) and _default_matches("graphs on", True)
    assert not _default_matches("off", True) and _default_matches("off", 0)
    assert not _default_matches("128 MiB", 256 << 20) and _default_matches("256 MiB", 256 << 20)
    assert not _default_matches("/run/dspark", Path("/tmp/dspark-sidecar"))
    assert not _default_matches("synthetic", Path("/x")) and not _default_matches("tiny", "minimax-m3.1")


def test_the_guide_quotes_the_launchers_line_after_a_rank_refused(tmp_path, caplog):
    """A rank that refuses at start-up exits 2 (or 75) with its one line, and the launcher passes the code on.
    The guide said the launcher added "no line of its own" and that the refusal stood last in the unit's journal;
    the launcher logs one INFO line after it (and the peers it stops log theirs). The line quoted is the one the
    launcher writes, read from a launch whose only rank exits 2 at once."""
    import logging
    from unittest import mock

    from dspark_sidecar.server import launcher
    from dspark_sidecar.server.config import ServeConfig

    class Refused:
        returncode = 2

        def __init__(self, *_args, **_kwargs):
            pass

        def poll(self):
            return 2

        def wait(self, timeout=None):
            return 2

        def send_signal(self, _signum):
            pass

        kill = send_signal

    with mock.patch.object(launcher.subprocess, "Popen", Refused), \
            caplog.at_level(logging.INFO, logger="dspark_sidecar.launcher"):
        assert launcher.launch(ServeConfig(tp=1, socket_dir=tmp_path), ["serve"], on_ready=lambda: False) == 2
    (said,) = [r.getMessage() for r in caplog.records if r.name == "dspark_sidecar.launcher"]
    quoted = re.sub(r"rank \d+", "rank N", said.split(" (", 1)[0])
    assert quoted.startswith("sidecar rank N refused to start"), said
    assert f'"{quoted}"' in " ".join(OPERATIONS.split()), quoted
    assert "no line of its own" not in OPERATIONS
