"""server/health.py's reasons, as GetStatus.state_reason gives them (the watches themselves: test_step_stuck.py,
test_lifecycle.py, test_peer_exit.py, test_peer_silence.py)."""

from __future__ import annotations

from dspark_sidecar.server.health import peers_reason, stuck_reason


def test_several_exited_peers_are_named_each_with_its_own_pid():
    """The pids in the ranks' order: rank 1's pid first, whatever the pids' own order (a restarted peer's pid may be
    lower than its elder's). Listed apart, an operator killed or looked up the wrong process."""
    why = peers_reason({3: 170, 1: 9001}, {})
    assert why.startswith("peer rank(s) 1, 3 exited (pid 9001, 170): "), why


def test_several_silent_peers_are_reported_silent_for_the_longest_silence():
    """The reason counts the silence of the peer silent longest: the one whose seconds matter for the steps that
    would abort, and the figure that keeps growing while the peers stay so."""
    why = peers_reason({}, {1: 3.5, 2: 61.3, 3: 4.0})
    assert why.startswith("peer rank(s) 1, 2, 3 silent for 61.3 s: stopped or hung"), why


def test_exited_peers_come_before_silent_ones_in_one_reason():
    why = peers_reason({2: 77}, {1: 4.0})
    assert why == ("peer rank(s) 2 exited (pid 77): steps abort until the sidecar group is restarted; "
                   "peer rank(s) 1 silent for 4.0 s: stopped or hung; steps would abort"), why
    assert stuck_reason(7, 16.04).startswith("draft step 7 has run for 16.0 s (steps take milliseconds)")
