"""SIGTERM on a TP-2 sidecar with steps flowing on the engines' streams: no K/V is written after a stream ends.

An engine reads the end of its DraftSteps stream as "the sidecar is done with my step"
(client/connection.py StepStream.settled): it then runs its stock layers and commits context over
that step's slots. So the drain must finish or refuse every step before it ends the streams
(server/rank.py RankLoop.stop_steps, called by server/app.py before server.stop).
"""

from __future__ import annotations

import os
import signal
import time

import torch

from dspark_sidecar.drafter import scenario
from helpers.engine_sim import PAGE, DraftStream, EngineSim
from helpers.sidecar_proc import SidecarProcess

TP = 2
LENS = [900 + 13 * i for i in range(32)]  # R = 32 (four launch groups): a step long enough to be in flight
DRAINING = ("SHUTTING_DOWN", "ABORTED")  # a refused step, or its peer's copy aborted for it: both write nothing


def _block_rows(eng: EngineSim, rank: int, slots: torch.Tensor) -> list[torch.Tensor]:
    return [t.view(2, -1, *t.shape[-2:])[:, slots] for t in eng.kv_tensors(rank)]


def test_no_kv_write_after_the_drain_ends_a_step_stream(tmp_path, tiny_ckpt, tiny_cfg, tiny_embed):
    pages = sum(scenario.pages_needed(c + 7, PAGE) for c in LENS) + 8
    sc = SidecarProcess(tmp_path, tp=TP, checkpoint=tiny_ckpt, extra_args=["--max-reqs", "32", "--drain-s", "0.2"])
    sc.start()
    eng = EngineSim(tiny_cfg, [sc.socket(r) for r in range(TP)], pages, torch.float32)
    try:
        eng.bind()
        step = scenario.random_step(tiny_cfg, LENS, PAGE, pages, tiny_embed, seed=5)
        slots = step.meta.slot_mapping.long()
        streams = [DraftStream(s) for s in eng.stubs]
        sc.proc.send_signal(signal.SIGTERM)
        t_term, step_id, refused = time.monotonic(), 1, 0
        while True:  # the engine keeps stepping on its open streams until they end
            for r in range(TP):
                streams[r].requests.put(eng.request(r, step_id, step))
            answers = [streams[r].answers.get(timeout=60) for r in range(TP)]
            assert time.monotonic() - t_term < 40, "the streams never ended after SIGTERM"
            if any(a is None for a in answers):
                break
            for a in answers:
                if a.WhichOneof("result") == "error":
                    assert a.error.reason in DRAINING, a.error
                    refused += 1
            step_id += 1
        # The engine owns these slots again (stock layers, then the context commit): clear and watch them.
        ended = [r for r in range(TP) if answers[r] is None]
        for r in ended:
            for t in eng.kv_tensors(r):
                t.view(2, -1, *t.shape[-2:])[:, slots] = 0
        assert sc.proc.wait(timeout=40) == 0
        written = [(r, i) for r in ended for i, rows in enumerate(_block_rows(eng, r, slots)) if rows.abs().sum() != 0]
        assert not written, (f"step {step_id}: K/V written after its stream ended on rank(s) {ended} "
                             f"(rank, layer): {written}")
        assert step_id > 1, "no step was answered during the drain: the test did not exercise it"
        print(f"{step_id - 1} steps answered after SIGTERM, {refused} of the answers refused")
    finally:
        eng.close()
        if sc.proc.poll() is None:
            os.killpg(sc.proc.pid, signal.SIGKILL)
            sc.proc.wait()
