"""Shared fixtures: the tiny preset and its synthetic checkpoint, written once per test session."""

from __future__ import annotations

import os
import sys
import traceback

import pytest
import torch

from dspark_sidecar.drafter.checkpoint import EMBED_KEY, CheckpointReader, write_synthetic_checkpoint
from dspark_sidecar.drafter.config import PRESETS

torch.set_num_threads(1)  # deterministic CPU reductions, and 2-core CI boxes

_SESSION_PID = os.getpid()
_real_exit = os._exit


def _exit_guard(code: int) -> None:
    """os._exit in the test session's own process (a production watchdog or exit path left running past its
    test, as the teardown's timer once was) ended pytest at once, without its summary and with the code it was
    given: os._exit(0) was a suite that passed, with a tenth of it never run. Here it ends the session with
    status 70 and says where it was called. In any other process (a forked child) it is os._exit itself. Tests
    that fake os._exit (monkeypatch) replace this for their own duration."""
    if os.getpid() == _SESSION_PID:
        if _capture is not None:  # else the line went into the running test's captured output, never shown
            _capture.suspend_global_capture(in_=False)
        sys.stderr.write(f"\ntests/conftest.py: os._exit({code}) called in the pytest process itself; the session "
                         "ends here with status 70. Called from:\n" + "".join(traceback.format_stack()))
        sys.stderr.flush()
        _real_exit(70)
    _real_exit(code)


os._exit = _exit_guard
_capture = None  # pytest's capture manager (pytest_configure), to write the guard's line where it is seen


def pytest_configure(config) -> None:
    global _capture
    _capture = config.pluginmanager.getplugin("capturemanager")


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked ends_mps_clients run last, in their own order. Each kills an engine process with GPU work in
    flight; under MPS that gives every other client's context a sticky error (BENCHMARKS.md run 301), the pytest
    process's own included once any test has used CUDA: in one `pytest -m gpu` every CUDA test after it failed
    (run 305: two data-plane tests that pass alone)."""
    items.sort(key=lambda item: item.get_closest_marker("ends_mps_clients") is not None)  # stable: False first


@pytest.fixture(scope="session")
def tiny_cfg():
    return PRESETS["tiny"]


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory, tiny_cfg):
    """(dspark_dir, target_dir) of the tiny preset's synthetic checkpoint, seed 0."""
    return write_synthetic_checkpoint(tiny_cfg, tmp_path_factory.mktemp("ckpt"), seed=0)


@pytest.fixture(scope="session")
def tiny_embed(tiny_ckpt, tiny_cfg):
    """embed_tokens [vocab, hidden] in fp32 (exact: stored as bf16)."""
    return CheckpointReader(tiny_ckpt[1], torch.float32).read(EMBED_KEY, (tiny_cfg.vocab_size, tiny_cfg.hidden_size))


@pytest.fixture
def no_launch(monkeypatch):
    """`serve` must refuse in the parent: starting the launcher fails the test (start-up refusal tests)."""
    from dspark_sidecar.server import launcher

    def refuse(*_a, **_k):
        raise AssertionError("a rank was started: the mistake was not caught before launch")
    monkeypatch.setattr(launcher, "launch", refuse)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def bench_sidecars(monkeypatch) -> list:
    """Every bench.SidecarUnderTest the test starts, in order, for what it left behind (its process, folder)."""
    from dspark_sidecar import bench

    started, real = [], bench.SidecarUnderTest

    def recording(*args, **kwargs):
        started.append(real(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(bench, "SidecarUnderTest", recording)
    return started
