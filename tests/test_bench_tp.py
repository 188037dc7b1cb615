"""`bench --tp N` on CPU: N sidecar ranks (gloo) driven by N engine rank processes, checked against the reference."""

from __future__ import annotations

import json

import pytest

from dspark_sidecar.bench import BenchConfig
from dspark_sidecar.bench_tp import PARITY_RTOL, _report, run_tp_bench


def test_tp4_sidecar_from_four_engine_ranks_equals_the_reference_at_tp4(tmp_path):
    # R = 9: two launches per step; fp32 on CPU runs the reference ops on both sides, so bit-identical.
    bc = BenchConfig(preset="tiny", reqs=(1, 9), contexts=(40,), dtype="fp32", repeats=2, out_dir=tmp_path)
    report = run_tp_bench(bc, 4, single_gpu=True, device_type="cpu")
    assert json.loads((tmp_path / "bench-tp4.json").read_text()) == report
    assert [r["R"] for r in report["rows"]] == [1, 9]
    for row in report["rows"]:
        assert row["errors"] == 0 and row["ranks_agree"] and row["parity_ok"]
        assert row["hidden_rel_l2"] == 0.0 and row["kv_rel_l2"] == 0.0
        assert row["tp_step_p50_ms"] > 0 and row["single_gpu_shard_p50_ms"] > 0 and row["x_floor"] > 0
        assert 0 < row["exchange_share"]
        # the same step through each rank's shim, its agreements included: the same bits on every rank
        assert row["tp_shim_step_p50_ms"] > 0 and row["shim_matches"]


def _rank_row(**kw) -> dict:
    return {"R": 8, "context": 4096, "p50_ms": 1.0, "errors": 0, "exchange_p50_ms": 0.1,
            "hidden_rel_l2": 0.01, "kv_rel_l2": 0.01, "ranks_agree": True, "shim_p50_ms": 1.1,
            "shim_matches": True, **kw}


def test_the_report_fails_a_case_on_any_rank_s_error_disagreement_or_drift(tmp_path):
    bc = BenchConfig(out_dir=tmp_path)
    single = {"rows": [{"mode": "d", "R": 8, "context": 4096, "p50_ms": 0.6, "floor_ms": 0.25},
                       {"mode": "c", "R": 8, "context": 4096, "p50_ms": 0.5, "floor_ms": 0.25}]}
    cases = {
        "ok": ([[_rank_row()], [_rank_row(p50_ms=1.5)]], True),
        "drift": ([[_rank_row()], [_rank_row(hidden_rel_l2=2 * PARITY_RTOL)]], False),
        "kv": ([[_rank_row(kv_rel_l2=0.5)], [_rank_row()]], False),
        "disagree": ([[_rank_row()], [_rank_row(ranks_agree=False)]], False),
        "error": ([[_rank_row(errors=1)], [_rank_row()]], False),
        "shim": ([[_rank_row()], [_rank_row(shim_matches=False)]], False),
    }
    for name, (per_rank, ok) in cases.items():
        row = _report(bc, 2, per_rank, single, "H200", PARITY_RTOL)["rows"][0]
        assert row["parity_ok"] is ok, name
    row = _report(bc, 2, cases["ok"][0], single, "H200", PARITY_RTOL)["rows"][0]
    # The slowest rank is the step; the floor and baselines are rank 0's shard on one GPU.
    assert row["tp_step_p50_ms"] == 1.5 and row["x_floor"] == 1.5 / 0.25 and row["tp_shim_step_p50_ms"] == 1.1
    assert row["single_gpu_shard_p50_ms"] == 0.6 and row["single_gpu_backend_inprocess_p50_ms"] == 0.5
    # On CPU (reference ops on both sides) any difference at all fails.
    assert not _report(bc, 2, cases["ok"][0], single, "cpu", 0.0)["rows"][0]["parity_ok"]


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_kv_layout_records_is_what_the_engine_ranks_allocate_and_bind(tmp_path, kv_dtype):
    # --kv-layout (and --kv-dtype) reach the TP engine ranks too: each allocates vLLM 0.34's records
    # cache, its shim binds it, and the reference runs over the same views; the rows say what they measured.
    bc = BenchConfig(preset="tiny", reqs=(2,), contexts=(40,), dtype="fp32", repeats=1, out_dir=tmp_path,
                     kv_layout="records", kv_dtype=kv_dtype)
    (row,) = run_tp_bench(bc, 2, single_gpu=False, device_type="cpu")["rows"]
    assert row["kv_layout"] == ("records fp8" if kv_dtype == "fp8" else "records")
    assert row["errors"] == 0 and row["parity_ok"] and row["kv_rel_l2"] == 0.0
