"""`serve` with a checkpoint that cannot be used: one line, exit 2, before any rank (or socket) exists.

README ("serve flags") and deploy/OPERATIONS.md promise that a checkpoint config or tensor that
cannot be used "stops the command before any rank starts", prints one line and exits 2
(drafter/checkpoint.py check_checkpoint, called by cli.py cmd_serve). Before, every case below
started the ranks (sockets created, NOT_SERVING while loading) and ended with exit 1 and one copy
of the line per rank, or a raw traceback (layer_types, an unreadable index, an MXFP8 scale over 2^7
under --weights mxfp8), or SERVING (a layer's tensors config.json does not name, a scale over 2^7
with bf16 weights). Each test forbids the launcher, so a regression fails in well under a second.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.refusals import refused

P = "language_model.model.dspark."
L0 = P + "layers.0.decoder_layer."
EMBED = "language_model.model.embed_tokens.weight"


pytestmark = pytest.mark.usefixtures("no_launch")  # tests/conftest.py


def _copy(tiny_ckpt, tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt[0], root / "dspark")
    shutil.copytree(tiny_ckpt[1], root / "target")
    return root / "dspark", root / "target"


def _edit_tensors(folder: Path, edit) -> None:
    f = folder / "model.safetensors"
    t = load_file(str(f))
    edit(t)
    save_file(t, str(f), metadata={"format": "pt"})


def _serve(tmp_path, dspark, target, *extra) -> list[str]:
    return ["serve", "--tp", "1", "--device", "cpu", "--socket-dir", str(tmp_path / "sock"),
            "--checkpoint", str(dspark), "--target-checkpoint", str(target), *extra]


def _refused(argv, capsys, tmp_path, *words) -> str:
    return refused(argv, capsys, *words, sock_dir=tmp_path / "sock")


def _scale_200(t):
    s = t[L0 + "self_attn.q_proj.weight_scale_inv"].clone()
    s[0, 0] = 200
    t[L0 + "self_attn.q_proj.weight_scale_inv"] = s


def _nan_norm(t):
    n = t[P + "final_norm.weight"].clone()
    n[3] = float("nan")
    t[P + "final_norm.weight"] = n


def _f8_nan_code(t):
    w = t[L0 + "self_attn.k_proj.weight"].clone()
    w.view(torch.uint8)[1, 2] = 0xFF  # E4M3's negative NaN (S.1111.111): the sign bit set
    t[L0 + "self_attn.k_proj.weight"] = w


TENSOR_CASES = {
    "missing": (lambda t: t.pop(P + "final_norm.weight"), (), ("final_norm.weight", "missing")),
    "shape": (lambda t: t.__setitem__(P + "hidden_norm.weight", torch.zeros(255, dtype=torch.bfloat16)), (),
              ("hidden_norm.weight", "[255]")),
    "nan": (_nan_norm, (), ("final_norm.weight", "non-finite")),
    "scale_dtype": (lambda t: t.__setitem__(L0 + "self_attn.q_proj.weight_scale_inv",
                                            t[L0 + "self_attn.q_proj.weight_scale_inv"].float()), (),
                    ("q_proj.weight_scale_inv", "U8")),
    # README, --weights: "a block exponent above 134 (a scale over 2^7) is refused at load"
    "scale_over_2^7_bf16": (_scale_200, ("--weights", "bf16"), ("q_proj.weight_scale_inv", "134")),
    "scale_over_2^7_mxfp8": (_scale_200, ("--weights", "mxfp8"), ("q_proj.weight_scale_inv", "134")),
    # a NaN code in the F8 bits would otherwise stop each rank at load, one traceback per rank
    "f8_nan_code": (_f8_nan_code, (), ("k_proj.weight", "1 NaN F8_E4M3 codes", "[1, 2]")),
    # only the layer linears are MXFP8: a norm stored as F8 has no block axis to read a scale along
    "f8_norm": (lambda t: t.__setitem__(P + "final_norm.weight", t[P + "final_norm.weight"].to(torch.float8_e4m3fn)),
                (), ("final_norm.weight", "dtype F8_E4M3")),
    # a dense-only tensor (fc is never MXFP8) beside a block scale: named as a stale scale, not as a tensor config.json
    # does not name ("is config.json this checkpoint's?" sent the operator to the wrong file: review 271)
    "fc_with_scale": (lambda t: t.__setitem__(P + "fc.weight_scale_inv", torch.zeros(4, dtype=torch.uint8)), (),
                      ("fc.weight_scale_inv", "a block scale for", "remove the scale")),
    # config says 5 layers; a 6th layer's tensors mean config.json and tensors disagree
    "unexpected_layer": (lambda t: t.__setitem__(P + "layers.5.decoder_layer.input_layernorm.weight",
                                                 torch.zeros(256, dtype=torch.bfloat16)), (), ("layers.5",)),
}


@pytest.mark.parametrize("case", list(TENSOR_CASES))
def test_a_checkpoint_tensor_that_cannot_be_used_is_one_line_and_exit_2_before_any_rank(case, tiny_ckpt, tmp_path, capsys):
    edit, extra, words = TENSOR_CASES[case]
    dspark, target = _copy(tiny_ckpt, tmp_path)
    _edit_tensors(dspark, edit)
    _refused(_serve(tmp_path, dspark, target, *extra), capsys, tmp_path, *words)


def test_a_target_without_embed_tokens_is_refused_before_any_rank(tiny_ckpt, tmp_path, capsys):
    dspark, target = _copy(tiny_ckpt, tmp_path)
    _edit_tensors(target, lambda t: t.pop(EMBED))
    _refused(_serve(tmp_path, dspark, target), capsys, tmp_path, "embed_tokens", "missing")


def test_a_target_embed_tokens_of_a_dtype_the_ranks_cannot_load_is_refused_before_any_rank(tiny_ckpt, tmp_path,
                                                                                              capsys):
    dspark, target = _copy(tiny_ckpt, tmp_path)
    _edit_tensors(target, lambda t: t.__setitem__(EMBED, t[EMBED].to(torch.int32)))
    _refused(_serve(tmp_path, dspark, target), capsys, tmp_path, "embed_tokens", "dtype I32")


def test_config_with_fewer_layers_than_the_tensors_is_refused(tiny_ckpt, tmp_path, capsys):
    """num_hidden_layers 4 over a 5-layer checkpoint served 4 layers, ignoring layer 4's tensors."""
    dspark, target = _copy(tiny_ckpt, tmp_path)
    cj = json.loads((dspark / "config.json").read_text())
    cj["text_config"]["num_hidden_layers"] = 4
    cj["text_config"]["layer_types"] = ["sliding_attention"] * 4
    (dspark / "config.json").write_text(json.dumps(cj))
    _refused(_serve(tmp_path, dspark, target), capsys, tmp_path, "layers.4")


def test_config_layer_types_not_a_list_is_one_line(tiny_ckpt, tmp_path, capsys):
    """drafter/config.py: len(layer_types) on an int raised TypeError, a traceback in the parent."""
    dspark, target = _copy(tiny_ckpt, tmp_path)
    cj = json.loads((dspark / "config.json").read_text())
    cj["text_config"]["layer_types"] = 5
    (dspark / "config.json").write_text(json.dumps(cj))
    _refused(_serve(tmp_path, dspark, target), capsys, tmp_path, "layer_types")


def test_a_layer_the_config_names_full_attention_is_refused(tiny_ckpt, tmp_path, capsys):
    """Every layer is served with the sliding window (spec section 1); a config naming layer 2 full attention
    was served with the window all the same (only the list's length was checked), its drafts quietly off."""
    dspark, target = _copy(tiny_ckpt, tmp_path)
    cj = json.loads((dspark / "config.json").read_text())
    cj["text_config"]["layer_types"][2] = "full_attention"
    (dspark / "config.json").write_text(json.dumps(cj))
    _refused(_serve(tmp_path, dspark, target), capsys, tmp_path, "layer(s) [2] are 'full_attention'")


def test_an_unreadable_index_is_one_line(tiny_ckpt, tmp_path, capsys):
    """The index read raised IsADirectoryError or PermissionError as a traceback."""
    dspark, target = _copy(tiny_ckpt, tmp_path)
    (dspark / "model.safetensors.index.json").mkdir()
    _refused(_serve(tmp_path, dspark, target), capsys, tmp_path, "model.safetensors.index.json")


def test_a_synthetic_checkpoint_that_cannot_be_written_is_one_line(tmp_path, capsys, monkeypatch):
    """Rank 0 wrote it while its peers waited in a barrier: a traceback there, then one per peer."""
    (tmp_path / "cache").write_text("a file where the cache folder should be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    argv = ["serve", "--tp", "2", "--device", "cpu", "--socket-dir", str(tmp_path / "sock")]
    _refused(argv, capsys, tmp_path, "cannot write the synthetic checkpoint", "XDG_CACHE_HOME")


def test_heads_the_sidecar_never_loads_may_be_absent_but_are_checked_when_present(tiny_ckpt, tmp_path, capsys,
                                                                                  monkeypatch):
    """The Markov and confidence heads run in the engine: a checkpoint without them (confidence head off)
    must still serve, while a corrupt one is still refused by name."""
    launched = []
    monkeypatch.setattr("dspark_sidecar.server.launcher.launch", lambda cfg, argv, on_ready=None: launched.append(1) or 0)
    dspark, target = _copy(tiny_ckpt, tmp_path)
    _edit_tensors(dspark, lambda t: [t.pop(k) for k in list(t) if ".confidence_head." in k])
    from dspark_sidecar import cli

    assert cli.main(_serve(tmp_path, dspark, target)) == 0 and launched == [1]
    _edit_tensors(dspark, lambda t: t.__setitem__(P + "markov_head.markov_w1.weight",
                                                  torch.full_like(t[P + "markov_head.markov_w1.weight"], float("nan"))))
    _refused(_serve(tmp_path, dspark, target), capsys, tmp_path, "markov_w1.weight", "non-finite")
