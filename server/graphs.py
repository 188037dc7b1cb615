"""CUDA graphs of the draft step, one per request count R, replayed with static input buffers.

Eager launches of ~30 kernels per layer cost milliseconds of Python and launch overhead per
step; a replay costs one launch. Shapes must not depend on the step's contents, so the
attention is addressed through window-relative metadata (drafter.kv_cache.window_metadata,
fixed width), and each graph is bound to the KV cache's addresses: a re-bind drops them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from dspark_sidecar import layout
from dspark_sidecar.drafter.kv_cache import StepMetadata, window_metadata
from dspark_sidecar.drafter.model import DSparkDrafter

log = logging.getLogger("dspark_sidecar.server")


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    embeds: torch.Tensor  # [n, hidden]
    positions: torch.Tensor  # int64 [n], absolute (RoPE)
    rel_positions: torch.Tensor  # int64 [n], window-relative (attention)
    seq_lens: torch.Tensor  # int32 [R], window-relative
    tables: torch.Tensor  # int32 [R, width]
    slots: torch.Tensor  # int64 [n], absolute
    out: torch.Tensor  # [n, hidden]


class StepGraphs:
    def __init__(self, model: DSparkDrafter, page_size_of) -> None:
        self.model = model
        self._page_size_of = page_size_of  # () -> the bound cache's page size
        self._graphs: dict[int, _Graph] = {}
        self._kv_key: tuple | None = None
        self.captures = 0

    def run(self, embeds: torch.Tensor, positions: torch.Tensor, meta: StepMetadata,
            kv: list[torch.Tensor]) -> torch.Tensor:
        """embeds [n, hidden] on the device; positions/meta on the host. Returns the graph's output
        buffer [n, hidden] (valid until the next step)."""
        key = tuple((t.data_ptr(), tuple(t.shape)) for t in kv)
        if key != self._kv_key:  # a new binding: graphs hold the old cache's addresses
            self._graphs.clear()
            self._kv_key = key
        ps = self._page_size_of()
        rel, wmeta = window_metadata(positions, meta, ps, self.model.cfg.sliding_window)
        g = self._graphs.get(meta.num_reqs)
        fresh = g is None
        if fresh:
            g = self._buffers(meta.num_reqs, wmeta.block_tables.shape[1])
        self._fill(g, embeds, positions, rel, wmeta)
        if fresh:
            self._capture(g, kv)
            self._graphs[meta.num_reqs] = g
        g.graph.replay()
        return g.out

    def _buffers(self, R: int, width: int) -> _Graph:
        m, n = self.model, layout.QPR * R
        dev = m.device
        return _Graph(torch.cuda.CUDAGraph(), torch.zeros(n, m.cfg.hidden_size, dtype=m.dtype, device=dev),
                      torch.zeros(n, dtype=torch.int64, device=dev), torch.zeros(n, dtype=torch.int64, device=dev),
                      torch.zeros(R, dtype=torch.int32, device=dev), torch.zeros(R, width, dtype=torch.int32, device=dev),
                      torch.zeros(n, dtype=torch.int64, device=dev), torch.empty(0))

    @staticmethod
    def _fill(g: _Graph, embeds, positions, rel, wmeta: StepMetadata) -> None:
        g.embeds.copy_(embeds, non_blocking=True)
        for dst, src in ((g.positions, positions), (g.rel_positions, rel), (g.seq_lens, wmeta.seq_lens),
                         (g.tables, wmeta.block_tables), (g.slots, wmeta.slot_mapping)):
            dst.copy_(src, non_blocking=True)

    def _step(self, g: _Graph, kv) -> torch.Tensor:
        meta = StepMetadata(g.seq_lens, g.tables, g.slots)
        return self.model.draft_step(g.embeds, g.positions, meta, kv, attn=(g.rel_positions, meta))

    def _capture(self, g: _Graph, kv) -> None:
        """Warm up on a side stream with this step's real inputs (the writes are this step's own
        K/V, so running it is harmless), then capture; the replay that follows is the real run."""
        dev = self.model.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            self._step(g, kv)
        torch.cuda.current_stream(dev).wait_stream(side)
        with torch.cuda.graph(g.graph):
            g.out = self._step(g, kv)
        self.captures += 1
        log.info("captured the draft-step graph for R=%d (%d graphs)", g.seq_lens.numel(), len(self._graphs) + 1)
