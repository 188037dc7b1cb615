"""Rank 0 (the rendezvous coordinator) SIGKILLed while a peer waits for a step's verdict (TP 2, real processes).

No verdict can come from a dead coordinator, and no rank launched the step (a GO would have been in the
ring before it died). Before the fix the peer waited for one until its 30 s give-up, so the engine's step
was not answered at all: its stream just ended when the launcher killed the peer ~10 s later.
"""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest
import torch

from dspark_sidecar.drafter import scenario
from helpers.engine_sim import PAGE, DraftStream, EngineSim
from helpers.sidecar_proc import SidecarProcess, alive
from helpers.waiting import wait_until

TP = 2
RDV_MS = 6000  # long: the kill lands while rank 1 still waits for its verdict
LENS = [5, 40]
PAGES = sum(scenario.pages_needed(c + 7, PAGE) for c in LENS) + 8


# Loaded by every process of a test's sidecar (sitecustomize): rank 0's coordinator makes none of its timed looks
# at the peers' processes between steps (every GONE_CHECK_S until each was seen alive), as with a start-up shorter
# than GONE_CHECK_S (--no-warmup), where the group serves before the first look that finds every peer's pid.
NO_TIMED_LOOKS = """
from dspark_sidecar.server import rendezvous
rendezvous.PeerProcesses.all_seen = property(lambda self: True)
"""


@pytest.fixture
def no_timed_looks(tmp_path, monkeypatch):
    site = tmp_path / "no-timed-looks"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NO_TIMED_LOOKS)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))


@pytest.fixture
def rig(tmp_path, tiny_ckpt, tiny_cfg, tiny_embed):
    yield from _rig(tmp_path, tiny_ckpt, tiny_cfg, tiny_embed)


@pytest.fixture
def rig_no_timed_looks(no_timed_looks, tmp_path, tiny_ckpt, tiny_cfg, tiny_embed):
    yield from _rig(tmp_path, tiny_ckpt, tiny_cfg, tiny_embed)


def _rig(tmp_path, tiny_ckpt, tiny_cfg, tiny_embed):
    sc = SidecarProcess(tmp_path, tp=TP, checkpoint=tiny_ckpt, extra_args=["--rendezvous-ms", str(RDV_MS)])
    sc.start()
    eng = EngineSim(tiny_cfg, [sc.socket(r) for r in range(TP)], PAGES, torch.float32)
    streams = []
    try:
        eng.bind()
        step = scenario.random_step(tiny_cfg, LENS, PAGE, PAGES, tiny_embed, seed=5)
        streams = [DraftStream(s) for s in eng.stubs]
        yield sc, eng, step, streams
    finally:
        for s in streams:
            s.close()
        eng.close()
        if sc.proc.poll() is None:
            os.killpg(sc.proc.pid, signal.SIGKILL)
            sc.proc.wait()


def _aborted_after_killing(rig, waiting: int, killed: int):
    """Rank `waiting`'s copy of step 2 posted alone (the other engine never sends it), then rank `killed`
    SIGKILLed: (the ABORTED answer `waiting` got, seconds from the kill to it, the ranks' pids)."""
    sc, eng, step, streams = rig
    pids = sc.rank_pids()
    streams[waiting].requests.put(eng.request(waiting, 2, step))
    time.sleep(1.0)  # the waiting rank has posted; the coordinator would abort it only at RDV_MS
    t_kill = time.monotonic()
    os.kill(pids[killed], signal.SIGKILL)
    ans = streams[waiting].answers.get(timeout=60)
    took = time.monotonic() - t_kill
    assert ans is not None, (f"the stream ended without an answer after {took:.1f} s ({streams[waiting].end})\n"
                             f"{sc.log_tail()}")
    assert ans.WhichOneof("result") == "error" and ans.error.code == grpc.StatusCode.ABORTED.value[0], ans
    return ans, took, pids


def test_a_peer_waiting_on_a_killed_coordinator_answers_its_step_aborted_at_once(rig):
    sc = rig[0]
    ans, took, pids = _aborted_after_killing(rig, waiting=1, killed=0)
    # Told by the exit, not at a deadline: the rendezvous deadline's abort says "did not receive it", and
    # the give-up it would otherwise have waited out answers nothing (the stream just ends, asserted above).
    assert "coordinator" in ans.error.message and "exited" in ans.error.message, (took, ans.error.message)
    # The group still goes down as a whole, and no rank is left behind.
    assert sc.proc.wait(timeout=60) == 1
    assert not alive(pids[1])


def test_a_step_waiting_for_a_killed_peer_s_copy_is_aborted_at_once_naming_it(rig):
    """The other way round: rank 1 SIGKILLed while rank 0's copy of a step waits for its post. Rank 0's
    coordinator waited out the whole --rendezvous-ms (here 6 s; up to 60 s) and answered "did not
    receive it"; now it aborts the step at once and says the rank exited."""
    sc = rig[0]
    ans, took, pids = _aborted_after_killing(rig, waiting=0, killed=1)
    # Not the deadline's "rank(s) 1 did not receive it within 6000 ms": the exit, told at once.
    assert "rank(s) 1 exited" in ans.error.message and "did not receive" not in ans.error.message, (
        took, ans.error.message)
    assert sc.proc.wait(timeout=60) == 1
    assert not alive(pids[0])


def _kill_idle_then_ask(rig, killed: int, asking: int):
    """SIGKILL rank `killed` while the group is idle, wait until it has exited (a zombie until the launcher reaps
    it counts), then send rank `asking` its next step: (its answer, seconds since the kill). An answer is required."""
    from dspark_sidecar.server.processes import exited

    sc, eng, step, streams = rig
    pids = sc.rank_pids()
    t_kill = time.monotonic()
    os.kill(pids[killed], signal.SIGKILL)
    wait_until(lambda: exited(pids[killed]), 10, f"rank {killed} exited after SIGKILL", interval_s=0.005)
    ans = streams[asking].ask(eng.request(asking, 2, step), timeout=60)  # within its --drain-s: still taken
    took = time.monotonic() - t_kill
    assert ans is not None, (f"the stream ended without an answer after {took:.1f} s ({streams[asking].end})\n"
                             f"{sc.log_tail()}")
    return ans, took


def test_a_step_that_comes_after_rank_0_exited_is_aborted_at_once_not_left_unanswered(rig):
    """Rank 0 killed while the group is idle, before rank 1's first step: rank 1's rendezvous had never looked
    at rank 0's process, and only a process seen alive is judged exited (PeerProcesses), so the step waited for
    a verdict that cannot come, its stream ending unanswered when the launcher killed the rank ~10 s later."""
    sc = rig[0]
    ans, took = _kill_idle_then_ask(rig, killed=0, asking=1)
    # Told by the exit: the deadline's abort would say "did not receive it", the give-up answers nothing.
    assert ans.WhichOneof("result") == "error" and ans.error.code == grpc.StatusCode.ABORTED.value[0], ans
    assert "coordinator" in ans.error.message and "exited" in ans.error.message, (took, ans.error.message)
    assert sc.proc.wait(timeout=60) == 1


def test_a_step_waiting_for_a_peer_that_exited_before_the_coordinator_s_first_look_is_aborted_naming_it(
        rig_no_timed_looks):
    """Rank 1 killed while the group is idle, rank 0's coordinator having made no look at its process yet (only a
    process seen alive is judged exited, PeerProcesses). Rank 0's step then waited out the whole --rendezvous-ms
    (here 6 s; up to 60 s) and answered "did not receive it", or went unanswered in the group's shutdown. Rank 0's
    peers_started has its coordinator look at every peer once all are past the start-up barrier."""
    sc = rig_no_timed_looks[0]
    ans, took = _kill_idle_then_ask(rig_no_timed_looks, killed=1, asking=0)
    assert ans.WhichOneof("result") == "error" and ans.error.code == grpc.StatusCode.ABORTED.value[0], ans
    assert "rank(s) 1 exited" in ans.error.message and "did not receive" not in ans.error.message, (
        took, ans.error.message)
    assert sc.proc.wait(timeout=60) == 1
