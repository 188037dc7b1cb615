"""server/graphs.py on a GPU: each step runs its collectives once, whether it captures a graph or replays one."""

from __future__ import annotations

import pytest
import torch

from dspark_sidecar.drafter import scenario
from dspark_sidecar.drafter.checkpoint import CheckpointReader
from dspark_sidecar.drafter.kv_cache import allocate_kv_cache
from dspark_sidecar.drafter.model import DSparkDrafter
from dspark_sidecar.drafter.parallel import ParallelContext
from dspark_sidecar.server.graphs import StepGraphs
from dspark_sidecar.server.validate import host_meta

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA/ROCm GPU", allow_module_level=True)
pytest.importorskip("triton")

PAGE = 16


class CountingExchange:
    """Rank 0 of 2 with no peer: each all-reduce that the GPU *executes* adds one to a device counter
    (recorded, not executed, inside a capture), and leaves the partial sums as they are."""

    def __init__(self, device: torch.device) -> None:
        self.executed = torch.zeros((), dtype=torch.int64, device=device)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self.executed.add_(1)
        return t


def test_a_capture_step_runs_its_collectives_once_like_a_replay(tiny_cfg, tiny_ckpt, tiny_embed):
    """At TP > 1 ranks capture at different steps (one engine rank's inputs move to another region:
    its graph key is new while its peers replay). A capture step that executed its all-reduces twice
    would pair its second round with the peers' next step: wrong hidden states from then on."""
    from dspark_sidecar.kernels.triton.ops import TRITON_OPS

    dev = torch.device("cuda", 0)
    ex = CountingExchange(dev)
    model = DSparkDrafter(tiny_cfg, ParallelContext(0, 2, ex), TRITON_OPS, torch.bfloat16, dev).load(
        CheckpointReader(tiny_ckpt[0], torch.bfloat16, device=dev))
    lens = [5, 40, 17]
    pages = sum(scenario.pages_needed(c + 7, PAGE) for c in lens)
    kv = allocate_kv_cache(tiny_cfg, 2, pages, PAGE, torch.bfloat16, dev)
    step = scenario.random_step(tiny_cfg, lens, PAGE, pages, tiny_embed, seed=3)
    embeds, host = step.inputs_embeds.to(dev, torch.bfloat16), host_meta(step.positions, step.meta)

    def executed(fn) -> tuple[torch.Tensor, int]:
        torch.cuda.synchronize(dev)
        before = int(ex.executed)
        out = fn()
        torch.cuda.synchronize(dev)
        return out.clone(), int(ex.executed) - before

    _, per_step = executed(lambda: model.draft_step(embeds, step.positions.to(dev), step.meta.to(dev), kv))
    assert per_step == 2 * tiny_cfg.num_hidden_layers  # o_proj and down_proj of each layer
    graphs = StepGraphs(model, lambda: PAGE)
    captured, at_capture = executed(lambda: graphs.run(embeds, host, kv))
    assert graphs.captures == 1
    replayed, at_replay = executed(lambda: graphs.run(embeds, host, kv))
    assert graphs.captures == 1
    assert (at_capture, at_replay) == (per_step, per_step)
    # The capture step's answer is the warm-up's: the same bits as the replay's (the same kernels on
    # the same inputs; each step rewrites the same block K/V).
    assert torch.equal(captured, replayed)
