"""`dspark-sidecar bench --tp N`: the sidecar at TP N across N GPUs, driven by N engine rank processes.

Each engine rank binds its KV shard on its own GPU to its sidecar rank and runs the same steps
over the data plane; the ranks start every step together (a gloo barrier, outside the timing).
Reported beside it, measured on the same machine: rank 0's shard on one GPU with no exchange
(mode d of `bench` with --shard-of N), and the time of the step's 10 all-reduces of [7R, hidden]
over NCCL between the engine processes' GPUs, i.e. the partial-sum exchange's share. The
all-reduces run as the sidecar runs them: inside one CUDA graph, timed by CUDA events (eager
launches timed from the host cost about 4x more: BENCHMARKS.md run 43).
"""

from __future__ import annotations

import datetime
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dspark_sidecar import layout
from dspark_sidecar.bench import BenchConfig, SidecarUnderTest
from dspark_sidecar.drafter import scenario
from dspark_sidecar.drafter.checkpoint import EMBED_KEY, SyntheticSource
from dspark_sidecar.drafter.config import load_config
from dspark_sidecar.drafter.kv_cache import kv_layer_shape


def _engine_rank(rank: int, world: int, bc: BenchConfig, target_dir: str, store: str, out: str) -> None:
    import grpc

    from dspark_sidecar.client.dataplane import DoorbellChannel, StepBuffers
    from dspark_sidecar.proto import codec, memory
    from dspark_sidecar.proto import sidecar_pb2 as pb
    from dspark_sidecar.proto import sidecar_pb2_grpc as pb_grpc

    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    nccl = dist.new_group(backend="nccl")
    cfg = load_config(bc.preset)
    dtype = torch.bfloat16
    page = bc.page_size
    pages = max(bc.reqs) * scenario.pages_needed(max(bc.contexts) + layout.QPR, page)
    shape = kv_layer_shape(cfg, world, pages, page)
    kv = [torch.randn(shape, device=dev).to(dtype) for _ in range(cfg.num_hidden_layers)]
    embed = SyntheticSource(cfg, dtype, dev, bc.seed).read(EMBED_KEY, (cfg.vocab_size, cfg.hidden_size))
    stub = pb_grpc.DrafterSidecarStub(grpc.insecure_channel(f"unix:{target_dir}/rank{rank}.sock"))
    facts = pb.EngineFacts(engine_rank=rank, tp_size=world, dp_size=1, pp_size=1, speculative_method="dspark",
                           num_speculative_tokens=7, device=str(dev))
    b = stub.BindKV(pb.BindKVRequest(engine=facts, page_size=page, layers=[
        pb.KVLayerBinding(layer=i, memory=memory.export_handle(t), dtype=codec.dtype_to_proto(dtype),
                          shape=list(t.shape), strides=list(t.stride())) for i, t in enumerate(kv)]), timeout=60)
    max_pages = scenario.pages_needed(max(bc.contexts) + layout.QPR, page)
    bufs = StepBuffers(stub, cfg.hidden_size, max(bc.reqs), max_pages, dtype, dev)
    bell = DoorbellChannel(stub, dev)
    results = []
    step_id = 0
    for ctx in bc.contexts:
        for R in bc.reqs:
            case = scenario.random_step(cfg, [ctx] * R, page, pages, embed, seed=R * 7 + ctx)  # same on every rank
            embeds = case.inputs_embeds.to(dev)
            times, errors = [], 0
            for i in range(bc.repeats + 3):
                step_id += 1
                req = pb.DraftStepRequest(step_id=step_id, binding_id=b.binding_id, binding_generation=b.generation,
                                          num_requests=R)
                bufs.fill(req, embeds, case.positions, case.meta)
                dist.barrier()
                t = time.perf_counter()
                bell.send(req)
                resp = bell.wait(step_id, 60.0)
                torch.cuda.synchronize(dev)
                if i >= 3:
                    times.append((time.perf_counter() - t) * 1e3)
                errors += resp is None or resp.HasField("error")
            ar = _time_exchange(torch.zeros(layout.QPR * R, cfg.hidden_size, device=dev, dtype=dtype), nccl,
                                2 * cfg.num_hidden_layers, bc.repeats)
            results.append({"R": R, "context": ctx, "p50_ms": statistics.median(times), "errors": errors,
                            "allreduce10_p50_ms": statistics.median(ar)})
    torch.save(results, Path(out) / f"rank{rank}.pt")
    bell.close()
    bufs.close()
    dist.destroy_process_group()


def _time_exchange(x: torch.Tensor, group, count: int, repeats: int) -> list[float]:
    """ms of `count` all-reduces of x in a row (the step's o_proj and down_proj exchanges), in one CUDA
    graph as the sidecar's step graphs hold them; the ranks start each replay together (gloo barrier)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the communicator's first use, outside the capture
        for _ in range(3):
            dist.all_reduce(x, group=group)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(count):
            dist.all_reduce(x, group=group)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def run_tp_bench(bc: BenchConfig, tp: int, single_gpu: bool = True) -> dict:
    """Per-step time of the TP-N sidecar from N engine ranks, against one GPU's shard and the exchange."""
    if torch.cuda.device_count() < tp:
        raise SystemExit(f"--tp {tp} needs {tp} GPUs, {torch.cuda.device_count()} visible")
    from dspark_sidecar.bench import run_bench

    single = run_bench(BenchConfig(**{**bc.__dict__, "modes": ("d",), "shard_of": tp,
                                      "out_dir": bc.out_dir / "single-gpu"}), torch.device("cuda", 0)) \
        if single_gpu else {"rows": []}
    work = Path(tempfile.mkdtemp(prefix="dspark-tp-bench-"))
    side = SidecarUnderTest(bc, torch.device("cuda"), work, tp=tp)
    try:
        mp.start_processes(_engine_rank, args=(tp, bc, str(side.sock), str(work / "store"), str(work)), nprocs=tp,
                           start_method="spawn")
        per_rank = [torch.load(work / f"rank{r}.pt") for r in range(tp)]
        return _report(bc, tp, per_rank, single)
    finally:
        side.close()


def _report(bc: BenchConfig, tp: int, per_rank: list, single: dict) -> dict:
    """Rows are printed and written as soon as the engine ranks finish (before the sidecar stops)."""
    rows = []
    for i, r0 in enumerate(per_rank[0]):
        step = max(p[i]["p50_ms"] for p in per_rank)
        one = next((x for x in single["rows"] if x["R"] == r0["R"] and x["context"] == r0["context"]), {})
        ar = max(p[i]["allreduce10_p50_ms"] for p in per_rank)
        row = {"R": r0["R"], "context": r0["context"], "tp_step_p50_ms": step,
               "single_gpu_shard_p50_ms": one.get("p50_ms"), "exchange_10x_allreduce_ms": ar,
               "exchange_share": ar / step, "errors": sum(p[i]["errors"] for p in per_rank)}
        rows.append(row)
        print(f"TP {tp}: R={row['R']:>2} ctx={row['context']:>5}  step p50 {step:8.3f} ms  single-GPU shard "
              f"{row['single_gpu_shard_p50_ms'] or float('nan'):8.3f} ms  10 all-reduces (graphed) {ar:.3f} ms "
              f"({100 * row['exchange_share']:.0f}% of the step)  errors {row['errors']}", flush=True)
    report = {"tp": tp, "device": torch.cuda.get_device_name(0), "rows": rows}
    (bc.out_dir / f"bench-tp{tp}.json").write_text(json.dumps(report, indent=1))
    return report



