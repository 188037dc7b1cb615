"""The seeded walks' step cases (tests/server/test_dataplane_gpu_stress.py on one GPU,
tests/server/test_dataplane_walk_tp.py at TP 2 on CPU): each on pages of its own, so that its answer
does not depend on which steps ran before it (a step writes only its own block rows)."""

from __future__ import annotations

import dataclasses

import torch

from dspark_sidecar.drafter import scenario
from dspark_sidecar.drafter.kv_cache import StepMetadata
from helpers.engine_sim import PAGE

# name -> (context lens, owner of its pages, seed of its embeddings). A2 is A's metadata with other
# embeddings and C2 is C's layout (shapes) with other positions and pages: same launch key, new contents.
CASES = {"A": ([5, 40], "A", 1), "A2": ([5, 40], "A", 2), "B": ([4096 + 20, 3, 90], "B", 3),
         "C": ([17], "C", 4), "C2": ([20], "C2", 5)}


def cases(cfg, embed) -> tuple[dict, int]:
    """Each case's StepInputs on pages of its own (A2 shares A's), and the first page no case owns."""
    owners = {own for _, own, _ in CASES.values()}
    need = {own: max(sum(scenario.pages_needed(c + 7, PAGE) for c in lens)
                     for lens, o, _ in CASES.values() if o == own) for own in owners}
    base, at = {}, 0
    for own in sorted(owners):
        base[own], at = at, at + need[own]
    steps = {}
    for name, (lens, own, seed) in CASES.items():
        if own != name:  # A2: A's step (its metadata), other embeddings
            g = torch.Generator().manual_seed(seed)
            steps[name] = dataclasses.replace(steps[own], inputs_embeds=torch.randn(steps[own].inputs_embeds.shape,
                                                                                     generator=g))
            continue
        st = scenario.random_step(cfg, lens, PAGE, need[own], embed, seed=seed)
        m = st.meta
        steps[name] = dataclasses.replace(st, meta=StepMetadata(m.seq_lens, m.block_tables + base[own],
                                                                m.slot_mapping + base[own] * PAGE))
    return steps, at
