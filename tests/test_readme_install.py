"""The README's install and test commands work from a clean checkout, and its Layout table indexes the package."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
README = (REPO / "README.md").read_text()
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def _dist(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower().replace("_", "-").replace(".", "-")


def _module_imports(path: Path) -> set[str]:
    """Top-level names a module imports when it is imported (its body's import statements, not functions')."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _skips(path: Path) -> set[str]:
    return set(re.findall(r"importorskip\(\s*[\"']([\w.]+)", path.read_text()))


def test_the_test_extra_installs_every_module_the_suite_imports():
    """`pip install -e ".[test]"` then `python -m pytest -q` (README): PyYAML, which tests/deploy imports, was
    not in the extra, so the suite stopped at collection ("15 errors during collection") without it."""
    required = {_dist(r) for r in PYPROJECT["project"]["dependencies"]}
    required |= {_dist(r) for r in PYPROJECT["project"]["optional-dependencies"]["test"]}
    local = {p.stem for p in TESTS.rglob("*.py")} | {p.name for p in TESTS.rglob("*") if p.is_dir()}
    local |= {"dspark_sidecar", "__future__"}
    by_module = importlib.metadata.packages_distributions()
    files = sorted(TESTS.rglob("*.py"))
    missing = []
    for path in files:
        skipped = _skips(path)
        if path.parent.name == "helpers":  # a helper's import is skipped where every importer skips it
            importers = [f for f in files if re.search(rf"helpers(\.|\s+import\s+){path.stem}\b", f.read_text())]
            skipped = set.intersection(*(_skips(f) for f in importers)) if importers else set()
        for name in _module_imports(path) - local - set(sys.stdlib_module_names) - skipped:
            if not {_dist(d) for d in by_module.get(name, [])} & required:
                missing.append(f"{path.relative_to(REPO)}: {name}")
    assert not missing, f"imported without importorskip, but not installed by the test extra: {missing}"


def test_the_test_extra_pins_the_grpcio_tools_that_wrote_the_committed_stubs():
    """tests/proto regenerates the stubs and compares bytes; a newer grpcio-tools (pip's pick for `>=1.84`)
    writes its own version into sidecar_pb2_grpc.py, and that test failed after the README's install."""
    generated = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", (REPO / "proto/sidecar_pb2_grpc.py").read_text())
    assert f"grpcio-tools=={generated[1]}" in PYPROJECT["project"]["optional-dependencies"]["test"]
    assert f'"grpcio-tools=={generated[1]}"' in (REPO / ".ci/run").read_text()


def test_every_module_outside_the_kernel_backends_imports_without_triton_or_flydsl(tmp_path):
    """Triton and FlyDSL are optional extras, and the README's install leaves them out: a CPU sidecar runs the
    reference ops. server/prelaunch.py imported the Triton step_meta kernels at module level, so server.app
    (every rank of `serve` and `demo`) failed with "No module named 'triton'" on such a machine."""
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent("""
        import sys

        class Absent:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("triton", "flydsl"):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
                return None

        sys.meta_path.insert(0, Absent())
    """))
    modules = sorted(
        "dspark_sidecar." + ".".join(p.relative_to(REPO).with_suffix("").parts)
        for folder in ("", "drafter", "kernels", "proto", "server", "client")
        for p in (REPO / folder).glob("*.py") if not p.name.startswith("__") and "sidecar_pb2" not in p.name)
    script = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-c", script, *modules], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _layout_table() -> str:
    return README.split("\n## Layout\n", 1)[1]


def test_layout_table_names_every_module_of_the_package():
    """The Layout table is the package's index: bench_phases.py, kernels/timing.py and six client modules
    (config, doorbell_transport, forward_context, launcher, metadata, stats) were missing from it."""
    table = _layout_table()
    rows = {row.split("|")[1].strip(): row for row in table.splitlines() if row.startswith("| `")}
    top = " ".join(k for k in rows if "/" not in k)
    missing = [p.name for p in REPO.glob("*.py") if p.name != "__init__.py" and f"`{p.name}`" not in top]
    for folder in ("drafter", "kernels", "proto", "server", "client"):
        row = rows[f"`{folder}/`"]
        missing += [f"{folder}/{p.name}" for p in (REPO / folder).glob("*.py")
                    if p.name != "__init__.py" and "sidecar_pb2" not in p.name and f"`{p.name}`" not in row]
    assert not missing, f"not in README's Layout table: {missing}"


def test_layout_table_names_only_files_that_exist():
    rows = [row.split("|")[1:3] for row in _layout_table().splitlines() if row.startswith("| `")]
    absent = []
    for path_cell, what in rows:
        for name in re.findall(r"`([\w./-]+)`", path_cell):
            if not (REPO / name).exists():
                absent.append(name)
        folder = path_cell.strip().strip("`")
        if folder.endswith("/") and folder not in ("deploy/", "tests/"):
            for name in re.findall(r"`([\w/]+\.(?:py|proto|md)|\w+/)`", what):
                # `triton/` (...; `blas.py`: ...) names a file of that subfolder
                if not (REPO / folder / name).exists() and not any((REPO / folder).rglob(name)):
                    absent.append(folder + name)
    assert not absent, absent
