"""`dspark-sidecar bench --tp N`: the sidecar at TP N across N GPUs, driven by N engine rank processes.

Each engine rank binds its KV shard on its own GPU to its sidecar rank and runs the same steps
over the data plane; the ranks start every step together (a gloo barrier between the engine's fill
and the ring, outside the timing; the fill inside it, as bench's (d) times it).
Each case then runs again through every rank's shim (`DrafterShim.maybe_forward`, the ranks'
agreements included, as an engine's forward runs it), which must return the same hidden states.
Reported beside it, measured on the same machine: rank 0's shard on one GPU with no exchange
(modes c and d of `bench` with --shard-of N, its launch groups on as many streams as the TP
sidecar's) and its HBM floor, and the time of the step's all-reduces between the engine processes'
GPUs, i.e. the partial-sum exchange's share: 10 per launch group of up to 8 requests, [7r, hidden]
each, over NCCL. They run as the sidecar runs them: inside one CUDA graph, timed by CUDA events
(eager launches timed from the host cost about 4x more: BENCHMARKS.md run 43).

Parity: after each case's timed steps the engine ranks run the same step through the reference
layers at TP N themselves (their own all-reduce), on a copy of the KV cache taken before the
case, and compare the sidecar's hidden states and the block K/V it wrote. On CPU (gloo, the
reference ops on both sides) the two must be bit-identical; that run is what the CPU test drives.
"""

from __future__ import annotations

import datetime
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dspark_sidecar import layout
from dspark_sidecar.bench import BenchConfig, BenchFailed, SidecarUnderTest, failed_rows, json_text
from dspark_sidecar.drafter import scenario
from dspark_sidecar.drafter.checkpoint import EMBED_KEY, SyntheticSource
from dspark_sidecar.drafter.config import load_config
from dspark_sidecar.drafter.kv_cache import FP8_KV, kv_cache_dtype, kv_planes, kv_rows, kv_storage_shape
from dspark_sidecar.drafter.model import DSparkDrafter
from dspark_sidecar.drafter.parallel import DistExchange, ParallelContext
from dspark_sidecar.kernels.ops import REFERENCE_OPS
from dspark_sidecar.kernels.weights import prepare_layer_weights

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# bf16 activations rounded at every op boundary through 5 layers, the GPU backend's roundings
# placed where its fused kernels put them: ~1e-2 relative to the bf16 reference is expected
# (the single-GPU test_dataplane_gpu bound; fp32 lands well inside it). On CPU both sides run
# the reference ops, so the bound there is 0.
PARITY_RTOL = 3e-2


def _engine_rank(rank: int, world: int, bc: BenchConfig, device_type: str, target_dir: str, store: str,
                 out: str) -> None:
    from dspark_sidecar.client.config import EngineConfig
    from dspark_sidecar.client.forward_context import set_forward_context
    from dspark_sidecar.client.shim import DrafterShim
    from dspark_sidecar.proto import memory
    from dspark_sidecar.proto import sidecar_pb2 as pb

    cuda = device_type == "cuda"
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    else:  # the sidecar's ranks run one thread (server/app.py): the same CPU reductions, bit-identical
        torch.set_num_threads(1)  # results (with 2 threads the hidden states differed by 3e-7 on an AMD EPYC host)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    group = dist.new_group(backend="nccl") if cuda else None  # the partial sums' group (gloo on CPU)
    cfg = load_config(bc.preset)
    dtype = DTYPES[bc.dtype]
    page = bc.page_size
    pages = max(bc.reqs) * scenario.pages_needed(max(bc.contexts) + layout.QPR, page)
    shape = kv_storage_shape(cfg, world, pages, page, bc.kv_layout)  # as the engine allocates it (--kv-layout)
    gen = torch.Generator(dev).manual_seed(bc.seed + 101 * rank)  # this rank's KV head: committed context
    kv_dtype = kv_cache_dtype(bc.kv_dtype, dtype)  # --kv-dtype fp8: e4m3 codes, as vLLM's fp8 cache
    held = [memory.exportable_zeros(shape, kv_dtype, dev) for _ in range(cfg.num_hidden_layers)]  # shm on CPU
    raw = [h.tensor for h in held]  # what the shim binds, as vLLM's attention layers hold it
    for t in raw:
        t.copy_(torch.randn(shape, generator=gen, device=dev))
    kv = [kv_planes(t) for t in raw]  # the reference's [2, pages, page_size, heads, head_dim] views
    allocated = "records" if raw[0].dim() == 4 else "planes"  # what the rows measured, in the report
    allocated += " fp8" if kv_dtype == FP8_KV else ""
    source = SyntheticSource(cfg, dtype, dev, bc.seed)  # the weights the sidecar drew (--random-weights)
    embed = source.read(EMBED_KEY, (cfg.vocab_size, cfg.hidden_size))
    ref = DSparkDrafter(cfg, ParallelContext(rank, world, DistExchange(group)), REFERENCE_OPS, dtype,
                        dev).load(source)
    # The weights the sidecar computes with (--weights mxfp8: quantized at load, server/app.py); with the dense
    # ones drawn, every MXFP8 case drifted by the quantization's error (3e-2) and failed parity.
    prepare_layer_weights(ref, bc.weights, cfg.quant_block, fold=False)
    exchange = DistExchange(group)  # as the sidecar sums partials, for the exchange's share
    # This rank's shim (its agreements over the CPU group: shared memory on one node) binds the cache and
    # sets up the data plane. The direct steps drive that data plane's channel; the shim's steps go
    # through maybe_forward, agreements included, as an engine's forward does.
    shim = DrafterShim(EngineConfig(tp_size=world, required_tp=world, endpoint=f"unix:{target_dir}/rank{rank}.sock",
                                    transport="doorbell", device=str(dev), max_reqs=max(bc.reqs), step_deadline_s=60.0),
                       None, lambda: raw, ParallelContext(rank, world, DistExchange(None)))
    why = shim.connect()
    if why is not None or shim.doorbell is None:
        raise RuntimeError(f"engine rank {rank}: the shim could not set up the data plane: {why or 'no doorbell'}")
    b, bufs, bell = shim.binder.current, shim.doorbell.buffers, shim.doorbell.bell
    sync = torch.cuda.synchronize if cuda else (lambda _dev: None)
    results = []
    step_id = 0
    for ctx in bc.contexts:
        for R in bc.reqs:
            case = scenario.random_step(cfg, [ctx] * R, page, pages, embed, seed=R * 7 + ctx)  # same on every rank
            embeds, positions, meta = case.inputs_embeds.to(dev), case.positions.to(dev), case.meta.to(dev)
            kv_before = [t.clone() for t in kv]
            # As bench's (d) and (h), the baseline beside these rows: the embeddings where the engine's lookup
            # would have written them (the input region), so a fill copies none; --engine-copy: copied every step.
            inputs = embeds
            if not bc.engine_copy:
                inputs = bufs.input_view(embeds.shape[0])
                inputs.copy_(embeds)

            def step() -> tuple[float, pb.DraftStepResponse]:
                nonlocal step_id
                step_id += 1
                req = pb.DraftStepRequest(step_id=step_id, binding_id=b.binding_id, binding_generation=b.generation,
                                          num_requests=R)

                def fill() -> None:
                    nonlocal hidden
                    hidden = bufs.fill(req, inputs, case.positions, case.meta)

                def ring() -> pb.DraftStepResponse:
                    bell.send(req)
                    resp = bell.wait(step_id, 60.0)
                    if resp is None:  # a sidecar rank that died answers nothing: stop here, not 60 s per step
                        raise RuntimeError(f"engine rank {rank}: step {step_id} unanswered after 60 s; see "
                                           f"{Path(target_dir).parent / 'sidecar.log'}")
                    sync(dev)
                    return resp

                return _step_ms(fill, dist.barrier, ring)

            hidden = None
            times, errors, early = _timed_steps(step, bc.repeats)
            got = hidden.clone()  # [7R, hidden]: the last step's answer (every repeat is the same step)
            row = {"R": R, "context": ctx, "kv_layout": allocated, "p50_ms": _median(times),
                   "errors": errors, "prelaunched_share": early / max(1, len(times)),
                   **_parity(ref, group, embeds, positions, meta, kv_before, kv, got)}
            shim_times, shimmed = [], None
            for i in range(bc.repeats + 3):  # the same step through the shim (it writes the same K/V again)
                dist.barrier()
                t = time.perf_counter()
                with set_forward_context(case.meta):  # the engine's host metadata, as the data plane takes it
                    shimmed = shim.maybe_forward(None, case.positions, inputs)
                sync(dev)
                if shimmed is None:
                    raise RuntimeError(f"engine rank {rank}: the shim fell back: {dict(shim.stats.fallbacks)}")
                if i >= 3:
                    shim_times.append((time.perf_counter() - t) * 1e3)
            row |= {"shim_p50_ms": statistics.median(shim_times), "shim_matches": bool(torch.equal(shimmed, got))}
            xs = [torch.zeros(layout.QPR * (hi - lo), cfg.hidden_size, device=dev, dtype=dtype)
                  for lo, hi in layout.launch_groups(R)]
            ar = _time_exchange(xs, exchange, 2 * cfg.num_hidden_layers, bc.repeats)
            results.append({**row, "exchange_p50_ms": statistics.median(ar)})
    torch.save(results, Path(out) / f"rank{rank}.pt")
    shim.close()  # its binding, then the data plane
    for h in held:
        h.close()
    dist.destroy_process_group()


def _step_ms(fill, start, ring) -> tuple[float, object]:
    """One direct step's ms and answer, counted as bench's (d) counts it, against which it is reported: the
    engine's fill of the regions, then ring() from the ring to the hidden states on the engine's stream.
    start() (the ranks' barrier) runs between the two, outside the time. The fill was left out, so the
    TP step lacked the 22-85 us an H200 host's fill takes (BENCHMARKS.md) that the one-GPU (d) beside it has."""
    t = time.perf_counter()
    fill()
    filled = time.perf_counter() - t
    start()
    t = time.perf_counter()
    resp = ring()
    return (filled + time.perf_counter() - t) * 1e3, resp


def _timed_steps(step, repeats: int, warmup: int = 3) -> tuple[list[float], int, int]:
    """Run warmup + repeats steps; step() -> (ms, the sidecar's answer). Returns the ms of the timed steps
    that were answered with hidden states, the steps answered with an error (warm-up included), and how
    many of those timed ones were pre-launched. An error answer is not a step's time: it comes back
    before any layer ran, and counted in the median it made a failing case look fast."""
    times, errors, early = [], 0, 0
    for i in range(warmup + repeats):
        ms, resp = step()
        if resp.HasField("error"):
            errors += 1
        elif i >= warmup:
            times.append(ms)
            early += resp.timings.prelaunched
    return times, errors, early


def _median(ms: list[float]) -> float:
    """The median, or NaN where no step was answered (the row's errors say why; its parity fails)."""
    return statistics.median(ms) if ms else float("nan")


def _worst(xs) -> float:
    """The worst rank's (or layer's) figure (the slowest step, the largest drift), NaN where any is NaN: max() keeps
    a NaN only in first place, so with rank 0 answered and rank 1 not the step took rank 0's p50 as if every
    rank had answered, and a rank past 0 whose K/V came back NaN passed parity on rank 0's drift."""
    xs = list(xs)
    return float("nan") if any(math.isnan(x) for x in xs) else max(xs)


def _parity(ref: DSparkDrafter, group, embeds: torch.Tensor, positions: torch.Tensor, meta, kv_before: list,
            kv: list, got: torch.Tensor) -> dict:
    """The sidecar's answer against the reference layers at the same TP, run here (collective)."""
    want = ref.draft_step(embeds, positions, meta, kv_before)  # writes the block K/V into kv_before
    slots = meta.slot_mapping

    def block(t: torch.Tensor) -> torch.Tensor:  # [2, pages, page, kv_heads, d] (any layout's view) -> the step's rows
        return torch.stack([kv_rows(t, 0, slots), kv_rows(t, 1, slots)])

    first = got.clone()  # every rank's hidden state must be rank 0's, bit for bit (one summation order)
    dist.broadcast(first, 0, group=group)
    # The worst layer's, NaN kept (_worst): max() dropped a NaN past the first layer, and such a layer's K/V
    # (garbage codes in an fp8 cache read as NaN, the hidden states fine) passed on layer 0's drift.
    kv_err = _worst(scenario.rel_l2(block(a), block(w)) for a, w in zip(kv, kv_before))
    return {"hidden_rel_l2": scenario.rel_l2(got, want), "kv_rel_l2": kv_err,
            "ranks_agree": bool(torch.equal(first, got))}


def _time_exchange(xs: list[torch.Tensor], exchange, count: int, repeats: int) -> list[float]:
    """ms of a step's exchanges: for each launch group's rows x, `count` all-reduces in a row (the
    o_proj and down_proj partials of every layer), in one CUDA graph as the sidecar's step graphs
    hold them; the ranks start each replay together (gloo barrier). On CPU (gloo, no graphs)
    they are timed eagerly from the host."""
    def step() -> None:
        for x in xs:
            for _ in range(count):
                exchange.all_reduce(x)

    if xs[0].device.type != "cuda":
        times = []
        for _ in range(repeats):
            dist.barrier()
            t = time.perf_counter()
            step()
            times.append((time.perf_counter() - t) * 1e3)
        return times
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the communicator's (or buffers') first use, outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
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


def run_tp_bench(bc: BenchConfig, tp: int, single_gpu: bool = True, device_type: str = "cuda") -> dict:
    """Per-step time of the TP-N sidecar from N engine ranks, against one GPU's shard and the exchange."""
    if device_type == "cuda" and torch.cuda.device_count() < tp:
        raise SystemExit(f"--tp {tp} needs {tp} GPUs, {torch.cuda.device_count()} visible")
    from dspark_sidecar.bench import run_bench

    modes = ("c", "d") if device_type == "cuda" else ("d",)
    # The shard's launch groups as the TP-N sidecar runs them: --launch-streams 0 is serve's default, 4 streams
    # side by side at --tp 1 but 1 (in order) above, so at R > 8 the gap between the two was not the exchange.
    streams = bc.launch_streams or 1
    single = run_bench(BenchConfig(**{**bc.__dict__, "modes": modes, "shard_of": tp, "launch_streams": streams,
                                      "out_dir": bc.out_dir / "single-gpu"}),
                       torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")) \
        if single_gpu else {"rows": []}
    work = Path(tempfile.mkdtemp(prefix="dspark-tp-bench-"))
    side = SidecarUnderTest(bc, torch.device(device_type), work, tp=tp)
    ranks, interrupted = None, False
    try:
        ranks = mp.start_processes(_engine_rank, args=(tp, bc, device_type, str(side.sock), str(work / "store"),
                                                       str(work)), nprocs=tp, start_method="spawn", join=False)
        try:
            while not ranks.join():
                pass
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            raise BenchFailed(f"engine rank {exc.error_index} failed: {_rank_failure(exc)} "
                              f"(the sidecar's folder: {work})") from exc
        per_rank = [torch.load(work / f"rank{r}.pt") for r in range(tp)]
        name = torch.cuda.get_device_name(0) if device_type == "cuda" else "cpu"
        tol = PARITY_RTOL if device_type == "cuda" else 0.0  # on CPU both sides run the reference ops
        report = _report(bc, tp, per_rank, single, name, tol)
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C, or SIGTERM (cli's _sigterm_unwinds): nothing failed
        interrupted = True
        raise
    finally:
        _stop(ranks)
        side.close()
        if interrupted:
            side.discard()  # no failed step's log to keep: the folder goes, as after a finished run
    side.discard()  # the engine ranks' results were read: kept only with a failed sidecar's log
    return report


def _rank_failure(exc: Exception) -> str:
    """What ended a failed engine rank, on one line. A raising rank's traceback comes back pickled in exc's
    message; its exception's first line says what failed: the last line did not where the message has several
    (a CUDA error's ends "Compile with `TORCH_USE_CUDA_DSA` ...", a gRPC error's with ">")."""
    if isinstance(exc, mp.ProcessExitedException):
        return f"exited with {exc.signal_name or f'status {exc.exit_code}'}"
    lines = str(exc).splitlines()
    frames = [i for i, ln in enumerate(lines) if ln.startswith("  File ")]  # the last: the raising frame
    after = lines[frames[-1] + 1:] if frames else []
    return next((ln.strip() for ln in after if ln.strip() and not ln[0].isspace()),  # past its code and ^^^ lines
                next((ln.strip() for ln in reversed(lines) if ln.strip()), "an error"))


def _stop(ranks) -> None:
    """End the engine ranks an interrupted join left running: else a SIGTERM'd bench waited at exit for
    them (multiprocessing joins its children) while each waited 60 s for a step from the stopped sidecar."""
    if ranks is None:
        return
    for p in ranks.processes:
        if p.is_alive():
            p.terminate()
    for p in ranks.processes:
        p.join(10)
        if p.is_alive():  # blocked where SIGTERM is not handled
            p.kill()
            p.join()


def _report(bc: BenchConfig, tp: int, per_rank: list, single: dict, device: str, tol: float) -> dict:
    """Rows are printed and written as soon as the engine ranks finish (before the sidecar stops).
    A case passes parity when every rank answered, agreed with rank 0 bit for bit, and stayed
    within `tol` (relative L2) of the reference in hidden states and block K/V."""
    rows = []
    for i, r0 in enumerate(per_rank[0]):
        step = _worst(p[i]["p50_ms"] for p in per_rank)
        same = [x for x in single["rows"] if x["R"] == r0["R"] and x["context"] == r0["context"]]
        by_mode = {x["mode"]: x for x in same}
        one, inproc = by_mode.get("d", {}), by_mode.get("c", {})
        floor = one.get("floor_ms")
        ar = max(p[i]["exchange_p50_ms"] for p in per_rank)
        hid = _worst(p[i]["hidden_rel_l2"] for p in per_rank)
        kv = _worst(p[i]["kv_rel_l2"] for p in per_rank)
        shim = _worst(p[i].get("shim_p50_ms", float("nan")) for p in per_rank)  # the slowest rank, as for the step
        row = {"R": r0["R"], "context": r0["context"], "kv_layout": r0.get("kv_layout"),
               "tp_step_p50_ms": step, "tp_shim_step_p50_ms": shim,
               "shim_matches": all(p[i].get("shim_matches", False) for p in per_rank),
               "single_gpu_shard_p50_ms": one.get("p50_ms"), "single_gpu_backend_inprocess_p50_ms": inproc.get("p50_ms"),
               "floor_ms": floor, "x_floor": step / floor if floor else None,
               "exchange_ms": ar, "exchange_share": ar / step,
               "errors": sum(p[i]["errors"] for p in per_rank), "hidden_rel_l2": hid, "kv_rel_l2": kv,
               "prelaunched_share": min(p[i].get("prelaunched_share", 0.0) for p in per_rank),
               "ranks_agree": all(p[i]["ranks_agree"] for p in per_rank), "parity_rtol": tol}
        row["parity_ok"] = (hid <= tol and kv <= tol and row["ranks_agree"] and row["errors"] == 0
                            and row["shim_matches"])
        rows.append(row)
        nan = float("nan")
        print(f"TP {tp}: R={row['R']:>2} ctx={row['context']:>5}  step p50 {step:8.3f} ms  "
              f"via the shim {shim:8.3f} ms  "
              f"{row['x_floor'] or nan:5.2f}x floor ({floor or nan:.3f} ms)  single-GPU shard "
              f"{row['single_gpu_shard_p50_ms'] or nan:8.3f} ms (in-process {inproc.get('p50_ms') or nan:.3f})  "
              f"exchange {ar:.3f} ms ({100 * row['exchange_share']:.0f}% of the step)  "
              f"pre-launched {100 * row['prelaunched_share']:.0f}%  errors {row['errors']}  "
              f"parity: hidden {hid:.2e} K/V {kv:.2e} ranks agree {row['ranks_agree']} "
              f"-> {'ok' if row['parity_ok'] else 'FAIL'}", flush=True)
    report = {"tp": tp, "device": device, "rows": rows, "single_gpu_failed": failed_rows(single["rows"]),
              "exchange": "eager gloo" if device == "cpu" else "graphed NCCL, 10 all-reduces per launch group"}
    (bc.out_dir / f"bench-tp{tp}.json").write_text(json_text(report))
    return report
