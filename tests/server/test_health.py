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


def test_a_silent_peer_that_exits_is_not_published_as_no_peer_out_while_the_watch_records_it():
    """watch_peers records the silent and the exited peers one after the other, unlocked, while a gRPC thread (a
    BindKV, a lease's end) or the fast path's compile thread may publish. A silent peer that then exits leaves the
    silent ones before it joins the exited ones: a publish in between found no peer out and set SERVING (Watch
    subscribers and GetStatus saw a rank with a dead peer serving) until the watch's own publish. The publish
    between the two records is made here, at that point, by the Lifecycle itself."""
    from types import SimpleNamespace

    from grpc_health.v1 import health, health_pb2

    from dspark_sidecar.server.health import HealthPublisher, watch_peers
    from dspark_sidecar.server.servicer import Lifecycle

    class Racing(Lifecycle):
        armed = False

        def __setattr__(self, name, value):
            super().__setattr__(name, value)
            if name in ("silent_peers", "exited_peers") and type(self).armed:
                type(self).armed = False
                publish()  # another thread's publish, between the watch's two records
                seen.append(self.snapshot())

    seen: list[tuple[str, str]] = []
    hs = health.HealthServicer()
    life = Racing(state="LOADING")
    publish = HealthPublisher(life, SimpleNamespace(refusal=lambda: ""), SimpleNamespace(refusal=None), hs,
                              SimpleNamespace(set_serving=lambda serving: None))
    publish("SERVING")
    board = SimpleNamespace(beat=lambda rank: None, silent=lambda rank, after_s: {1: 10.0})  # rank 1 beats no more
    peers = SimpleNamespace(exited=lambda: {})
    watch_peers(board, 0, life, publish, peers)
    assert life.state == "PEER_SILENT"
    got: list = []
    hs.Watch(health_pb2.HealthCheckRequest(service=""), SimpleNamespace(add_callback=lambda cb: None), got.append)
    peers.exited = lambda: {1: 4242}  # then its process exits
    Racing.armed = True
    watch_peers(board, 0, life, publish, peers)
    assert len(seen) == 1 and seen[0][0] == "PEER_SILENT" and seen[0][1], seen
    assert [r.status for r in got] == [health_pb2.HealthCheckResponse.NOT_SERVING], got
    assert life.snapshot() == ("PEER_SILENT", peers_reason({1: 4242}, {}))
