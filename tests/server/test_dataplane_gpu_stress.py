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

import dataclasses
import random

import pytest
import torch

from dspark_sidecar.client.dataplane import DoorbellChannel, StepBuffers
from dspark_sidecar.drafter import scenario
from dspark_sidecar.drafter.kv_cache import StepMetadata, kv_layer_shape
from dspark_sidecar.proto import codec
from dspark_sidecar.proto import sidecar_pb2 as pb
from helpers.engine_sim import PAGE
from helpers.sidecar_proc import SidecarProcess

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA/ROCm GPU", allow_module_level=True)

# name -> (context lens, owner of its pages, seed of its embeddings). A2 is A's metadata with other
# embeddings and C2 is C's layout (shapes) with other positions and pages: same launch key, new contents.
CASES = {"A": ([5, 40], "A", 1), "A2": ([5, 40], "A", 2), "B": ([4096 + 20, 3, 90], "B", 3),
         "C": ([17], "C", 4), "C2": ([20], "C2", 5)}
# The engine GPU's lag behind its host at a ring (ms) and how often. 7 ms is past serve's --prelaunch-behind-ms
# default (5): a cooldown, which 8 on-time steps in a row end; rarer than that, or pre-launch would stay off.
LAGS_MS, LAG_WEIGHTS = (0.0, 0.3, 1.0, 3.0, 7.0), (70, 12, 10, 6, 2)
STEPS = 360


def _bind(stub, kv: list[torch.Tensor], dev: torch.device) -> pb.BindKVResponse:
    from dspark_sidecar.client.binding import bind_request

    facts = pb.EngineFacts(engine_rank=0, tp_size=1, dp_size=1, pp_size=1, speculative_method="dspark",
                           num_speculative_tokens=7, device=str(dev))
    return stub.BindKV(bind_request(kv, facts), timeout=30)


def _cases(cfg, embed) -> tuple[dict, int]:
    """Each case's StepInputs on pages of its own (A2 shares A's), and the first page no case owns."""
    owners = {own for _, own, _ in CASES.values()}
    need = {own: max(sum(scenario.pages_needed(c + 7, PAGE) for c in lens)
                     for lens, o, _ in CASES.values() if o == own) for own in owners}
    base, at = {}, 0
    for own in sorted(owners):
        base[own], at = at, at + need[own]
    steps = {}
    for name, (lens, own, seed) in CASES.items():
        if own != name:  # A2: A's step (its metadata), other embeddings
            g = torch.Generator().manual_seed(seed)
            steps[name] = dataclasses.replace(steps[own], inputs_embeds=torch.randn(steps[own].inputs_embeds.shape,
                                                                                     generator=g))
            continue
        st = scenario.random_step(cfg, lens, PAGE, need[own], embed, seed=seed)
        m = st.meta
        steps[name] = dataclasses.replace(st, meta=StepMetadata(m.seq_lens, m.block_tables + base[own],
                                                                m.slot_mapping + base[own] * PAGE))
    return steps, at


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
        return codec.from_tensor_ref(self.stub.DraftStep(req, timeout=60).hidden_states, "h")

    def ring(self, embeds: torch.Tensor, step, meta: StepMetadata, lag_cycles: int):
        """One doorbell step; (answer, a copy of the hidden rows ordered after the sidecar's writes, or None)."""
        if lag_cycles:
            torch.cuda._sleep(lag_cycles)  # the engine's GPU behind its host: the inputs and the word land late
        req = self.request(step.meta.num_reqs)
        view = self.bufs.fill(req, embeds, step.positions, meta)
        self.bell.send(req)
        resp = self.bell.wait(req.step_id, 60.0)
        assert resp is not None, f"step {req.step_id} unanswered in 60 s"
        return resp, (view.clone() if resp.HasField("hidden_states") else None)


def _cycles_per_ms(dev: torch.device) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)  # warm
    start.record()
    torch.cuda._sleep(2_000_000)
    end.record()
    torch.cuda.synchronize(dev)
    return 2_000_000 / start.elapsed_time(end)


@pytest.mark.parametrize("seed", [0, 1])
def test_gpu_random_step_walks_answer_like_grpc(tmp_path, tiny_cfg, tiny_ckpt, tiny_embed, seed):
    import grpc

    from dspark_sidecar.proto import sidecar_pb2_grpc as pb_grpc

    dev = torch.device("cuda", 0)
    steps, spare = _cases(tiny_cfg, tiny_embed)
    assert steps["C"].meta.block_tables.shape == steps["C2"].meta.block_tables.shape  # one layout, two contents
    rng = random.Random(seed)
    cycles_ms = _cycles_per_ms(dev)
    with SidecarProcess(tmp_path, tp=1, checkpoint=tiny_ckpt, extra_args=["--device", "cuda"]) as sc:
        stub = pb_grpc.DrafterSidecarStub(grpc.insecure_channel(sc.socket(0)))
        eng = Engine(stub, tiny_cfg, dev, spare + 1)
        want = {k: eng.grpc(s) for k, s in steps.items()}
        assert not torch.equal(want["A"], want["A2"]) and not torch.equal(want["C"], want["C2"])
        embeds = {k: s.inputs_embeds.to(dev) for k, s in steps.items()}
        spare_then = [t[:, spare].clone() for t in eng.kv]
        got, log, refused = [], [], 0
        case = "A"
        for _ in range(STEPS):
            if rng.random() < 0.25:  # else the engine repeats its layout, which queues the next step
                case = rng.choice(list(CASES))
            op = rng.choices(("ring", "grpc", "bad", "rebind", "new_cache", "reattach"),
                             (80, 6, 5, 3, 3, 3))[0]
            lag = rng.choices(LAGS_MS, LAG_WEIGHTS)[0]
            log.append((op, case, lag))
            if op == "grpc":
                got.append((case, eng.grpc(steps[case]), "grpc"))
            elif op in ("rebind", "new_cache"):
                eng.rebind(op == "new_cache")  # a new cache is a copy: the spare page's bytes stay those of spare_then
            elif op == "reattach":
                eng.attach()
            else:
                meta = steps[case].meta
                if op == "bad":  # a slot in the spare page: refused on both sides, the page untouched
                    meta = StepMetadata(meta.seq_lens, meta.block_tables, meta.slot_mapping.clone())
                    meta.slot_mapping[-1] = spare * PAGE + 3
                resp, out = eng.ring(embeds[case], steps[case], meta, int(lag * cycles_ms))
                if op == "bad":
                    assert resp.HasField("error") and resp.error.field == "slot_mapping", (log[-5:], resp)
                    refused += 1
                else:
                    assert resp.HasField("hidden_states"), (log[-5:], resp)
                    got.append((case, out, "prelaunched" if resp.timings.prelaunched else "ordinary"))
            if rng.random() < 0.5:
                torch.cuda.synchronize(dev)
        torch.cuda.synchronize(dev)
        final = eng.grpc(steps["B"])  # still serving; any queued step released
        torch.cuda.synchronize(dev)
        counters = stub.GetStatus(pb.GetStatusRequest(), timeout=10).counters
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
