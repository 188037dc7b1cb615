"""server/launcher.py with real rank processes: a rank that refuses to start stops the group with its own code."""

from __future__ import annotations

import logging
import time

import pytest

from dspark_sidecar.server.config import ServeConfig
from dspark_sidecar.server.launcher import EXIT_USAGE, launch
from helpers.engine_fakes import short_socket_dir


@pytest.mark.parametrize("poll_s", [0.2, 4.0])
def test_a_rank_that_refuses_to_start_stops_the_group_with_exit_2_and_no_second_line(caplog, capfd, poll_s):
    # The parent checks flags, sockets and ports before launch; a rank can still refuse (a port taken
    # in between). Its one line is enough: the launcher used to add "rank N exited with code 2" and
    # exit 1, as for a crash. Here every rank refuses --seed -5 (range-checked when a rank parses).
    # With a slow poll both ranks have exited before the launcher looks again: that case returned 1
    # (the group's "all exited" branch came before the refusal's), as it did on a loaded CI box.
    sock = short_socket_dir()
    argv = ["serve", "--tp", "2", "--device", "cpu", "--socket-dir", str(sock), "--seed", "-5"]
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, logger="dspark_sidecar.launcher"):
        code = launch(ServeConfig(tp=2, socket_dir=sock), argv, on_ready=lambda: False, poll_s=poll_s)  # never serving
    assert code == EXIT_USAGE == 2
    assert time.monotonic() - t0 < 60
    assert "exited with code" not in caplog.text and "refused to start" in caplog.text
    err = capfd.readouterr().err
    assert "--seed" in err and "Traceback" not in err
    assert not list(sock.glob("*.sock"))
