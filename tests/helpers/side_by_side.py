"""One step's launch groups side by side against in order, eagerly and from a CUDA graph (GPU tests)."""

from __future__ import annotations

import torch


def side_by_side_against_in_order(model, embeds, positions, meta, kv0: list[torch.Tensor],
                                  streams: list[torch.cuda.Stream]) -> dict:
    """The step in order, then on `streams` eagerly and replayed from a graph (each on its own copy of
    the caches kv0) -> {"want": in-order hidden, "eager"/"graph": same bits as want, "kv": block K/V the
    same in all three, per layer}."""
    dev = embeds.device

    def run(kv, side_by_side):
        return model.draft_step(embeds, positions, meta, kv, streams=streams if side_by_side else ())

    kv_seq = [t.clone() for t in kv0]
    want = run(kv_seq, False)
    kv_eager = [t.clone() for t in kv0]
    eager = run(kv_eager, True)
    kv_graph = [t.clone() for t in kv0]
    side = torch.cuda.Stream(dev)  # a warm run off the default stream first, as graph capture wants
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        run(kv_graph, True)
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(kv_graph, True)
    for t, t0 in zip(kv_graph, kv0, strict=True):
        t.copy_(t0)
    graph.replay()
    torch.cuda.synchronize(dev)
    return {"want": want, "eager": torch.equal(eager, want), "graph": torch.equal(out, want),
            "kv": [torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(kv_seq, kv_eager, kv_graph, strict=True)]}
