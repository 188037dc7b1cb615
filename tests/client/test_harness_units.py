"""Harness pieces without a sidecar: the request mix, one in-process engine rank, the demo report."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dspark_sidecar import layout
from dspark_sidecar.client.demo import DemoReport, format_report, summarise
from dspark_sidecar.client.harness import EngineRank, Fault, HarnessConfig, Record
from dspark_sidecar.client.workload import MixConfig, Workload


def test_workload_is_deterministic_and_pages_are_never_shared():
    def trace(seed: int) -> list:
        w = Workload(MixConfig(seed=seed, max_active=6), vocab=2048, page_size=16, num_pages=600)
        out = []
        for rnd in range(60):
            w.admit()
            owned = [p for r in w.active for p in r.pages]
            assert len(owned) == len(set(owned)) and len(owned) + len(w.pool.free) == 600
            for r in w.active:
                assert len(r.pages) * 16 >= r.pos + layout.QPR  # the block rows have slots
                drafts = [(r.anchor + j * 17) % 2048 for j in range(7)]
                w.advance(r, w.accepted(r, drafts, rnd), drafts)
            out.append([(r.rid, r.pos) for r in w.active])
            w.retire()
        return out

    a, b = trace(1), trace(1)
    assert a == b and a != trace(2)
    start = MixConfig().long_prompt[0]  # request 0 starts just below the window, one round later:
    assert start < a[0][0][1] <= start + layout.QPR + 1


def test_engine_rank_tp1_drafts_deterministically_past_the_window(tiny_ckpt):
    h = HarnessConfig(rounds=8, tp=1, checkpoint=(str(tiny_ckpt[0]), str(tiny_ckpt[1])), num_pages=400,
                      mix=MixConfig(seed=0, max_active=3, long_prompt=(4094, 4094)), faults=(Fault(3, "realloc_kv"),))
    a, b = EngineRank(h, 0).run(), EngineRank(h, 0).run()
    assert a["digest"] == b["digest"] and a["decisions"] == "L" * 8
    assert a["max_seq_len"] > 4096 + layout.QPR and a["shim"] is None


def test_draft_tokens_follow_the_markov_chain(tiny_ckpt):
    rank = EngineRank(HarnessConfig(rounds=0, tp=1, checkpoint=(str(tiny_ckpt[0]), str(tiny_ckpt[1])),
                                    num_pages=8), 0)
    hidden = torch.randn(14, rank.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    anchors = torch.tensor([5, 9])
    d = rank.draft_tokens(hidden, anchors)
    assert d.shape == (2, 7)
    # row j of request 1 by hand: U_j + markov_w2 @ markov_w1[prev]
    prev = 9
    for j in range(7):
        logits = rank.lm_head @ hidden[7 + j] + rank.w2 @ rank.w1[prev]
        assert int(logits.argmax()) == int(d[1, j])
        prev = int(d[1, j])
    for s in rank.kv:
        s.close()


def test_summary_and_report_text():
    rank = {"decisions": "FFLFL", "reasons": ["", "", "R outside 1..max_reqs", "", "sidecar ABORTED"],
            "digest": 7, "fwd_ns": [2_000_000, 3_000_000, 4_000_000], "local_ns": [1_000_000] * 5, "compared": 3,
            "hidden_mismatch": 0, "max_hidden_diff": 0.0, "token_mismatch": 0, "tokens_differing": 0,
            "kv_mismatch": 0, "max_kv_diff": 0.0, "max_hidden_rel": 0.0, "max_kv_rel": 0.0,
            "max_seq_len": 4200, "joined": 4, "binds": 1,
            "shim": {"fallbacks": {"CUDA graph capture": 1, "R outside 1..max_reqs": 1, "sidecar ABORTED": 1}}}
    rep = summarise([rank, dict(rank)], rounds=5, wall_s=1.5)
    assert rep.forwarded == 3 and rep.fallbacks == {"R outside 1..max_reqs": 1, "sidecar ABORTED": 1}
    assert rep.warmup_fallbacks == {"CUDA graph capture": 1} and rep.ranks_agree
    assert rep.forwarded_p50_ms == 3.0 and rep.forwarded_p99_ms == 4.0 and rep.local_p50_ms == 1.0
    text = format_report(rep)
    assert "rounds: 5" in text and "forwarded to the sidecar: 3   local fallback: 2" in text
    assert "fallback: sidecar ABORTED: 1" in text and "p50 3.00 ms  p99 4.00 ms" in text
    assert "largest hidden-state difference 0 (0 rounds differ)" in text
    assert "relative (L2): hidden 0.00e+00, K/V 0.00e+00" in text
    diverged = summarise([rank, dict(rank, digest=8)], rounds=5, wall_s=1.0)
    assert not diverged.ranks_agree and "agree on every decision and token: NO" in format_report(diverged)
    assert isinstance(rep, DemoReport)


def test_the_summary_counts_the_mismatches_any_rank_saw():
    """Each engine rank compares its own shard of the block K/V and its own copy of the hidden states: a sidecar
    rank that wrote wrong K/V shows on that rank alone, its tokens (and so the ranks' digests) agreeing."""
    clean = {"decisions": "FF", "reasons": ["", ""], "digest": 7, "fwd_ns": [1], "local_ns": [1], "compared": 2,
             "hidden_mismatch": 0, "max_hidden_diff": 0.0, "token_mismatch": 0, "tokens_differing": 0,
             "kv_mismatch": 0, "max_kv_diff": 0.0, "max_hidden_rel": 0.0, "max_kv_rel": 0.0,
             "max_seq_len": 20, "joined": 1, "binds": 1, "shim": None}
    off = dict(clean, hidden_mismatch=1, max_hidden_diff=0.5, token_mismatch=1, tokens_differing=2,
               kv_mismatch=2, max_kv_diff=0.25, max_hidden_rel=0.1, max_kv_rel=0.2)
    rep = summarise([clean, off], rounds=2, wall_s=1.0)
    assert rep.ranks_agree
    assert (rep.hidden_mismatch_rounds, rep.token_mismatch_rounds, rep.tokens_differing, rep.kv_mismatch_rounds) == (
        1, 1, 2, 2)
    assert (rep.max_hidden_diff, rep.max_kv_diff, rep.max_hidden_rel, rep.max_kv_rel) == (0.5, 0.25, 0.1, 0.2)


def test_record_reports_relative_differences_beside_exact_ones():
    """The GPU backend rounds differently from the stock layers: the relative L2 is what is judged there."""
    rec = Record()
    local = torch.tensor([[3.0, 4.0]])  # norm 5
    kv = torch.ones(2, 2)
    drafts = torch.zeros(1, 7, dtype=torch.int64)
    rec.compare(local + torch.tensor([[0.0, 0.05]]), local, drafts, drafts, kv, kv)
    assert rec.hidden_mismatch == 1 and rec.kv_mismatch == 0
    assert abs(rec.max_hidden_rel - 0.01) < 1e-6 and rec.max_kv_rel == 0.0
    rec.compare(local, local, drafts, drafts, kv * 1.5, kv)  # the largest round is kept
    assert abs(rec.max_hidden_rel - 0.01) < 1e-6 and abs(rec.max_kv_rel - 0.5) < 1e-9


def test_the_launcher_makes_a_socket_folder_serve_accepts_whatever_the_umask(tmp_path):
    """Under umask 000 a plain mkdir made the folder and its parents 0777: serve, started next, refused it."""
    import os
    import stat

    from dspark_sidecar.client.launcher import SidecarLauncher
    from dspark_sidecar.server import sockdir

    d = tmp_path / "a" / "sock"
    old = os.umask(0)
    try:
        SidecarLauncher(d, tp=1).make_socket_dir()
    finally:
        os.umask(old)
    assert stat.S_IMODE(d.stat().st_mode) == 0o770 and not d.parent.stat().st_mode & stat.S_IWOTH
    sockdir.prepare(d)  # what serve's own check does: no refusal


def test_a_nan_forwarded_round_is_kept_and_fails_a_gpu_backend_s_verdict():
    """Python's max(0.0, nan) is 0.0: a forwarded round whose hidden states or block K/V held a NaN (a GPU
    kernel's bug) left the record's largest relative L2 at the clean rounds' value, and on a non-reference
    backend (judged on that number alone) the demo passed with exit 0, its report saying 0.00e+00."""
    from dspark_sidecar.client.demo import verdict

    drafts = torch.zeros(1, 7, dtype=torch.int64)
    local, kv = torch.tensor([[3.0, 4.0]]), torch.ones(2, 2)
    bad_hidden = torch.tensor([[3.0, float("nan")]])
    for fwd, kv_fwd, field_ in ((bad_hidden, kv, "max_hidden_rel"), (local, kv * float("nan"), "max_kv_rel")):
        rec = Record()
        rec.compare(local, local, drafts, drafts, kv, kv)  # a clean round first
        rec.compare(fwd, local, drafts, drafts, kv_fwd, kv)
        rec.compare(local, local, drafts, drafts, kv, kv)  # and one after: the NaN must stay
        assert getattr(rec, field_) != getattr(rec, field_), (field_, rec)
        rank = rec.as_dict() | {"max_seq_len": 100, "joined": 1, "binds": 1, "shim": None}
        clean = Record()
        clean.compare(local, local, drafts, drafts, kv, kv)
        clean = clean.as_dict() | {"max_seq_len": 100, "joined": 1, "binds": 1, "shim": None,
                                   "decisions": rank["decisions"], "digest": rank["digest"]}
        for reports in ([clean, rank], [rank, clean]):  # whichever rank saw it, the summary keeps it
            rep = summarise(reports, rounds=3, wall_s=1.0)
            rep.backend = "triton"
            why = verdict(rep, "bf16")
            assert why is not None and "nan" in why, (field_, why)


def test_the_demo_removes_the_folders_it_made_and_keeps_those_it_was_given(tmp_path, monkeypatch):
    """Every `dspark-sidecar demo` left two folders in $TMPDIR (dspark-demo-*: the sidecar's log, the ranks'
    reports, the rendezvous file; dsp-*: the emptied socket folder), never named to the user."""
    import tempfile

    from dspark_sidecar.client import demo

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    rank = {"decisions": "F", "reasons": [""], "digest": 1, "fwd_ns": [1], "local_ns": [1], "compared": 1,
            "hidden_mismatch": 0, "max_hidden_diff": 0.0, "token_mismatch": 0, "tokens_differing": 0,
            "kv_mismatch": 0, "max_kv_diff": 0.0, "max_hidden_rel": 0.0, "max_kv_rel": 0.0,
            "max_seq_len": 10, "joined": 1, "binds": 1, "shim": None}

    class Sidecar:
        exited = False

        def __init__(self, sock, **kw):
            self.log_path = kw.get("log_path")

        def start(self):
            Path(self.log_path).write_text("log\n")

        def status(self, rank):
            return _Status()

        def stop(self):
            return 0

    class _Status:
        backend, fast_path_refusal = "reference", ""

    def engine(h, work):
        Path(work).mkdir(parents=True)
        (Path(work) / "rank0.json").write_text("{}")
        return [rank]

    monkeypatch.setattr(demo, "SidecarLauncher", Sidecar)
    monkeypatch.setattr(demo, "run_engine", engine)
    monkeypatch.setattr(demo, "ensure_synthetic_checkpoint", lambda cfg, seed: (tmp_path / "d", tmp_path / "t"))
    rep = demo.run_demo(demo.DemoConfig(rounds=1, tp=1), out=lambda _line: None)
    assert rep.compared == 1 and list(scratch.iterdir()) == []
    given = tmp_path / "given"
    given.mkdir()
    demo.run_demo(demo.DemoConfig(rounds=1, tp=1, work_dir=str(given), socket_dir=str(given / "s")),
                  out=lambda _line: None)
    assert (given / "sidecar.log").exists() and (given / "engine" / "rank0.json").exists()


def test_a_cache_too_small_for_a_prompt_is_named_not_an_empty_round():
    """With no request in flight every page is free; a prompt that still does not fit never will. admit()
    returned no request, and the round's block table raised `max() arg is an empty sequence` (R = 0)."""
    w = Workload(MixConfig(seed=0), vocab=2048, page_size=16, num_pages=8)  # request 0: 4000 rows
    with pytest.raises(ValueError, match=r"num_pages 8 x page_size 16 = 128 rows: a prompt of 4000 rows needs 4007"):
        w.admit()
    ok = Workload(MixConfig(seed=0, first_long=False, mid_p=0.0, long_p=0.0), vocab=2048, page_size=16, num_pages=11)
    for _ in range(20):  # short prompts (up to 160 + 7 rows) fit 11 pages, one request at a time
        ok.admit()
        assert ok.active and ok.block_table().shape[0] == len(ok.active)
        for r in ok.active:
            ok.advance(r, 0, [0] * layout.QPR)
        ok.retire()


def test_a_reused_work_dir_pauses_at_this_run_s_round(tiny_ckpt, tmp_path):
    """run_engine left reached-N and go-N in work_dir/control: run again there, on_pause ran at once (before the
    ranks had got to round N, the stale reached-N) and rank 0, finding go-N, did not wait for it."""
    import os

    from dspark_sidecar.client.harness import run_engine

    h = HarnessConfig(rounds=3, tp=1, checkpoint=(str(tiny_ckpt[0]), str(tiny_ckpt[1])), num_pages=64,
                      mix=MixConfig(seed=0, max_active=2, short_prompt=(1, 20), mid_p=0.0, long_p=0.0,
                                    first_long=False), faults=(Fault(2, "pause"),))
    ctl = tmp_path / "control"
    reached = []

    def on_pause(rnd: int) -> None:  # this run's rank touched reached-N: its time is after the stale one's
        reached.append((rnd, (ctl / f"reached-{rnd}").stat().st_mtime))

    run_engine(h, tmp_path, on_pause=on_pause, timeout_s=300)
    for f in ctl.iterdir():
        os.utime(f, (1.0, 1.0))  # the last run's files, unmistakably old
    reached.clear()
    run_engine(h, tmp_path, on_pause=on_pause, timeout_s=300)
    assert len(reached) == 1 and reached[0][0] == 2 and reached[0][1] > 1.0, reached


def test_faults_that_never_fire_and_unusable_mixes_are_refused():
    """A fault past the last round or on a rank that does not exist was accepted and never fired: a fault run
    passed without the fault. A mix with no request in flight, or a reversed or negative range, failed mid-run."""
    # With a sidecar, so that the rank-4 break is refused for its rank alone (without one, the no-sidecar check
    # below refused it too, and the test passed with no rank check at all); each refusal is matched for its reason.
    for bad, why in (({"faults": (Fault(3, "break_stream", rank=4),)}, "never fires in 10 rounds on ranks 0..3"),
                     ({"faults": (Fault(10, "pause"),)}, "never fires in 10 rounds"),
                     ({"page_size": 0}, "page_size and num_pages"), ({"preset": "nope"}, "preset: one of")):
        with pytest.raises(ValueError, match=why):
            HarnessConfig(rounds=10, tp=4, socket_dir="/tmp/s", **bad)
    with pytest.raises(ValueError, match="round and rank"):
        Fault(-1, "pause")
    HarnessConfig(rounds=10, tp=4, socket_dir="/tmp/s", faults=(Fault(9, "break_stream", rank=3),))  # the last ones
    # No sidecar (socket_dir None): no stream to break, no shim to call the hook; the run passed as if it had
    # survived the break.
    with pytest.raises(ValueError, match="break_stream"):
        HarnessConfig(rounds=10, tp=4, faults=(Fault(3, "break_stream"),))
    for bad in ({"max_active": 0}, {"budget": (10, 5)}, {"short_prompt": (-3, -1)}):
        with pytest.raises(ValueError):
            MixConfig(**bad)
    MixConfig(short_prompt=(0, 0))  # an empty prompt is a valid request (P = 0)


def test_a_rank_that_raises_mid_run_releases_its_shim_and_kv_segments(tiny_ckpt, tmp_path):
    """EngineRank.run closed the shim and the KV cache's shared-memory segments only after the last round:
    an exception mid-run left the segments in /dev/shm (and the channel open) until the process exited."""
    import os

    h = HarnessConfig(rounds=4, tp=1, required_tp=1, checkpoint=(str(tiny_ckpt[0]), str(tiny_ckpt[1])),
                      num_pages=64, socket_dir=str(tmp_path / "none"), step_deadline_s=0.5, late_grace_s=0.5,
                      mix=MixConfig(seed=0, max_active=2, short_prompt=(1, 20), mid_p=0.0, long_p=0.0,
                                    first_long=False))
    rank = EngineRank(h, 0)
    names = [s.segment.name.lstrip("/") for s in rank.kv]
    assert all(os.path.exists(f"/dev/shm/{n}") for n in names)

    def advance(*_a):
        raise RuntimeError("engine bug")

    rank.work.advance = advance
    with pytest.raises(RuntimeError, match="engine bug"):
        rank.run()
    assert not any(os.path.exists(f"/dev/shm/{n}") for n in names)
    assert rank.shim is not None and rank.shim._hold.closed


def test_a_mix_whose_probabilities_are_not_probabilities_is_refused():
    """join_p, burst_p, mid_p and long_p were never checked: a NaN one never fired (`u < nan` is False, so a NaN
    join_p left one request in flight at a time, and the run's verdict covered no step of several), a negative one
    acted as 0 and one above 1 as 1, and mid_p + long_p above 1 silently drew no short prompt and fewer mid ones
    than asked. The run went on with a mix other than the one configured, and said nothing."""
    for bad in ({"join_p": float("nan")}, {"burst_p": -0.1}, {"join_p": 1.5}, {"long_p": float("inf")},
                {"mid_p": 0.6, "long_p": 0.6}):
        name = next(iter(bad)) if len(bad) == 1 else "mid_p + long_p"
        with pytest.raises(ValueError, match="^" + name.replace("+", r"\+") + ":"):
            MixConfig(**bad)
    # The edges are probabilities: never, always, and mid and long prompts only.
    MixConfig(join_p=0.0, burst_p=1.0, mid_p=0.0, long_p=1.0)
    MixConfig(mid_p=0.7, long_p=0.3)
    MixConfig(mid_p=0.15, long_p=0.85)


def _short_mix(**kw) -> MixConfig:
    """Short prompts only, no long first request: each field under test set by the caller."""
    return MixConfig(**{"seed": 0, "first_long": False, "mid_p": 0.0, "long_p": 0.0, "short_prompt": (1, 20), **kw})


def test_the_page_pool_hands_out_its_last_pages_and_no_more():
    from dspark_sidecar.client.workload import PagePool

    pool = PagePool(3)
    assert pool.take(3) == [0, 1, 2] and pool.take(1) is None and pool.take(0) == []
    pool.give([0, 1, 2])
    assert sorted(pool.take(3)) == [0, 1, 2]


def test_requests_stay_their_budget_and_long_ones_long_enough_to_cross_the_window():
    """A request leaves once it has stayed its budget's rounds, no later; a long prompt's budget is at least 40
    rounds, so that its context grows across the 4096 window (the mix's reason to draw long prompts)."""
    w = Workload(_short_mix(budget=(1, 1), max_active=1), vocab=2048, page_size=16, num_pages=64)
    (r,) = w.admit()
    w.advance(r, 0, [0] * layout.QPR)
    assert w.retire() == [r] and w.active == [] and len(w.pool.free) == 64 and (w.joined, w.left) == (1, 1)
    long = Workload(MixConfig(seed=0, budget=(1, 1), long_prompt=(10, 10)), vocab=2048, page_size=16, num_pages=64)
    (first,) = long.admit()
    assert first.pos == 10 and first.budget == 40


def test_advance_commits_only_rows_its_pages_hold_and_the_next_anchor_follows_them():
    """With no page left for all accepted rows, fewer are accepted: a committed row past the request's pages
    has no slot in the draft KV cache. The next anchor is the row after the last one committed."""
    w = Workload(_short_mix(short_prompt=(9, 9), max_active=1), vocab=2048, page_size=16, num_pages=1)
    (r,) = w.admit()  # 9 prompt rows + 7 block rows: the one page
    drafts, anchor = list(range(1, layout.QPR + 1)), r.anchor
    p, t = w.advance(r, layout.QPR, drafts)  # 8 rows wanted, 7 fit
    assert p.tolist() == list(range(9, 16)) and t.tolist() == [anchor] + drafts[:6]
    assert int(w.slots(r, p).max()) < 16 and r.pos == 16
    ok = Workload(_short_mix(short_prompt=(9, 9), max_active=1), vocab=2048, page_size=16, num_pages=4)
    (q,) = ok.admit()
    p, _ = ok.advance(q, 3, drafts)
    assert p.tolist() == [9, 10, 11, 12] and q.pos == 13


def test_the_block_table_and_prompts_address_each_request_s_own_pages():
    """The step's block table holds each request's pages in order, zeros after them (as vLLM pads), and a
    prompt's rows are 0..P-1 at their places in those pages: the step reads the rows the commits wrote. Two
    requests' prompts are their own tokens, not one stream."""
    from dspark_sidecar.drafter.scenario import block_rows

    w = Workload(_short_mix(burst_p=1.0, max_active=3, short_prompt=(5, 40)), vocab=2048, page_size=16,
                 num_pages=64)
    w.pool.free.reverse()  # pages handed out from the top: no request's page ids are 0, 1, 2, ...
    w.admit()
    w.admit()
    reqs = w.active
    assert len(reqs) == 3 and len({p for r in reqs for p in r.pages}) == sum(len(r.pages) for r in reqs)
    t = w.block_table()
    assert t.dtype == torch.int32 and t.shape == (3, max(len(r.pages) for r in reqs))
    for i, r in enumerate(reqs):
        assert t[i].tolist() == r.pages + [0] * (t.shape[1] - len(r.pages))
        pos, tokens, slots = w.prompt(r)
        assert pos.tolist() == list(range(r.pos)) and tokens.shape == (r.pos,)
        assert slots.tolist() == [r.pages[p // 16] * 16 + p % 16 for p in range(r.pos)]
        assert torch.equal(tokens, w.prompt(r)[1])  # the same on every rank
    a, b = (w.prompt(r)[1] for r in reqs[:2])
    k = min(a.numel(), b.numel())
    assert not torch.equal(a[:k], b[:k])
    seq_lens = torch.tensor([r.pos + layout.QPR for r in reqs], dtype=torch.int32)
    _, pos, slots = block_rows(torch.zeros(3, dtype=torch.int64), seq_lens, t, 16, 0)
    want = [w.slots(r, torch.arange(r.pos, r.pos + layout.QPR)).tolist() for r in reqs]
    assert slots.view(3, layout.QPR).tolist() == want  # the block rows' slots are the requests' own pages


def test_a_burst_fills_the_mix_up_to_max_active():
    w = Workload(_short_mix(burst_p=1.0, max_active=5), vocab=2048, page_size=16, num_pages=64)
    assert len(w.admit()) == 1  # none in flight: one joins
    assert len(w.admit()) == 4 and len(w.active) == 5


def test_a_burst_stops_at_the_first_request_its_pages_cannot_hold():
    """A request the free pages cannot hold is dropped, and so is the rest of its round's burst: none joins past
    it. Going on with the burst, a short prompt drawn after the refused long one joined in its place, so that under
    page pressure the mix drifted to short prompts only (fewer contexts across the window than asked for)."""
    w = Workload(_short_mix(burst_p=1.0, max_active=3), vocab=2048, page_size=16, num_pages=2)
    prompts = iter([9, 500, 9])  # 16 rows (one page), 507 rows (32 pages: never with one free), 16 rows
    w._prompt_len = lambda: next(prompts)
    (first,) = w.admit()  # none in flight: one joins, on one page
    assert w.admit() == [] and w.active == [first] and w.joined == 1
    assert len(w.pool.free) == 1 and next(prompts) == 9  # the short one after the refusal was never drawn


def test_taps_are_the_requests_own():
    from dspark_sidecar.client.workload import taps_for

    pos, tok = torch.arange(5), torch.tensor([3, 1, 4, 1, 5])
    assert torch.equal(taps_for(7, pos, tok, 8), taps_for(7, pos, tok, 8))
    assert not torch.equal(taps_for(7, pos, tok, 8), taps_for(8, pos, tok, 8))
    assert not torch.equal(taps_for(7, pos, tok, 8), taps_for(7, pos, tok + 1, 8))


def test_ranks_stopped_by_an_error_or_interrupt_release_their_kv_segments_first(tiny_ckpt, tmp_path):
    """run_engine's finally SIGKILLed the ranks still running when it unwound (Ctrl-C, the demo's SIGTERM, an
    error here): EngineRank.run's finally never ran, the KV cache's segments stayed in /dev/shm until the starter
    exited, and the starter's resource tracker then warned of "leaked shared_memory objects" after the demo's one
    `interrupted` line. Now they unwind as on their own Ctrl-C, and only one that cannot is killed."""
    import os

    from dspark_sidecar.client.harness import run_engine

    h = HarnessConfig(rounds=3, tp=1, checkpoint=(str(tiny_ckpt[0]), str(tiny_ckpt[1])), num_pages=64,
                      mix=MixConfig(seed=0, max_active=2, short_prompt=(1, 20), mid_p=0.0, long_p=0.0,
                                    first_long=False), faults=(Fault(1, "pause"),))
    held: list[str] = []

    def on_pause(_rnd: int) -> None:  # the rank waits in its pause: its KV cache is mapped now
        for child in Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split():
            try:
                if b"spawn_main" not in Path(f"/proc/{child}/cmdline").read_bytes():
                    continue
                maps = Path(f"/proc/{child}/maps").read_text()
            except OSError:
                continue
            held.extend(sorted({line.split()[-1] for line in maps.splitlines() if "/dev/shm/" in line}))
        raise RuntimeError("the controller failed")

    with pytest.raises(RuntimeError, match="the controller failed"):
        run_engine(h, tmp_path, on_pause=on_pause, timeout_s=300)
    assert held, "no engine rank held a KV segment at the pause"
    left = [p for p in held if os.path.exists(p)]
    assert not left, f"the stopped rank's KV segments are still in /dev/shm: {left}"


def test_a_round_with_one_differing_draft_token_counts_as_a_token_mismatch():
    """The reference backend must draft the same tokens: one token off in one round is a mismatched round."""
    rec = Record()
    hidden, kv = torch.ones(7, 4), torch.ones(2, 2)
    local = torch.zeros(1, 7, dtype=torch.int64)
    one_off = local.clone()
    one_off[0, 3] = 5
    rec.compare(hidden, hidden, one_off, local, kv, kv)
    assert (rec.token_mismatch, rec.tokens_differing) == (1, 1)
    rec.compare(hidden, hidden, local, local, kv, kv)
    three_off = local + torch.tensor([[1, 0, 1, 0, 1, 0, 0]])
    rec.compare(hidden, hidden, three_off, local, kv, kv)
    assert (rec.token_mismatch, rec.tokens_differing, rec.compared) == (2, 4, 3)


def test_the_demo_s_mix_goes_above_max_reqs_first_at_the_round_the_readme_names():
    """README: the mix has more requests than --max-reqs on purpose, "with the default --seed and --max-reqs the
    first is round 75" (1-based, as the progress lines count), and never more than max_reqs + 4. And such rounds
    are the exception (review 318): the mix filled up and stayed above max_reqs in ~88% of a 400-round run, so
    the demo forwarded 49 rounds of 400."""
    from dspark_sidecar.client.demo import DemoConfig, demo_mix
    from dspark_sidecar.drafter.config import PRESETS

    cfg = DemoConfig()
    vocab = PRESETS[cfg.preset].vocab_size  # the anchors' draws take the RNG's bits by the vocabulary's size
    w = Workload(demo_mix(cfg), vocab=vocab, page_size=16, num_pages=1024)  # the harness's default cache
    first, over = None, 0
    for rnd in range(400):
        w.admit()
        assert len(w.active) <= cfg.max_reqs + 4
        if len(w.active) > cfg.max_reqs:
            over += 1
            first = first or rnd + 1
        for r in w.active:
            drafts = [(r.anchor + j) % vocab for j in range(layout.QPR)]
            w.advance(r, w.accepted(r, drafts, rnd), drafts)
        w.retire()
    assert first == 75, first
    assert 0.05 <= over / 400 <= 0.35, over  # some rounds too large to forward, most not


def test_a_fault_or_harness_value_the_ranks_would_never_use_or_fail_on_is_refused_up_front():
    """Fault(1.5, "pause") passed the range check (1.5 < rounds) and never fired, no round being 1.5: the run
    passed without its pause, on_pause never called (a break_stream on rank 0.5 likewise). A harness value the
    engine ranks cannot use (rounds 2.5, a tp the preset does not shard over, the shim's own EngineConfig fields)
    was accepted here and failed in every rank, each after mapping its KV cache: the segments were left to the
    starter's resource tracker, which warned of "leaked shared_memory objects"."""
    for bad in ({"round": 1.5}, {"round": True}, {"rank": 0.5}):
        with pytest.raises(ValueError, match="whole numbers"):
            Fault(**({"round": 1, "kind": "pause"} | bad))
    ok = {"rounds": 10, "tp": 4, "socket_dir": "/tmp/s"}
    for bad, why in (({"rounds": 2.5}, "rounds"), ({"num_pages": 8.0}, "num_pages"), ({"tp": True}, "tp"),
                     ({"progress_every": -1}, "progress_every"), ({"tp": 3}, "not divisible by TP size 3"),
                     ({"transport": "bogus"}, "transport"), ({"step_deadline_s": 0}, "step_deadline_s"),
                     ({"late_grace_s": float("inf")}, "late_grace_s"), ({"required_tp": 0}, "required_tp"),
                     ({"kv_dtype": "fp16"}, "kv_dtype"), ({"kv_layout": "rows"}, "kv_layout"),
                     ({"dtype": "fp16"}, "dtype"), ({"device": "gpu"}, "device")):
        with pytest.raises(ValueError, match=why):
            HarnessConfig(**(ok | bad))
    HarnessConfig(**ok, progress_every=0, required_tp=2, transport="doorbell")  # usable values stay usable


def test_an_engine_rank_whose_set_up_fails_after_its_kv_cache_releases_the_segments(tiny_ckpt, monkeypatch):
    """EngineRank.__init__ maps the KV cache before it builds the shim (which may block on its peers): a failure
    or a stop (run_engine's SIGTERM) there left the segments in /dev/shm until the starter exited."""
    import os

    from dspark_sidecar.client import harness

    made = []

    def zeros(*a):
        made.append(seg := harness.exportable_zeros.__wrapped__(*a))
        return seg

    zeros.__wrapped__ = harness.exportable_zeros
    monkeypatch.setattr(harness, "exportable_zeros", zeros)

    def shim(*_a):
        assert made and all(os.path.exists(f"/dev/shm/{s.segment.name.lstrip('/')}") for s in made)
        raise RuntimeError("shim set-up failed")

    monkeypatch.setattr(harness, "DrafterShim", shim)
    h = HarnessConfig(rounds=1, tp=1, required_tp=1, checkpoint=(str(tiny_ckpt[0]), str(tiny_ckpt[1])),
                      num_pages=8, socket_dir="/tmp/none")
    with pytest.raises(RuntimeError, match="shim set-up failed"):
        EngineRank(h, 0)
    left = [s.segment.name for s in made if os.path.exists(f"/dev/shm/{s.segment.name.lstrip('/')}")]
    assert not left, f"the KV cache's segments are still in /dev/shm: {left}"


def _rank_pid() -> int:
    """This process's one spawned engine rank (not its resource tracker)."""
    import os

    me = os.getpid()
    (pid,) = [int(c) for c in Path(f"/proc/{me}/task/{me}/children").read_text().split()
              if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    return pid


def _short_harness(tiny_ckpt, **kw) -> HarnessConfig:
    return HarnessConfig(**{"rounds": 3, "tp": 1, "checkpoint": (str(tiny_ckpt[0]), str(tiny_ckpt[1])),
                            "num_pages": 64, "mix": _short_mix(max_active=2), **kw})


def test_a_rank_that_exits_without_its_report_is_named_not_replaced_by_the_last_run_s(tiny_ckpt, tmp_path):
    """A rank stopped by SIGINT alone (torch's spawn wrapper: exit 0, as its parent's stop) writes no report, and
    run_engine, all ranks having exited 0, read work_dir/rank0.json: the last run's, in a reused work_dir, returned
    as this run's (3 rounds, all passed, for a run of 5 cut short at round 1); in a fresh one a FileNotFoundError."""
    import os
    import select
    import signal

    from dspark_sidecar.client.harness import run_engine

    assert run_engine(_short_harness(tiny_ckpt), tmp_path, timeout_s=300)[0]["decisions"] == "LLL"

    def on_pause(_rnd: int) -> None:  # rank 0 waits in its pause for go-1: stopped there, as by a lone Ctrl-C
        fd = os.pidfd_open(_rank_pid())
        try:
            signal.pidfd_send_signal(fd, signal.SIGINT)
            assert select.select([fd], [], [], 60)[0], "the interrupted rank did not exit"
        finally:
            os.close(fd)

    with pytest.raises(RuntimeError, match=r"engine rank 0 exited \(status 0\) without its report"):
        run_engine(_short_harness(tiny_ckpt, rounds=5, faults=(Fault(1, "pause"),)), tmp_path, on_pause=on_pause,
                   timeout_s=300)


def test_a_failed_run_leaves_no_unreaped_rank_nor_torch_s_error_file(tiny_ckpt, tmp_path, monkeypatch):
    """A rank that raised left torch's pytorch-errorfile-*.pickle (its traceback) in $TMPDIR, one per failed run;
    a rank that did not unwind in time was SIGKILLed and never waited for: a zombie until this process next
    started one or exited."""
    import tempfile

    from torch.multiprocessing import ProcessRaisedException

    from dspark_sidecar.client import harness

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    # A first prompt the cache cannot hold: the rank raises (Workload's ValueError) before its first round.
    with pytest.raises(ProcessRaisedException, match="a prompt of 4000 rows needs 4007"):
        harness.run_engine(_short_harness(tiny_ckpt, mix=MixConfig(seed=0), num_pages=8), tmp_path / "a",
                           timeout_s=300)
    assert list(scratch.iterdir()) == []
    monkeypatch.setattr(harness, "RANK_UNWIND_S", 0.0)  # no time to unwind: the rank is killed
    pids = []

    def on_pause(_rnd: int) -> None:
        pids.append(_rank_pid())
        raise RuntimeError("the controller failed")

    with pytest.raises(RuntimeError, match="the controller failed"):
        harness.run_engine(_short_harness(tiny_ckpt, faults=(Fault(1, "pause"),)), tmp_path / "b",
                           on_pause=on_pause, timeout_s=300)
    stat = Path(f"/proc/{pids[0]}/stat")
    assert not stat.exists(), f"engine rank {pids[0]} was not reaped: {stat.read_text()}"


def test_verify_mode_finds_a_wrong_hidden_state_draft_token_or_kv_row(tiny_ckpt, tmp_path):
    """Each forwarded round is run again on the local layers and compared: the hidden states, the draft tokens
    and the block rows' K/V the sidecar wrote. A stand-in sidecar answers with the local layers' own step, then
    gets one thing wrong; a clean one must compare equal, each wrong one must count in its own field."""
    from dspark_sidecar.client.forward_context import get_forward_context

    def run(wrong) -> dict:
        h = _short_harness(tiny_ckpt, required_tp=1, socket_dir=str(tmp_path / "none"), warmup_calls=False)
        rank = EngineRank(h, 0)

        def forward(ids, pos):  # the sidecar's step: its answer, and its writes of the block rows' K/V
            meta = get_forward_context().attn_metadata
            out = rank.model.draft_step(rank.embed_input_ids(ids), pos, meta, rank._layers())
            return wrong(rank, out, meta)

        rank.shim.maybe_forward = forward
        return rank.run()

    def kv_row(rank, out, meta):  # one block row's K, one layer
        t, slot = rank._layers()[-1], int(meta.slot_mapping[3])
        t[0, slot // t.shape[2], slot % t.shape[2]] += 1.0
        return out

    def v_row(rank, out, meta):  # one block row's V, one layer: the V plane is compared too
        t, slot = rank._layers()[0], int(meta.slot_mapping[-1])
        t[1, slot // t.shape[2], slot % t.shape[2]] -= 1.0
        return out

    def hidden(_rank, out, _meta):  # a little off: the same tokens
        return out + torch.zeros_like(out).index_fill_(0, torch.tensor([2]), 1e-3)

    def nan(_rank, out, _meta):
        return out.clone().index_fill_(0, torch.tensor([0]), float("nan"))

    def tokens(_rank, out, _meta):
        return torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)

    fields = ("hidden_mismatch", "token_mismatch", "kv_mismatch")
    clean = run(lambda _r, out, _m: out)
    assert clean["decisions"] == "FFF" and clean["compared"] == 3
    assert [clean[f] for f in fields] == [0, 0, 0] and clean["max_hidden_diff"] == clean["max_kv_diff"] == 0.0
    got = run(kv_row)
    assert [got[f] for f in fields] == [0, 0, 3] and got["max_kv_diff"] > 0.5
    got = run(v_row)
    assert [got[f] for f in fields] == [0, 0, 3] and got["max_kv_diff"] > 0.5
    got = run(hidden)
    assert [got[f] for f in fields] == [3, 0, 0] and 0 < got["max_hidden_diff"] < 1e-2
    got = run(nan)
    assert got["hidden_mismatch"] == 3 and got["max_hidden_diff"] != got["max_hidden_diff"]
    got = run(tokens)
    assert got["hidden_mismatch"] == 3 and got["token_mismatch"] == 3 and got["tokens_differing"] > 0
    assert got["digest"] != clean["digest"]  # the forwarded tokens are the ones drafted


def test_a_kv_reallocation_keeps_the_contents_in_new_segments(tiny_ckpt):
    """realloc_kv stands for the engine's re-allocation (the shim must re-bind): new segments, contents carried
    over. The same run drafts the same tokens with and without it."""
    h = _short_harness(tiny_ckpt, rounds=4, faults=(Fault(2, "realloc_kv"),))
    rank = EngineRank(h, 0)
    before = [s.segment.name for s in rank.kv]
    moved = rank.run()
    assert not {s.segment.name for s in rank.kv} & set(before)
    assert moved["digest"] == EngineRank(_short_harness(tiny_ckpt, rounds=4), 0).run()["digest"]


def test_the_digest_covers_every_round_and_progress_counts_local_rounds():
    """Ranks agree when their digests do: a digest of the last round's tokens alone hid an earlier divergence."""
    a, b = Record(), Record()
    zero, one = torch.zeros(1, 7, dtype=torch.int64), torch.ones(1, 7, dtype=torch.int64)
    a.round(1, True, "", zero, 10)
    b.round(1, True, "", one, 10)
    for rec in (a, b):
        rec.round(2, False, "R outside 1..max_reqs", zero, 30)
    assert a.digest != b.digest
    assert a.progress(2, 5) == "round 2/5: R=2 forwarded 1, local 1, longest context 30, mismatches 0"


def test_a_break_stream_fault_arms_its_rank_s_hook_for_its_round_only(tiny_ckpt, tmp_path):
    """The shim calls fault_hook just before it sends a step: set in the fault's round on the fault's rank."""
    h = _short_harness(tiny_ckpt, required_tp=1, socket_dir=str(tmp_path / "none"), warmup_calls=False,
                       faults=(Fault(1, "break_stream", rank=0),))
    rank = EngineRank(h, 0)
    armed = []

    def forward(_ids, _pos):  # a refusal: the round runs locally
        armed.append(rank.shim.fault_hook is not None)
        return None

    rank.shim.maybe_forward = forward
    assert rank.run()["decisions"] == "LLL" and armed == [False, True, False]
    other = EngineRank(h, 0)  # the same fault, seen by another rank of the group: its stream stays whole
    other.rank, armed[:] = 1, []

    def forward_other(_ids, _pos):
        armed.append(other.shim.fault_hook is not None)
        return None

    other.shim.maybe_forward = forward_other
    assert other.run()["decisions"] == "LLL" and armed == [False, False, False]


def test_a_fallback_round_is_named_by_the_reason_counted_in_it(tiny_ckpt, tmp_path):
    """The reason of a local round is the fallback counter that moved in it, not the first one the shim ever
    counted (the warm-up's capture, before round 0, would have named every later round's fallback)."""
    h = _short_harness(tiny_ckpt, rounds=4, required_tp=1, socket_dir=str(tmp_path / "none"), warmup_calls=False)
    rank = EngineRank(h, 0)
    stats = rank.shim.stats
    stats.fallbacks["CUDA graph capture"] += 1  # counted before round 0, as the warm-up's capture pass is
    why = iter(["", "R outside 1..max_reqs", "", "sidecar ABORTED"])

    def forward(_ids, _pos):  # a refusal in rounds 1 and 3; rounds 0 and 2 run locally with no reason counted
        reason = next(why)
        if reason:
            stats.fallbacks[reason] += 1
        return None

    rank.shim.maybe_forward = forward
    assert rank.run()["reasons"] == ["", "R outside 1..max_reqs", "", "sidecar ABORTED"]


def test_a_nan_stays_in_the_largest_exact_differences_and_counts_as_a_mismatch():
    """As for the relative ones: Python's max(0.0, nan) is 0.0, and a later clean round must not wash it out."""
    drafts = torch.zeros(1, 7, dtype=torch.int64)
    local, kv = torch.tensor([[3.0, 4.0]]), torch.ones(2, 2)
    for fwd, kv_fwd, diff, count in ((torch.tensor([[3.0, float("nan")]]), kv, "max_hidden_diff", "hidden_mismatch"),
                                     (local, kv * float("nan"), "max_kv_diff", "kv_mismatch")):
        rec = Record()
        for args in ((local, kv), (fwd, kv_fwd), (local, kv)):
            rec.compare(args[0], local, drafts, drafts, args[1], kv)
        assert getattr(rec, diff) != getattr(rec, diff) and getattr(rec, count) == 1, (diff, rec)


def test_a_pause_holds_the_ranks_while_on_pause_runs(tiny_ckpt, tmp_path):
    """on_pause (a sidecar killed, restarted) must run while no rank drafts: rank 0 waits for go-N. Proving a
    wait takes a bounded look: the ranks must not finish while on_pause runs (a rank that did not wait ran its
    last two rounds and wrote its report in well under the look's 2 s)."""
    import time

    from dspark_sidecar.client.harness import run_engine

    finished = []

    def on_pause(_rnd: int) -> None:
        end = time.monotonic() + 2.0
        while time.monotonic() < end and not finished:
            if (tmp_path / "rank0.json").exists():
                finished.append(True)
            time.sleep(0.02)

    assert run_engine(_short_harness(tiny_ckpt, faults=(Fault(1, "pause"),)), tmp_path, on_pause=on_pause,
                      timeout_s=300)[0]["decisions"] == "LLL"
    assert not finished, "the rank drafted on while on_pause ran"


def test_a_mix_whose_counts_are_not_whole_numbers_is_refused():
    """max_active and the prompt and budget ranges are counts: max_active 2.5 passed the `>= 1` check and the
    first burst failed in range() ("'float' object cannot be interpreted as an integer"); a long_prompt of
    (4000.0, 4120) gave request 0 a float position, and a short_prompt of (1.5, 20) failed in randint, each in
    every engine rank mid-run, after it had mapped its KV cache (as HarnessConfig's rounds 2.5 did)."""
    for bad, name in (({"max_active": 2.5}, "max_active"), ({"max_active": True}, "max_active"),
                      ({"long_prompt": (4000.0, 4120)}, "long_prompt"), ({"short_prompt": (1.5, 20)}, "short_prompt"),
                      ({"mid_prompt": (300, 1200.0)}, "mid_prompt"), ({"budget": (True, 3)}, "budget")):
        with pytest.raises(ValueError, match=f"^{name}: "):
            MixConfig(**bad)
    w = Workload(MixConfig(max_active=3, burst_p=1.0, long_prompt=(40, 40), budget=(2, 3)), vocab=2048,
                 page_size=16, num_pages=64)  # whole numbers, as before
    w.admit()
    assert len(w.admit()) == 2 and w.active[0].pos == 40


def test_an_answer_of_another_dtype_is_a_mismatch_even_where_its_values_are_the_same():
    """The reference backend must give the same bits: a bf16 answer to an fp32 step whose values bf16 holds exactly
    compares equal once cast, and K/V rows of another 1-byte type (uint8 codes for float8) as bytes."""
    drafts = torch.zeros(1, 7, dtype=torch.int64)
    local, kv = torch.tensor([[0.5, -2.0]]), torch.tensor([[1.0, 0.25]]).to(torch.float8_e4m3fn)
    rec = Record()
    rec.compare(local.to(torch.bfloat16), local, drafts, drafts, kv, kv)
    assert (rec.hidden_mismatch, rec.kv_mismatch, rec.max_hidden_diff) == (1, 0, 0.0)
    rec.compare(local, local, drafts, drafts, kv.view(torch.uint8), kv)
    assert (rec.hidden_mismatch, rec.kv_mismatch) == (1, 1)


def test_the_simulated_verify_accepts_a_prefix_of_every_length():
    """accepted() stands for the target's verify: the drafts up to the first rejected one. An engine that always
    accepted all 7 (or none) never committed a partial block, the case where the next anchor's position and the
    block rows left as scratch differ from one request to the next."""
    w = Workload(_short_mix(max_active=1), vocab=2048, page_size=16, num_pages=64)
    (req,) = w.admit()
    seen, gen = set(), torch.Generator().manual_seed(0)
    for rnd in range(200):
        drafts = torch.randint(0, 2048, (layout.QPR,), generator=gen).tolist()
        a = w.accepted(req, drafts, rnd)
        seen.add(a)
        if a < layout.QPR:  # a prefix: the drafts after the rejected one do not change the answer
            assert w.accepted(req, drafts[: a + 1] + [d + 1 for d in drafts[a + 1 :]], rnd) == a
    assert seen == set(range(layout.QPR + 1)), seen


def test_mid_and_long_probabilities_summing_to_one_draw_no_short_prompt():
    """mid_p + long_p = 1 is a mix of mid and long prompts only: the mid band is [long_p, long_p + mid_p)."""
    w = Workload(MixConfig(seed=4, first_long=False, mid_p=0.5, long_p=0.5, mid_prompt=(300, 400),
                           long_prompt=(500, 600)), vocab=2048, page_size=16, num_pages=64)
    lens = [w._prompt_len() for _ in range(200)]
    assert all(300 <= n <= 600 for n in lens)
    assert any(n <= 400 for n in lens) and any(n >= 500 for n in lens)
