"""Start-up's warm steps: every launch shape a served step will launch, compiled and run once before SERVING."""

from __future__ import annotations

import time

import torch

from dspark_sidecar import layout
from dspark_sidecar.drafter import scenario
from dspark_sidecar.drafter.kv_cache import allocate_kv_cache, window_metadata
from dspark_sidecar.server.graphs import StepGraphs
from dspark_sidecar.server.rank import RankContext

# The page size of the warm-up's scratch cache: vLLM's default KV block size on a GPU. The attention's
# kernels are compiled per page size; an engine cache of another compiles them in its first step.
WARM_PAGE_SIZE = 16


def warm_sizes(max_reqs: int, streams: int = 0) -> list[int]:
    """The request counts whose steps together launch every launch shape a step of 1..max_reqs requests
    launches: each launch group's size (layout.launch_groups) with the number of groups side by side on
    `streams` streams (model.draft_step; the attention splits its keys for that share of the SMs).

    The kernels are compiled per shape (Triton: per specialization, e.g. the GEMMs' row tile and split
    from a launch's 7r rows, the attention's split count from its requests), and a shape first met in a
    served step compiled inside it: seconds on a cold compile cache, past the engine's step deadline
    (2 s by default), so that step fell back and its late K/V writes went on behind the engine's."""
    seen: set[tuple[int, int]] = set()
    sizes = []
    for R in range(1, max_reqs + 1):
        groups = layout.launch_groups(R)
        side = min(len(groups), streams) if len(groups) > 1 and streams > 1 else 1
        new = {(e - s, side) for s, e in groups} - seen
        if new:
            seen |= new
            sizes.append(R)
    return sizes


def warm_up(ctx: RankContext, page_size: int = WARM_PAGE_SIZE, sizes=(layout.LAUNCH_REQS,),
            graphs: StepGraphs | None = None) -> float:
    """A full step of each request count in `sizes` (warm_sizes) on a private scratch cache (collectives
    included). Every rank runs the same steps at start-up, so it also proves the TP group can exchange
    partial sums. graphs: the rank's step graphs; the steps are then addressed as theirs are (window-relative
    block tables of fixed width, their launch streams), so that what the steps compile is what the graphs
    run (with short tables the attention splits its keys otherwise). Returns the seconds it took.
    """
    cfg, m = ctx.cfg, ctx.model
    sizes = list(sizes)
    # Short contexts, repeated past LAUNCH_REQS requests: the scratch cache stays small at any --max-reqs.
    lens = [1 + 37 * (i % layout.LAUNCH_REQS) for i in range(max(sizes))]
    pages = sum(scenario.pages_needed(c + layout.QPR, page_size) for c in lens)
    kv = allocate_kv_cache(cfg, m.par.world_size, pages, page_size, m.dtype, m.device)
    t = time.perf_counter()
    for R in sizes:
        step = scenario.random_step(cfg, lens[:R], page_size, pages, ctx.embed, seed=0)
        positions, meta = step.positions.to(m.device), step.meta.to(m.device)
        attn, streams = None, ()
        if graphs is not None:  # as StepGraphs._step calls it: the window metadata for both
            rel, meta = window_metadata(positions, meta, page_size, cfg.sliding_window)
            attn, streams = (rel, meta), graphs.streams
        m.draft_step(step.inputs_embeds.to(m.device, m.dtype), positions, meta, kv, attn=attn, streams=streams)
    if m.device.type == "cuda":
        torch.cuda.synchronize(m.device)
    return time.perf_counter() - t
