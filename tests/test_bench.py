"""The bench command runs end to end on CPU (figures are printed, never asserted)."""

from __future__ import annotations

import json

import torch

from dspark_sidecar.bench import BenchConfig, run_bench


def test_bench_writes_rows_for_each_mode_it_can_run(tmp_path):
    bc = BenchConfig(preset="tiny", reqs=(1, 2), contexts=(40,), modes=("a", "b", "d", "e", "f"), repeats=2,
                     out_dir=tmp_path)
    report = run_bench(bc, torch.device("cpu"))
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["rows"] == report["rows"] and data["copy_bandwidth_GBps"] > 0
    for mode in ("a", "d", "e", "f"):
        rows = [r for r in data["rows"] if r["mode"] == mode]
        assert [r["R"] for r in rows] == [1, 2]
        assert all(r["p50_ms"] > 0 and r["p99_ms"] >= r["p50_ms"] and r["floor_ms"] > 0 for r in rows)
    assert all(r["note"] == "n/a: needs a GPU" for r in data["rows"] if r["mode"] == "b")
    for r in data["rows"]:
        if r["mode"] in ("d", "e"):  # the sidecar's own phases come back with every remote row
            assert r["sidecar_host_p50_us"] > 0 and len(r["sidecar_queue_rendezvous_launch_p50_us"]) == 3
        if r["mode"] == "d":
            assert r["engine_fill_p50_us"] > 0 and r["ring_to_answer_p50_us"] > 0


def test_mxfp8_weights_count_their_stored_bytes_in_the_floor(tmp_path):
    dense = run_bench(BenchConfig(preset="tiny", reqs=(1,), contexts=(40,), modes=("a",), repeats=2,
                                  out_dir=tmp_path / "dense"), torch.device("cpu"))
    quant = run_bench(BenchConfig(preset="tiny", reqs=(1,), contexts=(40,), modes=("a",), repeats=2, weights="mxfp8",
                                  out_dir=tmp_path / "mxfp8"), torch.device("cpu"))
    # bf16 (2 bytes per weight) -> 1 + 1/32: the weight term about halves, the K/V window and the
    # final norm stay. Each run measures its own bandwidth, so compare bytes: floor x bandwidth.
    d, q = (r["rows"][0]["floor_ms"] * r["copy_bandwidth_GBps"] for r in (dense, quant))
    assert 0.3 * d < q < 0.6 * d
