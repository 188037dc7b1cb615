"""The exec probe of deploy/ (`python -m dspark_sidecar.server.healthcheck`): its flags."""

from __future__ import annotations

import pytest

from dspark_sidecar.server import healthcheck


@pytest.mark.parametrize("flags, words", [
    (["--tp", "0"], "--tp: must be at least 1, got 0"),
    (["--tp", "-2"], "--tp: must be at least 1, got -2"),
    (["--timeout", "0"], "--timeout: must be a number of seconds above 0, got 0.0"),
    (["--timeout", "nan"], "--timeout: must be a number of seconds above 0, got nan"),
])
def test_a_probe_flag_that_cannot_be_used_is_refused_not_answered(flags, words, tmp_path, capsys):
    """--tp 0 checked no rank and exited 0: a probe that passed with no sidecar at all (a typo in a
    manifest marked the pod healthy). A timeout of 0 or nan reported every live rank UNREACHABLE
    (DEADLINE_EXCEEDED) instead of naming the flag."""
    with pytest.raises(SystemExit) as exit_:
        healthcheck.main(["--all-ranks", "--socket-dir", str(tmp_path), *flags])
    assert exit_.value.code == 2
    assert words in capsys.readouterr().err


def test_no_sidecar_is_not_healthy(tmp_path, capsys):
    assert healthcheck.main(["--all-ranks", "--socket-dir", str(tmp_path), "--tp", "1", "--timeout", "0.2"]) == 1
    assert "UNREACHABLE" in capsys.readouterr().out
