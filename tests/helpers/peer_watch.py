"""A rank's peer watch (server/health.py watch_peers) over a real board and a live peer process, for one test."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
import uuid
from types import SimpleNamespace


@contextlib.contextmanager
def watched_peer():
    """(life, publish, board, peer, look): rank 0 SERVING on a 2-rank board whose rank 1 is `peer` (a live
    process, beating now); look() is one watch_peers pass of rank 0, the first already made (peer seen alive)."""
    from grpc_health.v1 import health

    from dspark_sidecar.server.health import HealthPublisher, watch_peers
    from dspark_sidecar.server.processes import process_start
    from dspark_sidecar.server.rendezvous import Board, PeerProcesses
    from dspark_sidecar.server.servicer import Lifecycle

    life = Lifecycle(state="LOADING")
    publish = HealthPublisher(life, SimpleNamespace(refusal=lambda: ""), SimpleNamespace(refusal=None),
                              health.HealthServicer(), SimpleNamespace(set_serving=lambda serving: None))
    publish("SERVING")
    board = Board(f"dspark-test-{uuid.uuid4().hex[:8]}", 2, create=True)
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        board.starts[1], board.pids[1] = process_start(peer.pid), peer.pid
        board.beats[1] = time.monotonic_ns()
        peers = PeerProcesses(board, 0)

        def look() -> None:
            watch_peers(board, 0, life, publish, peers)

        look()  # seen alive
        yield life, publish, board, peer, look
    finally:
        peer.kill()
        peer.wait()
        board.close()
