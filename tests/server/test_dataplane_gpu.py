"""The data plane on a GPU: CUDA IPC KV binding and regions, interprocess events, doorbell == gRPC."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from dspark_sidecar.client.binding import bind_request
from dspark_sidecar.client.dataplane import DoorbellChannel, StepBuffers
from dspark_sidecar.drafter import scenario
from dspark_sidecar.drafter.kv_cache import StepMetadata, kv_layer_shape
from dspark_sidecar.proto import codec
from dspark_sidecar.proto import sidecar_pb2 as pb
from helpers.engine_sim import PAGE
from helpers.local_tp import shard_model
from helpers.sidecar_proc import SidecarProcess

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA/ROCm GPU", allow_module_level=True)

LENS = [5, 300, 4096 + 9]
PAGES = sum(scenario.pages_needed(c + 7, PAGE) for c in LENS) + 4


def _bind(stub, kv: list[torch.Tensor], dev: torch.device) -> pb.BindKVResponse:
    """Bind the engine's per-layer cache `kv` (CUDA IPC) to sidecar rank 0 of a TP-1 sidecar."""
    facts = pb.EngineFacts(engine_rank=0, tp_size=1, dp_size=1, pp_size=1, speculative_method="dspark",
                           num_speculative_tokens=7, device=str(dev))
    return stub.BindKV(bind_request(kv, facts), timeout=30)


def _inline_request(step_id: int, b: pb.BindKVResponse, step: scenario.StepInputs) -> pb.DraftStepRequest:
    """The step as a gRPC DraftStepRequest with every tensor inline, against binding `b`."""
    req = pb.DraftStepRequest(step_id=step_id, binding_id=b.binding_id, binding_generation=b.generation,
                              num_requests=step.meta.seq_lens.numel())
    for f, t in (("positions", step.positions), ("inputs_embeds", step.inputs_embeds), ("seq_lens", step.meta.seq_lens),
                 ("block_tables", step.meta.block_tables), ("slot_mapping", step.meta.slot_mapping)):
        getattr(req, f).CopyFrom(codec.to_tensor_ref(t))
    return req


def test_gpu_doorbell_equals_grpc_and_reference(tmp_path, tiny_cfg, tiny_ckpt, tiny_embed):
    import grpc

    from dspark_sidecar.proto import sidecar_pb2_grpc as pb_grpc

    dev = torch.device("cuda", 0)
    with SidecarProcess(tmp_path, tp=1, checkpoint=tiny_ckpt, extra_args=["--device", "cuda"]) as sc:
        stub = pb_grpc.DrafterSidecarStub(grpc.insecure_channel(sc.socket(0)))
        status = stub.GetStatus(pb.GetStatusRequest(), timeout=10)
        kv = [torch.randn(kv_layer_shape(tiny_cfg, 1, PAGES, PAGE), device=dev) for _ in range(tiny_cfg.num_hidden_layers)]
        b = _bind(stub, kv, dev)
        step = scenario.random_step(tiny_cfg, LENS, PAGE, PAGES, tiny_embed, seed=5)
        before = [t.clone() for t in kv]
        req = _inline_request(1, b, step)
        via_grpc = codec.from_tensor_ref(stub.DraftStep(req, timeout=60).hidden_states, "h").to(dev)
        bufs = StepBuffers(stub, tiny_cfg.hidden_size, 4, 300, torch.float32, dev)
        bell = DoorbellChannel(stub, dev)
        req2 = pb.DraftStepRequest(step_id=2, binding_id=b.binding_id, binding_generation=b.generation,
                                   num_requests=len(LENS))
        view = bufs.fill(req2, step.inputs_embeds.to(dev), step.positions, step.meta)
        bell.send(req2)
        resp = bell.wait(2, 60.0)
        assert resp is not None and resp.HasField("hidden_states"), resp
        via_bell = view.clone()  # the engine stream waited on the sidecar's event: no host sync needed
        torch.testing.assert_close(via_bell, via_grpc, rtol=0, atol=0)
        # Against the in-process reference on the CPU, from the same cache contents (fp32 on both;
        # the GPU backend's accumulation order differs from torch's CPU matmuls: 1e-4 relative).
        model = shard_model(0, 1, str(tiny_ckpt[0]), torch.float32, distributed=False)
        ref = model.draft_step(step.inputs_embeds, step.positions, step.meta, [t.cpu() for t in before])
        err = (via_bell.cpu() - ref).norm() / ref.norm()
        assert err < 1e-3, f"{status.backend}: relative error {err:.2e}"
        bell.close()
        bufs.close()


def test_gpu_doorbell_back_to_back_steps_without_host_sync(tmp_path, tiny_cfg, tiny_ckpt, tiny_embed):
    """Steps of alternating shapes rung back to back, the engine's host never synchronizing: the
    sidecar's double-buffered pinned staging and the interprocess events must keep every step's
    metadata and outputs apart (each result equals the same step over gRPC)."""
    import grpc

    from dspark_sidecar.proto import sidecar_pb2_grpc as pb_grpc

    dev = torch.device("cuda", 0)
    cases = [[5, 40], [4096 + 20, 3, 90], [17], [5, 40], [250, 4096 + 20, 3, 90], [17], [4096 + 20, 3, 90]]
    # Each case owns its own pages: a step writes its block rows, which another case must not
    # read as context, or results would depend on the order the steps ran in.
    own = [sum(scenario.pages_needed(c + 7, PAGE) for c in lens) for lens in cases]
    base = [sum(own[:i]) for i in range(len(cases))]
    pages = sum(own)
    with SidecarProcess(tmp_path, tp=1, checkpoint=tiny_ckpt, extra_args=["--device", "cuda"]) as sc:
        stub = pb_grpc.DrafterSidecarStub(grpc.insecure_channel(sc.socket(0)))
        kv = [torch.randn(kv_layer_shape(tiny_cfg, 1, pages, PAGE), device=dev) for _ in range(tiny_cfg.num_hidden_layers)]
        b = _bind(stub, kv, dev)
        steps = []
        for i, lens in enumerate(cases):
            st = scenario.random_step(tiny_cfg, lens, PAGE, own[i], tiny_embed, seed=60 + i)
            m = st.meta
            steps.append(dataclasses.replace(st, meta=StepMetadata(
                m.seq_lens, m.block_tables + base[i], m.slot_mapping + base[i] * PAGE)))
        want = []
        for i, step in enumerate(steps):  # the steps only write their own block rows: order-independent
            req = pb.DraftStepRequest(step_id=1 + i, binding_id=b.binding_id, binding_generation=b.generation,
                                      num_requests=step.meta.num_reqs)
            for f, t in (("positions", step.positions), ("inputs_embeds", step.inputs_embeds),
                         ("seq_lens", step.meta.seq_lens), ("block_tables", step.meta.block_tables),
                         ("slot_mapping", step.meta.slot_mapping)):
                getattr(req, f).CopyFrom(codec.to_tensor_ref(t))
            want.append(codec.from_tensor_ref(stub.DraftStep(req, timeout=60).hidden_states, "h"))
        bufs = StepBuffers(stub, tiny_cfg.hidden_size, 4, 300, torch.float32, dev)
        bell = DoorbellChannel(stub, dev)
        embeds = [s.inputs_embeds.to(dev) for s in steps]
        torch.cuda.synchronize(dev)
        got = []
        for rep in range(3):  # the first pass captures graphs; later passes only replay
            for i, step in enumerate(steps):
                sid = 100 + rep * len(steps) + i
                req = pb.DraftStepRequest(step_id=sid, binding_id=b.binding_id, binding_generation=b.generation,
                                          num_requests=step.meta.num_reqs)
                view = bufs.fill(req, embeds[i], step.positions, step.meta)
                bell.send(req)
                resp = bell.wait(sid, 60.0)
                assert resp is not None and resp.HasField("hidden_states"), resp
                got.append((i, view.clone()))  # ordered after the sidecar's event on this stream
        torch.cuda.synchronize(dev)
        for i, out in got:
            torch.testing.assert_close(out.cpu(), want[i], rtol=0, atol=0, msg=f"case {i} {cases[i]}")
        bell.close()
        bufs.close()


def test_gpu_sidecar_with_mxfp8_weights_matches_the_reference(tmp_path, tiny_cfg, tiny_ckpt, tiny_embed):
    """--weights mxfp8 on the GPU: the Triton GEMMs dequantize in registers, inside the CUDA graphs."""
    import grpc

    from dspark_sidecar.proto import sidecar_pb2_grpc as pb_grpc

    dev = torch.device("cuda", 0)
    with SidecarProcess(tmp_path, tp=1, dtype="bf16", checkpoint=tiny_ckpt,
                        extra_args=["--device", "cuda", "--weights", "mxfp8"]) as sc:
        stub = pb_grpc.DrafterSidecarStub(grpc.insecure_channel(sc.socket(0)))
        assert stub.GetStatus(pb.GetStatusRequest(), timeout=10).model.weight_format == "mxfp8"
        kv = [torch.randn(kv_layer_shape(tiny_cfg, 1, PAGES, PAGE), device=dev).to(torch.bfloat16)
              for _ in range(tiny_cfg.num_hidden_layers)]
        b = _bind(stub, kv, dev)
        step = scenario.random_step(tiny_cfg, LENS, PAGE, PAGES, tiny_embed, seed=7)
        before = [t.float().cpu() for t in kv]
        req = pb.DraftStepRequest(step_id=1, binding_id=b.binding_id, binding_generation=b.generation,
                                  num_requests=len(LENS))
        for f, t in (("positions", step.positions), ("inputs_embeds", step.inputs_embeds.to(torch.bfloat16)),
                     ("seq_lens", step.meta.seq_lens), ("block_tables", step.meta.block_tables),
                     ("slot_mapping", step.meta.slot_mapping)):
            getattr(req, f).CopyFrom(codec.to_tensor_ref(t))
        got = codec.from_tensor_ref(stub.DraftStep(req, timeout=60).hidden_states, "h").float()
    model = shard_model(0, 1, str(tiny_ckpt[0]), torch.float32, distributed=False)
    ref = model.draft_step(step.inputs_embeds.to(torch.bfloat16).float(), step.positions, step.meta, before)
    err = (got - ref).norm() / ref.norm()
    # bf16 activations rounded at every op boundary through 5 layers: ~1e-2 relative is expected.
    assert err < 3e-2, f"relative error {err:.2e}"


def test_gpu_prelaunched_steps_equal_ordinary_ones(tmp_path, tiny_cfg, tiny_ckpt, tiny_embed):
    """Pre-launched doorbell steps (server/prelaunch.py) against the same steps over gRPC, bit for bit:
    a layout repeated (queued from its third step), a change of layout (the queued step released),
    a gRPC step in between (the worker releases it), an invalid step while one is queued (the GPU
    program makes it a no-op: the page its bad slot names stays untouched), and steps rung back to
    back with no host sync."""
    import grpc

    from dspark_sidecar.proto import sidecar_pb2_grpc as pb_grpc

    dev = torch.device("cuda", 0)
    cases = {"A": [5, 40], "B": [4096 + 20, 3, 90]}
    own = {k: sum(scenario.pages_needed(c + 7, PAGE) for c in v) for k, v in cases.items()}
    spare = own["A"] + own["B"]  # a page no valid step writes
    pages = spare + 1
    with SidecarProcess(tmp_path, tp=1, checkpoint=tiny_ckpt, extra_args=["--device", "cuda"]) as sc:
        stub = pb_grpc.DrafterSidecarStub(grpc.insecure_channel(sc.socket(0)))
        kv = [torch.randn(kv_layer_shape(tiny_cfg, 1, pages, PAGE), device=dev) for _ in range(tiny_cfg.num_hidden_layers)]
        b = _bind(stub, kv, dev)
        steps, want = {}, {}
        for i, (k, lens) in enumerate(cases.items()):
            st = scenario.random_step(tiny_cfg, lens, PAGE, own[k], tiny_embed, seed=80 + i)
            base = 0 if k == "A" else own["A"]
            steps[k] = dataclasses.replace(st, meta=StepMetadata(
                st.meta.seq_lens, st.meta.block_tables + base, st.meta.slot_mapping + base * PAGE))
        sid = iter(range(1, 1000))

        def grpc_step(k: str) -> torch.Tensor:
            s = steps[k]
            req = pb.DraftStepRequest(step_id=next(sid), binding_id=b.binding_id, binding_generation=b.generation,
                                      num_requests=s.meta.num_reqs)
            for f, t in (("positions", s.positions), ("inputs_embeds", s.inputs_embeds), ("seq_lens", s.meta.seq_lens),
                         ("block_tables", s.meta.block_tables), ("slot_mapping", s.meta.slot_mapping)):
                getattr(req, f).CopyFrom(codec.to_tensor_ref(t))
            return codec.from_tensor_ref(stub.DraftStep(req, timeout=60).hidden_states, "h")

        for k in cases:
            want[k] = grpc_step(k)
        bufs = StepBuffers(stub, tiny_cfg.hidden_size, 4, 300, torch.float32, dev)
        bell = DoorbellChannel(stub, dev)
        assert bell.word_address, "the sidecar did not offer pre-launched steps on this GPU"
        embeds = {k: s.inputs_embeds.to(dev) for k, s in steps.items()}

        def ring(k: str, meta: StepMetadata | None = None, sync: bool = True):
            s = steps[k]
            i = next(sid)
            req = pb.DraftStepRequest(step_id=i, binding_id=b.binding_id, binding_generation=b.generation,
                                      num_requests=s.meta.num_reqs)
            view = bufs.fill(req, embeds[k], s.positions, meta or s.meta)
            bell.send(req)
            resp = bell.wait(i, 60.0)
            assert resp is not None
            out = view.clone() if resp.HasField("hidden_states") else None
            if sync:
                torch.cuda.synchronize(dev)
            return resp, out

        flags, outs = [], []
        for k in "AAAAABBB":
            resp, out = ring(k)
            flags.append(resp.timings.prelaunched)
            outs.append((k, out))
        assert flags == [False, False, True, True, True, False, False, True], flags
        grpc_step("A")  # the worker runs it: the queued B step is released first
        for k in "BB":
            resp, out = ring(k)
            assert not resp.timings.prelaunched  # the release reset the streak
            outs.append((k, out))
        spare_before = [t[:, spare].clone() for t in kv]
        bad = steps["B"].meta
        bad = StepMetadata(bad.seq_lens, bad.block_tables, bad.slot_mapping.clone())
        bad.slot_mapping[-1] = spare * PAGE + 3
        resp, _ = ring("B", bad)  # queued (B's third step in a row), refused by both sides
        assert resp.HasField("error") and resp.error.field == "slot_mapping", resp
        for t, before in zip(kv, spare_before):
            assert torch.equal(t[:, spare], before), "the refused step wrote the cache"
        hits = 0
        for _ in range(8):  # back to back, no host sync: the engine's stream orders everything
            resp, out = ring("A", sync=False)
            hits += resp.timings.prelaunched
            outs.append(("A", out))
        torch.cuda.synchronize(dev)
        assert hits >= 5, hits
        for k, out in outs:
            torch.testing.assert_close(out.cpu(), want[k], rtol=0, atol=0, msg=f"case {k}")
        assert grpc_step("B") is not None  # still serving (and the last queued A step released)
        counters = stub.GetStatus(pb.GetStatusRequest(), timeout=10).counters
        assert counters.steps_prelaunched == sum(flags) + hits
        # Released unused: A at the switch to B, B by the gRPC step, B by the refused step, A by the last gRPC step.
        assert counters.prelaunch_misses == 4, counters
        bell.close()
        bufs.close()


def test_gpu_launch_groups_side_by_side_in_the_sidecar(tmp_path, tiny_cfg, tiny_ckpt, tiny_embed):
    """17 requests (launch groups 8 + 8 + 1) through the sidecar's step graph with --launch-streams 2:
    captured on the first step, replayed on the second, each matching the in-process reference."""
    import grpc

    from dspark_sidecar.proto import sidecar_pb2_grpc as pb_grpc

    dev = torch.device("cuda", 0)
    lens = [3 + 11 * i for i in range(17)]
    pages = sum(scenario.pages_needed(c + 7, PAGE) for c in lens) + 2
    args = ["--device", "cuda", "--launch-streams", "2"]
    with SidecarProcess(tmp_path, tp=1, checkpoint=tiny_ckpt, extra_args=args) as sc:
        stub = pb_grpc.DrafterSidecarStub(grpc.insecure_channel(sc.socket(0)))
        kv = [torch.randn(kv_layer_shape(tiny_cfg, 1, pages, PAGE), device=dev) for _ in range(tiny_cfg.num_hidden_layers)]
        b = _bind(stub, kv, dev)
        bufs = StepBuffers(stub, tiny_cfg.hidden_size, 17, 16, torch.float32, dev)
        bell = DoorbellChannel(stub, dev)
        model = shard_model(0, 1, str(tiny_ckpt[0]), torch.float32, distributed=False)
        for step_id in (1, 2):
            step = scenario.random_step(tiny_cfg, lens, PAGE, pages, tiny_embed, seed=20 + step_id)
            before = [t.cpu() for t in kv]
            req = pb.DraftStepRequest(step_id=step_id, binding_id=b.binding_id, binding_generation=b.generation,
                                      num_requests=len(lens))
            view = bufs.fill(req, step.inputs_embeds.to(dev), step.positions, step.meta)
            bell.send(req)
            resp = bell.wait(step_id, 60.0)
            assert resp is not None and resp.HasField("hidden_states"), resp
            ref = model.draft_step(step.inputs_embeds, step.positions, step.meta, before)
            err = (view.cpu() - ref).norm() / ref.norm()
            assert err < 1e-3, f"step {step_id}: relative error {err:.2e}"
            for got, want in zip(kv, before, strict=True):  # the block K/V written by every group
                assert ((got.cpu() - want).norm() / want.norm()) < 1e-3
        bell.close()
        bufs.close()
        assert "captured the draft-step graph for R=17" in (tmp_path / "sidecar.log").read_text()


def test_gpu_released_buffers_free_the_engine_memory_and_steps_go_on(tmp_path, tiny_cfg, tiny_ckpt, tiny_embed):
    """A data plane dropped and set up again while the sidecar lives (a reconnect): StepBuffers.close
    releases its regions (UnregisterBuffers). The sidecar drops the pre-launched step and the graphs
    that read the old input rows in place, and unmaps them, so the engine's CUDA IPC buffers are
    freed for real (before, the sidecar held them until it exited); the new buffers' steps are
    pre-launched again and give the same bits."""
    import grpc

    from dspark_sidecar.proto import sidecar_pb2_grpc as pb_grpc

    dev = torch.device("cuda", 0)
    lens = [5, 40]
    pages = sum(scenario.pages_needed(c + 7, PAGE) for c in lens)
    big = 8192  # requests the buffers are sized for: 2 x 7 x 8192 x 256 x 4 bytes = 117 MB of GPU memory
    region_bytes = 2 * 7 * big * tiny_cfg.hidden_size * 4
    with SidecarProcess(tmp_path, tp=1, checkpoint=tiny_ckpt, extra_args=["--device", "cuda"]) as sc:
        stub = pb_grpc.DrafterSidecarStub(grpc.insecure_channel(sc.socket(0)))
        kv = [torch.randn(kv_layer_shape(tiny_cfg, 1, pages, PAGE), device=dev) for _ in range(tiny_cfg.num_hidden_layers)]
        b = _bind(stub, kv, dev)
        step = scenario.random_step(tiny_cfg, lens, PAGE, pages, tiny_embed, seed=41)
        req = _inline_request(1, b, step)
        want = codec.from_tensor_ref(stub.DraftStep(req, timeout=60).hidden_states, "h")
        embeds = step.inputs_embeds.to(dev)
        bell = DoorbellChannel(stub, dev)
        assert bell.word_address, "the sidecar did not offer pre-launched steps on this GPU"
        sid = iter(range(2, 1000))

        def steps(bufs: StepBuffers) -> list[bool]:
            flags = []
            for _ in range(5):
                i = next(sid)
                r = pb.DraftStepRequest(step_id=i, binding_id=b.binding_id, binding_generation=b.generation,
                                        num_requests=len(lens))
                view = bufs.fill(r, embeds, step.positions, step.meta)
                bell.send(r)
                resp = bell.wait(i, 60.0)
                assert resp is not None and resp.HasField("hidden_states"), resp
                torch.cuda.synchronize(dev)
                torch.testing.assert_close(view.cpu(), want, rtol=0, atol=0)
                flags.append(resp.timings.prelaunched)
            return flags

        first = StepBuffers(stub, tiny_cfg.hidden_size, big, 300, torch.float32, dev)
        assert steps(first) == [False, False, True, True, True]
        before = _allocated(dev)
        first.close()
        freed = before - _allocated(dev)
        assert freed >= region_bytes, f"{freed / 2**20:.1f} MiB freed of {region_bytes / 2**20:.1f}"
        again = StepBuffers(stub, tiny_cfg.hidden_size, 4, 300, torch.float32, dev)
        assert steps(again) == [False, False, True, True, True]
        assert stub.GetStatus(pb.GetStatusRequest(), timeout=10).serving
        bell.close()
        again.close()


def _allocated(dev: torch.device) -> int:
    """This process's allocated GPU bytes. A block shared over IPC and freed here stays allocated
    (torch's IPC limbo) until the sidecar has let go of it too; ipc_collect then frees it.
    (Device-wide free memory also moves with the caching allocator's segments: run 207.)"""
    torch.cuda.synchronize(dev)
    torch.cuda.ipc_collect()
    return torch.cuda.memory_allocated(dev)


class _Forwarding:
    """A stub that forwards the buffer calls to the sidecar's; subclasses change RegisterBuffers."""

    def __init__(self, stub) -> None:
        self.stub = stub

    def RegisterBuffers(self, req, timeout=None):  # noqa: N802  (the gRPC method's name)
        return self.stub.RegisterBuffers(req, timeout=timeout)

    def UnregisterBuffers(self, req, timeout=None):  # noqa: N802
        return self.stub.UnregisterBuffers(req, timeout=timeout)


def _held_after_failed_buffers(tmp_path, cfg, ckpt, wrapper: type[_Forwarding]):
    """(engine GPU bytes still held, bytes the buffers took, the RpcError) after StepBuffers of 8192
    requests failed through `wrapper`, on a real CUDA sidecar that then still serves."""
    import grpc

    from dspark_sidecar.proto import sidecar_pb2_grpc as pb_grpc

    dev = torch.device("cuda", 0)
    big = 8192
    region_bytes = 2 * 7 * big * cfg.hidden_size * 4
    with SidecarProcess(tmp_path, tp=1, checkpoint=ckpt, extra_args=["--device", "cuda"]) as sc:
        stub = pb_grpc.DrafterSidecarStub(grpc.insecure_channel(sc.socket(0)))
        before = _allocated(dev)
        with pytest.raises(grpc.RpcError) as err:
            StepBuffers(wrapper(stub), cfg.hidden_size, big, 300, torch.float32, dev)
        held = _allocated(dev) - before
        assert stub.GetStatus(pb.GetStatusRequest(), timeout=10).serving
    return held, region_bytes, err.value


def test_gpu_a_registration_whose_answer_is_lost_frees_the_engine_memory(tmp_path, tiny_cfg, tiny_ckpt):
    """Under CUDA IPC a registration the sidecar completed after the engine's call gave up would keep
    the engine's buffers allocated until the sidecar exits. StepBuffers releases it by its owner token,
    and the memory is freed once the sidecar lets go of its mappings."""
    import grpc

    class _Deadline(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.DEADLINE_EXCEEDED

    class _AnswerLost(_Forwarding):
        def RegisterBuffers(self, req, timeout=None):  # noqa: N802
            self.stub.RegisterBuffers(req, timeout=timeout)
            raise _Deadline()

    held, region_bytes, _ = _held_after_failed_buffers(tmp_path, tiny_cfg, tiny_ckpt, _AnswerLost)
    assert held < region_bytes // 2, f"{held / 2**20:.1f} MiB still held of {region_bytes / 2**20:.1f}"


def test_gpu_a_refused_registration_frees_the_engine_memory(tmp_path, tiny_cfg, tiny_ckpt):
    """A registration refused at its first region (size_bytes beyond the mapping) leaves the other two
    handles unopened. Each CUDA IPC export counts one consumer, so the sidecar gives their counters
    back (memory.discard_handle); else the engine's blocks stay allocated until the engine exits."""
    import grpc

    class _Oversized(_Forwarding):
        def RegisterBuffers(self, req, timeout=None):  # noqa: N802
            bad = pb.RegisterBuffersRequest()
            bad.CopyFrom(req)
            bad.regions[0].size_bytes += 1 << 40
            return self.stub.RegisterBuffers(bad, timeout=timeout)

    held, region_bytes, err = _held_after_failed_buffers(tmp_path, tiny_cfg, tiny_ckpt, _Oversized)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert held < region_bytes // 4, f"{held / 2**20:.1f} MiB still held of {region_bytes / 2**20:.1f}"


def test_gpu_overlapping_cuda_ipc_layers_and_regions_are_refused(tmp_path, tiny_cfg, tiny_ckpt, tiny_embed):
    """The overlap checks over CUDA IPC handles (the CPU tests cover shared memory). MappedMemory.place
    compares device addresses, which holds only if torch maps one IPC allocation once per process, so
    that every handle to it (one per layer, exported separately) gives the same addresses: layers cut
    from one allocation at the same or half-overlapping offsets must be refused, side by side they bind
    and serve, and a region over the bound cache is refused while one beside it registers."""
    import math

    import grpc

    from dspark_sidecar.proto import memory
    from dspark_sidecar.proto import sidecar_pb2_grpc as pb_grpc

    dev = torch.device("cuda", 0)
    shape = kv_layer_shape(tiny_cfg, 1, PAGES, PAGE)
    n, layers = math.prod(shape), tiny_cfg.num_hidden_layers
    pool = torch.randn(layers * n + n, device=dev)  # one allocation: every layer below is a slice of it

    def side_by_side() -> list[torch.Tensor]:
        return [pool[i * n:(i + 1) * n].view(shape) for i in range(layers)]

    def refused(call, req, field: str) -> str:
        with pytest.raises(grpc.RpcError) as err:
            call(req, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.value.code(), err.value.details())
        details = err.value.details()
        assert details.startswith(f"{field}: ") and "overlap" in details and "GPU's address space" in details, details
        return details

    facts = pb.EngineFacts(engine_rank=0, tp_size=1, dp_size=1, pp_size=1, speculative_method="dspark",
                           num_speculative_tokens=7, device=str(dev), device_uuid=memory.gpu_uuid(dev))
    with SidecarProcess(tmp_path, tp=1, checkpoint=tiny_ckpt, extra_args=["--device", "cuda"]) as sc:
        stub = pb_grpc.DrafterSidecarStub(grpc.insecure_channel(sc.socket(0)))
        # The engine's facts naming another GPU: refused before any layer is opened (kv_binding).
        elsewhere = pb.BindKVRequest()
        elsewhere.CopyFrom(bind_request(side_by_side(), facts))
        elsewhere.engine.device_uuid = "GPU-00000000-0000-0000-0000-000000000000"
        with pytest.raises(grpc.RpcError) as err:
            stub.BindKV(elsewhere, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("engine.device_uuid: "), err.value.details()
        same = [pool[:n].view(shape)] * layers
        assert "layers[0]" in refused(stub.BindKV, bind_request(same, facts), "layers[1].memory")
        half = side_by_side()
        half[2] = pool[n + n // 2: 2 * n + n // 2].view(shape)  # over the second half of layer 1
        assert "layers[1]" in refused(stub.BindKV, bind_request(half, facts), "layers[2].memory")
        b = _bind(stub, side_by_side(), dev)
        step = scenario.random_step(tiny_cfg, LENS, PAGE, PAGES, tiny_embed, seed=5)
        req = _inline_request(1, b, step)
        assert stub.DraftStep(req, timeout=60).HasField("hidden_states")
        # A region is a whole storage from its first byte: the pool's own lies on layer 0; a separate
        # tensor (its own storage, perhaps in the same allocator block) registers.
        on_cache = pb.BufferRegion(name="hidden_states", memory=memory.export_handle(pool), size_bytes=4096)
        details = refused(stub.RegisterBuffers, pb.RegisterBuffersRequest(regions=[on_cache]), "regions[0].memory")
        assert "layers[0]" in details, details
        other = torch.zeros(4096, dtype=torch.uint8, device=dev)
        beside = pb.BufferRegion(name="hidden_states", memory=memory.export_handle(other), size_bytes=4096)
        ids = stub.RegisterBuffers(pb.RegisterBuffersRequest(regions=[beside]), timeout=30).region_ids
        assert len(ids) == 1
        assert stub.GetStatus(pb.GetStatusRequest(), timeout=10).kv.binding_id == b.binding_id  # the binding stood


def test_gpu_a_grpc_answer_naming_a_region_means_the_region_is_written(tmp_path, tiny_cfg, tiny_ckpt, tiny_embed):
    """Over unary gRPC and the DraftSteps stream there is no output event (only the doorbell has one):
    an answer that names the output region must leave only after the device wrote it
    (RankLoop._device_done). The engine reads the rows on a stream ordered after nothing, at once,
    over a NaN fill: each must equal the same step answered inline."""
    import grpc

    from dspark_sidecar.proto import sidecar_pb2_grpc as pb_grpc

    dev = torch.device("cuda", 0)
    # Long contexts on every request: the step's GPU time is as long as the tiny model allows, so a
    # premature answer would be read before the attention's writes land.
    lens = [4096 + 9 + 13 * i for i in range(8)]
    pages = sum(scenario.pages_needed(c + 7, PAGE) for c in lens) + 2
    with SidecarProcess(tmp_path, tp=1, checkpoint=tiny_ckpt, extra_args=["--device", "cuda"]) as sc:
        stub = pb_grpc.DrafterSidecarStub(grpc.insecure_channel(sc.socket(0)))
        kv = [torch.randn(kv_layer_shape(tiny_cfg, 1, pages, PAGE), device=dev) for _ in range(tiny_cfg.num_hidden_layers)]
        b = _bind(stub, kv, dev)
        step = scenario.random_step(tiny_cfg, lens, PAGE, pages, tiny_embed, seed=77)
        # The step writes only its own block rows and reads the context: repeating it gives the same rows.
        want = codec.from_tensor_ref(stub.DraftStep(_inline_request(1, b, step), timeout=60).hidden_states, "h")
        bufs = StepBuffers(stub, tiny_cfg.hidden_size, len(lens), 300, torch.float32, dev)
        embeds = step.inputs_embeds.to(dev)
        reader = torch.cuda.Stream(dev)  # waits on no event of the sidecar's
        for i, how in enumerate(["unary"] * 6 + ["stream"] * 6):
            bufs.hidden.fill_(float("nan"))
            req = pb.DraftStepRequest(step_id=10 + i, binding_id=b.binding_id, binding_generation=b.generation,
                                      num_requests=len(lens))
            view = bufs.fill(req, embeds, step.positions, step.meta)
            torch.cuda.synchronize(dev)  # the NaNs and the inputs are in place before the sidecar starts
            if how == "unary":
                resp = stub.DraftStep(req, timeout=60)
            else:
                resp = next(stub.DraftSteps(iter([req]), timeout=60))
            assert resp.hidden_states.HasField("region"), resp
            with torch.cuda.stream(reader):
                got = view.to("cpu")
            assert not got.isnan().any(), f"{how} step {i}: the answer came before the rows were written"
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{how} step {i}")
        bufs.close()


def test_gpu_metadata_rewritten_while_steps_run_never_reaches_the_kernels(tmp_path, tiny_cfg, tiny_ckpt, tiny_embed):
    """The engine's metadata region is shared memory it may write at any time. A thread flips one request's
    slots between their values and far past the cache while the same step is sent again and again: each
    step must be refused naming slot_mapping (OUT_OF_RANGE), or run the values it checked (the clean answer, bit for
    bit). A GPU rank that checked the region and then read it again for its graph's inputs wrote K/V
    far out of bounds on a flip between the two: an illegal address, and the rank exited."""
    import threading

    import grpc

    from dspark_sidecar.proto import sidecar_pb2_grpc as pb_grpc

    dev = torch.device("cuda", 0)
    with SidecarProcess(tmp_path, tp=1, checkpoint=tiny_ckpt, extra_args=["--device", "cuda"]) as sc:
        stub = pb_grpc.DrafterSidecarStub(grpc.insecure_channel(sc.socket(0)))
        kv = [torch.randn(kv_layer_shape(tiny_cfg, 1, PAGES, PAGE), device=dev) for _ in range(tiny_cfg.num_hidden_layers)]
        b = _bind(stub, kv, dev)
        step = scenario.random_step(tiny_cfg, LENS, PAGE, PAGES, tiny_embed, seed=13)
        bufs = StepBuffers(stub, tiny_cfg.hidden_size, len(LENS), 300, torch.float32, dev)
        req = pb.DraftStepRequest(binding_id=b.binding_id, binding_generation=b.generation, num_requests=len(LENS))
        view = bufs.fill(req, step.inputs_embeds.to(dev), step.positions, step.meta)
        torch.cuda.synchronize(dev)
        req.step_id = 1
        assert stub.DraftStep(req, timeout=60).hidden_states.HasField("region")
        want = view.cpu()
        ref = req.slot_mapping.region
        n = 7 * len(LENS)
        slots = bufs.meta_bytes[ref.offset_bytes : ref.offset_bytes + 8 * n].view(torch.int64).numpy()
        good, bad = slots[7:14].copy(), np.full(7, 1 << 40, np.int64)  # request 1's rows
        stop, flips = threading.Event(), [0]

        def flip() -> None:
            while not stop.is_set():
                slots[7:14] = bad
                slots[7:14] = good
                flips[0] += 1

        flipper = threading.Thread(target=flip, daemon=True)
        flipper.start()
        ran = refused = 0
        try:
            for i in range(300):
                req.step_id = 10 + i
                try:
                    resp = stub.DraftStep(req, timeout=60)
                except grpc.RpcError as err:
                    # OUT_OF_RANGE: all seven rows read far out; INVALID_ARGUMENT: a mix of the two writes.
                    assert err.code() in (grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.INVALID_ARGUMENT), err
                    assert "slot_mapping" in err.details(), err
                    refused += 1
                    continue
                assert resp.hidden_states.HasField("region"), resp
                torch.testing.assert_close(view.cpu(), want, rtol=0, atol=0, msg=f"step {10 + i}")
                ran += 1
        finally:
            stop.set()
            flipper.join()
        assert sc.proc.poll() is None, "the sidecar exited"
        assert ran and refused and flips[0] > 300, (ran, refused, flips)  # the flips met the checks both ways
        slots[7:14] = good
        req.step_id = 1000
        assert stub.DraftStep(req, timeout=60).hidden_states.HasField("region")  # it serves on
        torch.testing.assert_close(view.cpu(), want, rtol=0, atol=0)
        bufs.close()
