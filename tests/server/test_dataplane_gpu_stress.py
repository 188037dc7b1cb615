"""Seeded random step sequences over the GPU data plane: every answer equals the same step over gRPC, bit for bit.

The scripted tests (test_dataplane_gpu.py) each walk one path through the pre-launched step machinery
(server/prelaunch.py). Here a seeded walk mixes them the way an engine might: layouts repeated (queued
from their third step) and switched, one layout's steps with different contents (the queued graph must
read the step the engine wrote, not the one it was queued after), gRPC steps and re-binds while a step
is queued, refused steps, a doorbell replaced by a new one, and an engine GPU that lags its host by up
to past the cooldown threshold (the word lands after the ring), answered with and without a host sync.
The oracle is the sidecar itself: each case's hidden states over gRPC with inline tensors, taken once
before the walk (every case writes only its own block rows, so its answer does not depend on order).
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch

from dspark_sidecar.client.dataplane import DoorbellChannel, StepBuffers
from dspark_sidecar.drafter.kv_cache import StepMetadata, kv_layer_shape
from dspark_sidecar.proto import codec
from dspark_sidecar.proto import sidecar_pb2 as pb
from helpers import cycle_probe, walk_cases
from helpers.engine_sim import PAGE
from helpers.sidecar_proc import SidecarProcess

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA/ROCm GPU", allow_module_level=True)

# The engine GPU's lag behind its host at a ring (ms) and how often. 7 ms is past serve's --prelaunch-behind-ms
# default (5): a cooldown, which 8 on-time steps in a row end; rarer than that, or pre-launch would stay off.
LAGS_MS, LAG_WEIGHTS = (0.0, 0.3, 1.0, 3.0, 7.0), (70, 12, 10, 6, 2)
STEPS = 360
STEP_WAIT_S = 30.0  # a step of this tiny drafter takes milliseconds (a graph capture ~0.1 s): past this it hangs


def _bind(stub, kv: list[torch.Tensor], dev: torch.device) -> pb.BindKVResponse:
    from dspark_sidecar.client.binding import bind_request

    facts = pb.EngineFacts(engine_rank=0, tp_size=1, dp_size=1, pp_size=1, speculative_method="dspark",
                           num_speculative_tokens=7, device=str(dev))
    return stub.BindKV(bind_request(kv, facts), timeout=30)


class Engine:
    """The engine's side of one walk: its KV caches (one per binding), step buffers and doorbell."""

    def __init__(self, stub, cfg, dev: torch.device, pages: int) -> None:
        self.stub, self.cfg, self.dev = stub, cfg, dev
        self.kv = [torch.randn(kv_layer_shape(cfg, 1, pages, PAGE), device=dev) for _ in range(cfg.num_hidden_layers)]
        self.retired: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []  # (a replaced cache, its bytes then)
        self.binding = _bind(stub, self.kv, dev)
        self.bufs = self.bell = None
        self.attach()
        self.sid = 0

    def attach(self) -> None:
        """New step buffers and a new doorbell, attached before the old ones close: the sidecar closes
        the old page itself (its CLOSED word), as for a second engine attaching to the rank."""
        old = (self.bell, self.bufs)
        self.bufs = StepBuffers(self.stub, self.cfg.hidden_size, 4, 300, torch.float32, self.dev)
        self.bell = DoorbellChannel(self.stub, self.dev)
        assert self.bell.word_address, "the sidecar did not offer pre-launched steps on this GPU"
        if old[0] is not None:
            old[0].close()
            old[1].close()

    def rebind(self, new_cache: bool) -> None:
        torch.cuda.synchronize(self.dev)  # every answered step's writes are in (its event is on this stream)
        if new_cache:
            old, self.kv = self.kv, [t.clone() for t in self.kv]
            self.retired.append((old, [t.clone() for t in old]))
        self.binding = _bind(self.stub, self.kv, self.dev)

    def request(self, r: int) -> pb.DraftStepRequest:
        self.sid += 1
        return pb.DraftStepRequest(step_id=self.sid, binding_id=self.binding.binding_id,
                                   binding_generation=self.binding.generation, num_requests=r)

    def grpc(self, step) -> torch.Tensor:
        req = self.request(step.meta.num_reqs)
        for f, t in (("positions", step.positions), ("inputs_embeds", step.inputs_embeds),
                     ("seq_lens", step.meta.seq_lens), ("block_tables", step.meta.block_tables),
                     ("slot_mapping", step.meta.slot_mapping)):
            getattr(req, f).CopyFrom(codec.to_tensor_ref(t))
        return codec.from_tensor_ref(self.stub.DraftStep(req, timeout=STEP_WAIT_S).hidden_states, "h")

    def ring(self, embeds: torch.Tensor, step, meta: StepMetadata, lag_cycles: int):
        """One doorbell step; (answer, a copy of the hidden rows ordered after the sidecar's writes, or None)."""
        if lag_cycles:
            torch.cuda._sleep(lag_cycles)  # the engine's GPU behind its host: the inputs and the word land late
        req = self.request(step.meta.num_reqs)
        view = self.bufs.fill(req, embeds, step.positions, meta)
        self.bell.send(req)
        resp = self.bell.wait(req.step_id, STEP_WAIT_S)
        assert resp is not None, f"step {req.step_id} unanswered in {STEP_WAIT_S} s"
        return resp, (view.clone() if resp.HasField("hidden_states") else None)


def _cycles_per_ms(dev: torch.device) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)  # warm
    start.record()
    torch.cuda._sleep(2_000_000)
    end.record()
    torch.cuda.synchronize(dev)
    return 2_000_000 / start.elapsed_time(end)


def _walk_one(eng: Engine, op: str, step, embeds: torch.Tensor, case: str, lag_cycles: float, spare: int,
              got: list) -> int:
    """One op of the walk; answers go to `got` as (case, hidden rows, how). Returns 1 for a refused step."""
    if op == "grpc":
        got.append((case, eng.grpc(step), "grpc"))
    elif op in ("rebind", "new_cache"):
        eng.rebind(op == "new_cache")  # a new cache is a copy: the spare page's bytes stay those of spare_then
    elif op == "reattach":
        eng.attach()
    else:
        meta = step.meta
        if op == "bad":  # a slot in the spare page: refused on both sides, the page untouched
            meta = StepMetadata(meta.seq_lens, meta.block_tables, meta.slot_mapping.clone())
            meta.slot_mapping[-1] = spare * PAGE + 3
        resp, out = eng.ring(embeds, step, meta, int(lag_cycles))
        if op == "bad":
            assert resp.HasField("error") and resp.error.field == "slot_mapping", resp
            return 1
        assert resp.HasField("hidden_states"), resp
        got.append((case, out, "prelaunched" if resp.timings.prelaunched else "ordinary"))
    return 0


def _stacks(sc: SidecarProcess) -> str:
    """Every sidecar rank's thread stacks (SIGUSR1: faulthandler, server/app.py) and the log's tail."""
    pids = sc.rank_pids()
    for pid in pids:
        os.kill(pid, signal.SIGUSR1)
    time.sleep(2.0)
    alive = "" if pids else " (no rank process is left: it exited or aborted, see the log)"
    return f"SIGUSR1 sent to the rank pids {pids}{alive}; the sidecar's log:\n{sc.log_tail(250)}"


@pytest.mark.parametrize("seed, probe", [(0, False), (1, False), (2, False), pytest.param(3, True, id="3-cycle-probe")])
def test_gpu_random_step_walks_answer_like_grpc(tmp_path, monkeypatch, tiny_cfg, tiny_ckpt, tiny_embed, seed, probe):
    """probe: the walk also checks that the rank left no tensor to the cyclic collector (helpers.cycle_probe;
    its collections keep what they find, so a walk under it frees no cycle's IPC mapping)."""
    import grpc

    from dspark_sidecar.proto import sidecar_pb2_grpc as pb_grpc

    dev = torch.device("cuda", 0)
    steps, spare = walk_cases.cases(tiny_cfg, tiny_embed)
    assert steps["C"].meta.block_tables.shape == steps["C2"].meta.block_tables.shape  # one layout, two contents
    rng = random.Random(seed)
    cycles_ms = _cycles_per_ms(dev)
    reports_at = cycle_probe.install(tmp_path, monkeypatch) if probe else None
    with SidecarProcess(tmp_path, tp=1, checkpoint=tiny_ckpt, extra_args=["--device", "cuda"]) as sc:
        stub = pb_grpc.DrafterSidecarStub(grpc.insecure_channel(sc.socket(0)))
        eng = Engine(stub, tiny_cfg, dev, spare + 1)
        want = {k: eng.grpc(s) for k, s in steps.items()}
        if probe:  # start-up's garbage set aside: what follows is the walk's
            cycle_probe.collect(sc, reports_at, 1)
        assert not torch.equal(want["A"], want["A2"]) and not torch.equal(want["C"], want["C2"])
        embeds = {k: s.inputs_embeds.to(dev) for k, s in steps.items()}
        spare_then = [t[:, spare].clone() for t in eng.kv]
        got, log, refused = [], [], 0
        case = "A"
        for i in range(STEPS):
            if rng.random() < 0.25:  # else the engine repeats its layout, which queues the next step
                case = rng.choice(list(walk_cases.CASES))
            op = rng.choices(("ring", "grpc", "bad", "rebind", "new_cache", "reattach"),
                             (80, 6, 5, 3, 3, 3))[0]
            lag = rng.choices(LAGS_MS, LAG_WEIGHTS)[0]
            log.append((i, op, case, lag))
            try:
                refused += _walk_one(eng, op, steps[case], embeds[case], case, lag * cycles_ms, spare, got)
            except (AssertionError, grpc.RpcError) as e:
                raise AssertionError(f"op {i} of the walk failed; its last ops: {log[-8:]}\n{_stacks(sc)}") from e
            if rng.random() < 0.5:
                torch.cuda.synchronize(dev)
        torch.cuda.synchronize(dev)
        final = eng.grpc(steps["B"])  # still serving; any queued step released
        torch.cuda.synchronize(dev)
        counters = stub.GetStatus(pb.GetStatusRequest(), timeout=10).counters
        cycles = cycle_probe.collect(sc, reports_at, 2) if probe else None
        eng.bell.close()
        eng.bufs.close()
    kinds = {k: sum(1 for *_, how in got if how == k) for k in ("prelaunched", "ordinary", "grpc")}
    print(f"seed {seed}: {kinds}, {refused} refused, {counters.steps_prelaunched} pre-launched, "
          f"{counters.prelaunch_misses} released unused, {len(eng.retired)} caches replaced")
    for i, (case, out, how) in enumerate(got):
        assert torch.equal(out.cpu(), want[case]), f"answer {i} ({how}) of case {case} differs; walk: {log}"
    assert torch.equal(final, want["B"])
    assert kinds["prelaunched"] >= STEPS // 10, f"the walk hardly pre-launched: {kinds}"  # else it tested little
    assert counters.steps_prelaunched == kinds["prelaunched"]
    for t, before in zip(eng.kv, spare_then):
        assert torch.equal(t[:, spare], before), "a refused step wrote the spare page"
    for old, then in eng.retired:  # nothing reaches a cache once the engine has bound another
        for t, before in zip(old, then):
            assert torch.equal(t, before), "a step wrote a replaced KV cache"
    if probe:
        cycle_probe.assert_none_held(cycles)


def test_gpu_a_grpc_step_or_bind_right_after_a_layout_is_first_queued_is_answered(tmp_path, tiny_cfg, tiny_ckpt,
                                                                                  tiny_embed):
    """Run 265's deadlock, on purpose: the sidecar queues a layout's first pre-launched step right after
    answering the step before, and the engine's next call is not a ring but a gRPC step or a BindKV,
    which need the rank lock. The queueing used to load its kernels' code behind the wait on the GPU
    word (that is, until the engine's next ring) while holding the lock: neither call was ever answered."""
    import grpc

    from dspark_sidecar.proto import sidecar_pb2_grpc as pb_grpc

    dev = torch.device("cuda", 0)
    steps, spare = walk_cases.cases(tiny_cfg, tiny_embed)
    with SidecarProcess(tmp_path, tp=1, checkpoint=tiny_ckpt, extra_args=["--device", "cuda"]) as sc:
        stub = pb_grpc.DrafterSidecarStub(grpc.insecure_channel(sc.socket(0)))
        eng = Engine(stub, tiny_cfg, dev, spare + 1)
        want = {k: eng.grpc(steps[k]) for k in ("A", "B", "C")}
        embeds = {k: steps[k].inputs_embeds.to(dev) for k in want}
        try:
            for case, then in (("A", "grpc"), ("B", "bind"), ("C", "grpc")):  # each layout's first queue
                for _ in range(2):  # a streak of two: the next step is queued after the second answer
                    resp, out = eng.ring(embeds[case], steps[case], steps[case].meta, 0)
                    assert torch.equal(out.cpu(), want[case])
                if then == "grpc":
                    assert torch.equal(eng.grpc(steps[case]), want[case])
                else:
                    eng.rebind(new_cache=False)
                resp, out = eng.ring(embeds[case], steps[case], steps[case].meta, 0)  # and the doorbell still works
                assert torch.equal(out.cpu(), want[case])
        except (AssertionError, grpc.RpcError) as e:
            raise AssertionError(f"{_stacks(sc)}") from e
        eng.bell.close()
        eng.bufs.close()


def test_gpu_step_graphs_capture_while_another_client_registers_and_attaches(tmp_path, tiny_cfg, tiny_ckpt,
                                                                               tiny_embed):
    """RegisterBuffers (CUDA IPC opens) and AttachDoorbell (a Prelaunch's device buffers, events, page
    registration) run outside the rank lock, so a second client's can land during a step's graph
    capture. Every re-bind drops the step graphs, so each step after one captures again: the answers
    stay the reference's, the other client's calls all succeed, and the rank lives on. Whether a call
    lands inside a capture is left to timing (and torch's cached blocks often spare it a cudaMalloc):
    this shows the two side by side do no harm; it does not prove the global mode would have failed."""
    import threading

    import grpc

    from dspark_sidecar.proto import sidecar_pb2_grpc as pb_grpc

    dev = torch.device("cuda", 0)
    steps, spare = walk_cases.cases(tiny_cfg, tiny_embed)
    with SidecarProcess(tmp_path, tp=1, checkpoint=tiny_ckpt, extra_args=["--device", "cuda"]) as sc:
        stub = pb_grpc.DrafterSidecarStub(grpc.insecure_channel(sc.socket(0)))
        eng = Engine(stub, tiny_cfg, dev, spare + 1)
        want = {k: eng.grpc(steps[k]) for k in ("A", "B", "C")}
        stop, errors, attached = threading.Event(), [], [0]

        def other_client() -> None:
            other = pb_grpc.DrafterSidecarStub(grpc.insecure_channel(sc.socket(0)))
            try:
                while not stop.is_set():
                    bufs = StepBuffers(other, tiny_cfg.hidden_size, 4, 300, torch.float32, dev)
                    bell = DoorbellChannel(other, dev)
                    attached[0] += 1
                    bell.close()
                    bufs.close()
            except Exception as e:  # noqa: BLE001  (reported by the test below, with its type)
                errors.append(e)

        t = threading.Thread(target=other_client, daemon=True)
        t.start()
        try:
            for _ in range(12):
                eng.rebind(new_cache=True)  # the graphs go with the old cache: the next steps capture
                for k in want:
                    assert torch.equal(eng.grpc(steps[k]), want[k]), k
        except (AssertionError, grpc.RpcError) as e:
            raise AssertionError(f"{_stacks(sc)}") from e
        finally:
            stop.set()
            t.join(60)
        assert not errors, errors
        assert attached[0] >= 3, f"the other client attached only {attached[0]} times: the overlap was not tested"
        assert torch.equal(eng.grpc(steps["A"]), want["A"])
        eng.bell.close()
        eng.bufs.close()
