"""The synthetic checkpoint writer and the sharding MXFP8 reader."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dspark_sidecar.drafter.checkpoint import (
    PREFIX, CheckpointError, CheckpointReader, dequantize_mxfp8, quantize_mxfp8, tensor_specs,
    write_synthetic_checkpoint,
)
from dspark_sidecar.drafter.config import DrafterConfig
from dspark_sidecar.drafter.parallel import ParallelContext

Q = f"{PREFIX}layers.2.decoder_layer.self_attn.q_proj.weight"
O = f"{PREFIX}layers.2.decoder_layer.self_attn.o_proj.weight"


def test_layout_has_97_tensors_with_real_names_and_dtypes(tiny_ckpt, tiny_cfg):
    with safe_open(str(tiny_ckpt[0] / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_slice(Q).get_dtype() == "F8_E4M3"
        assert f.get_slice(Q + "_scale_inv").get_dtype() == "U8"
        assert f.get_slice(Q + "_scale_inv").get_shape() == [tiny_cfg.q_size, tiny_cfg.hidden_size // 32]
        assert f.get_slice(f"{PREFIX}fc.weight").get_dtype() == "BF16"
    # spec: 97 tensors = 7 global + 5 layers x (4 norms + 7 F8 linears + their 7 U8 scales)
    assert len(keys) == 97
    assert {k for k in keys if not k.endswith("_scale_inv")} == {s.key for s in tensor_specs(tiny_cfg)}
    assert sum(k.endswith("_scale_inv") for k in keys) == 35
    cfg_json = json.loads((tiny_ckpt[0] / "config.json").read_text())
    assert DrafterConfig.from_hf_json(cfg_json) == tiny_cfg


def test_writer_is_deterministic_and_shards_with_index(tmp_path, tiny_cfg):
    d1, _ = write_synthetic_checkpoint(tiny_cfg, tmp_path / "a", seed=1)
    d2, _ = write_synthetic_checkpoint(tiny_cfg, tmp_path / "b", seed=1, max_shard_bytes=1 << 20)
    index = json.loads((d2 / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    a = load_file(str(d1 / "model.safetensors"))
    b = {}
    for f in sorted(d2.glob("model-*.safetensors")):
        b.update(load_file(str(f)))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)
    r1 = CheckpointReader(d1, torch.float32).read(Q, (tiny_cfg.q_size, tiny_cfg.hidden_size))
    r2 = CheckpointReader(d2, torch.float32).read(Q, (tiny_cfg.q_size, tiny_cfg.hidden_size))
    assert torch.equal(r1, r2)


def test_mxfp8_dequantization_hand_computed_block():
    # One row, one 32-wide block: E8M0 byte 130 means 2^(130-127) = 8.
    q = torch.tensor([[0.5, -1.5, 448.0, 0.0] + [1.0] * 28]).to(torch.float8_e4m3fn)
    s = torch.tensor([[130]], dtype=torch.uint8)
    out = dequantize_mxfp8(q, s, 32)
    assert out[0, :5].tolist() == [4.0, -12.0, 3584.0, 0.0, 8.0]
    # Round trip: quantization picks 2^ceil(log2(amax/448)) so the largest value fits E4M3.
    w = torch.randn(4, 64) * 3
    qq, ss = quantize_mxfp8(w, 32)
    assert (dequantize_mxfp8(qq, ss, 32) - w).abs().max() <= w.abs().max() * 2 ** -3
    # The round trip alone passes with a scale one step too large (coarser, still within tolerance): pin the bytes.
    # amax 448 * 8 needs exactly 2^3 (byte 130); a hair above it 2^4 (131); amax 1 needs 2^ceil(log2(1/448)) = 2^-8.
    rows = torch.tensor([[448.0 * 8] + [0.0] * 31, [448.0 * 8 + 64] + [0.0] * 31, [1.0] + [0.0] * 31])
    assert quantize_mxfp8(rows, 32)[1].flatten().tolist() == [130, 131, 119]


@pytest.mark.parametrize("world", [2, 4])
def test_each_shard_equals_slice_of_full_weight(world, tiny_ckpt, tiny_cfg):
    r = CheckpointReader(tiny_ckpt[0], torch.float32)
    shape_q, shape_o = (tiny_cfg.q_size, tiny_cfg.hidden_size), (tiny_cfg.hidden_size, tiny_cfg.q_size)
    full_q, full_o = r.read(Q, shape_q), r.read(O, shape_o)
    for rank in range(world):
        par = ParallelContext(rank, world)
        assert torch.equal(r.read(Q, shape_q, rows=par.shard(shape_q[0])), full_q[par.shard(shape_q[0])])
        assert torch.equal(r.read(O, shape_o, cols=par.shard(shape_o[1])), full_o[:, par.shard(shape_o[1])])


def _rewrite_without(src, dst, drop=None, reshape=None):
    t = load_file(str(src / "model.safetensors"))
    if drop:
        del t[drop]
    if reshape:
        t[reshape] = t[reshape][:-1].contiguous()
    dst.mkdir()
    save_file(t, str(dst / "model.safetensors"))
    return dst


def test_missing_key_names_key_and_expected_shape(tmp_path, tiny_ckpt, tiny_cfg):
    d = _rewrite_without(tiny_ckpt[0], tmp_path / "m", drop=Q)
    with pytest.raises(CheckpointError, match=rf"{Q}: missing .*expected shape \[{tiny_cfg.q_size}, {tiny_cfg.hidden_size}\]"):
        CheckpointReader(d, torch.float32).read(Q, (tiny_cfg.q_size, tiny_cfg.hidden_size))


def test_missing_scale_and_misshaped_tensor_are_named(tmp_path, tiny_ckpt, tiny_cfg):
    shape = (tiny_cfg.q_size, tiny_cfg.hidden_size)
    d = _rewrite_without(tiny_ckpt[0], tmp_path / "s", drop=Q + "_scale_inv")
    with pytest.raises(CheckpointError, match=f"{Q}_scale_inv: missing"):
        CheckpointReader(d, torch.float32).read(Q, shape)
    d = _rewrite_without(tiny_ckpt[0], tmp_path / "r", reshape=Q)
    with pytest.raises(CheckpointError, match=rf"{Q}: shape \[{shape[0] - 1}, {shape[1]}\], expected"):
        CheckpointReader(d, torch.float32).read(Q, shape)


def test_corrupted_file_gives_named_error(tmp_path, tiny_ckpt):
    d = tmp_path / "c"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}garbage")
    with pytest.raises(CheckpointError, match="model.safetensors: unreadable"):
        CheckpointReader(d, torch.float32)


NORM = f"{PREFIX}layers.2.decoder_layer.input_layernorm.weight"


@pytest.mark.parametrize("key, corrupt, match", [
    (Q, lambda t: t.view(torch.uint8).flatten().__setitem__(5, 0x7F), rf"{Q}: 1 non-finite .*F8_E4M3 NaN codes"),
    (Q, lambda t: t.view(torch.uint8).flatten().__setitem__(5, 0xFF), rf"{Q}: 1 non-finite .*F8_E4M3 NaN codes"),
    # E8M0 NaN (255), or any exponent past 2^7 (finite in bf16, so it would load): named by the scale
    (Q + "_scale_inv", lambda t: t.flatten().__setitem__(0, 255), rf"{Q}_scale_inv: block exponent 255 above 134"),
    (Q + "_scale_inv", lambda t: t.flatten().__setitem__(0, 135), rf"{Q}_scale_inv: block exponent 135 above 134"),
    (NORM, lambda t: t.flatten().__setitem__(0, float("nan")), rf"{NORM}: 1 non-finite values"),
])
def test_non_finite_weights_are_refused_by_name(tmp_path, tiny_ckpt, tiny_cfg, key, corrupt, match):
    """A NaN or inf weight used to load and serve: every draft wrong and nothing said."""
    t = load_file(str(tiny_ckpt[0] / "model.safetensors"))
    corrupt(t[key])
    d = tmp_path / "n"
    d.mkdir()
    save_file(t, str(d / "model.safetensors"))
    target = Q if key.startswith(Q) else NORM
    shape = (tiny_cfg.q_size, tiny_cfg.hidden_size) if target == Q else (tiny_cfg.hidden_size,)
    with pytest.raises(CheckpointError, match=match):
        CheckpointReader(d, torch.bfloat16).read(target, shape)


def test_the_largest_allowed_block_exponent_loads(tmp_path, tiny_ckpt, tiny_cfg):
    """MAX_EXPONENT (134, 2^7) is the last exponent the kernels take: refused from 135, loaded at 134."""
    t = load_file(str(tiny_ckpt[0] / "model.safetensors"))
    t[Q + "_scale_inv"].flatten()[0] = 134
    d = tmp_path / "e134"
    d.mkdir()
    save_file(t, str(d / "model.safetensors"))
    w = CheckpointReader(d, torch.float32).read(Q, (tiny_cfg.q_size, tiny_cfg.hidden_size))
    assert torch.equal(w[0, :32], t[Q][0, :32].float() * 2.0 ** 7)


def test_a_column_slice_that_cuts_an_mxfp8_block_is_named(tiny_ckpt, tiny_cfg):
    """A row-parallel slice must keep whole blocks: one that starts or ends inside a block would pair its
    columns with the wrong scales."""
    r = CheckpointReader(tiny_ckpt[0], torch.float32)
    shape = (tiny_cfg.hidden_size, tiny_cfg.q_size)
    for cols in (slice(16, 64), slice(0, 48)):
        with pytest.raises(CheckpointError, match=rf"{O}: column slice .* cuts MXFP8 blocks of 32"):
            r.read(O, shape, cols=cols)


@pytest.mark.parametrize("world", [1, 4])
def test_a_block_scale_of_the_wrong_shape_is_named(world, tmp_path, tiny_ckpt, tiny_cfg):
    """A scale of 1 x 16 blocks (another converter's layout) has the rows of the 1 x 32 one: every rank's
    slice of it, column-parallel (rows) and row-parallel (columns), and the check before the ranks start,
    must refuse it by name rather than dequantize it against the wrong columns or fail in a broadcast."""
    from dspark_sidecar.drafter.checkpoint import check_checkpoint

    t = load_file(str(tiny_ckpt[0] / "model.safetensors"))
    for key in (Q, O):
        t[key + "_scale_inv"] = torch.cat([t[key + "_scale_inv"]] * 2, dim=1)
    d = tmp_path / "scale16"
    d.mkdir()
    save_file(t, str(d / "model.safetensors"))
    r = CheckpointReader(d, torch.float32)
    shape_q, shape_o = (tiny_cfg.q_size, tiny_cfg.hidden_size), (tiny_cfg.hidden_size, tiny_cfg.q_size)
    for rank in range(world):
        par = ParallelContext(rank, world)
        for key, shape, cut in ((Q, shape_q, {"rows": par.shard(shape_q[0])}),
                                (O, shape_o, {"cols": par.shard(shape_o[1])})):
            rows, cols = shape
            want = rf"{key}_scale_inv: shape \[{rows}, {cols // 16}\], expected \[{rows}, {cols // 32}\]"
            with pytest.raises(CheckpointError, match=want):
                r.read(key, shape, **cut)
    with pytest.raises(CheckpointError, match=rf"{Q}_scale_inv: shape \[{shape_q[0]}, {shape_q[1] // 16}\]"):
        check_checkpoint(tiny_cfg, d, tiny_ckpt[1])


def test_a_norm_stored_as_f8_is_named_not_an_index_error(tmp_path, tiny_ckpt, tiny_cfg):
    """Only [rows, cols] linears are MXFP8: a 1-D weight stored as F8_E4M3 reached the 2-D
    dequantization and ended in "IndexError: tuple index out of range" (read is the loader of the
    ranks and of the engine harness, which does not run check_checkpoint first)."""
    t = load_file(str(tiny_ckpt[0] / "model.safetensors"))
    t[NORM] = t[NORM].to(torch.float8_e4m3fn)
    d = tmp_path / "f8norm"
    d.mkdir()
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"{NORM}: F8_E4M3 for a tensor of shape \[{tiny_cfg.hidden_size}\]"):
        CheckpointReader(d, torch.float32).read(NORM, (tiny_cfg.hidden_size,))


def test_a_key_in_two_files_or_a_broken_index_is_named(tmp_path, tiny_ckpt):
    """Without an index, a key in two files was taken from whichever sorted last (a stale file won)."""
    t = load_file(str(tiny_ckpt[0] / "model.safetensors"))
    d = tmp_path / "dup"
    d.mkdir()
    save_file(t, str(d / "model.safetensors"))
    save_file({NORM: t[NORM]}, str(d / "old.safetensors"))
    with pytest.raises(CheckpointError, match=rf"{NORM}: in both model.safetensors and old.safetensors"):
        CheckpointReader(d, torch.float32)
    (d / "old.safetensors").unlink()
    for text in ("{not json", json.dumps({"metadata": {}}), json.dumps([1])):
        (d / "model.safetensors.index.json").write_text(text)
        with pytest.raises(CheckpointError, match="model.safetensors.index.json: not a safetensors index"):
            CheckpointReader(d, torch.float32)


@pytest.mark.parametrize("name", ["../model.safetensors", "/tmp/model.safetensors", "a/../../model.safetensors"])
def test_an_index_that_names_a_file_outside_its_folder_is_refused(tmp_path, tiny_ckpt, name):
    """The index's weight_map was joined to the folder as given: a downloaded checkpoint whose index names
    `../x` or an absolute path had the sidecar read (and serve as weights) a file outside the folder it was
    given. A file in the folder may still be a link elsewhere (the Hugging Face cache's snapshots are links
    to its blobs): only the index's own names are held to the folder."""
    t = load_file(str(tiny_ckpt[0] / "model.safetensors"))
    d = tmp_path / "ckpt" / "inner"
    d.mkdir(parents=True)
    save_file(t, str(tmp_path / "ckpt" / "model.safetensors"))
    save_file(t, str(tmp_path / "model.safetensors"))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {NORM: name}}))
    with pytest.raises(CheckpointError, match=rf"model.safetensors.index.json: {NORM} is in {name!r}, outside "):
        CheckpointReader(d, torch.float32)
    (d / "model.safetensors").symlink_to(tmp_path / "ckpt" / "model.safetensors")  # a link in the folder: read
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {NORM: "model.safetensors"}}))
    assert CheckpointReader(d, torch.float32).has(NORM)


def test_a_disk_that_fills_while_the_synthetic_checkpoint_is_written_is_named_and_cleaned(tmp_path, monkeypatch,
                                                                                          tiny_cfg):
    """safetensors' save_file reports an I/O error (ENOSPC mid-shard) as SafetensorError, not OSError: it
    escaped as a traceback (exit 1, so systemd restarted serve every 5 s) and left the partial
    `<name>.tmp<pid>` folder behind on the full disk, one more per attempt. It must be the one-line
    CheckpointError (exit 2) with nothing left in the cache folder."""
    from safetensors import SafetensorError

    from dspark_sidecar.drafter import checkpoint

    def disk_full(tensors, path, metadata=None):
        with open(path, "wb") as f:  # what had been written when the disk ran out
            f.write(b"\0" * 4096)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(checkpoint, "save_file", disk_full)
    with pytest.raises(CheckpointError, match="cannot write the synthetic checkpoint.*No space left on device"):
        checkpoint.ensure_synthetic_checkpoint(tiny_cfg, seed=0)
    assert list((tmp_path / "dspark-sidecar").iterdir()) == []  # no partial folder left behind


def test_a_synthetic_checkpoint_write_that_is_interrupted_leaves_no_partial_folder(tmp_path, monkeypatch, tiny_cfg):
    """A serve interrupted while it writes the synthetic checkpoint (Ctrl-C: KeyboardInterrupt, or any other
    exception than the I/O errors) left `<name>.tmp<pid>` behind, gigabytes for the full preset, one more per
    interrupted start (helper 87). The interruption goes on up; the partial folder does not stay."""
    from dspark_sidecar.drafter import checkpoint

    def interrupted(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"\0" * 4096)
        raise KeyboardInterrupt

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(checkpoint, "save_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.ensure_synthetic_checkpoint(tiny_cfg, seed=0)
    assert list((tmp_path / "dspark-sidecar").iterdir()) == []


@pytest.mark.parametrize("world", [2, 4])
def test_random_weights_give_each_rank_its_own_slice_of_one_weight(world, tiny_cfg):
    """SyntheticSource (--random-weights) drew only a slice's row count from the key's seed: every rank got
    rank 0's rows, so a TP-N drafter held the same heads and FFN columns N times and was no TP-1 one."""
    from dspark_sidecar.drafter.checkpoint import SyntheticSource

    src = SyntheticSource(tiny_cfg, torch.float32)
    shape_q, shape_o = (tiny_cfg.q_size, tiny_cfg.hidden_size), (tiny_cfg.hidden_size, tiny_cfg.q_size)
    full_q, full_o = src.read(Q, shape_q), src.read(O, shape_o)
    for rank in range(world):
        par = ParallelContext(rank, world)
        assert torch.equal(src.read(Q, shape_q, rows=par.shard(shape_q[0])), full_q[par.shard(shape_q[0])])
        assert torch.equal(src.read(O, shape_o, cols=par.shard(shape_o[1])), full_o[:, par.shard(shape_o[1])])


def test_a_dense_linear_next_to_a_block_scale_is_named(tmp_path, tiny_ckpt, tiny_cfg):
    """A converter that casts the F8 codes up to bf16 and keeps `weight_scale_inv` leaves every weight off by its
    block's 2^(v - 127). check_checkpoint blamed config.json ("is config.json this checkpoint's?") for the scale,
    and CheckpointReader.read (the engine harness's loader, no check_checkpoint first) loaded the codes as weights."""
    from dspark_sidecar.drafter.checkpoint import check_checkpoint

    t = load_file(str(tiny_ckpt[0] / "model.safetensors"))
    t[Q] = t[Q].to(torch.bfloat16)  # cast, not dequantized: the scale is still needed
    d = tmp_path / "cast"
    d.mkdir()
    save_file(t, str(d / "model.safetensors"))
    shape = (tiny_cfg.q_size, tiny_cfg.hidden_size)
    with pytest.raises(CheckpointError, match=rf"{Q}_scale_inv: a block scale for {Q}, which is stored as BF16"):
        check_checkpoint(tiny_cfg, d, tiny_ckpt[1])
    with pytest.raises(CheckpointError, match=rf"{Q}_scale_inv: a block scale for {Q}, which is stored as torch.bf"):
        CheckpointReader(d, torch.float32).read(Q, shape, rows=slice(0, 256))


def test_a_synthetic_checkpoint_folder_without_its_complete_mark_is_replaced_not_trusted(tmp_path, monkeypatch,
                                                                                        tiny_cfg):
    """A finished synthetic checkpoint arrives by one rename with COMPLETE inside, so a folder without it is what
    is left of one (a removal cut short; in /tmp, tmpfiles aging out COMPLETE, which is only ever stat'ed, before
    the shards that every start reads). ensure wrote a whole new copy, could not rename it over the old folder,
    took that for another process's finished copy, deleted the new one and returned the old one: every start
    failed on its cut files (or rewrote gigabytes and threw them away), and nothing ever repaired it."""
    from dspark_sidecar.drafter import checkpoint

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    out = checkpoint.default_checkpoint_dir(tiny_cfg, seed=0)
    (out / "dspark").mkdir(parents=True)
    (out / "dspark" / "model.safetensors").write_bytes(b"\0" * 64)  # cut short
    dspark, target = checkpoint.ensure_synthetic_checkpoint(tiny_cfg, seed=0)
    assert (out / "COMPLETE").exists()
    checkpoint.check_checkpoint(tiny_cfg, dspark, target)
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no new copy, nor the old folder, left beside it


def test_a_folder_written_again_unsharded_reads_the_new_tensors_not_the_old_index(tmp_path, tiny_cfg):
    """The writer left a sharded write's model.safetensors.index.json in place when it wrote the folder again as
    one file: the reader follows an index, so it read the old shards (another seed's weights) without a word."""
    shape = (tiny_cfg.q_size, tiny_cfg.hidden_size)
    d, _ = write_synthetic_checkpoint(tiny_cfg, tmp_path / "w", seed=1, max_shard_bytes=1 << 20)
    d, _ = write_synthetic_checkpoint(tiny_cfg, tmp_path / "w", seed=2)
    fresh, _ = write_synthetic_checkpoint(tiny_cfg, tmp_path / "fresh", seed=2)
    assert sorted(p.name for p in d.iterdir()) == sorted(p.name for p in fresh.iterdir())
    assert torch.equal(CheckpointReader(d, torch.float32).read(Q, shape),
                       CheckpointReader(fresh, torch.float32).read(Q, shape))


def test_an_empty_xdg_cache_home_is_unset_not_the_working_folder(tmp_path, monkeypatch, tiny_cfg):
    """XDG_CACHE_HOME set but empty (an `Environment=XDG_CACHE_HOME=` or `ENV XDG_CACHE_HOME=` line) was taken as
    the path "", so the synthetic checkpoint (gigabytes for the full preset) went into the working folder, or
    failed there (a unit's "/"), naming a relative path. Empty means unset (XDG spec), as kernels/flydsl does."""
    import tempfile

    from dspark_sidecar.drafter import checkpoint

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    assert checkpoint.default_checkpoint_dir(tiny_cfg, seed=3).parent == tmp_path / "tmp" / "dspark-sidecar"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert checkpoint.default_checkpoint_dir(tiny_cfg, seed=3).parent == tmp_path / "cache" / "dspark-sidecar"


def test_the_synthetic_checkpoint_s_folder_is_its_config_s_and_seed_s(tiny_cfg):
    """Keyed by the preset's name and the seed alone, a cache written by a release whose preset had other shapes
    was read by the next (every rank refused a tensor's shape, naming the cached folder, until someone removed
    it); two configs of one name (a test's, a patched preset) shared one folder."""
    import dataclasses

    from dspark_sidecar.drafter import checkpoint

    here = checkpoint.default_checkpoint_dir(tiny_cfg, seed=3)
    assert here.name.startswith("tiny-seed3-")
    assert checkpoint.default_checkpoint_dir(tiny_cfg, seed=3) == here  # the same config and seed: the same folder
    assert checkpoint.default_checkpoint_dir(tiny_cfg, seed=4) != here
    assert checkpoint.default_checkpoint_dir(dataclasses.replace(tiny_cfg, ffn_hidden_size=64), seed=3) != here


def test_a_synthetic_copy_finished_first_by_another_process_is_used_and_a_foreign_name_refused(tmp_path, monkeypatch,
                                                                                                tiny_cfg):
    """Two serves starting at once both write a copy; the one whose rename loses must hand out the winner's (same cfg
    and seed: the same tensors) and drop its own, not fail. A name held by something that is no finished copy (a
    file) is refused by name instead."""
    from dspark_sidecar.drafter import checkpoint

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    out = checkpoint.default_checkpoint_dir(tiny_cfg, seed=0)
    write = checkpoint.write_synthetic_checkpoint

    def the_other_finishes_first(cfg, tmp, seed):
        write(cfg, tmp, seed)
        write(cfg, out, seed)  # the other process's copy, renamed into place while this one wrote
        (out / "COMPLETE").write_text("ok\n")

    monkeypatch.setattr(checkpoint, "write_synthetic_checkpoint", the_other_finishes_first)
    assert checkpoint.ensure_synthetic_checkpoint(tiny_cfg, seed=0) == (out / "dspark", out / "target")
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # this process's copy is gone
    shutil.rmtree(out)
    monkeypatch.setattr(checkpoint, "write_synthetic_checkpoint", write)

    def a_file_takes_the_name(path):  # after the stale-folder sweep, before the rename
        out.write_text("not a checkpoint")

    monkeypatch.setattr(checkpoint, "_remove_unfinished", a_file_takes_the_name)
    with pytest.raises(CheckpointError, match=rf"{out}: cannot put the synthetic checkpoint in place"):
        checkpoint.ensure_synthetic_checkpoint(tiny_cfg, seed=0)
    assert [p.name for p in out.parent.iterdir()] == [out.name]


@pytest.mark.parametrize("code", [0x7F, 0xFF])
def test_check_checkpoint_names_f8_nan_codes_of_either_sign(tmp_path, tiny_ckpt, tiny_cfg, code):
    """E4M3 has two NaN codes, S.1111.111: the negative one (0xFF) is as corrupt as 0x7F."""
    from dspark_sidecar.drafter.checkpoint import check_checkpoint

    t = load_file(str(tiny_ckpt[0] / "model.safetensors"))
    t[Q].view(torch.uint8).flatten()[7] = code
    d = tmp_path / "nan"
    d.mkdir()
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"^{Q}: 1 NaN F8_E4M3 codes \(first at \[0, 7\]\)"):
        check_checkpoint(tiny_cfg, d, tiny_ckpt[1])


def test_check_checkpoint_takes_a_folder_without_the_engine_heads_but_not_without_fc(tmp_path, tiny_ckpt, tiny_cfg):
    """The Markov and confidence heads run in the engine, never in the sidecar: a checkpoint without them
    (enable_confidence_head false) serves. A missing tensor the layers need is still named."""
    from dspark_sidecar.drafter.checkpoint import check_checkpoint

    t = load_file(str(tiny_ckpt[0] / "model.safetensors"))
    heads = [k for k in t if k.startswith((f"{PREFIX}markov_head.", f"{PREFIX}confidence_head."))]
    assert len(heads) == 4
    d = tmp_path / "noheads"
    d.mkdir()
    save_file({k: v for k, v in t.items() if k not in heads}, str(d / "model.safetensors"))
    check_checkpoint(tiny_cfg, d, tiny_ckpt[1])
    save_file({k: v for k, v in t.items() if k not in heads and k != f"{PREFIX}fc.weight"},
              str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"^{PREFIX}fc.weight: missing from"):
        check_checkpoint(tiny_cfg, d, tiny_ckpt[1])



def test_the_folders_of_a_killed_writer_are_swept_once_untouched_and_not_those_of_a_live_one(tmp_path, monkeypatch,
                                                                                             tiny_cfg):
    """A writer killed outright (SIGKILL: the OOM killer, a supervisor's last resort) runs no cleanup: its
    `<name>.tmp<pid>` folder stayed, gigabytes for the full preset, one more per killed start, and one killed
    between its COMPLETE mark and its rename stayed even though the next start wrote its own copy (which no later
    start ever looked past). Every start sweeps the folders of writers no longer running here, once untouched for
    ABANDONED_S; a live writer's (or a recent one's: a writer in another pid namespace looks dead from here) stays."""
    import os
    import subprocess
    import time

    from dspark_sidecar.drafter import checkpoint

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    out = checkpoint.default_checkpoint_dir(tiny_cfg, seed=0)
    out.parent.mkdir(parents=True)
    dead = []
    for _ in range(4):  # pids no process has here now
        p = subprocess.Popen(["true"])
        p.wait()
        dead.append(p.pid)

    def age(d, age_s: float):
        then = time.time() - age_s
        for p in [*sorted(d.rglob("*"), reverse=True), d]:  # the files, then their folders
            os.utime(p, (then, then))
        return d

    def folder(suffix: str, age_s: float, complete: bool = False):
        d = out.with_name(out.name + suffix)
        (d / "dspark").mkdir(parents=True)
        (d / "dspark" / "model.safetensors").write_bytes(bytes(64))
        if complete:
            (d / "COMPLETE").write_text("ok\n")
        return age(d, age_s)

    old = checkpoint.ABANDONED_S + 60
    swept = [folder(f".tmp{dead[0]}", old), folder(f".tmp{dead[1]}", old, complete=True),
             folder(f".stale{dead[2]}", old)]
    kept = [folder(f".tmp{os.getppid()}", old),  # its writer runs
            folder(f".tmp{dead[3]}", 5.0),  # touched seconds ago: a writer this namespace does not see
            folder("-other.tmp1x", old)]  # no copy of this checkpoint
    checkpoint.ensure_synthetic_checkpoint(tiny_cfg, seed=0)
    assert (out / "COMPLETE").exists()
    assert [p for p in swept if p.exists()] == [] and all(p.exists() for p in kept), sorted(out.parent.iterdir())
    # A finished copy in place: the sweep runs at every start, not only one that writes.
    checkpoint.ensure_synthetic_checkpoint(tiny_cfg, seed=0)
    assert kept[1].exists()
    age(kept[1], old)
    checkpoint.ensure_synthetic_checkpoint(tiny_cfg, seed=0)
    assert not kept[1].exists() and kept[0].exists() and (out / "COMPLETE").exists()
