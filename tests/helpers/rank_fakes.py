"""Stand-ins for the rank loop's tests: the portable layers, counting their calls."""

from __future__ import annotations

import torch


class FakeModel:
    """The drafter's portable layers: every hidden state 2.0 (a fast path's stand-in answers 1.0)."""

    device, dtype = torch.device("cpu"), torch.float32

    def __init__(self) -> None:
        self.calls = 0

    def draft_step(self, embeds, positions, meta, kv):
        self.calls += 1
        return torch.full_like(embeds, 2.0)
