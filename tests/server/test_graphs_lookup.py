"""StepGraphs.will_capture: the same lookup run() makes, without a GPU (the graphs are stand-ins)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from dspark_sidecar.server.graphs import StepGraphs, _kv_key


def _graphs() -> StepGraphs:
    g = StepGraphs.__new__(StepGraphs)  # no model, no stream: only the lookup's state
    g._graphs, g._kv_key = {}, None
    return g


def test_will_capture_answers_as_run_would_look_the_graph_up():
    g, kv, region = _graphs(), [torch.zeros(2, 4)], torch.zeros(7, 8)
    assert g.will_capture(region, 1, kv, in_place=True)  # nothing captured for any cache yet
    g._kv_key = _kv_key(kv)
    assert g.will_capture(region, 1, kv, in_place=True)
    g._graphs[(1, True)] = SimpleNamespace(embeds=region)
    assert not g.will_capture(region, 1, kv, in_place=True)
    assert g.will_capture(region, 2, kv, in_place=True)  # another R
    other = torch.zeros(7, 8)
    assert g.will_capture(other, 1, kv, in_place=True)  # another slice: the static-buffer graph, not there yet
    g._graphs[(1, False)] = SimpleNamespace(embeds=torch.zeros(7, 8))
    assert not g.will_capture(other, 1, kv, in_place=True) and not g.will_capture(other, 1, kv)
    assert g.will_capture(region, 1, [torch.zeros(2, 4)], in_place=True)  # another cache: run() drops them all
