"""A sidecar rank frees what its steps, bindings and buffers held by reference counting, not through a
cyclic collection: on a GPU such a collection may run on any thread, and torch's unmap of a CUDA IPC
tensor it frees synchronizes that thread's current stream, possibly behind a pre-launched wait (session
37's note). Nor does it keep anything per step: no more tensors or project objects are alive after
more rounds of steps. Run against a real CPU sidecar with helpers.cycle_probe; the GPU paths (pre-launched steps,
graphs) under the same probe: test_dataplane_gpu_stress.py."""

from __future__ import annotations

import time

import grpc
import pytest
import torch

from dspark_sidecar.client.dataplane import DoorbellChannel, StepBuffers
from dspark_sidecar.drafter import scenario
from dspark_sidecar.proto import codec
from dspark_sidecar.proto import sidecar_pb2 as pb
from helpers import cycle_probe
from helpers.engine_sim import PAGE, EngineSim
from helpers.sidecar_proc import SidecarProcess

LENS = ([5, 40], [300, 3, 90], [17])


@pytest.mark.parametrize("tp", [1, 2])
def test_steps_rebinds_refusals_and_released_buffers_leave_nothing_to_the_collector_nor_behind(
        tmp_path, monkeypatch, tiny_cfg, tiny_ckpt, tiny_embed, tp):
    out = cycle_probe.install(tmp_path, monkeypatch)
    pages = max(sum(scenario.pages_needed(c + 7, PAGE) for c in lens) for lens in LENS) + 2
    steps = [scenario.random_step(tiny_cfg, lens, PAGE, pages, tiny_embed, seed=60 + i) for i, lens in enumerate(LENS)]
    cpu = torch.device("cpu")
    with SidecarProcess(tmp_path / "sc", tp=tp, checkpoint=tiny_ckpt) as sc:
        eng = EngineSim(tiny_cfg, [sc.socket(r) for r in range(tp)], pages, torch.float32)
        eng.bind()
        cycle_probe.collect(sc, out, 1)  # start-up's garbage set aside: what follows is the steps'
        step_id = 0

        def ring_all(bufs, bells, step, **override):
            nonlocal step_id
            step_id += 1
            for r in range(tp):
                bid, gen = eng.bindings[r]
                req = pb.DraftStepRequest(step_id=step_id, binding_id=bid, binding_generation=gen,
                                          num_requests=step.meta.num_reqs)
                for k, v in override.items():
                    setattr(req, k, v)
                bufs[r].fill(req, step.inputs_embeds, step.positions, step.meta)
                bells[r].send(req)
            return [bells[r].wait(step_id, 30.0) for r in range(tp)]

        bufs = [StepBuffers(eng.stubs[r], tiny_cfg.hidden_size, 8, 64, torch.float32, cpu) for r in range(tp)]
        bells = [DoorbellChannel(eng.stubs[r], cpu) for r in range(tp)]
        reports = []
        for round_ in range(5):
            for step in steps:
                assert all(x is not None and x.HasField("hidden_states") for x in ring_all(bufs, bells, step))
                step_id += 1
                grpc_answers = eng.step_all(step_id, step)
                assert all(isinstance(x, pb.DraftStepResponse) and x.HasField("hidden_states") for x in grpc_answers)
                # The doorbell's answer is the output region's rows: the same bits as the inline answer
                n = step.inputs_embeds.shape[0]
                inline = [codec.from_tensor_ref(x.hidden_states, "hidden") for x in grpc_answers]
                assert all(torch.equal(bufs[r].hidden[:n], inline[r]) for r in range(tp))
            # refused on the doorbell (a stale binding) and over gRPC (a bad tensor)
            stale = ring_all(bufs, bells, steps[0], binding_generation=99)
            assert all(x is not None and x.error.reason == "STALE_BINDING" for x in stale), stale
            step_id += 1
            bad = codec.to_tensor_ref(torch.zeros(3, dtype=torch.int32))
            refused = eng.step_all(step_id, steps[1], positions=bad)
            assert all(isinstance(x, grpc.RpcError) and x.code() == grpc.StatusCode.INVALID_ARGUMENT
                       for x in refused), refused
            eng.bind()  # a re-bind: the old binding's views let go
            # a doorbell replaced by a new attach before the old one closes; the buffers released, new ones registered
            new_bells = [DoorbellChannel(eng.stubs[r], cpu) for r in range(tp)]
            for b in bells + bufs:
                b.close()
            bells = new_bells
            bufs = [StepBuffers(eng.stubs[r], tiny_cfg.hidden_size, 8, 64, torch.float32, cpu) for r in range(tp)]
            if round_ in (0, 4):
                time.sleep(0.5)  # the last RPCs' server side ends (their state is not the rank's)
                reports.append(cycle_probe.collect(sc, out, 2 + len(reports)))
        assert all(x is not None and x.HasField("hidden_states") for x in ring_all(bufs, bells, steps[2]))
        for b in bells + bufs:
            b.close()
        eng.close()
    for rep in reports:
        cycle_probe.assert_none_held(rep)
    # Nor does a rank keep anything per step: after 4 more rounds of 10 steps, re-binds, attaches and
    # registrations, no more tensors or project objects are alive than after the first.
    assert cycle_probe.growth(*reports) == [{}] * tp, cycle_probe.growth(*reports)
