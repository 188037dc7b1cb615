"""Seeded random steps over a TP-2 CPU sidecar: every rank's answer equals the same step over gRPC.

The GPU walks (test_dataplane_gpu_stress.py) run one rank, since only one GPU is lent. What only
TP > 1 has is the ranks' agreement on each step (server/rendezvous.py) while the engine ranks act apart:
one rank rings while another calls over gRPC, ranks arrive up to SKEW_MS apart, one rank's step is
stale, malformed or never sent (its peers must answer ABORTED, not hang and not run the step alone),
and one rank's doorbell or buffers are replaced while its peer's are not. Re-binds renew every rank's
generation. The oracle is each case's answer over gRPC, taken before the walk (walk_cases: a case's
answer does not depend on what ran before it).
"""

from __future__ import annotations

import itertools
import random
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from dspark_sidecar.client.dataplane import DoorbellChannel, StepBuffers
from dspark_sidecar.drafter.kv_cache import StepMetadata
from dspark_sidecar.proto import codec
from dspark_sidecar.proto import sidecar_pb2 as pb
from helpers import cycle_probe, walk_cases
from helpers.engine_sim import PAGE, EngineSim
from helpers.sidecar_proc import SidecarProcess

TP = 2
STEPS = 160
SKEW_MS = 15.0  # well inside RDV_MS: skewed ranks still meet
# Not serve's 200 ms: on a 2-core box at a load average of 7 one rank's copy came later than that (an ABORTED "ok"
# step, both walks). Each "absent" op waits it out (about 6 a walk: ~5 s, no slower at a 2x load than with 200 ms).
RDV_MS = 1000
OPS, WEIGHTS = ("ring", "grpc", "mixed", "stale", "bad", "absent", "rebind", "reattach"), (50, 10, 12, 5, 5, 3, 4, 5)
WAIT_S = 30.0


class Plane:
    """One engine rank's data plane: step buffers and a doorbell, replaceable while its peer's stay."""

    def __init__(self, eng: EngineSim, rank: int) -> None:
        self.eng, self.rank = eng, rank
        self.bufs = self.bell = None
        self.attach()

    def attach(self) -> None:
        """New buffers and doorbell, attached before the old ones close (the sidecar closes the old page)."""
        old = (self.bell, self.bufs)
        cpu = torch.device("cpu")
        self.bufs = StepBuffers(self.eng.stubs[self.rank], self.eng.cfg.hidden_size, 4, 300, torch.float32, cpu)
        self.bell = DoorbellChannel(self.eng.stubs[self.rank], cpu)
        for x in old:
            if x is not None:
                x.close()

    def ring(self, step_id: int, step, meta: StepMetadata, **override) -> tuple[str, object]:
        bid, gen = self.eng.bindings[self.rank]
        fields = dict(step_id=step_id, binding_id=bid, binding_generation=gen, num_requests=step.meta.num_reqs)
        req = pb.DraftStepRequest(**(fields | override))
        view = self.bufs.fill(req, step.inputs_embeds, step.positions, meta)
        self.bell.send(req)
        resp = self.bell.wait(step_id, WAIT_S)
        assert resp is not None, f"rank {self.rank}: doorbell step {step_id} unanswered in {WAIT_S} s"
        return ("ok", view.clone()) if resp.HasField("hidden_states") else ("error", resp.error.reason)

    def grpc(self, step_id: int, step, **override) -> tuple[str, object]:
        try:
            resp = self.eng.stubs[self.rank].DraftStep(self.eng.request(self.rank, step_id, step, **override),
                                                      timeout=WAIT_S)
        except grpc.RpcError as err:
            assert err.code() != grpc.StatusCode.DEADLINE_EXCEEDED, f"rank {self.rank}: gRPC step {step_id} hung"
            return "error", err.code().name
        return "ok", codec.from_tensor_ref(resp.hidden_states, "h")

    def close(self) -> None:
        self.bell.close()
        self.bufs.close()


@pytest.mark.parametrize("seed, probe", [(0, False), pytest.param(1, True, id="1-cycle-probe")])
def test_tp2_random_step_walk_answers_like_grpc_and_ranks_never_run_a_step_apart(tmp_path, monkeypatch, tiny_cfg,
                                                                                 tiny_ckpt, tiny_embed, seed, probe):
    """probe: the ranks also leave no tensor or frame to the cyclic collector (helpers.cycle_probe)."""
    steps, spare = walk_cases.cases(tiny_cfg, tiny_embed)
    reports_at = cycle_probe.install(tmp_path, monkeypatch) if probe else None
    rng = random.Random(seed)
    with (SidecarProcess(tmp_path, tp=TP, checkpoint=tiny_ckpt, extra_args=["--rendezvous-ms", str(RDV_MS)]) as sc,
          ThreadPoolExecutor(TP) as pool):
        eng = EngineSim(tiny_cfg, [sc.socket(r) for r in range(TP)], spare + 1, torch.float32)
        eng.bind()
        sid = itertools.count(1)
        want = {k: [codec.from_tensor_ref(x.hidden_states, "h") for x in eng.step_all(next(sid), st)]
                for k, st in steps.items()}
        planes = [Plane(eng, r) for r in range(TP)]
        if probe:  # start-up's garbage set aside
            cycle_probe.collect(sc, reports_at, 1)
        log, seen = [], {op: 0 for op in OPS}
        case = "A"
        for i in range(STEPS):
            if rng.random() < 0.3:
                case = rng.choice(list(walk_cases.CASES))
            op = rng.choices(OPS, WEIGHTS)[0]
            odd = rng.randrange(TP)  # the rank an op of one rank picks
            how = [rng.choice(("ring", "grpc")) if op == "mixed" else "grpc" if op == "grpc" else "ring"
                   for _ in range(TP)]
            if op == "bad":
                how[odd] = rng.choice(("ring", "grpc"))
            skews = [rng.uniform(0, SKEW_MS) / 1e3 for _ in range(TP)]
            log.append((i, op, case, odd, how))
            seen[op] += 1
            if op == "rebind":
                eng.bind()
                continue
            if op == "reattach":
                planes[odd].attach()
                continue
            step_id, step = next(sid), steps[case]

            def one(r: int) -> tuple[str, object] | None:
                time.sleep(skews[r])
                if op == "absent" and r == odd:
                    return None  # this engine rank never sends the step
                if op == "stale" and r == odd:
                    override = {"binding_generation": eng.bindings[r][1] + 7}
                elif op == "bad" and r == odd and how[r] == "grpc":
                    override = {"positions": codec.to_tensor_ref(torch.zeros(3, dtype=torch.int64))}
                else:
                    override = {}
                if how[r] == "grpc":
                    return planes[r].grpc(step_id, step, **override)
                meta = step.meta
                if op == "bad" and r == odd:  # a slot in the page no case owns: refused, the page untouched
                    meta = StepMetadata(meta.seq_lens, meta.block_tables, meta.slot_mapping.clone())
                    meta.slot_mapping[-1] = spare * PAGE + 3
                return planes[r].ring(step_id, step, meta, **override)

            got = list(pool.map(one, range(TP)))
            where = f"op {i} {log[-1]} (step {step_id}); last ops {log[-6:-1]}"
            if op in ("stale", "bad", "absent"):
                mine = {"stale": ("STALE_BINDING", "FAILED_PRECONDITION"),
                        "bad": ("INVALID_ARGUMENT", "INVALID_FIELD")}.get(op)
                for r, res in enumerate(got):
                    if r == odd:
                        assert res is None or (res[0] == "error" and res[1] in mine), f"{where}: rank {r} {res}"
                    else:  # its peer's copy is refused or missing: never run alone
                        assert res == ("error", "ABORTED"), f"{where}: rank {r} answered {res[0]} {res[1]!s:.200}"
                continue
            for r, res in enumerate(got):
                assert res[0] == "ok", f"{where}: rank {r} refused: {res[1]}"
                assert torch.equal(res[1], want[case][r]), f"{where}: rank {r}'s answer differs from gRPC's"
        final = eng.step_all(next(sid), steps["B"])  # still serving
        assert all(torch.equal(codec.from_tensor_ref(x.hidden_states, "h"), w) for x, w in zip(final, want["B"]))
        cycles = cycle_probe.collect(sc, reports_at, 2) if probe else None
        spare_rows = [[t.tensor[:, spare].clone() for t in eng.kv[r]] for r in range(TP)]  # before the unmap
        for p in planes:
            p.close()
        eng.close()
    assert all(not torch.any(x) for rows in spare_rows for x in rows), "a refused step wrote the spare page"
    assert all(seen[op] for op in OPS), f"the walk left out ops: {seen}"
    if probe:
        cycle_probe.assert_none_held(cycles)
