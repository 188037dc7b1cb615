"""`python -m dspark_sidecar.bench_host`: prints each call's host time on a GPU, refuses clearly without one."""

from __future__ import annotations

import subprocess
import sys

import torch


def test_bench_host_runs_on_a_gpu_or_says_it_needs_one():
    r = subprocess.run([sys.executable, "-m", "dspark_sidecar.bench_host"], capture_output=True, text=True, timeout=300)
    if not torch.cuda.is_available():
        assert r.returncode == 2 and "needs a CUDA/ROCm GPU" in r.stderr
        return
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.rstrip().endswith(" us")]
    word = "GPU word unavailable" not in r.stdout  # its three calls are timed where the driver has them
    assert len(lines) == (16 if word else 13) and any(ln.startswith("peer: stream.wait_event") for ln in lines)
    assert all(float(ln.split()[-2]) > 0 for ln in lines)
