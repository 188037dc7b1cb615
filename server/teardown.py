"""A drained sidecar rank's end: the doorbell, the steps, the streams, then the device's and the group's resources."""

from __future__ import annotations

import logging
import os
import threading

import grpc
import torch.distributed as dist

from dspark_sidecar.server.graphs import StepGraphs
from dspark_sidecar.server.rank import STOP_STEPS_S, RankLoop
from dspark_sidecar.server.rendezvous import Board, Rendezvous
from dspark_sidecar.server.servicer import DrafterServicer

log = logging.getLogger("dspark_sidecar.server")
# The watchdog's bound on the teardown past its waits for the steps and the streams (STOP_STEPS_S, SERVER_GRACE_S):
# past it the process ends (a peer gone first can wedge an NCCL destroy).
TEARDOWN_LIMIT_S = 15.0
SERVER_GRACE_S = 5.0  # in-flight gRPC calls finish within this at shutdown
STUCK_EXIT = 1  # a rank whose shutdown found a step stuck (teardown): not a clean stop, for its supervisor
# How long the teardown waits for the doorbells' attach lock before it stops the steps. A lease's release (an
# engine gone) and an UnregisterBuffers take that lock and then wait for the rank's, which a stuck step holds:
# unbounded, the teardown waited there until its watchdog ended the rank with status 0, never finding the step
# stuck. Within TEARDOWN_LIMIT_S, beside a doorbell's own stop (doorbell.STOP_S).
DOORBELL_LOCK_S = 5.0


def teardown(rank: int, servicer: DrafterServicer, loop: RankLoop, server: grpc.Server, graphs: StepGraphs | None,
             fast, rendezvous: Rendezvous, board: Board, status: int = 0) -> None:
    """A drained rank's end: the doorbell, the steps, the streams, then the device's and the group's resources.

    A step still running once stop_steps gives up is stuck (on the device, or in a collective with a wedged
    peer: steps take milliseconds): everything after the streams would wait on it (graphs.close() and the
    fast path synchronize the device; the group's destroy waits for its collectives) until the watchdog
    ended the process with status 0, a clean stop to its supervisor. The rank ends the streams and then
    the process at once, status 1; the driver frees its device memory and IPC mappings at exit. `status`: the
    rank's exit status (1: it failed, or torchrun's agent left), which the watchdog ends the process with too (1 once
    the teardown itself has raised)."""
    # Teardown must not hang the exit (a peer that left first can wedge an NCCL teardown): after
    # the drain nothing is in flight, so past the limit the process just ends.
    stage = ["the doorbell"]  # what the teardown is doing, for the watchdog's line
    code = [status]  # the watchdog's exit status: 1 once the teardown itself has failed
    limit = TEARDOWN_LIMIT_S + STOP_STEPS_S + SERVER_GRACE_S
    watchdog = threading.Timer(limit, lambda: (log.warning("rank %d: teardown exceeded %.0f s in %s; exiting",
                                                           rank, limit, stage[0]), os._exit(code[0])))
    watchdog.daemon = True
    watchdog.start()
    try:
        _tear_down(rank, servicer, loop, server, graphs, fast, rendezvous, board, stage)
    except BaseException:
        # Raised through serve_rank, the interpreter's exit may then wait for good (a gRPC server never stopped):
        # the watchdog's end must not read as the clean stop of a drained rank.
        code[0] = 1
        raise


def _tear_down(rank: int, servicer: DrafterServicer, loop: RankLoop, server: grpc.Server, graphs: StepGraphs | None,
               fast, rendezvous: Rendezvous, board: Board, stage: list[str]) -> None:
    """teardown's stages, in order; `stage[0]` names the one running (the watchdog's line)."""
    # The doorbell before the streams: an engine reads the end of its idle liveness stream as "the
    # sidecar is done with my step", so no doorbell step may still be running when the streams end.
    closed = servicer.close_doorbell(DOORBELL_LOCK_S)
    # Then the steps, for the same reason: the streams end only once no step runs. Steps that
    # arrive from here on are answered UNAVAILABLE (SHUTTING_DOWN) on their still-open streams.
    stage[0] = "the steps in flight"
    stuck = not loop.stop_steps()
    if not closed and not stuck:
        # The attach lock's holder waited behind a step that has ended since: it lets go now, and the doorbells
        # stop before the streams end. (With the step stuck, the process ends below: no doorbell step starts,
        # stop_steps refuses them.)
        stage[0] = "the doorbell"
        servicer.close_doorbell()
    stage[0] = "the gRPC server"
    server.stop(grace=SERVER_GRACE_S).wait()  # then refuse new calls and end the streams
    stage[0] = "the engines' leases"  # a release already running is waited for (on the device, maybe)
    # Engines read end of file: the next sidecar hands out leases of its own. With a step stuck, a lease's release
    # waiting for the loop that step holds is not waited for: joined, it hung the teardown past the exit below.
    servicer.close_leases(0.0 if stuck else None)
    if stuck:
        log.error("rank %d: a step still runs %.0f s into the shutdown (stuck on the device or in a collective: "
                  "a peer gone?); the streams are ended, and the process ends now with status %d, its device "
                  "resources left to the exit", rank, STOP_STEPS_S, STUCK_EXIT)
        logging.shutdown()  # os._exit skips the handlers' flush
        os._exit(STUCK_EXIT)
    stage[0] = "the rank loop"
    loop.close()
    if graphs is not None:
        stage[0] = "dropping the CUDA graphs"
        graphs.close()
        loop.drain()  # the device is synchronized: releases still held (at TP > 1) go before the group does
    if fast is not None:
        stage[0] = "the FlyDSL fast path"
        fast.close()
    stage[0] = "the rendezvous"
    if rendezvous.close():
        board.close()
    else:
        board.unlink()  # a thread still reads it: its mapping goes with the process (Rendezvous.close)
    stage[0] = f"destroying the {dist.get_backend()} process group"
    dist.destroy_process_group()
    # The watchdog stays: it bounds the interpreter's exit too (a thread that holds it), which its line must not
    # blame on the group's destroy, done by then.
    stage[0] = "the process's exit, after the teardown"
    log.info("rank %d: stopped", rank)
