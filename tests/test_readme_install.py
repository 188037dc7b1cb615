"""The README's install and test commands work from a clean checkout, and its Layout table indexes the package."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10, which requires-python admits: the test extra's backport
    import tomli as tomllib

import pytest

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


# A machine after the README's install, which leaves the optional extras out: triton and flydsl do not import.
WITHOUT_EXTRAS = textwrap.dedent("""
    import sys

    class Absent:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("triton", "flydsl"):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Absent())
""")

# Python 3.10's standard library as the suite sees it, as a pytest plug-in: no tomllib, and in its place the
# test extra's tomli (tomllib's API). Hidden only once pytest has read its own configuration, with tomllib.
PYTHON_3_10 = textwrap.dedent("""
    import sys

    class NoTomllib:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "tomllib":
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    def pytest_configure(config):
        import tomllib
        sys.modules["tomli"] = tomllib
        for name in [m for m in sys.modules if m.split(".")[0] == "tomllib"]:
            del sys.modules[name]
        sys.meta_path.insert(0, NoTomllib())
""")


def _env_with(folder: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH")) if p)}


def test_every_module_outside_the_kernel_backends_imports_without_triton_or_flydsl(tmp_path):
    """Triton and FlyDSL are optional extras, and the README's install leaves them out: a CPU sidecar runs the
    reference ops. server/prelaunch.py imported the Triton step_meta kernels at module level, so server.app
    (every rank of `serve` and `demo`) failed with "No module named 'triton'" on such a machine."""
    (tmp_path / "sitecustomize.py").write_text(WITHOUT_EXTRAS)
    modules = sorted(
        "dspark_sidecar." + ".".join(p.relative_to(REPO).with_suffix("").parts)
        for folder in ("", "drafter", "kernels", "proto", "server", "client")
        for p in (REPO / folder).glob("*.py") if not p.name.startswith("__") and "sidecar_pb2" not in p.name)
    script = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    proc = subprocess.run([sys.executable, "-c", script, *modules], env=_env_with(tmp_path), capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _collect(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`python -m pytest --collect-only` in the checkout, with tmp_path first on the path."""
    return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                          cwd=REPO, env=_env_with(tmp_path), capture_output=True, text=True, timeout=600)


def test_the_suite_collects_without_the_triton_and_flydsl_extras(tmp_path):
    """The README says tests that need the other extras skip without them. tests/server/test_validate_indices.py
    imported kernels/triton/step_meta.py (which imports triton) unguarded: after `pip install -e ".[test]"`,
    `python -m pytest -q` stopped at "Interrupted: 1 error during collection" and ran no test at all."""
    (tmp_path / "sitecustomize.py").write_text(WITHOUT_EXTRAS)
    proc = _collect(tmp_path, "tests")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _module_skips_for(tree: ast.Module, package: str) -> bool:
    """Whether the module skips as a whole where `package` (or a GPU it would need) is missing."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue  # a helper's own pytest.skip skips only the tests that call it
        text = ast.unparse(node)
        if re.search(rf"importorskip\(\s*[\"']{package}\b", text) or "pytest.skip(" in text:
            return True
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            if "skipif" in text:
                return True
    return False


def test_a_test_imports_an_optional_extra_only_where_it_skips_without_it():
    """tests/kernels/flydsl/test_flydsl_runner.py's compile test imported flydsl.compiler in its body: after the
    README's install it failed ("No module named 'flydsl'") instead of skipping. A test that imports triton or
    flydsl must be in a module that skips without them, or call pytest.importorskip before the import.
    (helpers/ are left out: their functions run inside their importers' tests, which skip as a whole.)"""
    unguarded = []
    for path in sorted(TESTS.rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    names = [node.module]
                else:
                    continue
                for package in {n.split(".")[0] for n in names} & {"triton", "flydsl"}:
                    before = "\n".join(path.read_text().splitlines()[fn.lineno - 1:node.lineno - 1])
                    if not _module_skips_for(tree, package) and f'importorskip("{package}' not in before:
                        unguarded.append(f"{path.relative_to(REPO)}:{node.lineno} {fn.name} imports {package}")
    assert not unguarded, unguarded


def test_the_suite_reads_toml_on_the_oldest_python_requires_python_admits(tmp_path):
    """requires-python admits 3.10 (Ubuntu 22.04's), whose standard library has no tomllib: two test modules
    imported it, so there the README's test command stopped at collection ("No module named 'tomllib'"). They
    fall back to tomli, which the test extra installs below 3.11."""
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    if "3.10" not in SpecifierSet(PYPROJECT["project"]["requires-python"]):
        pytest.skip("requires-python no longer admits 3.10")
    tomli = [r for r in map(Requirement, PYPROJECT["project"]["optional-dependencies"]["test"]) if r.name == "tomli"]
    assert tomli and tomli[0].marker and tomli[0].marker.evaluate({"python_version": "3.10"}), \
        "the test extra must install tomli on Python 3.10"
    (tmp_path / "py310.py").write_text(PYTHON_3_10)
    readers = sorted(str(p.relative_to(REPO)) for p in TESTS.rglob("test_*.py") if "import tomllib" in p.read_text())
    assert readers
    proc = _collect(tmp_path, "-p", "py310", *readers)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


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
