"""A real 4-rank sidecar over unix sockets: results, agreement, bad input, status (one server per module)."""

from __future__ import annotations


import time

import grpc
import pytest
import torch
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from dspark_sidecar.drafter import scenario
from dspark_sidecar.proto import codec
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.proto.rich_status import error_reason
from helpers.engine_sim import PAGE, EngineSim
from helpers.local_tp import local_step, shard_model
from helpers.ranks import run_ranks
from helpers.sidecar_proc import SidecarProcess, free_port_block

TP, DTYPE, DEADLINE_MS = 4, torch.float32, 300
LENS = [5, 4096 + 40, 200, 33, 1, 77, 130, 9, 12]  # R = 9: two launches, one context past the window
PAGES = sum(scenario.pages_needed(c + 7, PAGE) for c in LENS) + 8


METRICS_PORT = free_port_block(TP)


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory, tiny_ckpt):
    with SidecarProcess(tmp_path_factory.mktemp("sc"), tp=TP, dtype="fp32", checkpoint=tiny_ckpt,
                        extra_args=["--rendezvous-ms", str(DEADLINE_MS), "--max-reqs", "16",
                                    "--metrics-port", str(METRICS_PORT)]) as sc:
        yield sc


@pytest.fixture(scope="module")
def engine(sidecar, tiny_cfg, tiny_ckpt):
    eng = EngineSim(tiny_cfg, [sidecar.socket(r) for r in range(TP)], PAGES, DTYPE)
    eng.bind()
    # Context commit on the engine side (no collectives: K/V projections are column-parallel).
    step = scenario.random_step(tiny_cfg, LENS, PAGE, PAGES, _embed(tiny_ckpt, tiny_cfg), seed=11)
    pos, slots = scenario.context_rows(step.meta, PAGE)
    taps = scenario.random_taps(tiny_cfg, pos.numel(), seed=12)
    for r in range(TP):
        shard_model(r, TP, str(tiny_ckpt[0]), DTYPE, distributed=False).commit_context(taps, pos, slots, eng.kv_tensors(r))
    eng.step = step
    yield eng
    eng.close()


def _embed(ckpt, cfg):
    from dspark_sidecar.drafter.checkpoint import EMBED_KEY, CheckpointReader

    return CheckpointReader(ckpt[1], torch.float32).read(EMBED_KEY, (cfg.vocab_size, cfg.hidden_size))


def _code(err) -> grpc.StatusCode:
    assert isinstance(err, grpc.RpcError), f"expected an RpcError, got {type(err).__name__}"
    return err.code()


def _bad_fields(err) -> list[str]:
    """The fields the error's google.rpc.BadRequest names (the engine's field-level view of a refusal)."""
    out = []
    for detail in rpc_status.from_call(err).details:
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            out += [v.field for v in bad.field_violations]
    return out


def _each(engine, reqs):
    """reqs[r] to rank r, concurrently (unary): each result a response or an RpcError."""
    def one(r):
        try:
            return engine.stubs[r].DraftStep(reqs[r], timeout=30)
        except grpc.RpcError as err:
            return err

    return list(engine.pool.map(one, range(len(reqs))))


def test_steps_bit_identical_to_in_process_tp4_reference(engine, tiny_ckpt):
    before = [[t.clone() for t in engine.kv_tensors(r)] for r in range(TP)]
    resps = engine.step_all(1, engine.step)
    hidden = [codec.from_tensor_ref(x.hidden_states, "hidden") for x in resps]
    assert all(x.timings.launches == 2 for x in resps)
    local = run_ranks(TP, local_step, str(tiny_ckpt[0]), DTYPE, before, engine.step)
    for r in range(TP):
        assert torch.equal(hidden[r], local[r][0]), f"rank {r}: sidecar != local stock layers"
        for layer in range(len(before[r])):  # block K/V written into the engine's cache exactly as locally
            assert torch.equal(engine.kv_tensors(r)[layer], local[r][1][layer]), f"rank {r} layer {layer} KV"


def test_missing_rank_aborts_every_rank_within_deadline(engine):
    t0 = time.monotonic()
    errs = engine.step_all(2, engine.step, ranks=[0, 1, 2])
    took = time.monotonic() - t0
    # Aborted at the deadline: not before (the missing copy could still come), nor long after (each
    # such step holds the engine that long). The upper bound is loose for a loaded CI host.
    assert DEADLINE_MS / 1e3 * 0.9 <= took < DEADLINE_MS / 1e3 + 2.5, took
    # The coordinator's deadline abort (its message), on every rank alike: not a give-up or a stream's end.
    assert [_code(e) for e in errs] == [grpc.StatusCode.ABORTED] * 3
    assert len({e.details() for e in errs}) == 1 and "rank(s) 3 did not receive it" in errs[0].details()
    assert {error_reason(e) for e in errs} == {"ABORTED"}
    # the late copy of step 2 on rank 3 cannot launch alone either
    late = engine.step_all(2, engine.step, ranks=[3])
    assert _code(late[0]) == grpc.StatusCode.ABORTED
    ok = engine.step_all(3, engine.step)
    assert all(isinstance(x, pb.DraftStepResponse) for x in ok)


def test_ranks_that_disagree_or_refuse_their_copy_abort_every_rank_alike(engine, tiny_cfg, tiny_ckpt):
    s = engine.step
    reqs = [engine.request(r, 700, s) for r in range(TP)]
    # Rank 2's copy names other (valid, in-bounds) cache slots: its metadata differs, so no rank may launch it.
    other = scenario.random_step(tiny_cfg, LENS, PAGE, PAGES, _embed(tiny_ckpt, tiny_cfg), seed=13)
    reqs[2] = engine.request(2, 700, other)
    errs = _each(engine, reqs)
    assert [_code(e) for e in errs] == [grpc.StatusCode.ABORTED] * TP
    assert len({e.details() for e in errs}) == 1, [e.details() for e in errs]
    assert "ranks disagree on the step's metadata" in errs[0].details() and "rank(s) 2 differ" in errs[0].details()
    # Rank 1's copy has fewer requests (its own shapes agree): num_requests, not the digest, is named.
    fewer = scenario.random_step(tiny_cfg, LENS[:4], PAGE, PAGES, _embed(tiny_ckpt, tiny_cfg), seed=14)
    reqs = [engine.request(r, 701, fewer if r == 1 else s) for r in range(TP)]
    errs = _each(engine, reqs)
    assert [_code(e) for e in errs] == [grpc.StatusCode.ABORTED] * TP
    assert "ranks disagree on num_requests (rank(s) 1 differ" in errs[0].details(), errs[0].details()
    # Rank 3's copy is malformed: rank 3 answers its own refusal, the others an abort naming rank 3.
    reqs = [engine.request(r, 702, s) for r in range(TP)]
    reqs[3].positions.CopyFrom(codec.to_tensor_ref(s.positions.to(torch.int32)))
    errs = _each(engine, reqs)
    assert [_code(e) for e in errs] == [grpc.StatusCode.ABORTED] * 3 + [grpc.StatusCode.INVALID_ARGUMENT]
    assert all("rank(s) 3 rejected their copy" in e.details() for e in errs[:3]), errs[0].details()
    assert "positions" in errs[3].details()
    ok = engine.step_all(703, s)
    assert all(isinstance(x, pb.DraftStepResponse) for x in ok)


def _bad_cases(engine, cfg):
    s = engine.step
    big_tables = s.meta.block_tables.clone()
    big_tables[0, 0] = PAGES + 5
    bad_slots = s.meta.slot_mapping.clone()
    bad_slots[3] = PAGES * PAGE
    shifted = s.positions.clone()
    shifted[7:14] += 1
    return [
        ("shape", dict(inputs_embeds=codec.to_tensor_ref(s.inputs_embeds[:, :-1])), grpc.StatusCode.INVALID_ARGUMENT, "inputs_embeds", "INVALID_FIELD"),
        ("dtype", dict(positions=codec.to_tensor_ref(s.positions.to(torch.int32))), grpc.StatusCode.INVALID_ARGUMENT, "positions", "INVALID_FIELD"),
        ("size", dict(seq_lens=pb.TensorRef(dtype=pb.DTYPE_INT32, shape=[len(LENS)], data=b"\0" * 3)), grpc.StatusCode.INVALID_ARGUMENT, "seq_lens", "INVALID_FIELD"),
        ("n%7", dict(positions=codec.to_tensor_ref(s.positions[:-2])), grpc.StatusCode.INVALID_ARGUMENT, "positions", "INVALID_FIELD"),
        ("R=0", dict(num_requests=0), grpc.StatusCode.OUT_OF_RANGE, "num_requests", "OUT_OF_RANGE"),
        ("R>max", dict(num_requests=17), grpc.StatusCode.OUT_OF_RANGE, "num_requests", "OUT_OF_RANGE"),
        ("page id", dict(block_tables=codec.to_tensor_ref(big_tables)), grpc.StatusCode.OUT_OF_RANGE, "block_tables", "OUT_OF_RANGE"),
        ("slot", dict(slot_mapping=codec.to_tensor_ref(bad_slots)), grpc.StatusCode.OUT_OF_RANGE, "slot_mapping", "OUT_OF_RANGE"),
        ("seq len", dict(positions=codec.to_tensor_ref(shifted)), grpc.StatusCode.INVALID_ARGUMENT, "positions", "INVALID_FIELD"),
        ("binding", dict(binding_id=12345), grpc.StatusCode.FAILED_PRECONDITION, "binding_id", "UNKNOWN_BINDING"),
        ("stale", dict(binding_generation=0), grpc.StatusCode.FAILED_PRECONDITION, "binding_generation", "STALE_BINDING"),
    ]


def test_every_bad_input_class_gets_its_status_and_serving_goes_on(engine, tiny_cfg, sidecar):
    for i, (name, override, code, field, reason) in enumerate(_bad_cases(engine, tiny_cfg)):
        with pytest.raises(grpc.RpcError) as info:
            engine.stubs[1].DraftStep(engine.request(1, 100 + i, engine.step, **override), timeout=10)
        err = info.value
        assert err.code() == code, f"{name}: {err.code()} {err.details()}"
        assert field in err.details(), f"{name}: message does not name {field}: {err.details()}"
        status = rpc_status.from_call(err)
        assert status is not None and len(status.details) >= 1, f"{name}: no rich error details"
        # The engine switches on ErrorInfo.reason, and reads the field from BadRequest (proto/rich_status.py).
        assert error_reason(err) == reason, f"{name}: reason {error_reason(err)!r}"
        assert _bad_fields(err) == [field], f"{name}: BadRequest names {_bad_fields(err)}"
    # oversize: the server's explicit message limit applies before any handler runs
    ok = engine.step_all(200, engine.step)
    assert all(isinstance(x, pb.DraftStepResponse) for x in ok), [getattr(x, "details", lambda: x)() for x in ok]


def test_oversize_message_is_refused(engine):
    req = engine.request(0, 300, engine.step)
    req.inputs_embeds.data = b"\0" * (300 << 20)  # over the default 256 MiB limit
    with pytest.raises(grpc.RpcError) as info:
        engine.stubs[0].DraftStep(req, timeout=60)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_stream_answers_in_order_and_survives_failed_steps(engine):
    def reqs():
        for i in range(3):
            yield engine.request(0, 400 + i, engine.step, **({"num_requests": 0} if i == 1 else {}))

    out = list(engine.stubs[0].DraftSteps(reqs(), timeout=30))
    assert [o.step_id for o in out] == [400, 401, 402]
    assert out[1].error.code == grpc.StatusCode.OUT_OF_RANGE.value[0] and out[1].error.field == "num_requests"
    assert out[1].error.reason == "OUT_OF_RANGE" and "num_requests" in out[1].error.message
    # rank 0 alone: steps 400/402 cannot agree with absent peers
    assert out[0].error.code == grpc.StatusCode.ABORTED.value[0] and out[0].error.reason == "ABORTED"


def test_status_reports_limits_backend_refusal_binding_and_counters(engine, sidecar):
    st = engine.stubs[2].GetStatus(pb.GetStatusRequest(), timeout=5)
    assert (st.limits.qpr, st.limits.launch_reqs, st.limits.max_reqs) == (7, 8, 16)
    assert (st.parallel.tp_size, st.parallel.tp_rank) == (TP, 2)
    assert st.backend == "reference" and st.fast_path_refusal == "not gfx950"
    assert st.serving and st.state == "SERVING"
    assert st.kv.bound and st.kv.num_pages == PAGES and st.kv.page_size == PAGE
    assert st.counters.steps_ok >= 1 and st.counters.kv_binds == 1
    assert any(lat.name == "total" and lat.count >= 1 for lat in st.latencies)


def test_bind_refuses_wrong_rank_and_tp(engine):
    req = engine.bind_request(0)
    req.engine.engine_rank = 1
    with pytest.raises(grpc.RpcError) as info:
        engine.stubs[0].BindKV(req, timeout=5)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "sidecar rank 0" in info.value.details()
    assert error_reason(info.value) == "RANK_MISMATCH"  # the shim's BindError(permanent) reads it
    req = engine.bind_request(0)
    req.engine.tp_size = 2
    with pytest.raises(grpc.RpcError) as info:
        engine.stubs[0].BindKV(req, timeout=5)
    assert "engine TP 2 != sidecar TP 4" in info.value.details() and error_reason(info.value) == "TP_MISMATCH"
    req = engine.bind_request(0)
    req.layers[1].shape[2] = 8
    with pytest.raises(grpc.RpcError) as info:
        engine.stubs[0].BindKV(req, timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "layers[1].shape" in info.value.details()


def test_step_past_its_deadline_is_refused_on_every_rank(engine):
    # 1 ms from receipt cannot survive validation and the agreement: no rank may launch it.
    errs = engine.step_all(500, engine.step, deadline_ms=1)
    assert [_code(e) for e in errs] == [grpc.StatusCode.DEADLINE_EXCEEDED] * TP
    assert len({e.details() for e in errs}) == 1 and "deadline_ms passed" in errs[0].details()
    ok = engine.step_all(501, engine.step, deadline_ms=30_000)
    assert all(isinstance(x, pb.DraftStepResponse) for x in ok)


def test_prometheus_endpoint_counts_steps_per_rank(engine):
    import urllib.request

    engine.step_all(600, engine.step)
    for r in range(TP):
        text = urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT + r}/metrics", timeout=5).read().decode()
        ok = [ln for ln in text.splitlines() if ln.startswith(f'dspark_steps_total{{rank="{r}",result="ok"}}')]
        assert ok and float(ok[0].split()[-1]) >= 1, text[:500]
        assert f'dspark_serving{{rank="{r}"}} 1.0' in text
        assert "dspark_step_seconds_bucket" in text


def test_a_step_of_max_reqs_requests_is_served(engine, tiny_cfg, tiny_ckpt):
    # --max-reqs 16 is the limit GetStatus advertises: a step of exactly 16 requests is served, not refused.
    full = scenario.random_step(tiny_cfg, [3 + 5 * i for i in range(16)], PAGE, PAGES, _embed(tiny_ckpt, tiny_cfg),
                                seed=15)
    ok = engine.step_all(800, full)
    assert all(isinstance(x, pb.DraftStepResponse) for x in ok), [getattr(x, "details", lambda: x)() for x in ok]
    assert all(x.timings.launches == 2 for x in ok)


def test_a_step_stream_names_the_instance_that_get_status_names(sidecar, engine):
    """Each rank's server picks its own instance token at start-up and sends it as the stream's initial metadata
    before any step: the shim's check that its stream reached the server whose status it read (client/connection.py
    StepStream) holds only if both say the same."""
    from dspark_sidecar.client.connection import SidecarConnection
    from dspark_sidecar.proto import INSTANCE_METADATA

    tokens = [engine.stubs[r].GetStatus(pb.GetStatusRequest(), timeout=5).instance for r in range(TP)]
    assert all(tokens) and len(set(tokens)) == TP, tokens
    call = engine.stubs[1].DraftSteps(iter(()), timeout=30)  # no request: the metadata comes all the same
    assert dict(call.initial_metadata())[INSTANCE_METADATA] == tokens[1]
    assert list(call) == []
    # The shim's own link: the stream is confirmed before any step is sent, its requests still open (the call
    # above half-closed at once, so metadata sent only as the stream ended passed it; the shim's stream, never
    # confirmed, was given up at open()'s deadline and no step was ever sent).
    conn = SidecarConnection(sidecar.socket(1))
    try:
        assert conn.open(10.0).instance == tokens[1]
        stream = conn.stream()
        assert stream.alive, stream.end
    finally:
        conn.close()
