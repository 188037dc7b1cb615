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
