"""Pre-launched doorbell steps at TP 2 on two GPUs: the ranks' agreements, against ordinary steps, bit for bit."""

from __future__ import annotations

import concurrent.futures
import dataclasses

import pytest
import torch

from dspark_sidecar.client.binding import bind_request
from dspark_sidecar.client.dataplane import DoorbellChannel, StepBuffers
from dspark_sidecar.drafter import scenario
from dspark_sidecar.drafter.kv_cache import StepMetadata, kv_layer_shape
from dspark_sidecar.proto import codec
from dspark_sidecar.proto import sidecar_pb2 as pb
from helpers.engine_sim import PAGE
from helpers.sidecar_proc import SidecarProcess

pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu]
if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs", allow_module_level=True)

WORLD = 2


class EngineRank:
    """One engine rank: its GPU, its KV shard bound to its sidecar rank, its registered buffers and doorbell."""

    def __init__(self, rank: int, target: str, cfg, pages: int) -> None:
        import grpc

        from dspark_sidecar.proto import sidecar_pb2_grpc as pb_grpc

        self.rank, self.dev = rank, torch.device("cuda", rank)
        torch.cuda.set_device(self.dev)
        self.stub = pb_grpc.DrafterSidecarStub(grpc.insecure_channel(target))
        gen = torch.Generator(self.dev).manual_seed(100 + rank)
        self.kv = [torch.randn(kv_layer_shape(cfg, WORLD, pages, PAGE), generator=gen, device=self.dev)
                   for _ in range(cfg.num_hidden_layers)]
        facts = pb.EngineFacts(engine_rank=rank, tp_size=WORLD, dp_size=1, pp_size=1, speculative_method="dspark",
                               num_speculative_tokens=7, device=str(self.dev))
        self.b = self.stub.BindKV(bind_request(self.kv, facts), timeout=60)
        self.bufs = StepBuffers(self.stub, cfg.hidden_size, 4, 300, torch.float32, self.dev)
        self.bell = DoorbellChannel(self.stub, self.dev)

    def grpc_step(self, step_id: int, s) -> torch.Tensor:
        req = pb.DraftStepRequest(step_id=step_id, binding_id=self.b.binding_id, binding_generation=self.b.generation,
                                  num_requests=s.meta.num_reqs)
        for f, t in (("positions", s.positions), ("inputs_embeds", s.inputs_embeds), ("seq_lens", s.meta.seq_lens),
                     ("block_tables", s.meta.block_tables), ("slot_mapping", s.meta.slot_mapping)):
            getattr(req, f).CopyFrom(codec.to_tensor_ref(t))
        return codec.from_tensor_ref(self.stub.DraftStep(req, timeout=60).hidden_states, "h")

    def ring(self, step_id: int, s, meta: StepMetadata | None = None, sync: bool = True):
        req = pb.DraftStepRequest(step_id=step_id, binding_id=self.b.binding_id, binding_generation=self.b.generation,
                                  num_requests=s.meta.num_reqs)
        view = self.bufs.fill(req, s.inputs_embeds.to(self.dev), s.positions, meta or s.meta)
        self.bell.send(req)
        resp = self.bell.wait(step_id, 60.0)
        assert resp is not None, f"rank {self.rank}: step {step_id} not answered"
        out = view.clone() if resp.HasField("hidden_states") else None
        if sync:
            torch.cuda.synchronize(self.dev)
        return resp, out

    def close(self) -> None:
        self.bell.close()
        self.bufs.close()


def test_tp2_prelaunched_steps_equal_ordinary_ones_and_never_write_with_a_peer_s_no_op(
        tmp_path, tiny_cfg, tiny_ckpt, tiny_embed):
    """Two engine ranks in lockstep (a thread each) against a TP-2 sidecar: a layout repeated (queued
    from its third step on both ranks), a change of layout, a gRPC step in between, rank 1's copy of
    a step invalid while one is queued (both ranks refuse it; the page its bad slot names stays
    untouched), the ranks ringing different steps while one is queued (every rank's queued copy is a
    no-op: the one whose word matched writes nothing either), and steps rung back to back."""
    cases = {"A": [5, 40], "B": [4096 + 20, 3, 90]}
    own = {k: sum(scenario.pages_needed(c + 7, PAGE) for c in v) for k, v in cases.items()}
    spare = own["A"] + own["B"]  # a page no valid step writes
    steps = {}
    for i, (k, lens) in enumerate(cases.items()):
        st = scenario.random_step(tiny_cfg, lens, PAGE, own[k], tiny_embed, seed=80 + i)
        base = 0 if k == "A" else own["A"]
        steps[k] = dataclasses.replace(st, meta=StepMetadata(
            st.meta.seq_lens, st.meta.block_tables + base, st.meta.slot_mapping + base * PAGE))
    pool = concurrent.futures.ThreadPoolExecutor(WORLD)

    def both(fn, *args):
        """fn(engine, *args) on every rank at once (each in its own thread, its GPU current there)."""
        def one(e):
            torch.cuda.set_device(e.dev)
            return fn(e, *args)
        return [f.result(timeout=120) for f in [pool.submit(one, e) for e in engines]]

    with SidecarProcess(tmp_path, tp=WORLD, checkpoint=tiny_ckpt, extra_args=["--device", "cuda"]) as sc:
        engines = list(pool.map(lambda r: EngineRank(r, sc.socket(r), tiny_cfg, spare + 1), range(WORLD)))
        assert all(e.bell.word_address for e in engines), "the sidecar did not offer pre-launched steps"
        sid = iter(range(1, 1000))
        want = {}
        for k in cases:
            i = next(sid)
            got = both(EngineRank.grpc_step, i, steps[k])
            assert torch.equal(got[0], got[1])  # the exchange gives every rank the same sums
            want[k] = got[0]
        outs, flags = [], []

        def ring_all(k, meta=None, sync=True):
            i = next(sid)
            res = both(lambda e: e.ring(i, steps[k], meta[e.rank] if meta else None, sync))
            for resp, out in res:
                if out is not None:
                    outs.append((k, out))
            return [resp for resp, _ in res]

        for k in "AAAAABBB":
            flags.append([r.timings.prelaunched for r in ring_all(k)])
        assert flags == [[f, f] for f in (False, False, True, True, True, False, False, True)], flags
        both(EngineRank.grpc_step, next(sid), steps["A"])  # the workers run it: both queued B steps released
        for k in "BB":
            assert not any(r.timings.prelaunched for r in ring_all(k))  # the release reset the streak
        # Rank 1's copy of the third B in a row names the spare page (B is queued on both ranks).
        spare_before = [[t[:, spare].clone() for t in e.kv] for e in engines]
        good = steps["B"].meta
        bad = StepMetadata(good.seq_lens, good.block_tables, good.slot_mapping.clone())
        bad.slot_mapping[-1] = spare * PAGE + 3
        resps = ring_all("B", meta=[good, bad])
        assert all(r.HasField("error") for r in resps), resps
        assert resps[1].error.field == "slot_mapping" and "rank(s) 1" in resps[0].error.message, resps
        for e, before in zip(engines, spare_before):
            assert all(torch.equal(t[:, spare], b) for t, b in zip(e.kv, before)), f"rank {e.rank} wrote the spare page"
        hits = 0
        for _ in range(8):  # back to back, no host sync: each engine's stream orders everything
            hits += min(r.timings.prelaunched for r in ring_all("A", sync=False))
        both(lambda e: torch.cuda.synchronize(e.dev))
        assert hits >= 5, hits
        # A is queued on both ranks. Rank 0 rings A, rank 1 rings B: rank 0's word matches its queued
        # copy, rank 1's does not, so after the flags' exchange both copies are no-ops. Rank 0's A
        # rows must keep the K/V the earlier A steps wrote (a copy summed with rank 1's no-op would not).
        a_slots = steps["A"].meta.slot_mapping.to(engines[0].dev)
        a_before = [t.reshape(2, -1, *t.shape[3:])[:, a_slots].clone() for t in engines[0].kv]
        i = next(sid)
        split = both(lambda e: e.ring(i, steps["A" if e.rank == 0 else "B"]))
        assert all(resp.HasField("error") for resp, _ in split), split
        a_after = [t.reshape(2, -1, *t.shape[3:])[:, a_slots] for t in engines[0].kv]
        assert all(torch.equal(x, y) for x, y in zip(a_after, a_before)), "rank 0's no-op copy wrote K/V"
        for k in "AA":  # still in step with each other, and right
            ring_all(k)
        for k, out in outs:
            torch.testing.assert_close(out.cpu(), want[k], rtol=0, atol=0, msg=f"case {k}")
        assert torch.equal(both(EngineRank.grpc_step, next(sid), steps["B"])[0], want["B"])
        for e in engines:
            counters = e.stub.GetStatus(pb.GetStatusRequest(), timeout=10).counters
            assert counters.steps_prelaunched >= sum(f[e.rank] for f in flags) + hits, (e.rank, counters)
        both(EngineRank.close)
    pool.shutdown()


def test_tp2_launch_groups_side_by_side_on_exchange_lanes(tmp_path, tiny_cfg, tiny_ckpt, tiny_embed):
    """`serve --tp 2 --launch-streams 2`: the ranks make one more communicator at start-up
    (app.exchange_lanes) and run a 17-request step's launch groups (8 + 8 + 1) on two streams,
    each stream's all-reduces on its own communicator, captured on the first step and replayed on
    the second. Both ranks return the same sums, matching the in-process TP-1 reference."""
    from helpers.local_tp import shard_model

    lens = [3 + 11 * i for i in range(17)]
    pages = sum(scenario.pages_needed(c + 7, PAGE) for c in lens) + 2
    pool = concurrent.futures.ThreadPoolExecutor(WORLD)
    model = shard_model(0, 1, str(tiny_ckpt[0]), torch.float32, distributed=False)
    args = ["--device", "cuda", "--launch-streams", "2"]
    with SidecarProcess(tmp_path, tp=WORLD, checkpoint=tiny_ckpt, extra_args=args) as sc:
        engines = list(pool.map(lambda r: EngineRank(r, sc.socket(r), tiny_cfg, pages), range(WORLD)))
        for step_id in (1, 2):
            step = scenario.random_step(tiny_cfg, lens, PAGE, pages, tiny_embed, seed=40 + step_id)
            # TP 1 sees every KV head: rank r's cache holds heads [r * h / 2, (r + 1) * h / 2).
            before = [torch.cat([e.kv[i].cpu() for e in engines], dim=3) for i in range(tiny_cfg.num_hidden_layers)]
            got = [f.result(timeout=300) for f in [pool.submit(e.grpc_step, step_id, step) for e in engines]]
            assert torch.equal(got[0], got[1]), f"step {step_id}: the ranks' sums differ"
            ref = model.draft_step(step.inputs_embeds, step.positions, step.meta, before)
            err = (got[0] - ref).norm() / ref.norm()
            assert err < 1e-3, f"step {step_id}: relative error {err:.2e}"
        both_logs = (tmp_path / "sidecar.log").read_text()
        assert both_logs.count("captured the draft-step graph for R=17") >= WORLD, sc.log_tail()
        for e in engines:
            e.close()
    pool.shutdown()
