"""The demo's exit status: 1 when its own checks fail (ranks disagreeing, forwarded rounds off the local layers,
or, verifying, no round forwarded to compare)."""

from __future__ import annotations

import dataclasses

import pytest

from dspark_sidecar import cli
from dspark_sidecar.client import demo
from dspark_sidecar.client.demo import DemoReport, verdict


def _report(**over) -> DemoReport:
    """A clean 20-round run on the reference backend: every round forwarded and the same bits."""
    base = DemoReport(rounds=20, forwarded=20, fallbacks={}, warmup_fallbacks={}, forwarded_p50_ms=1.0,
                      forwarded_p99_ms=2.0, local_p50_ms=3.0, local_p99_ms=4.0, compared=20,
                      hidden_mismatch_rounds=0, max_hidden_diff=0.0, token_mismatch_rounds=0, tokens_differing=0,
                      kv_mismatch_rounds=0, max_kv_diff=0.0, max_hidden_rel=0.0, max_kv_rel=0.0, ranks_agree=True,
                      longest_context=5000, requests=30, binds=1, backend="reference")
    return dataclasses.replace(base, **over)


# A GPU backend's run, as measured in runs 220 / 227 (bf16; an fp8 cache's K/V one e4m3 step apart here and there).
GPU_BF16 = dict(backend="triton", hidden_mismatch_rounds=20, kv_mismatch_rounds=20, token_mismatch_rounds=2,
                tokens_differing=9, max_hidden_rel=6.5e-3, max_kv_rel=5.2e-3)


@pytest.mark.parametrize("over, dtype, kv_dtype", [
    ({}, "fp32", "auto"),
    (GPU_BF16, "bf16", "auto"),
    ({**GPU_BF16, "max_kv_rel": 1.66e-2}, "bf16", "fp8"),
    ({**GPU_BF16, "max_hidden_rel": 3e-5, "max_kv_rel": 2e-5}, "fp32", "auto"),
    ({**GPU_BF16, "max_hidden_rel": 2.0 ** -5, "max_kv_rel": 2.0 ** -5}, "bf16", "auto"),  # within: the limit itself
])
def test_a_run_within_its_backend_s_rounding_passes(over, dtype, kv_dtype):
    assert verdict(_report(**over), dtype, kv_dtype) is None


@pytest.mark.parametrize("over, dtype, kv_dtype, words", [
    (dict(ranks_agree=False), "fp32", "auto", "engine ranks disagreed"),
    (dict(hidden_mismatch_rounds=1, max_hidden_diff=1e-7), "fp32", "auto", "hidden states in 1"),
    (dict(kv_mismatch_rounds=2), "bf16", "auto", "block K/V in 2"),
    (dict(token_mismatch_rounds=1, tokens_differing=3), "fp32", "auto", "draft tokens in 1 of 20"),
    ({**GPU_BF16, "max_hidden_rel": 0.2}, "bf16", "auto", "hidden 2.00e-01 (limit 3.12e-02)"),
    ({**GPU_BF16, "max_kv_rel": 4e-2}, "bf16", "auto", "K/V 4.00e-02 (limit 3.12e-02)"),
    ({**GPU_BF16, "max_kv_rel": 0.1}, "bf16", "fp8", "K/V 1.00e-01 (limit 6.25e-02) for bf16 with an fp8 cache"),
    ({**GPU_BF16, "max_hidden_rel": float("nan")}, "bf16", "auto", "hidden nan"),
    ({**GPU_BF16, "max_hidden_rel": 5e-3}, "fp32", "auto", "limit 1.00e-04"),
])
def test_a_run_off_the_local_layers_fails(over, dtype, kv_dtype, words):
    why = verdict(_report(**over), dtype, kv_dtype)
    assert why is not None and words in why, why


def test_the_demo_command_exits_1_with_the_reason_when_its_checks_fail(monkeypatch, capsys):
    """It printed the report and exited 0 whatever the report said: a sidecar drafting wrong tokens
    passed as a green run of the main command."""
    bad = _report(token_mismatch_rounds=3, tokens_differing=5)
    monkeypatch.setattr(demo, "run_demo", lambda cfg: bad)
    assert cli.main(["demo", "--rounds", "20"]) == 1
    out, err = capsys.readouterr()
    assert "forwarded to the sidecar: 20" in out
    assert err.startswith("dspark-sidecar demo: FAILED: the reference backend differed") and "draft tokens in 3" in err
    monkeypatch.setattr(demo, "run_demo", lambda cfg: _report())
    assert cli.main(["demo", "--rounds", "20"]) == 0


NOTHING_FORWARDED = dict(compared=0, forwarded=0, fallbacks={"BindKV refused": 19, "no sidecar": 1})


def test_a_verifying_run_that_forwarded_nothing_fails_and_says_why():
    """Every round on the local layers (the sidecar refused every step) compared nothing: it passed as green."""
    why = verdict(_report(**NOTHING_FORWARDED), "fp32")
    assert why is not None and "no round was forwarded" in why and "nothing was compared" in why, why
    assert "'BindKV refused' 19" in why, why  # the main fallback reason, so the line says where to look
    assert verdict(_report(**NOTHING_FORWARDED), "fp32", verify=False) is None  # --no-verify: not a check


def test_a_verifying_run_that_compared_no_forwarded_round_fails():
    why = verdict(_report(compared=0), "fp32")
    assert why is not None and "20 rounds were forwarded but none was compared" in why, why


def test_the_demo_exits_1_when_nothing_was_forwarded_and_0_under_no_verify_saying_so_last(monkeypatch, capsys):
    monkeypatch.setattr(demo, "run_demo", lambda cfg: _report(**NOTHING_FORWARDED))
    assert cli.main(["demo", "--rounds", "20"]) == 1
    out, err = capsys.readouterr()
    assert err.startswith("dspark-sidecar demo: FAILED: no round was forwarded") and err.count("\n") == 1, err
    assert cli.main(["demo", "--rounds", "20", "--no-verify"]) == 0
    out, err = capsys.readouterr()
    assert not err
    assert out.splitlines()[-1] == ("dspark-sidecar demo: --no-verify: nothing was compared with the local layers "
                                    "(and no round was forwarded)"), out
    monkeypatch.setattr(demo, "run_demo", lambda cfg: _report(compared=0))  # forwarded, not compared
    assert cli.main(["demo", "--rounds", "20", "--no-verify"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == "dspark-sidecar demo: --no-verify: nothing was compared with the local layers", last


# Steps the sidecar answered with its own fault, each then run on the local layers: never compared, so never counted.
SIDECAR_FAULTS = dict(forwarded=12, compared=12, fallbacks={"sidecar INTERNAL": 6, "malformed answer": 1,
                                                             "sidecar unavailable (breaker open)": 1})


@pytest.mark.parametrize("verify", [True, False])
def test_steps_the_sidecar_failed_fail_the_run_though_the_forwarded_ones_matched(verify):
    """A sidecar raising (INTERNAL) in its step past the 4096 window, say, or answering hidden states of another
    shape: those rounds fell back, the rest matched, and the demo passed with the fault in its fallback lines."""
    why = verdict(_report(**SIDECAR_FAULTS), "fp32", verify=verify)
    assert why is not None and "'sidecar INTERNAL' 6" in why and "'malformed answer' 1" in why, why
    assert "breaker" not in why, why  # what followed the faults, not one of them
    for name in ("sidecar UNKNOWN", "shim error in phase 2: KeyError"):
        assert verdict(_report(forwarded=19, fallbacks={name: 1}), "fp32", verify=verify) is not None, name


def test_fallbacks_of_the_mix_s_own_making_do_not_fail_the_run():
    """Steps above --max-reqs (on purpose), a peer's abort, a late step on a loaded machine: the shim's to take."""
    ok = {"R outside 1..max_reqs": 4, "sidecar ABORTED": 1, "step deadline exceeded": 1}
    assert verdict(_report(forwarded=14, fallbacks=ok), "fp32") is None


def test_the_demo_command_exits_1_when_the_sidecar_failed_steps(monkeypatch, capsys):
    monkeypatch.setattr(demo, "run_demo", lambda cfg: _report(**SIDECAR_FAULTS))
    assert cli.main(["demo", "--rounds", "20"]) == 1
    out, err = capsys.readouterr()
    assert "fallback: sidecar INTERNAL: 6" in out
    assert err.startswith("dspark-sidecar demo: FAILED: the sidecar failed 7 steps"), err
