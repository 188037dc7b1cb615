"""The microbench's arithmetic that runs without a GPU: the fixed-cost and streaming-rate fit."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from dspark_sidecar.kernels.triton.microbench import fit_fixed_and_rate, main  # noqa: E402


def test_fit_recovers_fixed_cost_and_rate():
    """Points on t = 5 us + bytes / 3.9 TB/s, with +-0.2 us of alternating noise, give both back."""
    pts = [(b, 5e-6 + b / 3.9e12 + (0.2e-6 if i % 2 else -0.2e-6)) for i, b in enumerate((28e6, 75e6, 150e6, 300e6, 450e6))]
    t0, rate = fit_fixed_and_rate(pts)
    assert abs(t0 - 5e-6) < 0.3e-6, t0
    assert abs(rate / 3.9e12 - 1) < 0.02, rate


def test_fit_needs_two_sizes():
    with pytest.raises(ValueError, match="two or more sizes"):
        fit_fixed_and_rate([(1e6, 1e-6), (1e6, 2e-6)])


@pytest.mark.parametrize("argv", [["--rows", "8"], ["--rows", "7", "3"], ["--rows", "0"], ["--context", "-1"]])
def test_rows_that_are_not_whole_requests_are_refused_before_the_gpu(argv, capsys):
    """r = rows / 7 requests: 8 rows built 8-row activations beside 7 positions and failed deep in a
    kernel; the flag is refused first, with its name (and on a machine with no GPU, before CUDA)."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and argv[0] in capsys.readouterr().err
