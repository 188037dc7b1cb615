"""The bench's per-mode figures are read over that mode's timed steps alone, warm-up excluded."""

from __future__ import annotations

import itertools

import torch

from dspark_sidecar import bench as B
from dspark_sidecar.bench import Bench, BenchConfig, Case


def test_pipelined_prelaunched_share_leaves_out_the_warm_up(tmp_path, monkeypatch):
    """f times PIPELINE-step batches: with --repeats 45 that is 4 batches, 40 timed steps. Its
    pre-launched share must be over those 40, not the last 45 steps, 5 of them the warm-up's (on a
    GPU the warm-up builds the pre-launch streak, so its steps are the unqueued ones). A fake
    sidecar answers exactly the timed steps from a pre-launched step: the share is 1."""
    bc = BenchConfig(preset="tiny", reqs=(1,), contexts=(40,), modes=("a",), repeats=45, engine_copy=True,
                     out_dir=tmp_path)
    bench = Bench(bc, torch.device("cpu"))  # mode a only: no sidecar started
    try:
        case = Case(bench.cfg, 1, 40, bc.page_size, bench.pages, bench.embed, bench.device, seed=0)
        timed = {"now": False}
        real_timeit = B.timeit

        def marking_timeit(fn, device, repeats, warmup=3):
            calls = itertools.count()

            def counted():
                timed["now"] = next(calls) >= warmup  # the real timeit's warm-up calls come first
                return fn()
            return real_timeit(counted, device, repeats, warmup)

        def fake_remote(mode, case):
            bench.sidecar_ns.append((1, 1, 1, 3, timed["now"], 0, 0, 0, 0))

        monkeypatch.setattr(B, "timeit", marking_timeit)
        monkeypatch.setattr(bench, "_remote", fake_remote)
        monkeypatch.setattr(bench, "_misses", lambda: 0)
        ms = bench.measure("f", case)
        assert len(ms) == 4  # batch means
        fields = bench.phase_fields("f")
        assert fields["prelaunched_share"] == 1.0, fields
    finally:
        bench.close()


def test_pipelined_figures_are_ms_per_step_over_at_least_three_batches(monkeypatch):
    """f times batches of PIPELINE steps: each sample is a batch's ms over PIPELINE (the row is ms per step,
    beside d's), and --repeats below 3 batches' worth still gives 3 batch means to take a median of."""
    bench = object.__new__(Bench)
    bench.device = torch.device("cpu")
    steps = []
    bench._remote = lambda mode, case: steps.append(mode)

    def batch_timeit(fn, device, repeats, warmup=3):
        fn()  # one batch, untimed here: each sample below is a batch's ms
        return [20.0 * B.PIPELINE] * repeats

    monkeypatch.setattr(B, "timeit", batch_timeit)
    for repeats, batches in ((2, 3), (45, 4), (1000, 100)):
        bench.bc, steps[:] = BenchConfig(preset="tiny", repeats=repeats), []
        assert bench._pipelined(None) == [20.0] * batches
        assert steps == ["d"] * B.PIPELINE


def test_the_sidecar_s_phases_are_read_from_their_own_fields():
    """A remote row's sidecar host time is the step's total (arrival to launch), beside its phases, each from
    its own field of the step's timings, over the timed steps alone (a warm-up step's figures left out)."""
    bench = object.__new__(Bench)
    bench.bc, bench.mode_misses = BenchConfig(preset="tiny", repeats=2), None
    warm_up = (9_000,) * 4 + (False,) + (9_000,) * 4
    # timeit's 3 warm-up steps first: more of them than timed steps, so a median over all would be theirs.
    bench.sidecar_ns = [*[warm_up] * 3, *[(1_000, 2_000, 3_000, 10_000, False, 4_000, 5_000, 6_000, 7_000)] * 2]
    fields = bench.phase_fields("e")
    assert fields == {"sidecar_host_p50_us": 10.0, "sidecar_queue_rendezvous_launch_p50_us": [1.0, 2.0, 3.0],
                      "sidecar_validate_word_start_output_p50_us": [4.0, 5.0, 6.0, 7.0]}, fields
