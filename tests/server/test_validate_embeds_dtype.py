"""inputs_embeds: the dtypes validate_step takes are the ones sidecar.proto documents."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import dspark_sidecar.proto as proto_pkg
from dspark_sidecar.drafter import scenario
from dspark_sidecar.drafter.config import load_config
from dspark_sidecar.proto import codec
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.server.errors import SidecarError
from dspark_sidecar.server.validate import validate_step

PS, PAGES = 16, 32


def _comment(field_line: str) -> str:
    """The // comment block right above `field_line` in sidecar.proto, as one line of text."""
    text = (Path(proto_pkg.__file__).parent / "sidecar.proto").read_text()
    block = re.search(r"((?:[ \t]*//[^\n]*\n)+)[ \t]*" + re.escape(field_line), text).group(1)
    return " ".join(line.strip().lstrip("/").strip() for line in block.splitlines())


def _validate(dtype: torch.dtype):
    """validate_step on a bf16 sidecar (out_dtype) of a valid step whose inputs_embeds are `dtype`."""
    cfg = load_config("tiny")
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size)
    st = scenario.random_step(cfg, [5, 30], PS, PAGES, embed, seed=1)
    req = pb.DraftStepRequest(step_id=1, binding_id=3, binding_generation=1, num_requests=2,
                              positions=codec.to_tensor_ref(st.positions),
                              inputs_embeds=codec.to_tensor_ref(st.inputs_embeds.to(dtype)),
                              seq_lens=codec.to_tensor_ref(st.meta.seq_lens),
                              block_tables=codec.to_tensor_ref(st.meta.block_tables),
                              slot_mapping=codec.to_tensor_ref(st.meta.slot_mapping))
    kv = SimpleNamespace(page_size=PS, num_pages=PAGES)
    mem = SimpleNamespace(check=lambda binding_id, generation: kv, layouts={}, resolve=None)
    return validate_step(req, cfg, mem, 8, out_dtype=torch.bfloat16)


def test_inputs_embeds_in_any_of_the_documented_dtypes_are_taken_and_the_proto_says_which():
    """A bf16 sidecar takes FP32 and FP16 embeddings as well as BF16 (the runner converts them; the shim
    sends the engine's own dtype to a sidecar that names no compute dtype), and refuses other dtypes
    naming the three. sidecar.proto said "[n, hidden] in the compute dtype", so an engine read another
    float dtype as a refused step, and nothing told it what the sidecar refuses."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert _validate(dtype).inputs_embeds.dtype == dtype
    with pytest.raises(SidecarError, match="dtype must be BF16, FP16 or FP32") as err:
        _validate(torch.float8_e4m3fn)
    assert err.value.field == "inputs_embeds"
    doc = _comment("TensorRef inputs_embeds = 11;")
    assert "BF16, FP16 or FP32" in doc and "in the compute dtype:" not in doc, doc


@pytest.mark.parametrize("dtype,name", [(torch.float8_e4m3fn, "DTYPE_FP8_E4M3"), (torch.int32, "DTYPE_INT32"),
                                        (torch.uint8, "DTYPE_UINT8")])
def test_a_refused_embeddings_dtype_is_named_as_the_wire_names_it(dtype, name):
    """Every other field's dtype refusal names the DType the engine sent ("got DTYPE_INT32"); inputs_embeds said
    "got torch.int32", a name that is not in sidecar.proto."""
    with pytest.raises(SidecarError) as err:
        _validate(dtype)
    assert err.value.message == f"inputs_embeds: dtype must be BF16, FP16 or FP32, got {name}", err.value.message
