"""The frozen drafter config: presets, config.json parsing, and errors that name the field."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from dspark_sidecar.drafter.config import PRESETS, ConfigError, DrafterConfig, load_config


def test_real_preset_matches_spec():
    c = PRESETS["minimax-m3.1"]
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (6144, 64, 4, 128)
    assert (c.q_size, c.kv_size, c.ffn_hidden_size, c.tap_size) == (8192, 512, 12288, 30720)
    assert c.noise_token_id == 200058 and c.sliding_window == 4096 and c.rotary_dim == 64
    # spec: ~1.96 B parameters, of which the layer linears are 1.667 B
    assert 1.9e9 < c.param_count() < 2.0e9
    c.check_tp(4)


def test_tiny_preset_keeps_structure_and_shards_over_1_2_4():
    t, real = PRESETS["tiny"], PRESETS["minimax-m3.1"]
    for f in ("num_hidden_layers", "head_dim", "rotary_dim", "block_size", "sliding_window", "num_key_value_heads"):
        assert getattr(t, f) == getattr(real, f), f
    assert t.num_attention_heads > t.num_key_value_heads  # GQA
    for w in (1, 2, 4):
        t.check_tp(w)


def test_json_round_trip_and_defaults_for_missing_optional_fields():
    data = PRESETS["minimax-m3.1"].to_hf_json()
    for k in ("rms_norm_eps", "rope_theta", "rotary_dim", "swiglu_alpha", "swiglu_limit"):
        del data["text_config"][k]
    c = DrafterConfig.from_hf_json(data)
    assert c.rms_norm_eps == 1e-6 and c.rope_theta == 5e6 and c.rotary_dim == 64
    assert c.swiglu_alpha == 1.702 and c.swiglu_limit == 7.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.hidden_size = 1  # type: ignore[misc]


# The field alone matched a later check's error too: without the positivity check, hidden_size -1 was
# refused as "hidden_size: must be a multiple of the MXFP8 block" and the test still passed.
@pytest.mark.parametrize("key,value,field", [
    ("num_key_value_heads", 5, "text_config.num_key_value_heads: 5 must divide num_attention_heads"),
    ("dspark_block_size", 8, "text_config.dspark_block_size: must be 7"),
    ("hidden_size", -1, "text_config.hidden_size: must be a positive integer, got -1"),
    ("dspark_noise_token_id", 10**9, "text_config.dspark_noise_token_id: 1000000000 outside vocab"),
    ("head_dim", "128", "text_config.head_dim: must be a positive integer, got '128'"),
    # The step's window-relative block tables hold window / page_size pages per request (kv_cache.window_width,
    # graphs.py's buffers); 2**32 asked 256 Mi pages of every request at warm-up, and StatusReport's uint32
    # sliding_window raised in GetStatus (INTERNAL) for it.
    ("sliding_window", 1 << 32, "text_config.sliding_window: at most 1048576 tokens, got 4294967296"),
    ("sliding_window", (1 << 20) + 1, "text_config.sliding_window: at most 1048576 tokens, got 1048577"),
    # Zero is no positive number: eps 0 divides a zero row by zero, theta 0 rotates by 0 ** -x.
    ("rms_norm_eps", 0, "text_config.rms_norm_eps: must be a positive finite number, got 0"),
    ("rope_theta", 0.0, "text_config.rope_theta: must be a positive finite number, got 0.0"),
])
def test_bad_field_is_named(key, value, field):
    data = PRESETS["tiny"].to_hf_json()
    data["text_config"][key] = value
    with pytest.raises(ConfigError, match="^" + re.escape(field)):
        DrafterConfig.from_hf_json(data)


def test_missing_field_and_bad_file_are_named(tmp_path):
    data = PRESETS["tiny"].to_hf_json()
    del data["text_config"]["sliding_window"]
    with pytest.raises(ConfigError, match="text_config.sliding_window: missing"):
        DrafterConfig.from_hf_json(data)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ConfigError, match="config.json"):
        load_config(checkpoint=tmp_path)
    with pytest.raises(ConfigError, match="preset: unknown 'nope'"):
        load_config("nope")
    (tmp_path / "config.json").write_text(json.dumps({**data, "architectures": ["X"]}))
    with pytest.raises(ConfigError, match="architectures"):
        load_config(checkpoint=tmp_path)


def test_tp_divisibility_error_names_field():
    with pytest.raises(ConfigError, match="num_key_value_heads: 4 is not divisible by TP size 8"):
        PRESETS["tiny"].check_tp(8)


@pytest.mark.parametrize("where, key, value, words", [
    (None, "quantization_config", None, "quantization_config: expected an object"),
    ("text_config", "dspark_target_layer_ids", 5, "dspark_target_layer_ids: expected a list"),
    ("text_config", "enable_confidence_head", "false", "enable_confidence_head: expected true or false"),
    ("text_config", "partial_rotary_factor", "0.5", "partial_rotary_factor: expected a number"),
])
def test_fields_of_the_wrong_json_type_are_named(where, key, value, words):
    """Each used to fail as a raw AttributeError or TypeError, or ("false") read as true."""
    data = PRESETS["tiny"].to_hf_json()
    (data[where] if where else data)[key] = value
    with pytest.raises(ConfigError, match=words):
        DrafterConfig.from_hf_json(data)
    with pytest.raises(ConfigError, match="config.json: expected a JSON object, got list"):
        DrafterConfig.from_hf_json([data])  # type: ignore[arg-type]


def _without_rotary_dim(**text):
    data = PRESETS["minimax-m3.1"].to_hf_json()
    del data["text_config"]["rotary_dim"]
    data["text_config"].update(text)
    return data


def test_partial_rotary_factor_gives_the_rotary_dim():
    assert DrafterConfig.from_hf_json(_without_rotary_dim(partial_rotary_factor=0.5)).rotary_dim == 64
    both = _without_rotary_dim(partial_rotary_factor=0.5, rotary_dim=64)
    assert DrafterConfig.from_hf_json(both).rotary_dim == 64


def test_a_partial_rotary_factor_of_one_rotates_every_dim():
    """The upper edge of (0, 1] is a config (full RoPE, as Hugging Face writes it by default), not an error."""
    assert DrafterConfig.from_hf_json(_without_rotary_dim(partial_rotary_factor=1.0)).rotary_dim == 128
    assert DrafterConfig.from_hf_json(_without_rotary_dim(partial_rotary_factor=1)).rotary_dim == 128


@pytest.mark.parametrize("text, words", [
    # 0.3 x 128 = 38.4 rotary dims: used to be served as 38, RoPE on a band the checkpoint never had.
    ({"partial_rotary_factor": 0.3}, r"partial_rotary_factor: 0.3 x head_dim 128 = 38.4"),
    # Two fields saying different things: rotary_dim used to win without a word.
    ({"partial_rotary_factor": 0.25, "rotary_dim": 64}, "partial_rotary_factor: 0.25 x head_dim 128 = 32, "
                                                        "but rotary_dim is 64"),
    # Used to escape as a raw ValueError / OverflowError (a traceback, not a config error naming the field).
    ({"partial_rotary_factor": float("nan")}, "partial_rotary_factor: expected a finite number"),
    ({"partial_rotary_factor": float("inf")}, "partial_rotary_factor: expected a finite number"),
    # A head_dim of the wrong type is named as such, not a TypeError from the product.
    ({"partial_rotary_factor": 0.5, "head_dim": "128"}, "head_dim: must be a positive integer"),
])
def test_partial_rotary_factor_that_gives_no_rotary_dim_is_refused(text, words):
    with pytest.raises(ConfigError, match=words):
        DrafterConfig.from_hf_json(_without_rotary_dim(**text))


@pytest.mark.parametrize("key, value, words", [
    # Used to be accepted: eps = inf zeroes every norm's output, theta = inf freezes RoPE.
    ("rms_norm_eps", float("inf"), "rms_norm_eps: must be a positive finite number"),
    ("rope_theta", float("inf"), "rope_theta: must be a positive finite number"),
    # Used to be accepted: a float (2.5 became token 2 in the block rows) or a bool (true: token 1).
    ("dspark_noise_token_id", 2.5, "noise_token_id: must be an integer"),
    ("dspark_noise_token_id", True, "noise_token_id: must be an integer"),
    # Used to be blamed on layer_types ("5 entries for 5 layers").
    ("num_hidden_layers", "5", "num_hidden_layers: must be a positive integer"),
])
def test_values_that_used_to_pass_or_be_misnamed(key, value, words):
    data = PRESETS["tiny"].to_hf_json()
    data["text_config"][key] = value
    with pytest.raises(ConfigError, match=words):
        DrafterConfig.from_hf_json(data)


@pytest.mark.parametrize("block", [0, "32", True, None])
def test_a_bad_weight_block_size_is_named_by_its_key(block):
    """A bad B in quantization_config.weight_block_size [1, B] was named "text_config.quant_block", a key
    that no config.json has (the dataclass's field name, under the text_config prefix)."""
    data = PRESETS["tiny"].to_hf_json()
    data["quantization_config"]["weight_block_size"] = [1, block]
    with pytest.raises(ConfigError, match=r"^quantization_config.weight_block_size: expected \[1, B\]"):
        DrafterConfig.from_hf_json(data)


@pytest.mark.parametrize("key, words", [
    ("rope_theta", "rope_theta: must be a positive finite number"),
    ("rms_norm_eps", "rms_norm_eps: must be a positive finite number"),
    ("partial_rotary_factor", "partial_rotary_factor: expected a finite number"),
])
def test_an_integer_past_a_floats_range_is_named(key, words):
    """JSON reads 1e400 as inf (refused) but 10**400 written out as an integer as an int, which math.isfinite
    cannot convert: an OverflowError traceback instead of serve's one line and exit 2."""
    data = PRESETS["tiny"].to_hf_json()
    if key == "partial_rotary_factor":
        del data["text_config"]["rotary_dim"]
    data["text_config"][key] = 10 ** 400
    with pytest.raises(ConfigError, match=words):
        DrafterConfig.from_hf_json(json.loads(json.dumps(data)))


def test_a_config_json_that_is_not_utf8_is_named(tmp_path):
    """A config.json saved as UTF-16 (an editor's or PowerShell's default) raised UnicodeDecodeError from
    read_text: neither OSError nor JSONDecodeError, so a traceback instead of a ConfigError naming the file."""
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["tiny"].to_hf_json()), encoding="utf-16")
    with pytest.raises(ConfigError, match="config.json: cannot read config.json"):
        load_config(checkpoint=tmp_path)


@pytest.mark.parametrize("factor", [1e307, -1e307, 2.0, 0.0, -0.5])
def test_a_partial_rotary_factor_outside_0_to_1_is_named_by_its_key(factor):
    """1e307 x head_dim is inf, and round(inf) raised OverflowError: a traceback, not serve's one line. A factor
    above 1 or not above 0 was blamed on text_config.rotary_dim, a key that config.json does not have then."""
    with pytest.raises(ConfigError, match=r"^text_config.partial_rotary_factor: .*\(0, 1\]"):
        DrafterConfig.from_hf_json(_without_rotary_dim(partial_rotary_factor=factor))


@pytest.mark.parametrize("key, value, words", [
    ("dspark_ffn_hidden_size", 0, "text_config.dspark_ffn_hidden_size: must be a positive integer"),
    ("dspark_ffn_hidden_size", 500, "text_config.dspark_ffn_hidden_size: must be a multiple of the MXFP8 block"),
    ("dspark_markov_rank", -1, "text_config.dspark_markov_rank: must be a positive integer"),
    ("dspark_block_size", 0, "text_config.dspark_block_size: must be a positive integer"),
])
def test_a_dspark_field_is_named_by_its_config_json_key(key, value, words):
    """These were named by the dataclass's attribute (text_config.ffn_hidden_size, ...), keys no config.json has."""
    data = PRESETS["tiny"].to_hf_json()
    data["text_config"][key] = value
    with pytest.raises(ConfigError, match="^" + re.escape(words)):
        DrafterConfig.from_hf_json(data)


def test_check_tp_names_the_config_json_keys():
    """A per-rank slice that cuts an MXFP8 block was blamed on "q_size", which is no field anywhere, and the FFN
    on "ffn_hidden_size" (config.json's key is dspark_ffn_hidden_size)."""
    heads = dataclasses.replace(PRESETS["tiny"], num_attention_heads=4, head_dim=16, rotary_dim=16)
    with pytest.raises(ConfigError, match=r"^num_attention_heads \* head_dim: per-rank slice 16 is not a multiple of 32"):
        heads.check_tp(4)
    narrow = dataclasses.replace(PRESETS["tiny"], ffn_hidden_size=96, hidden_size=96)
    with pytest.raises(ConfigError, match=r"^dspark_ffn_hidden_size: per-rank slice 48 is not a multiple of 32"):
        narrow.check_tp(2)


@pytest.mark.parametrize("key, value", [
    ("rope_scaling", {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}),
    ("rope_scaling", {"rope_type": "linear", "factor": 2.0}),
    ("rope_parameters", {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e6}),
    ("rope_scaling", "yarn"),
])
def test_a_scaled_rope_is_refused_not_served_as_plain_rope(key, value):
    """The layers rotate with plain RoPE (theta, rotary dims): a config.json asking for scaled positions (YaRN,
    linear, ...) was served without it, every draft from positions the checkpoint was not trained with."""
    data = PRESETS["tiny"].to_hf_json()
    data["text_config"][key] = value
    with pytest.raises(ConfigError, match=f"^text_config.{key}: "):
        DrafterConfig.from_hf_json(data)


@pytest.mark.parametrize("key, value", [
    ("rope_scaling", None), ("rope_scaling", {"rope_type": "default"}), ("rope_parameters", {"rope_type": "default"}),
])
def test_plain_rope_spelled_out_is_accepted(key, value):
    data = PRESETS["tiny"].to_hf_json()
    data["text_config"][key] = value
    assert DrafterConfig.from_hf_json(data) == PRESETS["tiny"]


def test_rope_parameters_theta_is_read_and_a_disagreeing_one_refused():
    """transformers 5 writes rope_theta (and partial_rotary_factor) inside rope_parameters: a theta given only
    there was ignored and the spec's default 5e6 served instead."""
    data = PRESETS["tiny"].to_hf_json()
    del data["text_config"]["rope_theta"], data["text_config"]["rotary_dim"]
    data["text_config"]["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25}
    c = DrafterConfig.from_hf_json(data)
    assert (c.rope_theta, c.rotary_dim) == (1e6, 32)
    data["text_config"]["rope_theta"] = 5e6
    with pytest.raises(ConfigError, match=r"^text_config.rope_parameters.rope_theta: 1000000.0, but text_config.rope_theta"):
        DrafterConfig.from_hf_json(data)


@pytest.mark.parametrize("ids", [
    [1, 3, 5, 7, None], ["1", "3", "5", "7", "9"], [1, 3, 5, 7, 9.5], [True, 3, 5, 7, 9], [-1, 3, 5, 7, 9],
    [[1], [3], [5], [7], [9]],
])
def test_target_layer_ids_that_name_no_target_layer_are_named(ids):
    """Only the ids' count was checked (it sizes fc's input): null, a string, a float, a bool, a negative or a
    nested list was served as a tap of the target model, and a nested list left the frozen config unhashable."""
    data = PRESETS["tiny"].to_hf_json()
    data["text_config"]["dspark_target_layer_ids"] = ids
    with pytest.raises(ConfigError, match=r"^text_config.dspark_target_layer_ids: .*non-negative integer"):
        DrafterConfig.from_hf_json(data)
    data["text_config"]["dspark_target_layer_ids"] = [0, 3, 5, 7, 9]  # layer 0 is a layer
    assert DrafterConfig.from_hf_json(data).target_layer_ids == (0, 3, 5, 7, 9)


@pytest.mark.parametrize("where, key, value, words", [
    ("text_config", "use_gemma_norm", False, "text_config.use_gemma_norm: only Gemma RMSNorm"),
    ("text_config", "dspark_markov_head_type", "gated", "text_config.dspark_markov_head_type: only 'vanilla'"),
    ("quantization_config", "quant_method", "fp8", "quantization_config.quant_method: expected 'mxfp8', got 'fp8'"),
    # DeepSeek-style 128 x 128 blocks: the 1 x B dequantization would pair rows with the wrong scales.
    ("quantization_config", "weight_block_size", [128, 128], "quantization_config.weight_block_size: expected [1, B]"),
    ("text_config", "layer_types", ["sliding_attention"] * 4, "text_config.layer_types: 4 entries for 5 layers"),
    ("text_config", "dspark_target_layer_ids", [], "text_config.dspark_target_layer_ids: must not be empty"),
    # Odd: RoPE rotates pairs (i, i + rotary_dim / 2).
    ("text_config", "rotary_dim", 63, "text_config.rotary_dim: must be even and <= head_dim 128, got 63"),
    ("text_config", "dspark_noise_token_id", 2048, "text_config.dspark_noise_token_id: 2048 outside vocab [0, 2048)"),
])
def test_a_config_the_drafter_cannot_serve_is_named(where, key, value, words):
    """Each check's removal passed every other test: a config.json the layers would serve wrongly (another norm,
    Markov head, quantization or RoPE band, a noise token past the embedding) or that contradicts itself."""
    data = PRESETS["tiny"].to_hf_json()
    data[where][key] = value
    with pytest.raises(ConfigError, match="^" + re.escape(words)):
        DrafterConfig.from_hf_json(data)


def test_the_edges_of_the_noise_token_and_rotary_checks_are_accepted():
    data = PRESETS["tiny"].to_hf_json()
    data["text_config"].update(dspark_noise_token_id=2047, rotary_dim=128)  # the last token; every dim rotates
    c = DrafterConfig.from_hf_json(data)
    assert (c.noise_token_id, c.rotary_dim) == (2047, 128)


def test_query_heads_that_cut_an_mxfp8_block_are_named():
    """o_proj's input is num_attention_heads * head_dim wide: 3 x 80 = 240 is 7.5 blocks of 32, which no 1 x 32
    scale row covers (check_tp only looks at it when sharding)."""
    data = PRESETS["tiny"].to_hf_json()
    data["text_config"].update(num_attention_heads=3, num_key_value_heads=1, head_dim=80)
    with pytest.raises(ConfigError, match=r"^text_config.num_attention_heads \* head_dim: must be a multiple of"):
        DrafterConfig.from_hf_json(data)


def test_check_tp_names_an_ffn_that_does_not_split_evenly():
    """Heads that split over 3 ranks and an FFN of 512 that does not: uneven, which is what to say (the per-rank
    block check only refused it by accident, as a slice of 170)."""
    three = dataclasses.replace(PRESETS["tiny"], num_attention_heads=12, num_key_value_heads=3)
    with pytest.raises(ConfigError, match=r"^dspark_ffn_hidden_size: 512 is not divisible by TP size 3"):
        three.check_tp(3)
    dataclasses.replace(three, ffn_hidden_size=768).check_tp(3)


@pytest.mark.parametrize("tp", [0, -1, -4, True, 2.0])
def test_check_tp_refuses_a_world_size_that_is_no_rank_count(tp):
    """0 raised a raw ZeroDivisionError, and -1 (or -4) passed: every field divides by it, so the per-rank
    slices were cut with negative sizes. True passed as one rank, 2.0 as two."""
    with pytest.raises(ConfigError, match=r"TP size: must be a positive integer"):
        PRESETS["tiny"].check_tp(tp)


def test_the_largest_sliding_window_is_served():
    """SLIDING_WINDOW_MAX itself is allowed; one more token is refused (test_bad_field_is_named)."""
    data = PRESETS["tiny"].to_hf_json()
    data["text_config"]["sliding_window"] = 1 << 20
    assert DrafterConfig.from_hf_json(data).sliding_window == 1 << 20
