"""Per-rank body of the symmetric-exchange test (importable by spawned processes): one GPU per rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dspark_sidecar.drafter.parallel import DistExchange, SymmetricExchange

HIDDEN, ROWS, COUNT = 512, (7, 56), 10


def symmetric_vs_nccl(rank: int, world: int) -> dict:
    """COUNT all-reduces in a row, each of its own data (as a step's o_proj and down partials), in one
    CUDA graph: through SymmetricExchange and through NCCL. Returns both sums and the fallback's."""
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    nccl = dist.new_group(backend="nccl")
    sym = SymmetricExchange(nccl, [(r, HIDDEN) for r in ROWS], torch.bfloat16, dev)
    ref = DistExchange(nccl)
    out = {}
    for rows in ROWS:
        gen = torch.Generator(dev).manual_seed(1000 * rank + rows)
        data = [torch.randn(rows, HIDDEN, generator=gen, device=dev).to(torch.bfloat16) for _ in range(COUNT)]
        got = [torch.empty_like(d) for d in data]
        want = [d.clone() for d in data]
        for w in want:
            ref.all_reduce(w)

        def step() -> None:
            for g, d in zip(got, data):
                g.copy_(d)
                sym.all_reduce(g)

        step()  # eager first (the buffers' first use), then the same inside a graph
        eager = [g.clone() for g in got]
        for g in got:
            g.zero_()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graph.replay()
        torch.cuda.synchronize()
        out[rows] = {"graph": [g.cpu() for g in got], "eager": [g.cpu() for g in eager],
                     "nccl": [w.cpu() for w in want]}
    odd = torch.ones(3, HIDDEN, device=dev, dtype=torch.bfloat16)  # no buffer of this shape: NCCL
    out["fallback"] = sym.all_reduce(odd).cpu()
    torch.cuda.synchronize()
    return out
