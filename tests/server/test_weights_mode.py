"""`serve --weights mxfp8`: a real sidecar keeps the layer weights quantized and answers as the dense layers do."""

from __future__ import annotations

import pytest
import torch

from dspark_sidecar.drafter import scenario
from dspark_sidecar.proto import codec
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.server.config import ServeConfig, ServeConfigError
from helpers.engine_sim import PAGE, EngineSim
from helpers.local_tp import shard_model
from helpers.sidecar_proc import SidecarProcess

LENS = [5, 300, 4096 + 20]
PAGES = sum(scenario.pages_needed(c + 7, PAGE) for c in LENS) + 2


def test_unknown_weight_format_is_refused_with_the_choices():
    with pytest.raises(ServeConfigError, match="--weights: must be bf16 or mxfp8, got 'fp4'"):
        ServeConfig(weights="fp4")


def test_mxfp8_sidecar_step_equals_the_dense_layers(tmp_path, tiny_cfg, tiny_ckpt, tiny_embed):
    with SidecarProcess(tmp_path, tp=1, dtype="fp32", checkpoint=tiny_ckpt, extra_args=["--weights", "mxfp8"]) as sc:
        eng = EngineSim(tiny_cfg, [sc.socket(0)], PAGES, torch.float32)
        eng.bind()
        status = eng.stubs[0].GetStatus(pb.GetStatusRequest(), timeout=10)
        step = scenario.random_step(tiny_cfg, LENS, PAGE, PAGES, tiny_embed, seed=8)
        before = [t.clone() for t in eng.kv_tensors(0)]
        (resp,) = eng.step_all(1, step)
        got = codec.from_tensor_ref(resp.hidden_states, "hidden")
        eng.close()
    assert status.model.weight_format == "mxfp8"  # kept quantized in memory (dense: "mxfp8->fp32")
    dense = shard_model(0, 1, str(tiny_ckpt[0]), torch.float32, distributed=False)
    want = dense.draft_step(step.inputs_embeds, step.positions, step.meta, before)
    assert torch.equal(got, want)
