"""Fixtures shared by the server tests."""

from __future__ import annotations

import pytest
import torch

from helpers.engine_sim import RIG_PAGES, EngineSim
from helpers.sidecar_proc import SidecarProcess


@pytest.fixture(scope="module")
def rig(request, tmp_path_factory, tiny_cfg, tiny_ckpt, tiny_embed):
    """A TP-1 sidecar on CPU with an fp32 EngineSim of RIG_PAGES pages bound to it, one per test module:
    (engine, config, embedding, held). `held` collects the segments a test makes; they are closed after
    the module, with the engine."""
    tmp = tmp_path_factory.mktemp(request.module.__name__.rpartition(".")[2])
    with SidecarProcess(tmp, tp=1, checkpoint=tiny_ckpt) as sc:
        eng = EngineSim(tiny_cfg, [sc.socket(0)], RIG_PAGES, torch.float32)
        eng.bind()
        held = []
        try:
            yield eng, tiny_cfg, tiny_embed, held
        finally:
            eng.close()
            for t in held:
                t.close()
