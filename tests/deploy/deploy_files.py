"""Readers for the files under deploy/: Kubernetes variants, systemd units, the flag contract."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
SYSTEMD = DEPLOY / "systemd"
VARIANTS = ("amd", "nvidia")

# The `serve` flags these deploy files rely on (the command-line contract they were written
# to), as the environment names the server reads: DSPARK_<FLAG_UPPER_SNAKE>.
CONTRACT_FLAG_ENV = frozenset(
    "DSPARK_" + f
    for f in (
        "TP SOCKET_DIR TCP_HOST TCP_BASE_PORT ALLOW_REMOTE CHECKPOINT TARGET_CHECKPOINT PRESET "
        "BACKEND DEVICE DTYPE MAX_REQS METRICS_PORT STRICT_REFUSAL DIST_BACKEND MASTER_ADDR MASTER_PORT"
    ).split()
)
HEALTHCHECK_MODULE = "dspark_sidecar.server.healthcheck"


def manifest_files() -> list[Path]:
    """Every Kubernetes object file (kustomization.yaml files are kustomize's, not objects)."""
    return sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")


def load_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def kustomization_files(directory: Path) -> list[Path]:
    """The object files a kustomization directory pulls in, following `resources` into bases."""
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    out: list[Path] = []
    for res in kust["resources"]:
        target = (directory / res).resolve()
        out.extend(kustomization_files(target) if target.is_dir() else [target])
    return out


@dataclass
class Variant:
    """The objects `kubectl apply -k deploy/k8s/<name>` creates, indexed for the tests."""

    name: str
    docs: list[dict]

    def one(self, kind: str) -> dict:
        found = [d for d in self.docs if d["kind"] == kind]
        assert len(found) == 1, f"{self.name}: expected one {kind}, found {len(found)}"
        return found[0]

    @property
    def config(self) -> dict[str, str]:
        return self.one("ConfigMap")["data"]

    @property
    def pod(self) -> dict:
        return self.one("Deployment")["spec"]["template"]["spec"]

    def container(self, name: str) -> dict:
        pod = self.pod
        found = [c for c in pod.get("initContainers", []) + pod["containers"] if c["name"] == name]
        assert len(found) == 1, f"{self.name}: expected one container {name!r}"
        return found[0]

    def all_containers(self) -> list[dict]:
        return self.pod.get("initContainers", []) + self.pod["containers"]


def load_variant(name: str) -> Variant:
    docs = [d for f in kustomization_files(K8S / name) for d in load_docs(f)]
    return Variant(name, docs)


def env_of(container: dict) -> dict[str, dict]:
    """name -> the env entry (with `value` or `valueFrom`)."""
    return {e["name"]: e for e in container.get("env", [])}


def mounts_of(container: dict) -> dict[str, str]:
    """volume name -> mountPath."""
    return {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])}


def parse_unit(path: Path) -> list[tuple[str, str, str]]:
    """(section, key, value) of a systemd unit or drop-in, in order; repeated keys kept."""
    out, section = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, _, value = line.partition("=")
        out.append((section, key.strip(), value.strip()))
    return out


def unit_values(path: Path, key: str) -> list[str]:
    return [v for _, k, v in parse_unit(path) if k == key]


def unit_environment(path: Path) -> dict[str, str]:
    """Environment= assignments of a unit (space-separated pairs, no quoting used in ours)."""
    env = {}
    for value in unit_values(path, "Environment"):
        for pair in value.split():
            k, _, v = pair.partition("=")
            env[k] = v
    return env


def env_file(path: Path) -> dict[str, str]:
    """KEY=value lines of an EnvironmentFile (comments and blanks skipped)."""
    out = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            k, _, v = line.partition("=")
            out[k] = v
    return out


def serve_parser(env: dict[str, str] | None = None) -> argparse.ArgumentParser:
    """The real `dspark-sidecar serve` parser, its defaults read from `env` as the only DSPARK_* variables."""
    from dspark_sidecar import cli

    clean = {k: v for k, v in os.environ.items() if not k.startswith("DSPARK_")}
    with mock.patch.dict(os.environ, {**clean, **(env or {})}, clear=True):
        parser = argparse.ArgumentParser()
        cli._add_serve_flags(parser)  # defaults are taken from the environment here
    return parser


def serve_flag_env() -> set[str]:
    """Environment name of every `serve` flag the CLI has."""
    return {"DSPARK_" + a.dest.upper() for a in serve_parser()._actions if a.option_strings and a.dest != "help"}


def serve_config_from_env(env: dict[str, str]):
    """The ServeConfig a `serve` with no flags builds from `env` (validated, as the server would)."""
    from dspark_sidecar import cli

    return cli.serve_config(serve_parser(env).parse_args([]))
